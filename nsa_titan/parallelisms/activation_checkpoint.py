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
import importlib
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

AC_MODES = ("none", "full", "selective_op", "ratio", "memory_budget")

# Attention ops whose outputs selective_op saves (recomputing attention is the expensive part).
_ATTENTION_OP_NAMES = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
    "higher_order.flex_attention",
    "_c10d_functional.reduce_scatter_tensor",
    # The forward op registered by nsa_titan.kernels (Triton; present only where the kernels import).
    "nsa_titan.nsa_fwd",
)


def _resolve_op(dotted: str) -> Any | None:
    """``torch.ops.<ns>.<op>`` (its ``.default`` overload where there is one), or None if not registered."""
    ns, name = dotted.split(".")
    try:
        op = getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError):
        return None
    return getattr(op, "default", op)


def selective_save_ops() -> frozenset:
    """The ops whose outputs selective_op saves: aten.mm (every other call) plus the attention ops present."""
    try:  # the Triton kernels register their ops on import; absent (no triton) means nothing to save
        importlib.import_module("nsa_titan.kernels")
    except ImportError:
        pass
    ops = {torch.ops.aten.mm.default}
    ops.update(op for op in map(_resolve_op, _ATTENTION_OP_NAMES) if op is not None)
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

    n=8: p=0 -> [], 0.25 -> [0, 4], 0.5 -> [0, 2, 4, 6], 1.0 -> all eight.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"activation_checkpoint.ratio must be in [0, 1], got {ratio}")
    k = math.floor(ratio * n_blocks + 0.5)  # round half up (Python's round() would send 2.5 to 2)
    return [i * n_blocks // k for i in range(k)] if k else []


def _wrap(block: nn.Module, context_fn=None) -> nn.Module:
    # preserve_rng_state=False: the blocks draw no random numbers (no dropout), so saving and restoring the
    # RNG state for the recompute would be pure overhead.
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False, **kwargs)


def apply_ac(model: nn.Module, ac_config: Any) -> list[int]:
    """Wrap ``model.layers`` blocks in place per ``ac_config.mode``; returns the checkpointed block indices.

    'memory_budget' wraps nothing: compile's partitioner decides what to recompute (see compile.py).
    """
    mode = ac_config.mode
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode must be one of {', '.join(AC_MODES)}, got {mode!r}")
    names = list(model.layers.keys())
    if mode in ("none", "memory_budget"):
        return []
    if mode == "ratio":
        chosen = ratio_block_ids(len(names), ac_config.ratio)
    else:
        chosen = list(range(len(names)))
    context_fn = functools.partial(_selective_context, selective_save_ops()) if mode == "selective_op" else None
    for i in chosen:
        model.layers[names[i]] = _wrap(model.layers[names[i]], context_fn)
    return chosen
