"""Data-parallel wrappers: FSDP2 (the default), and FSDP1 / DDP for comparison.

Sharding units (FSDP2 and FSDP1 alike): the token embedding, each transformer block (FSDP2: or each run of
``parallelism.fsdp_blocks_per_unit`` blocks), [final norm + output] and the root (whatever is left). A unit's
parameters are all-gathered just before it runs and its gradients reduce-scattered just after its backward, so
communication overlaps the neighbouring units' compute.
"""

from __future__ import annotations

import itertools
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import CustomPolicy
from torch.nn.parallel import DistributedDataParallel as DDP

_DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp32": torch.float32})  # read-only


def resolve_param_dtype(param_dtype: str, mixed_precision: str, device: torch.device) -> torch.dtype:
    """'auto' follows training.mixed_precision, which CPU runs ignore (fp32): the same numerics as 1 rank."""
    if param_dtype == "auto":
        return torch.bfloat16 if (mixed_precision == "bf16" and device.type == "cuda") else torch.float32
    return _DTYPES[param_dtype]


def _reshard_policy(value: Any) -> tuple[bool | int, bool]:
    """(blocks' reshard_after_forward, last unit's). The last unit (norm + output) is needed again at the
    very start of backward, so resharding it after forward would only re-gather it at once."""
    if value == "always":
        return True, True
    if value == "never":
        return False, False
    if value == "default":
        return True, False
    return int(value), False  # reshard to a smaller world (e.g. within a node): an int divisor of dp_shard


def apply_fsdp2(model: nn.Module, mesh: DeviceMesh, pcfg: Any, param_dtype: torch.dtype, device: torch.device) -> None:
    """fully_shard per unit (see module docstring) of a meta model. HSDP when ``mesh`` is 2-D (replicate x shard).

    Each unit is allocated and initialised in full on ``device`` just before it is sharded. Every rank then
    draws the same random numbers in the same order as one process would (the same seed gives the same model
    under every parallelism and world size), while no rank ever holds more than one unit unsharded.
    (Initialising the sharded DTensors instead would draw from DTensor's own RNG: other values than one
    process's on GPUs, and the same rows on every rank of a CPU mesh.) CPU offload moves each shard to host
    memory as it is made.
    """
    # cast_forward_inputs=False: blocks receive the fp32 RoPE tables, which a bf16 cast would coarsen (the
    # activations are already in the compute dtype; autocast handles the rest, as with one GPU).
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=_DTYPES[pcfg.reduce_dtype],
                              cast_forward_inputs=False)
    offload: OffloadPolicy = (CPUOffloadPolicy(pin_memory=device.type == "cuda") if pcfg.fsdp_cpu_offload
                              else OffloadPolicy())
    blocks_reshard, last_reshard = _reshard_policy(pcfg.fsdp_reshard_after_forward)
    common = {"mesh": mesh, "mp_policy": mp, "offload_policy": offload}

    # the embedding, each block (or run of blocks), [norm + output]: FSDP's units, in init order
    units = group_blocks(model.init_units(), list(model.layers.values()), pcfg.fsdp_blocks_per_unit)
    for i, (unit, init) in enumerate(units):
        for module in unit if isinstance(unit, list) else [unit]:
            module.to_empty(device=device)
        with torch.no_grad():
            init()
        last = i == len(units) - 1
        fully_shard(unit, reshard_after_forward=last_reshard if last else blocks_reshard, **common)
    model.init_buffers(device)  # RoPE tables: the root's only state, computed (not random)
    # The root's own parameters (none today) are needed through the whole step: never reshard them.
    fully_shard(model, reshard_after_forward=False, **common)

    n = pcfg.fsdp_prefetch
    if n > 0:
        # Explicit prefetch: issue the next n units' all-gathers when unit i starts (forward), the previous
        # n units' when unit i's backward starts; more overlap than the implicit one-ahead, more memory. A unit
        # of several blocks is named by its first block (its FSDP state is shared by all of them).
        ids = {id(b) for b in model.layers.values()}
        firsts = [m for m in (u[0] if isinstance(u, list) else u for u, _ in units) if id(m) in ids]
        for i, unit in enumerate(firsts):
            unit.set_modules_to_forward_prefetch(firsts[i + 1:i + 1 + n])
            unit.set_modules_to_backward_prefetch(firsts[max(0, i - n):i][::-1])


class _UnshardFirstUnits:
    """Called after each optimizer step (parallelism.fsdp_unshard_early): all-gathers the first units of the next
    forward (the embedding, the first block's unit), so that FSDP2's pre-forward finds them unsharded. FSDP2's
    state_dict hooks reshard them for a checkpoint, and the forward reshards them by its own policy."""

    def __init__(self, units: list):
        self.units = units

    def __call__(self) -> None:
        for unit in self.units:
            unit.unshard()


def early_unshard(model: nn.Module, pcfg: Any) -> _UnshardFirstUnits | None:
    """What the trainer calls after each optimizer step under ``parallelism.fsdp_unshard_early`` (None: nothing,
    also when the model was not sharded by FSDP2, e.g. one rank)."""
    if not pcfg.fsdp_unshard_early or not isinstance(model.tok_embeddings, FSDPModule):
        return None
    return _UnshardFirstUnits([model.tok_embeddings, next(iter(model.layers.values()))])


class _InitEach:
    """The initialiser of a unit of several blocks: each block's, in order (an object, not a closure in a loop:
    each unit keeps its own list)."""

    def __init__(self, inits: list):
        self.inits = list(inits)

    def __call__(self) -> None:
        for init in self.inits:
            init()


def group_blocks(units: list, blocks: list[nn.Module], per_unit: int) -> list:
    """``model.init_units()`` with each run of ``per_unit`` consecutive blocks merged into one unit (a list of
    blocks whose initialiser runs theirs in order: the random draws stay one process's). The last run may be
    shorter."""
    if per_unit == 1:
        return list(units)
    ids = {id(b) for b in blocks}
    out = []
    for is_block, run in itertools.groupby(units, key=lambda u: not isinstance(u[0], list) and id(u[0]) in ids):
        run = list(run)
        if not is_block:
            out += run
            continue
        for i in range(0, len(run), per_unit):
            chunk = run[i:i + per_unit]
            out.append(([m for m, _ in chunk], _InitEach([f for _, f in chunk])))
    return out


def apply_fsdp1(model: nn.Module, mesh: DeviceMesh, pcfg: Any, param_dtype: torch.dtype,
                device: torch.device) -> nn.Module:
    """FullyShardedDataParallel with auto-wrap per block (+ embedding, + [norm, output] via the root).

    FSDP1 cannot run our model-level ``init_weights`` per unit, so the model must already be materialised.
    """
    strategy = {"full": ShardingStrategy.FULL_SHARD, "grad_op": ShardingStrategy.SHARD_GRAD_OP,
                "hybrid": ShardingStrategy.HYBRID_SHARD}[pcfg.fsdp1_sharding_strategy]
    prefetch = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST,
                "none": None}[pcfg.fsdp1_backward_prefetch]
    mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=_DTYPES[pcfg.reduce_dtype], buffer_dtype=None)
    # Wrap exactly the objects in model.layers (after AC / compile wrapping), whatever their class, so
    # that FSDP never wraps a module inside a compiled or checkpointed block.
    units = {id(m) for m in (model.tok_embeddings, *model.layers.values())}
    policy = CustomPolicy(_InUnits(units))
    return FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=strategy,
        mixed_precision=mp,
        use_orig_params=pcfg.fsdp1_use_orig_params,
        limit_all_gathers=pcfg.fsdp1_limit_all_gathers,
        forward_prefetch=pcfg.fsdp1_forward_prefetch,
        backward_prefetch=prefetch,
        device_mesh=mesh,
        device_id=device,  # FSDP1 refuses a CPU-only process unless told the device explicitly
    )


class _InUnits:
    """FSDP1 CustomPolicy lambda: wrap a module iff it is one of the chosen units (an object, no closure)."""

    def __init__(self, unit_ids: set[int]):
        self.unit_ids = unit_ids

    def __call__(self, module: nn.Module) -> bool:
        return id(module) in self.unit_ids


def ddp_static_graph_valid(pcfg: Any, grad_accum_steps: int) -> bool:
    """static_graph is valid when every backward reduces the same way: DDP's static-graph reducer asserts
    inside ``no_sync`` backwards, i.e. with grad accumulation that syncs on the last micro-batch only."""
    return pcfg.ddp_static_graph and (grad_accum_steps == 1 or pcfg.grad_sync == "every_micro_batch")


def apply_ddp(model: nn.Module, mesh: DeviceMesh, pcfg: Any, device: torch.device, grad_accum_steps: int) -> nn.Module:
    """DistributedDataParallel over every rank; the model must already be materialised (DDP broadcasts
    rank 0's parameters at construction)."""
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh.get_group(),
        # Valid with every AC mode because checkpointing is never reentrant: each parameter's gradient
        # hook fires exactly once per backward.
        static_graph=ddp_static_graph_valid(pcfg, grad_accum_steps),
    )
