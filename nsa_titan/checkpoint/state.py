"""What a checkpoint holds, and how each part is captured from and restored into a live run.

A checkpoint is one ``torch.distributed.checkpoint`` (DCP) state dict:

- ``model`` / ``optimizer``: from ``get_state_dict`` with the same options for every wrapper (none, DDP,
  FSDP1, FSDP2, compiled, activation-checkpointed), so names are clean FQNs and tensors are DTensors
  where the run shards them. DCP then reshards on load: a checkpoint written by 2 ranks loads into 1 and
  vice versa, and one written under DDP loads under FSDP2.
- ``trainer``: pickled bytes of the global host state (train state + LR scheduler), identical on every
  rank (DCP keeps one copy).
- ``rank_state.rank{r}``: pickled bytes of rank r's own state (its data-loader position and RNG states).
  Keyed by rank because DCP de-duplicates equal keys across ranks.

Bytes rather than nested dicts for the host state: the load template must mirror the saved structure
key by key, and a pickled blob keeps that structure trivially stable (e.g. with or without CUDA RNG).
"""

from __future__ import annotations

import dataclasses
import pickle
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

# Param-group keys that choose the optimizer's implementation, not its hyper-parameters: the running
# optimizer's own choice wins over the saved one (a foreach checkpoint may resume under the fused kernel).
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def state_dict_options() -> StateDictOptions:
    """flatten_optimizer_state_dict: optimizer entries keyed "state.<fqn>.<name>" / "param_groups.<fqn>.<key>",
    which DCP can reshard and which depend neither on parameter order nor on wrapper prefixes. (A function,
    not a module constant: StateDictOptions is a mutable dataclass.)"""
    return StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class TrainState:
    """Progress of the run, saved with every checkpoint."""

    step: int = 0
    """Optimizer steps completed (skipped non-finite steps included: they consumed data and schedule)."""
    tokens_seen: int = 0
    """Input tokens over all ranks."""
    skipped_steps: list[int] = dataclasses.field(default_factory=list)
    """Steps whose update the non-finite guard dropped."""


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every RNG a step could draw from (host copies; on CUDA the generator state is seed + offset: no sync)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def capture_host_state(train_state: TrainState, scheduler: Any, loader: Any, device: torch.device) -> dict[str, Any]:
    """Everything a checkpoint needs besides model and optimizer tensors; host only, cheap, no device sync."""
    return {
        "train_state": dataclasses.asdict(train_state),
        "lr_scheduler": scheduler.state_dict(),
        "loader": loader.state_dict(),
        "rng": rng_state(device),
    }


def restore_host_state(snapshot: dict[str, Any], train_state: TrainState, scheduler: Any, optimizer: Any,
                       loader: Any, device: torch.device) -> None:
    """Inverse of capture_host_state for a snapshot of THIS run (same world size)."""
    _set_train_state(train_state, snapshot["train_state"])
    _load_scheduler(scheduler, optimizer, snapshot["lr_scheduler"])
    loader.load_state_dict(snapshot["loader"])
    set_rng_state(snapshot["rng"], device)


def _set_train_state(train_state: TrainState, values: dict[str, Any]) -> None:
    fresh = TrainState(**values)
    for f in dataclasses.fields(TrainState):
        setattr(train_state, f.name, getattr(fresh, f.name))


def _load_scheduler(scheduler: Any, optimizer: Any, state: dict[str, Any]) -> None:
    scheduler.load_state_dict(state)
    # The lr each group steps with must be the schedule's value for the restored step.
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def dcp_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, host: dict[str, Any],
                   rank: int) -> dict[str, Any]:
    """The state dict handed to ``dcp.save`` (tensors are the live ones; DCP or its stager copies them)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options())
    trainer = {"train_state": host["train_state"], "lr_scheduler": host["lr_scheduler"]}
    rank_state = {"loader": host["loader"], "rng": host["rng"]}
    return {
        "model": model_sd,
        "optimizer": optim_sd,
        "trainer": pickle.dumps(trainer),
        "rank_state": {f"rank{rank}": pickle.dumps(rank_state)},
    }


def load_template(model: nn.Module, optimizer: torch.optim.Optimizer, rank_key: str) -> dict[str, Any]:
    """A state dict shaped like a saved one, whose tensors ``dcp.load`` fills in place."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options())
    return {"model": model_sd, "optimizer": optim_sd, "trainer": b"", "rank_state": {rank_key: b""}}


def apply_loaded(loaded: dict[str, Any], rank_key: str, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, loader: Any, train_state: TrainState, device: torch.device,
                 saved_world_size: int, world_size: int, log=print) -> None:
    """Push a filled ``load_template`` into the live objects."""
    impl = [{k: g[k] for k in _IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"],
                   options=state_dict_options())
    for group, keep in zip(optimizer.param_groups, impl):
        group.update(keep)
    trainer = pickle.loads(loaded["trainer"])
    _set_train_state(train_state, trainer["train_state"])
    _load_scheduler(scheduler, optimizer, trainer["lr_scheduler"])
    rank_state = pickle.loads(loaded["rank_state"][rank_key])
    if saved_world_size == world_size:
        loader.load_state_dict(rank_state["loader"])
        set_rng_state(rank_state["rng"], device)
    else:
        loader.load_state_dict(reshard_loader_state(rank_state["loader"], loader.state_dict()))
        log(f"checkpoint: saved by {saved_world_size} rank(s), resumed on {world_size}: model, optimizer, LR "
            f"schedule and step are exact; the data stream continues after the same number of global samples, "
            f"but which chunks of the current epoch were already seen is not carried over; RNGs keep this run's seed")


def reshard_loader_state(saved: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's saved loader state mapped onto this loader at another world size.

    Position k of rank r is global sample k * W + r, so ``k * W_saved`` global samples were consumed; this
    loader continues after the same count. Seed, seq_len, split and mix must still match (the loader checks).
    """
    consumed = int(saved["sample_index"]) * int(saved["world_size"])
    out = dict(saved)
    for key in ("rank", "world_size", "chunks_per_rank"):
        out[key] = mine[key]
    out["sample_index"] = consumed // int(mine["world_size"])
    return out
