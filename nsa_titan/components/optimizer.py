"""AdamW with decoupled weight-decay groups.

Weight decay is applied only to matrices (ndim >= 2) that are not embeddings: decaying norms, biases and
embedding rows hurts LMs (embedding rows of rare tokens get shrunk towards zero between their rare updates).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

SUPPORTED_OPTIMIZERS = ("adamw",)


def _embedding_param_ids(model: nn.Module) -> set[int]:
    # By module type, not by name: names differ between models, wrappers (compile, FSDP) prefix them.
    return {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}


def split_decay_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(decay, no_decay) lists of (name, param); shared (tied) params appear once; frozen params are skipped."""
    embed_ids = _embedding_param_ids(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # named_parameters() de-duplicates tied weights
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and id(p) not in embed_ids:
            decay.append((name, p))
        else:
            no_decay.append((name, p))
    return decay, no_decay


def resolve_fused(fused: Any, device_type: str) -> bool:
    """True -> fused AdamW kernel. Only on CUDA: elsewhere the foreach (multi-tensor) path is used."""
    if isinstance(fused, str):
        key = fused.strip().lower()
        if key == "auto":
            fused = True
        elif key in ("true", "1", "yes"):
            fused = True
        elif key in ("false", "0", "no"):
            fused = False
        else:
            raise ValueError(f"optimizer.fused must be 'auto', true or false, got {fused!r}")
    if not isinstance(fused, bool):
        raise ValueError(f"optimizer.fused must be 'auto', true or false, got {fused!r}")
    return fused and device_type == "cuda"


def local_shard(t: Any) -> Any:
    """A DTensor's local shard (the plain tensor this rank holds, sharing its storage); anything else unchanged."""
    return t._local_tensor if isinstance(t, DTensor) else t


class ShardLocalAdamW(torch.optim.AdamW):
    """AdamW that updates FSDP2's sharded (DTensor) parameters through their local shards.

    AdamW is elementwise, so stepping each rank's local shard is the same arithmetic as stepping the DTensor. But
    through DTensor every foreach / fused op is dispatched with sharding propagation over the whole parameter list:
    host time that grows with the parameter count (clip + step at m7c's size: 13.15 ms through DTensor, 3.58 on
    the local shards; a step only gets shorter where that host time is on its critical path, docs/experiments.md).
    The state stays DTensors keyed by the DTensor parameters, so checkpoints (torch.distributed.checkpoint) are
    unchanged; only the lists handed to the update kernel are the local views.
    """

    def _init_group(self, group, *lists):  # noqa: ANN001 (torch's signature: group, then the per-tensor lists)
        has_complex = super()._init_group(group, *lists)
        for tensors in lists:
            tensors[:] = [local_shard(t) for t in tensors]
        return has_complex


def build_optimizer(model: nn.Module, opt_cfg: Any, device_type: str, *,
                    require_fused: bool = False) -> torch.optim.AdamW:
    """``require_fused``: use the fused kernel on any device (torch has it on CPU too) unless the config says
    fused=false, which is then an error: the non-finite guard drops bad updates through its found_inf input."""
    name = str(opt_cfg.name).lower()
    if name not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer.name {opt_cfg.name!r}; supported: {', '.join(SUPPORTED_OPTIMIZERS)} "
            "(set --optimizer.name adamw)"
        )
    betas = tuple(float(b) for b in opt_cfg.betas)
    if len(betas) != 2:
        raise ValueError(f"optimizer.betas must have 2 values, got {list(opt_cfg.betas)}")
    if require_fused:
        if not resolve_fused(opt_cfg.fused, "cuda"):
            raise ValueError("optimizer.fused is false, but fault.nonfinite needs the fused AdamW kernel (it drops "
                             "non-finite updates on device); use --optimizer.fused auto, or --fault.nonfinite off")
        fused = True
    else:
        if opt_cfg.fused is True and device_type != "cuda":
            warnings.warn(f"optimizer.fused=true ignored on device type {device_type!r}; using foreach AdamW")
        fused = resolve_fused(opt_cfg.fused, device_type)

    decay, no_decay = split_decay_params(model)
    groups = [
        {"params": [p for _, p in decay], "weight_decay": float(opt_cfg.weight_decay)},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]  # AdamW rejects empty groups
    kwargs = {"fused": True} if fused else {"foreach": True}
    cls = ShardLocalAdamW if opt_cfg.shard_local else torch.optim.AdamW
    return cls(groups, lr=float(opt_cfg.lr), betas=betas, eps=float(opt_cfg.eps), **kwargs)
