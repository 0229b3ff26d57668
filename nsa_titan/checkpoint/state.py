"""What a checkpoint holds, and how each part is captured from and restored into a live run.

A checkpoint is one ``torch.distributed.checkpoint`` (DCP) state dict of tensors only:

- ``model`` / ``optimizer``: from ``get_state_dict`` with the same options for every wrapper (none, DDP,
  FSDP1, FSDP2, compiled, activation-checkpointed), so names are clean FQNs and tensors are DTensors
  where the run shards them. DCP then reshards on load: a checkpoint written by 2 ranks loads into 1 and
  vice versa, and one written under DDP loads under FSDP2. Only the optimizer's tensors go here; its
  param-group values (lr, betas, ...) are plain numbers, which DCP would pickle: they travel in ``trainer``.
- ``trainer``: UTF-8 JSON in a uint8 tensor: the global host state (train state, LR scheduler, optimizer
  param groups), identical on every rank (DCP keeps one copy).
- ``rank_state.rank{r}.*``: rank r's own state: ``json`` (its data-loader position, Python and NumPy RNG
  states) and the torch (and CUDA) RNG states as the uint8 tensors torch returns. Keyed by rank because DCP
  de-duplicates equal keys across ranks.

Why no pickle: unpickling runs code named by the file, so a crafted checkpoint could run a command on
resume. With tensors only, loading can refuse every pickled entry (``safe_load.py``). The JSON blobs vary in
length, so a load template takes their sizes from the checkpoint's metadata (``load_template``).
"""

from __future__ import annotations

import dataclasses
import json
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
# Param-group hyper-parameters and the config key each comes from. On resume this run's values win over the
# saved ones (the usual reason to resume with other settings is a failure they caused, e.g. the non-finite
# stop at too high an lr), unless checkpoint.keep_saved_hyperparams. initial_lr is the peak lr that the
# LR schedule scales (its base_lrs); the schedule's shape always comes from this run's [lr_scheduler].
_HYPERPARAM_KEYS = {"initial_lr": "optimizer.lr", "betas": "optimizer.betas", "eps": "optimizer.eps",
                    "weight_decay": "optimizer.weight_decay"}


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


def _load_scheduler(scheduler: Any, optimizer: Any, state: dict[str, Any], base_lrs: list[float] | None = None) -> None:
    """Restore the schedule's position; ``base_lrs``: this run's peak lrs instead of the saved ones."""
    scheduler.load_state_dict(state)
    if base_lrs is not None:
        scheduler.base_lrs = list(base_lrs)
    # The lr each group steps with is the schedule's value for the restored step, computed as LambdaLR does.
    lrs = [base * fn(scheduler.last_epoch) for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() returns: the lr of the next step


def _hyperparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: g[k] for k in _HYPERPARAM_KEYS if k in g} for g in optimizer.param_groups]


def hyperparam_changes(saved: list[dict[str, Any]], mine: list[dict[str, Any]]) -> list[str]:
    """'optimizer.lr 0.01 -> 0.001' for each hyper-parameter that differs in some param group (first one shown)."""
    out = []
    for key, name in _HYPERPARAM_KEYS.items():
        pair = next(((a[key], b[key]) for a, b in zip(saved, mine) if key in a and key in b and a[key] != b[key]), None)
        if pair is not None:
            fmt = (lambda v: ",".join(f"{x:g}" for x in v)) if key == "betas" else (lambda v: f"{v:g}")
            out.append(f"{name} {fmt(pair[0])} -> {fmt(pair[1])}")
    return out


def _json_tensor(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode("utf-8")), dtype=torch.uint8)


def _from_json_tensor(t: torch.Tensor) -> Any:
    return json.loads(t.numpy().tobytes().decode("utf-8"))


def _rng_to_saved(rng: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON-able part, tensors) of ``rng_state``: tuples and arrays become lists."""
    version, internal, gauss = rng["python"]
    name, key, pos, has_gauss, cached = rng["numpy"]
    as_json = {"python": [version, list(internal), gauss],
               "numpy": [name, [int(k) for k in key], int(pos), int(has_gauss), float(cached)]}
    tensors = {"rng_torch": rng["torch"]}
    if "cuda" in rng:
        tensors["rng_cuda"] = rng["cuda"]
    return as_json, tensors


def _rng_from_saved(as_json: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    version, internal, gauss = as_json["python"]
    name, key, pos, has_gauss, cached = as_json["numpy"]
    rng = {"python": (version, tuple(internal), gauss),
           "numpy": (name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached),
           "torch": tensors["rng_torch"]}
    if "rng_cuda" in tensors:
        rng["cuda"] = tensors["rng_cuda"]
    return rng


def _split_optimizer(optim_sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, plain values) of a flattened optimizer state dict; tuples (betas) become lists."""
    tensors = {k: v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
    plain = {k: list(v) if isinstance(v, tuple) else v for k, v in optim_sd.items() if k not in tensors}
    return tensors, plain


def dcp_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, host: dict[str, Any],
                   rank: int) -> dict[str, Any]:
    """The state dict handed to ``dcp.save`` (tensors are the live ones; DCP or its stager copies them)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options())
    optim_tensors, param_groups = _split_optimizer(optim_sd)
    trainer = {"train_state": host["train_state"], "lr_scheduler": host["lr_scheduler"],
               "param_groups": param_groups}
    rng_json, rng_tensors = _rng_to_saved(host["rng"])
    return {
        "model": model_sd,
        "optimizer": optim_tensors,
        "trainer": _json_tensor(trainer),
        "rank_state": {f"rank{rank}": {"json": _json_tensor({"loader": host["loader"], "rng": rng_json}),
                                       **rng_tensors}},
    }


def load_template(model: nn.Module, optimizer: torch.optim.Optimizer, rank_key: str,
                  saved_sizes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A state dict shaped like a saved one, whose tensors ``dcp.load`` fills in place. ``saved_sizes``: the
    checkpoint's entries (key -> size, from its metadata), which fix the lengths of the host-state blobs."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options())
    optim_tensors, _ = _split_optimizer(optim_sd)
    prefix = f"rank_state.{rank_key}."
    rank_state = {k[len(prefix):]: torch.empty(size, dtype=torch.uint8)
                  for k, size in saved_sizes.items() if k.startswith(prefix)}
    if "trainer" not in saved_sizes or "json" not in rank_state:
        raise ValueError(f"the checkpoint lacks the trainer or {rank_key} state (not written by this nsa_titan)")
    return {"model": model_sd, "optimizer": optim_tensors,
            "trainer": torch.empty(saved_sizes["trainer"], dtype=torch.uint8), "rank_state": {rank_key: rank_state}}


def apply_loaded(loaded: dict[str, Any], rank_key: str, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, loader: Any, train_state: TrainState, device: torch.device,
                 saved_world_size: int, world_size: int, keep_saved_hyperparams: bool = False, log=print) -> None:
    """Push a filled ``load_template`` into the live objects."""
    impl = [{k: g[k] for k in _IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    mine, my_base_lrs = _hyperparams(optimizer), list(scheduler.base_lrs)
    trainer = _from_json_tensor(loaded["trainer"])
    # Param-group values for every key the live optimizer has: the saved one (JSON lists back to tuples,
    # e.g. betas), or the live one where the checkpoint has none.
    live_optim = get_state_dict(model, optimizer, options=state_dict_options())[1]
    saved_plain = trainer["param_groups"]
    plain = {k: (tuple(saved_plain[k]) if isinstance(v, tuple) else saved_plain[k]) if k in saved_plain else v
             for k, v in live_optim.items() if not isinstance(v, torch.Tensor)}
    set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                   optim_state_dict={**loaded["optimizer"], **plain}, options=state_dict_options())
    for group, keep in zip(optimizer.param_groups, impl):
        group.update(keep)
    changes = hyperparam_changes(_hyperparams(optimizer), mine)
    if keep_saved_hyperparams:
        if changes:
            log(f"checkpoint: keeping the saved hyper-parameters (checkpoint.keep_saved_hyperparams), not this "
                f"run's: {'; '.join(c.replace(' -> ', ' (this run: ') + ')' for c in changes)}")
    else:
        for group, values in zip(optimizer.param_groups, mine):
            group.update(values)
        if changes:
            log(f"checkpoint: this run's settings replace the saved ones: {'; '.join(changes)} "
                "(--checkpoint.keep_saved_hyperparams keeps the saved ones)")
    _set_train_state(train_state, trainer["train_state"])
    _load_scheduler(scheduler, optimizer, trainer["lr_scheduler"], None if keep_saved_hyperparams else my_base_lrs)
    rank_files = loaded["rank_state"][rank_key]
    rank_state = _from_json_tensor(rank_files["json"])
    if saved_world_size == world_size:
        loader.load_state_dict(rank_state["loader"])
        set_rng_state(_rng_from_saved(rank_state["rng"], rank_files), device)
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
    # The loader's own states (torchdata's, a stream's) describe the saved ranks' streams: not carried over (an
    # in-memory corpus continues from the position; a streamed one cannot, and its loader says so).
    out.update(torchdata=None, stream=None, start=out["sample_index"])
    return out
