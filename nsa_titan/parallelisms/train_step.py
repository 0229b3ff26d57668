"""The data-parallel optimizer step: global token normalisation, gradient-sync policy, sharded clipping.

Loss normalisation over data parallelism: the step loss is sum(token CE over ALL ranks' micro-batches) /
(target tokens over all ranks), so every target token weighs the same wherever it was processed. Each
rank all-reduces its target-token count before the first backward and divides its local CE sum by the
global count; DDP/FSDP then AVERAGE gradients over the dp ranks, so each rank scales its loss by the dp
degree to turn that average back into the sum. With one rank this is exactly components.train_step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from nsa_titan.components.train_step import Batch, count_target_tokens, model_inputs, token_loss_sum


def _is_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: PLC0415 - FSDP1 is legacy, load on use

    return isinstance(model, FullyShardedDataParallel)


def grad_sync_context(model: nn.Module, sync: bool) -> AbstractContextManager:
    """Enter around one micro-batch's forward AND backward: whether its backward reduces gradients."""
    if isinstance(model, FSDPModule):
        # FSDP2: a flag on every FSDP unit (recurse); without sync gradients accumulate unsharded.
        model.set_requires_gradient_sync(sync)
        return nullcontext()
    if not sync and (isinstance(model, nn.parallel.DistributedDataParallel) or _is_fsdp1(model)):
        return model.no_sync()
    return nullcontext()


def forward_backward(
    model: nn.Module,
    micro_batches: Sequence[Batch],
    *,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    dp_degree: int = 1,
    sync_every_micro_batch: bool = False,
) -> torch.Tensor:
    """Accumulate gradients of the globally token-normalised step loss; returns the global step loss (device).

    With ``dp_degree > 1`` the default process group must be the data-parallel group (DP is the only
    parallelism). No host syncs: the all-reduces work on device tensors.
    """
    n_tokens = count_target_tokens(micro_batches).float()
    if dp_degree > 1:
        dist.all_reduce(n_tokens)  # sum over ranks: every rank divides by the same global count
    n_tokens = n_tokens.clamp(min=1)  # a step with every label ignored gives zero gradient, not NaN
    total = torch.zeros((), device=n_tokens.device)
    last = len(micro_batches) - 1
    for i, mb in enumerate(micro_batches):
        with grad_sync_context(model, sync=sync_every_micro_batch or i == last):
            with autocast():
                logits = model(mb["input"], **model_inputs(mb))
            loss = token_loss_sum(logits, mb["labels"]) / n_tokens
            (loss * dp_degree if dp_degree > 1 else loss).backward()
        total += loss.detach()
    if dp_degree > 1:
        dist.all_reduce(total)  # each rank holds its share of the global mean; the sum is the step loss
    return total


def clip_grad_norm(model: nn.Module, params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient L2 norm (a device tensor) over all ranks' shards; clips when ``max_norm > 0``."""
    if _is_fsdp1(model):
        # FSDP1 flattens parameters: only its own method knows which shard belongs to which rank.
        return model.clip_grad_norm_(max_norm if max_norm > 0 else float("inf"))
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(total, DTensor):
        # FSDP2: the norm of sharded gradients is a partial result; full_tensor() all-reduces it.
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: Sequence[Batch],
    *,
    params: Sequence[nn.Parameter],
    max_norm: float,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    before_optimizer_step: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    dp_degree: int = 1,
    grad_sync: str = "last_micro_batch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``micro_batches`` (gradient accumulation); returns (loss, grad_norm) on device.

    The data-parallel counterpart of ``components.train_step.train_step`` (same arguments, plus these):
    ``dp_degree``: data-parallel ranks (1: exactly the single-process step); ``grad_sync``:
    'last_micro_batch' reduces gradients once per step, 'every_micro_batch' after each micro-batch.
    """
    if grad_sync not in ("last_micro_batch", "every_micro_batch"):
        raise ValueError(f"parallelism.grad_sync must be 'last_micro_batch' or 'every_micro_batch', got {grad_sync!r}")
    loss = forward_backward(model, micro_batches, autocast=autocast, dp_degree=dp_degree,
                            sync_every_micro_batch=grad_sync == "every_micro_batch")
    grad_norm = clip_grad_norm(model, params, max_norm)
    if before_optimizer_step is not None:
        before_optimizer_step(loss, grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss, grad_norm


@contextlib.contextmanager
def full_param_shapes(model: nn.Module):
    """Inside, every parameter has its full shape: build the optimizer here (weight decay is chosen by ndim).

    Only FSDP1 needs it: with use_orig_params it exposes each parameter as a flat 1-D slice of its shard,
    so an ndim test would put every matrix in the no-decay group. summon_full_params gathers the
    parameters once, keeping the same Parameter objects the optimizer will hold.
    """
    if _is_fsdp1(model) and model._use_orig_params:  # noqa: SLF001 - FSDP1 has no public getter
        with type(model).summon_full_params(model, writeback=False):
            yield
    else:
        yield
