"""Activation checkpointing of the transformer blocks: none / full / selective_op / ratio / memory_budget.

Rules this module keeps, each a bug the old system had:

- Never reentrant (``use_reentrant=False``): reentrant checkpointing runs a second backward inside the
  first, which under DDP fires a parameter's gradient hook twice ("marked ready twice") and ignores
  gradients of inputs that do not require grad.
- No closures created in a loop: each block is wrapped as a module (``checkpoint_wrapper``), so a block's
  recomputation always calls that block. A late-bound ``lambda x: block(x)`` made in a loop recomputes
  the LAST block for every block.
- No module-global counters: the selective policy counts matmuls in a ``_SelectivePolicy`` object that
  ``context_fn`` creates afresh for every checkpointed call, so every forward (and its recompute) starts
  counting at zero.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Ops whose outputs selective_op saves (recomputing attention is the expensive part): torch's own attention ops
# and reduce-scatter. A model adds its own (nsa_titan.models.nsa.attention.SELECTIVE_AC_SAVE_OPS) through
# apply_ac's ``save_op_names``; this module knows no model.
_TORCH_SAVE_OP_NAMES = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
    "higher_order.flex_attention",
    "_c10d_functional.reduce_scatter_tensor",
)


def _resolve_op(dotted: str) -> Any | None:
    """``torch.ops.<ns>.<op>`` (its ``.default`` overload where there is one), or None if not registered."""
    ns, name = dotted.split(".")
    try:
        op = getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError):
        return None
    return getattr(op, "default", op)


def selective_save_ops(extra_names: Iterable[str] = ()) -> frozenset:
    """The ops whose outputs selective_op saves: aten.mm (every other call), torch's attention ops and
    ``extra_names`` ("namespace.op"), each where registered (a model's kernels may not import here)."""
    ops = {torch.ops.aten.mm.default}
    ops.update(op for op in map(_resolve_op, (*_TORCH_SAVE_OP_NAMES, *extra_names)) if op is not None)
    return frozenset(ops)


class _SelectivePolicy:
    """Save the listed ops' outputs, except every second ``aten.mm``; recompute everything else.

    Forward and recompute keep separate counts, so that the recompute pass makes the same decisions as the
    forward it replays (the n-th mm of the recompute is the n-th mm of the forward).
    """

    def __init__(self, save_ops: frozenset):
        self.save_ops = save_ops
        self.mm_count = {"forward": 0, "recompute": 0}

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func is torch.ops.aten.mm.default:
            phase = "recompute" if ctx.is_recompute else "forward"
            self.mm_count[phase] += 1
            if self.mm_count[phase] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in self.save_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context(save_ops: frozenset):
    """``context_fn`` of checkpoint: called once per checkpointed forward, so each gets a fresh policy."""
    return create_selective_checkpoint_contexts(_SelectivePolicy(save_ops))


def ratio_block_ids(n_blocks: int, ratio: float) -> list[int]:
    """Indices of the blocks that 'ratio' checkpoints: k = round(p * n) blocks, evenly spaced from block 0.

    n=8: p=0 -> [], 0.25 -> [0, 4], 0.5 -> [0, 2, 4, 6], 1.0 -> all eight. ``ratio`` in [0, 1]: the config
    checks it (ActivationCheckpoint.validate).
    """
    k = math.floor(ratio * n_blocks + 0.5)  # round half up (Python's round() would send 2.5 to 2)
    return [i * n_blocks // k for i in range(k)] if k else []


def _wrap(block: nn.Module, context_fn=None) -> nn.Module:
    # preserve_rng_state=False: the blocks draw no random numbers (no dropout), so saving and restoring the
    # RNG state for the recompute would be pure overhead.
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False, **kwargs)


def apply_ac(model: nn.Module, ac_config: Any, save_op_names: Iterable[str] = ()) -> list[int]:
    """Wrap ``model.layers`` blocks in place per ``ac_config.mode`` (the [activation_checkpoint] section, whose
    modes the config defines and checks); returns the checkpointed block indices.

    'none' and 'memory_budget' wrap nothing ('memory_budget': compile's partitioner decides what to recompute,
    see compile.py). ``save_op_names``: the model's own ops whose outputs 'selective_op' saves.
    """
    mode, names = ac_config.mode, list(model.layers.keys())
    if mode == "ratio":
        chosen = ratio_block_ids(len(names), ac_config.ratio)
    elif mode in ("full", "selective_op"):
        chosen = list(range(len(names)))
    else:
        return []
    selective = mode == "selective_op"
    context_fn = functools.partial(_selective_context, selective_save_ops(save_op_names)) if selective else None
    for i in chosen:
        model.layers[names[i]] = _wrap(model.layers[names[i]], context_fn)
    return chosen
