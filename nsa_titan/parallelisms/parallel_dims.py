"""Parallel degrees from the world size and ``[parallelism]``, and the device mesh built from them.

Only data parallelism exists, so every rank is a data-parallel rank: world = dp_replicate x dp_shard, the
data-parallel rank is the global rank, and the mesh is

- 1-D ``("dp_shard",)`` for FSDP (fsdp2, or fsdp1 full / grad_op),
- 2-D ``("dp_replicate", "dp_shard")`` for HSDP (fsdp2 with dp_replicate > 1, fsdp1 'hybrid'),
- 1-D ``("dp_replicate",)`` for DDP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nsa_titan.config import ConfigError


@dataclass
class ParallelDims:
    """Resolved, validated degrees; ``build_mesh`` builds the device mesh over the trainer's process group."""

    world_size: int
    data_parallel: str
    dp_replicate: int
    dp_shard: int
    mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_config(cls, world_size: int, parallelism: Any) -> ParallelDims:
        """Resolve ``dp_shard = -1`` and check that the degrees multiply to ``world_size``; ConfigError if not.

        ``parallelism`` is the validated [parallelism] section: its choices and ranges are checked there; here
        only what needs the world size.
        """
        kind, rep, shard = parallelism.data_parallel, parallelism.dp_replicate, parallelism.dp_shard
        if kind == "ddp":
            # DDP replicates the whole model on every rank: there is nothing to shard.
            if shard not in (-1, 1) or rep not in (1, world_size):
                raise ConfigError(f"parallelism.data_parallel=ddp replicates over all {world_size} ranks; got "
                                  f"dp_replicate={rep}, dp_shard={shard}. Leave both at their defaults, or use "
                                  "fsdp2 for sharding / HSDP")
            rep, shard = world_size, 1
        elif shard == -1:
            if world_size % rep:
                raise ConfigError(f"parallelism.dp_replicate={rep} does not divide the world size {world_size}; "
                                  f"choose a divisor of {world_size}")
            shard = world_size // rep
        if rep * shard != world_size:
            raise ConfigError(f"parallelism: dp_replicate x dp_shard = {rep} x {shard} = {rep * shard} but the "
                              f"world size (torchrun --nproc_per_node x nodes) is {world_size}; make the product "
                              f"equal, e.g. --parallelism.dp_shard -1")
        dims = cls(world_size=world_size, data_parallel=kind, dp_replicate=rep, dp_shard=shard)
        dims._check_strategy(parallelism)
        return dims

    def _check_strategy(self, parallelism: Any) -> None:
        if not self.dp_enabled:
            return
        if self.data_parallel == "fsdp1":
            hybrid = parallelism.fsdp1_sharding_strategy == "hybrid"
            if hybrid and self.dp_replicate == 1:
                raise ConfigError("parallelism.fsdp1_sharding_strategy=hybrid shards within and replicates across "
                                  "groups: set --parallelism.dp_replicate > 1 (e.g. the number of nodes)")
            if hybrid and self.dp_shard == 1:
                # FSDP1 silently turns a 1-rank shard group into NO_SHARD, which then skips the all-reduce
                # across replicas: every replica would train on its own gradients.
                raise ConfigError("parallelism.fsdp1_sharding_strategy=hybrid with dp_shard=1 is unsupported "
                                  "(FSDP1 would drop the gradient all-reduce across replicas); use ddp, or fsdp2 "
                                  "(HSDP works with dp_shard=1)")
            if not hybrid and self.dp_replicate > 1:
                raise ConfigError(f"parallelism.dp_replicate={self.dp_replicate} with fsdp1 needs "
                                  "--parallelism.fsdp1_sharding_strategy hybrid")
        rafp = parallelism.fsdp_reshard_after_forward
        if self.data_parallel == "fsdp2" and isinstance(rafp, int) and not isinstance(rafp, bool):
            if not (1 < rafp < self.dp_shard and self.dp_shard % rafp == 0):
                raise ConfigError(f"parallelism.fsdp_reshard_after_forward={rafp} must be a divisor k of "
                                  f"dp_shard={self.dp_shard} with 1 < k < dp_shard; use default, always or never")

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def hsdp(self) -> bool:
        return self.data_parallel != "ddp" and self.dp_replicate > 1

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        if self.data_parallel == "ddp":
            return (self.dp_replicate,), ("dp_replicate",)
        if self.hsdp:
            return (self.dp_replicate, self.dp_shard), ("dp_replicate", "dp_shard")
        return (self.dp_shard,), ("dp_shard",)

    def build_mesh(self, device: torch.device) -> DeviceMesh | None:
        """The device mesh over the default process group, which the caller started (the trainer:
        ``components.runtime.start_process_group``); None for one rank."""
        if not self.dp_enabled:
            return None
        if self.mesh is not None:
            return self.mesh
        if not dist.is_initialized():
            raise RuntimeError(f"{self.dp_degree} data-parallel ranks need a process group: start it before "
                               "parallelize_nsa (nsa_titan.components.runtime.start_process_group)")
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"process group has {dist.get_world_size()} ranks, ParallelDims expects "
                               f"{self.world_size}")
        shape, names = self.mesh_shape()
        self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        return self.mesh

    def dp_rank(self) -> int:
        """This rank's data shard index in [0, dp_degree): the global rank (row-major mesh, DP only)."""
        return dist.get_rank() if self.dp_enabled else 0
