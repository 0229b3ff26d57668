"""Learning-rate schedules: linear warmup, then cosine / linear / WSD / constant decay to a floor.

The factor is a pure function of the optimizer-step index ``s`` (0-based, LambdaLR's ``last_epoch``; the
training loop calls ``scheduler.step()`` after every ``optimizer.step()``):

* warmup (s < W):            (s + 1) / W               -> step W-1 is the first at the peak, step 0 is not lr=0
* stable (WSD only):         1.0
* decay (last D steps):      progress p = (s - start) / (D - 1) in [0, 1], first decay step at the peak,
                             last training step (s = total-1) exactly at ``min_lr_ratio``
  cosine: m + (1-m) * (1 + cos(pi p)) / 2;  linear / wsd: m + (1-m) * (1 - p);  constant: 1.0
D = total - W for cosine/linear; for WSD D = max(1, round(wsd_decay_ratio * (total - W))): the ratio is a
fraction of the post-warmup steps (as documented for ``[lr_scheduler] wsd_decay_ratio``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

DECAY_TYPES = ("cosine", "linear", "wsd", "constant")


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_type: str,
    min_lr_ratio: float,
    wsd_decay_ratio: float,
) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_type == "constant":
        return 1.0
    decay_steps = total_steps - warmup_steps
    if decay_type == "wsd":
        decay_steps = min(decay_steps, max(1, round(wsd_decay_ratio * decay_steps)))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, decay_steps - 1))
    if decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear, wsd
        shape = 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def validate_schedule(sched_cfg: Any, total_steps: int) -> None:
    warmup = int(sched_cfg.warmup_steps)
    if total_steps < 1:
        raise ValueError(f"training.steps must be >= 1, got {total_steps}")
    if warmup < 0:
        raise ValueError(f"lr_scheduler.warmup_steps must be >= 0, got {warmup}")
    if warmup > total_steps:
        raise ValueError(
            f"lr_scheduler.warmup_steps ({warmup}) exceeds training.steps ({total_steps}); "
            f"lower --lr_scheduler.warmup_steps or raise --training.steps"
        )
    if sched_cfg.decay_type not in DECAY_TYPES:
        raise ValueError(f"unknown lr_scheduler.decay_type {sched_cfg.decay_type!r}; choose one of {DECAY_TYPES}")
    if not 0.0 <= float(sched_cfg.min_lr_ratio) <= 1.0:
        raise ValueError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {sched_cfg.min_lr_ratio}")
    if sched_cfg.decay_type == "wsd" and not 0.0 <= float(sched_cfg.wsd_decay_ratio) <= 1.0:
        raise ValueError(f"lr_scheduler.wsd_decay_ratio must be in [0, 1], got {sched_cfg.wsd_decay_ratio}")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, sched_cfg: Any, total_steps: int) -> LambdaLR:
    validate_schedule(sched_cfg, total_steps)
    # functools.partial (not a lambda/closure) keeps the scheduler picklable for checkpointing.
    fn = functools.partial(
        lr_factor,
        warmup_steps=int(sched_cfg.warmup_steps),
        total_steps=int(total_steps),
        decay_type=str(sched_cfg.decay_type),
        min_lr_ratio=float(sched_cfg.min_lr_ratio),
        wsd_decay_ratio=float(getattr(sched_cfg, "wsd_decay_ratio", 0.2)),
    )
    return LambdaLR(optimizer, fn)
