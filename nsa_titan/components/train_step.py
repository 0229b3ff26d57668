"""The optimizer step: token-normalised loss, gradient accumulation, gradient sync, clipping; and validation.

Loss normalisation: the step loss is sum(token CE over ALL ranks' micro-batches) / (target tokens over all
ranks), so every target token weighs the same wherever it was processed and however the real (non-ignored)
tokens are spread over micro-batches (averaging per-micro-batch means would over-weight micro-batches with
few targets). Each rank all-reduces its target-token count before the first backward and divides its local
CE sum by the global count; DDP/FSDP then AVERAGE gradients over the dp ranks, so each rank scales its loss
by the dp degree to turn that average back into the sum. With one rank (``dp_degree=1``) there is no
collective at all. Labels equal to ``nsa_titan.data.IGNORE_INDEX`` (the data's padding) are not targets.

The data-parallel tests hold this step to an independent single-process reference (tests/_reference_step.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from nsa_titan.components.optimizer import local_shard
from nsa_titan.data import IGNORE_INDEX

Batch = dict[str, torch.Tensor]


# ---- loss pieces ----
def move_batch(batch: Batch, device: torch.device) -> Batch:
    # non_blocking only overlaps when the loader pins memory; harmless otherwise.
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def model_inputs(batch: Batch) -> dict:
    """The model's keyword inputs besides the tokens: document starts and RoPE positions when the batch has
    them (data.document_mask, data/documents.py); empty otherwise."""
    return {k: batch[k] for k in ("doc_start", "positions") if k in batch}


def count_target_tokens(micro_batches: Iterable[Batch]) -> torch.Tensor:
    """Number of non-ignored labels, as a device tensor (no host sync)."""
    counts = [(mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches]
    return torch.stack(counts).sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32 (bf16 log-softmax over a large vocab loses precision)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


# ---- the step ----
def grad_sync_context(model: nn.Module, sync: bool) -> AbstractContextManager:
    """Enter around one micro-batch's forward AND backward: whether its backward reduces gradients."""
    if isinstance(model, FSDPModule):
        # FSDP2: a flag on every FSDP unit (recurse); without sync gradients accumulate unsharded.
        model.set_requires_gradient_sync(sync)
        return nullcontext()
    if not sync and isinstance(model, (nn.parallel.DistributedDataParallel, FullyShardedDataParallel)):
        return model.no_sync()
    return nullcontext()


def forward_backward(
    model: nn.Module,
    micro_batches: Sequence[Batch],
    *,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    dp_degree: int = 1,
    sync_every_micro_batch: bool = False,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
) -> torch.Tensor:
    """Accumulate gradients of the globally token-normalised step loss; returns the global step loss (device).

    With ``dp_degree > 1`` the default process group must be the data-parallel group (DP is the only
    parallelism). No host syncs: the all-reduces work on device tensors. ``loss_fn(logits, labels)``: the summed
    token loss, token_loss_sum or its compiled form (parallelisms.compile_loss).
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
            loss = loss_fn(logits, mb["labels"]) / n_tokens
            # The loss saved what its backward needs; a live name would keep the logits ([B, T, vocab], 3.9 GiB for
            # the 1b at 64k) through every block's backward instead of freeing them after the loss's own.
            del logits
            (loss * dp_degree if dp_degree > 1 else loss).backward()
        total += loss.detach()
    if dp_degree > 1:
        dist.all_reduce(total)  # each rank holds its share of the global mean; the sum is the step loss
    return total


def _sharded_grad_norm(grads: list[DTensor]) -> torch.Tensor | None:
    """L2 norm of FSDP2's sharded gradients from their local shards: each rank's sum of squares, all-reduced over
    the mesh dimensions that shard them (none for replicated ones, e.g. HSDP's replicate dimension). None when
    the gradients do not share one mesh and Shard/Replicate placements (then the DTensor path decides)."""
    mesh, placements = grads[0].device_mesh, grads[0].placements
    if any(g.device_mesh != mesh or g.placements != placements for g in grads) or not all(
            p.is_shard() or p.is_replicate() for p in placements):
        return None
    sq = torch.nn.utils.get_total_norm([local_shard(g) for g in grads], foreach=True).float().square()
    home = sq.device
    sq = sq.to(mesh.device_type)  # CPU-offloaded gradients on a CUDA mesh: the collective runs on the mesh's device
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            dist.all_reduce(sq, group=mesh.get_group(dim))
    return sq.sqrt().to(home)


def clip_grad_norm(model: nn.Module, params: Sequence[nn.Parameter], max_norm: float,
                   shard_local: bool = True) -> torch.Tensor:
    """Global gradient L2 norm (a device tensor) over all ranks' shards; clips when ``max_norm > 0``.
    ``shard_local`` (optimizer.shard_local): FSDP2's norm and clipping on the local shards, no DTensor dispatch."""
    if isinstance(model, FullyShardedDataParallel):
        # FSDP1 flattens parameters: only its own method knows which shard belongs to which rank.
        return model.clip_grad_norm_(max_norm if max_norm > 0 else float("inf"))
    grads = [p.grad for p in params if p.grad is not None]
    if shard_local and grads and all(isinstance(g, DTensor) for g in grads):
        total = _sharded_grad_norm(grads)
        if total is not None:
            if max_norm > 0:  # torch.nn.utils.clip_grads_with_norm_'s arithmetic, on the local shards
                local = [local_shard(g) for g in grads]
                torch._foreach_mul_(local, torch.clamp(max_norm / (total + 1e-6), max=1.0).to(local[0].device))
            return total
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
    shard_local: bool = True,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``micro_batches`` (gradient accumulation); returns (loss, grad_norm) on device.

    ``dp_degree``: data-parallel ranks (1: one process, no collectives); ``grad_sync`` (parallelism.grad_sync):
    'last_micro_batch' reduces gradients once per step, 'every_micro_batch' after each micro-batch.
    ``before_optimizer_step(loss, grad_norm)`` runs after clipping (the non-finite guard). ``shard_local``
    (optimizer.shard_local): FSDP2 gradients are clipped on their local shards. ``loss_fn``: see forward_backward.
    """
    loss = forward_backward(model, micro_batches, autocast=autocast, dp_degree=dp_degree,
                            sync_every_micro_batch=grad_sync == "every_micro_batch", loss_fn=loss_fn)
    grad_norm = clip_grad_norm(model, params, max_norm, shard_local)
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
    if isinstance(model, FullyShardedDataParallel) and model._use_orig_params:  # noqa: SLF001 - no public getter
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            yield
    else:
        yield


# ---- validation ----
@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Sequence[Batch],
    device: torch.device,
    *,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    retrieval_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
) -> dict[str, float]:
    """Token-weighted validation loss over fixed batches; with ``retrieval_fn(logits, labels, is_retrieval)``
    (``nsa_titan.data.retrieval_accuracy``) also the retrieval accuracy. Runs on val steps only."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device)
    n_tokens = torch.zeros((), device=device, dtype=torch.long)
    correct = torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    try:
        for batch in batches:
            batch = move_batch(batch, device)
            with autocast():
                logits = model(batch["input"], **model_inputs(batch))
            loss_sum += loss_fn(logits, batch["labels"])
            n_tokens += count_target_tokens([batch])
            if retrieval_fn is not None:
                c, t = retrieval_fn(logits, batch["labels"], batch.get("is_retrieval"))
                correct += c
                total += t
    finally:
        model.train(was_training)
    val_loss = (loss_sum / n_tokens.clamp(min=1)).item()  # host sync ok: log step
    out = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
    if retrieval_fn is not None:
        out["retrieval_acc"] = (correct / total.clamp(min=1)).item()  # host sync ok: log step
        out["retrieval_n"] = int(total.item())  # host sync ok: log step
    return out
