"""Per-block torch.compile, compile's activation memory budget, and a count of compiled graphs.

Compiling each block rather than the whole model keeps FSDP's per-block hooks (all-gather, reduce-scatter)
outside the compiled graphs, and all blocks share one compiled graph: they run the same code on tensors of
the same shapes, so compile time does not grow with depth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.config as functorch_config  # the partitioner's settings (activation_memory_budget)
import torch.compiler.config as compiler_config  # cache_key_tag: part of every compile cache's key
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule  # private, but the class torch.compile returns
from torch._dynamo.utils import counters  # private: dynamo's process-wide compile statistics


class _CompileConfigScope:
    """Sets compile settings only while a block runs, instead of process-wide: the activation memory budget
    and a tag added to the compile caches' keys.

    Both are read when the block is compiled (AOTAutograd partitions the joint graph and the caches compute
    their keys inside the block's first call, and any recompile); forward pre/post hooks around the compiled
    block cover that.
    """

    def __init__(self, budget: float | None, cache_tag: str | None):
        self.budget, self.cache_tag = budget, cache_tag
        self._saved: list[tuple[float, str]] = []  # a stack: blocks do not nest, but re-entrancy must not lose one

    def enter(self, module, args) -> None:
        self._saved.append((functorch_config.activation_memory_budget, compiler_config.cache_key_tag))
        if self.budget is not None:
            functorch_config.activation_memory_budget = self.budget
        if self.cache_tag:  # added to a tag the user may have set (TORCH_COMPILE_CACHE_KEY_TAG)
            compiler_config.cache_key_tag = "|".join(t for t in (compiler_config.cache_key_tag, self.cache_tag) if t)

    def exit(self, module, args, output) -> None:
        functorch_config.activation_memory_budget, compiler_config.cache_key_tag = self._saved.pop()


def apply_compile(model: nn.Module, compile_config: Any, memory_budget: float | None = None,
                  backend: str = "inductor", cache_tag: str | None = None) -> None:
    """Replace each ``model.layers`` block by ``torch.compile(block, fullgraph=...)`` in place.

    ``memory_budget`` (activation_checkpoint mode 'memory_budget'): the budget compile's partitioner uses
    to choose which activations to recompute. ``backend``: 'inductor' for training; tests may pass
    'aot_eager_decomp_partition' (the same AOTAutograd partitioner, hence the same recompute decisions,
    without code generation). ``cache_tag``: added to the compile caches' keys while the blocks compile (the
    model's custom ops' source fingerprint: a graph cached by another version of them is then not reused).
    """
    for name, block in list(model.layers.items()):
        mode = None if compile_config.mode == "default" else compile_config.mode
        compiled = torch.compile(block, fullgraph=compile_config.fullgraph, backend=backend, mode=mode)
        if memory_budget is not None or cache_tag:
            scope = _CompileConfigScope(memory_budget, cache_tag)
            compiled.register_forward_pre_hook(scope.enter)
            compiled.register_forward_hook(scope.exit)
        model.layers[name] = compiled


def compile_loss(loss_fn: Callable[..., torch.Tensor], compile_config: Any,
                 backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """``loss_fn`` compiled (fullgraph, mode 'default') when compile.enable and compile.loss, else itself. The loss
    sits outside the blocks, so per-block compile left it eager: F.cross_entropy over an fp32 copy of the logits
    saves its fp32 log-softmax [tokens, vocabulary] for the backward, which inductor's fused version does not (it
    keeps the logits and per-token statistics, recomputes the softmax in the backward and writes the gradient in the
    logits' dtype)."""
    if not (compile_config.enable and compile_config.loss):
        return loss_fn
    return torch.compile(loss_fn, fullgraph=True, backend=backend)


class CompileCounter:
    """Graphs dynamo compiled since this object was made (``torch._dynamo`` keeps process-wide counters).

    Make it after ``parallelize_nsa`` and before the first forward (compilation happens on first call).
    Blocks of one kind (e.g. all checkpointed ones) share one graph, so a healthy training run compiles one
    graph per kind (``expected`` counts the others a run makes by design: evaluation under no_grad, diagnostic
    forwards, the compiled loss); every further graph is a recompile, worth a look with ``TORCH_LOGS=recompiles``.
    """

    def __init__(self, model: nn.Module):
        self.kinds = len({type(m._orig_mod) for m in model.modules() if isinstance(m, OptimizedModule)})
        self._start = self._graphs()

    @staticmethod
    def _graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    def graphs(self) -> int:
        return self._graphs() - self._start

    def expected(self, *, diagnostics: bool = False, evaluated: bool = False, loss: bool = False) -> int:
        """Graphs a healthy run compiles: one per block kind, one more per kind for the diagnostic forwards (log
        steps) and for evaluation (no_grad), and the compiled loss's one (two with evaluation)."""
        per_kind = 1 + int(diagnostics) + int(evaluated)
        return self.kinds * per_kind + (1 + int(evaluated) if loss else 0)

