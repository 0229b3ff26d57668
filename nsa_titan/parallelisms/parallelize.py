"""parallelize_nsa: activation checkpointing -> per-block torch.compile -> data parallelism -> materialise."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from nsa_titan.config import ConfigError
from nsa_titan.models.nsa.attention import SELECTIVE_AC_SAVE_OPS, compile_cache_tag
from nsa_titan.parallelisms.activation_checkpoint import apply_ac, ratio_block_ids
from nsa_titan.parallelisms.compile import apply_compile
from nsa_titan.parallelisms.data_parallel import apply_ddp, apply_fsdp1, apply_fsdp2, resolve_param_dtype
from nsa_titan.parallelisms.parallel_dims import ParallelDims


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate a meta model's storage on ``device`` and initialise it (``to_empty`` + ``init_weights``).

    For an unwrapped, DDP or FSDP1 model; FSDP2 materialises unit by unit inside ``apply_fsdp2``.
    """
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)


def parallelize_nsa(model: nn.Module, parallel_dims: ParallelDims, job_config: Any, device: torch.device, *,
                    compile_backend: str = "inductor") -> nn.Module:
    """Make a meta-device NSA model ready to train on this rank; returns the model to call (may be a wrapper).

    Order, and why:

    1. Activation checkpointing wraps each block first, so that the checkpointed region is exactly one
       block and everything applied later (compile, FSDP hooks) sees the wrapped block as the unit.
    2. torch.compile per block next, so that the compiled graph contains the checkpoint region: compile
       then honours the recompute decisions (full, or the selective policy's tags), and 'memory_budget'
       lets its partitioner choose them. Compiling after FSDP would put FSDP's hooks into the graph.
    3. Data parallelism last, wrapping the compiled blocks: FSDP's all-gather / reduce-scatter hooks run
       outside the compiled graphs, around each block, and a block's recompute in backward runs while
       FSDP holds its parameters unsharded (so recomputation never re-issues the all-gather itself).
    4. Materialise: FSDP2 allocates, initialises and shards one unit at a time (the same random draws as one
       process, never more than one unit unsharded); DDP and FSDP1 need the whole model materialised before
       wrapping (DDP broadcasts it, FSDP1 flattens it and cannot run our model-level init per unit).

    ``device``: this rank's device. With several ranks the default process group must be started (the trainer
    does it: ``components.runtime.start_process_group``). ``compile_backend``: see ``apply_compile`` (tests use
    a cheaper backend with the same partitioner).
    """
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("parallelize_nsa expects a model built under `with torch.device('meta')`: it shards "
                         "before allocating, so no rank ever holds the full model")
    ac, pc = job_config.activation_checkpoint, job_config.parallelism
    cc = job_config.compile
    if cc.enable and cc.mode == "reduce-overhead" and (device.type != "cuda" or parallel_dims.dp_enabled):
        raise ConfigError("compile.mode 'reduce-overhead' (CUDA graphs) needs one CUDA GPU without data parallelism "
                          f"(here: device {device.type}, data parallel degree {parallel_dims.dp_degree}): data "
                          "parallel hooks run between the blocks' graphs and reallocate parameters; use "
                          "compile.mode 'auto' (graphs only where they can run) or 'default' there")
    apply_ac(model, ac, save_op_names=SELECTIVE_AC_SAVE_OPS)
    if cc.enable:
        budget = ac.memory_budget if ac.mode == "memory_budget" else None
        mode = cc.effective_mode(device.type, parallel_dims.dp_enabled)
        apply_compile(model, dataclasses.replace(cc, mode=mode), budget, backend=compile_backend,
                      cache_tag=compile_cache_tag())

    mesh = parallel_dims.build_mesh(device)
    kind = parallel_dims.data_parallel if parallel_dims.dp_enabled else "none"
    param_dtype = resolve_param_dtype(pc.param_dtype, job_config.training.mixed_precision, device)
    if kind == "fsdp2":
        apply_fsdp2(model, mesh, pc, param_dtype, device)  # materialises unit by unit as it shards
    else:
        materialize(model, device)
        if kind == "fsdp1":
            model = apply_fsdp1(model, mesh, pc, param_dtype, device)
        elif kind == "ddp":
            model = apply_ddp(model, mesh, pc, device, job_config.training.grad_accum_steps)
    model.train()
    return model


def describe_parallelism(parallel_dims: ParallelDims, job_config: Any, n_layers: int, device_type: str) -> str:
    """One log line: data parallelism, mesh, AC and compile as they were applied (on a ``device_type`` device)."""
    ac, pc = job_config.activation_checkpoint, job_config.parallelism
    if parallel_dims.dp_enabled:
        shape, names = parallel_dims.mesh_shape()
        dp = f"{parallel_dims.data_parallel} over {parallel_dims.dp_degree} ranks, mesh " + \
             " x ".join(f"{n}={s}" for n, s in zip(names, shape)) + f", grad sync {pc.grad_sync}"
        if parallel_dims.data_parallel == "fsdp2":
            dp += f", {pc.fsdp_blocks_per_unit} blocks per unit" if pc.fsdp_blocks_per_unit > 1 else ""
            dp += ", first units gathered after each step" if pc.fsdp_unshard_early else ""
    else:
        dp = "no data parallelism (1 rank)"
    if ac.mode == "ratio":
        ac_text = f"ratio {ac.ratio} (blocks {ratio_block_ids(n_layers, ac.ratio)})"
    elif ac.mode == "memory_budget":
        ac_text = f"memory_budget {ac.memory_budget}"
    else:
        ac_text = ac.mode
    cc = job_config.compile
    mode = cc.effective_mode(device_type, parallel_dims.dp_enabled)
    compiled = f"per-block (fullgraph={cc.fullgraph}, mode {mode})" if cc.enable else "off"
    if cc.step_graph:
        compiled += ", whole step replayed as one CUDA graph"
    elif cc.enable and device_type == "cuda" and parallel_dims.dp_enabled and parallel_dims.data_parallel == "fsdp2":
        # Measured (m7c 8k batch 2, 2 GPUs): 39 % of one GPU's tokens/s per GPU without it, 101-102 % with it.
        compiled += (" (FSDP2 without compile.step_graph: the host launches every kernel and FSDP2's hooks run each "
                     "step; a small model is host-bound then, --compile.step_graph --metrics.nsa_diagnostics false "
                     "replays whole steps)")
    return f"parallelism: {dp} | activation checkpointing: {ac_text} | compile: {compiled}"
