"""Token-normalised loss pieces, the single-process gradient-accumulation reference, and the validation pass.

Loss normalisation: the step loss is sum(token CE) / (target tokens of the WHOLE step), so every target
token weighs the same no matter how the real (non-ignored) tokens are spread over micro-batches. Averaging
per-micro-batch means instead would over-weight micro-batches with few targets.
The trainer's optimizer step is ``nsa_titan.parallelisms.train_step`` (any number of data-parallel ranks);
``forward_backward`` here is its single-process reference, which the data-parallel tests hold it to.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
Batch = dict[str, torch.Tensor]


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


def forward_backward(
    model: nn.Module,
    micro_batches: Sequence[Batch],
    autocast: Callable[[], AbstractContextManager] = nullcontext,
) -> torch.Tensor:
    """Accumulate gradients of the token-normalised step loss; returns the detached step loss (device)."""
    # clamp: a step whose labels are all ignored gives zero gradient instead of NaN.
    n_tokens = count_target_tokens(micro_batches).clamp(min=1).float()
    total = None
    for mb in micro_batches:
        with autocast():
            logits = model(mb["input"], **model_inputs(mb))
        loss = token_loss_sum(logits, mb["labels"]) / n_tokens
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Sequence[Batch],
    device: torch.device,
    *,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    retrieval_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
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
            loss_sum += token_loss_sum(logits, batch["labels"])
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
