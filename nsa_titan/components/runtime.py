"""Process-level setup for training: torchrun world, process group, device, seeding, autocast, environment facts."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import random
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env(environ: Mapping[str, str] | None = None) -> World:
    """Read torchrun's RANK / LOCAL_RANK / WORLD_SIZE (defaults 0 / 0 / 1 for a plain `python -m`)."""
    env = os.environ if environ is None else environ
    try:
        world = World(int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1)))
    except ValueError as e:
        raise ValueError(f"malformed torchrun environment (RANK/LOCAL_RANK/WORLD_SIZE): {e}") from None
    if world.world_size < 1 or not 0 <= world.rank < world.world_size:
        raise ValueError(f"invalid torchrun world: {world}")
    return world


def start_process_group(world: World, device: torch.device, timeout_s: float | None = None) -> None:
    """Start the default process group of a multi-rank run: NCCL on CUDA, gloo on CPU; nothing for one rank.

    The trainer calls it once, after the config and the data were checked (a bad setting then fails before any
    rank waits for the others) and before the model is built. ``timeout_s`` (fault.collective_timeout_s): a
    collective that waits longer fails instead of hanging.
    """
    if world.world_size <= 1 or dist.is_initialized():
        return
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    # device_id binds NCCL to this rank's GPU at once (eager init: no lazy per-collective setup).
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None, timeout=timeout)


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    spec = str(spec).lower()
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("training.device = 'cuda' but no CUDA device is available; use --training.device auto")
        return torch.device(f"cuda:{local_rank}")
    if spec == "cpu":
        return torch.device("cpu")
    raise ValueError(f"training.device must be 'auto', 'cpu' or 'cuda', got {spec!r}")


def configure_cuda_allocator(device: torch.device, expandable_segments: bool) -> None:
    """training.expandable_segments on a CUDA device (a no-op elsewhere). It applies to the segments allocated
    from then on, so the trainer calls it before building the model."""
    if device.type == "cuda" and expandable_segments:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def autocast_context(device: torch.device, mixed_precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (params stay fp32 = master weights); CPU always runs plain fp32.
    ``mixed_precision``: training.mixed_precision ('bf16' or 'fp32', checked by the config)."""
    if device.type == "cuda" and mixed_precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    # The intra-op thread count matters on CPU: oversubscribed OpenMP threads can slow steps by 10x+.
    return (f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"intra-op threads {torch.get_num_threads()})")


def software_versions() -> dict[str, str | None]:
    try:
        import triton  # noqa: PLC0415 - optional

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version}
