"""Per-block torch.compile, compile's activation memory budget, and a count of compiled graphs.

Compiling each block rather than the whole model keeps FSDP's per-block hooks (all-gather, reduce-scatter)
outside the compiled graphs, and all blocks share one compiled graph: they run the same code on tensors of
the same shapes, so compile time does not grow with depth.
"""

from __future__ import annotations

from typing import Any

import torch
import torch._functorch.config as functorch_config  # the partitioner's settings (activation_memory_budget)
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule  # private, but the class torch.compile returns
from torch._dynamo.utils import counters  # private: dynamo's process-wide compile statistics


class _MemoryBudgetScope:
    """Sets compile's activation memory budget only while a block runs, instead of process-wide.

    The budget is read when AOTAutograd partitions the joint forward/backward graph, which happens inside
    the block's first call (and any recompile); forward pre/post hooks around the compiled block cover that.
    """

    def __init__(self, budget: float):
        self.budget = budget
        self._saved: list[float] = []  # a stack: blocks do not nest, but re-entrancy must not lose a value

    def enter(self, module, args) -> None:
        self._saved.append(functorch_config.activation_memory_budget)
        functorch_config.activation_memory_budget = self.budget

    def exit(self, module, args, output) -> None:
        functorch_config.activation_memory_budget = self._saved.pop()


def apply_compile(model: nn.Module, compile_config: Any, memory_budget: float | None = None,
                  backend: str = "inductor") -> None:
    """Replace each ``model.layers`` block by ``torch.compile(block, fullgraph=...)`` in place.

    ``memory_budget`` (activation_checkpoint mode 'memory_budget'): the budget compile's partitioner uses
    to choose which activations to recompute. ``backend``: 'inductor' for training; tests may pass
    'aot_eager_decomp_partition' (the same AOTAutograd partitioner, hence the same recompute decisions,
    without code generation).
    """
    for name, block in list(model.layers.items()):
        mode = None if compile_config.mode == "default" else compile_config.mode
        compiled = torch.compile(block, fullgraph=compile_config.fullgraph, backend=backend, mode=mode)
        if memory_budget is not None:
            scope = _MemoryBudgetScope(memory_budget)
            compiled.register_forward_pre_hook(scope.enter)
            compiled.register_forward_hook(scope.exit)
        model.layers[name] = compiled


class CompileCounter:
    """Graphs dynamo compiled since this object was made (``torch._dynamo`` keeps process-wide counters).

    Make it after ``parallelize_nsa`` and before the first forward (compilation happens on first call).
    Blocks of one kind (e.g. all checkpointed ones) share one graph, so a healthy training run compiles one
    graph per kind; every further graph is a recompile (evaluation under no_grad adds one per kind),
    worth a look with ``TORCH_LOGS=recompiles``.
    """

    def __init__(self, model: nn.Module):
        self.kinds = len({type(m._orig_mod) for m in model.modules() if isinstance(m, OptimizedModule)})
        self._start = self._graphs()

    @staticmethod
    def _graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    def graphs(self) -> int:
        return self._graphs() - self._start

    def recompiles(self) -> int:
        return max(0, self.graphs() - self.kinds)
