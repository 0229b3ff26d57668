"""The test oracle of the train step: its loss and gradients for one process holding the whole global batch.

The trainer's step (``nsa_titan.components.train_step``) normalises by the target tokens of the whole step, over
micro-batches and data-parallel ranks, with all-reduces and gradient-sync contexts. This computes the same
quantity the plainest way, sharing none of that code: one cross-entropy sum over every micro-batch divided by
their target count. tests/_dist_worker.py (DDP, FSDP1, FSDP2 on 2 ranks) and tests/test_components.py hold
the real step to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nsa_titan.data import IGNORE_INDEX


def reference_forward_backward(model: nn.Module, micro_batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Accumulate the gradients of sum(token CE) / (target tokens of all micro-batches); returns that loss."""
    n_targets = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
    total = torch.zeros(())
    for mb in micro_batches:
        logits = model(mb["input"]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / max(n_targets, 1)
        loss.backward()
        total += loss.detach()
    return total
