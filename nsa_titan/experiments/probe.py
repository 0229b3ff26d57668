"""Peak memory and step time of one training configuration from a few synthetic steps (the AC planner's probe).

    python -m nsa_titan.experiments.probe --result R.json [--fake-world-size N] [--warmup 2 --steps 3] \\
        --config train_configs/nsa_1b.toml --training.local_batch_size 2 --activation_checkpoint.mode ratio ...
    torchrun --standalone --nproc_per_node N -m nsa_titan.experiments.probe --result R.json ...   (real N GPUs)

It builds exactly what the trainer trains (``parallelize_nsa``: AC -> compile -> data parallel, the same
data-parallel train step with gradient accumulation and the fused optimizer) but feeds random tokens: no loader,
no logging, no checkpoints. ``--fake-world-size N`` makes this one process rank 0 of N through a fake process
group (``FakeStore`` + backend "fake": collectives return at once), so FSDP shards parameters, gradients and
optimizer state N ways exactly as on N GPUs: that measures the per-rank memory of an N-GPU job on one GPU
(minus NCCL's own buffers). Its step time is compute only (no communication) and is reported as such.

Memory: CUDA peak allocated / active / reserved since the first step. On CPU only the process's peak RSS exists
(not per configuration); the planner's CPU tests inject their own memory function instead. ``--memory-cap-gib C``
caps the caching allocator at C GiB (``torch.cuda.set_per_process_memory_fraction``): allocations beyond it fail
as they would on a GPU of C GiB, so an H200 measures what fits an 80 GB H100 (the CUDA context and NCCL's own
buffers sit outside the allocator on both).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nsa_titan.components.device_stats import GIB, peak_active_gib, peak_flops_for_name, peak_memory_gib
from nsa_titan.components.optimizer import build_optimizer
from nsa_titan.components.runtime import (
    autocast_context,
    device_name,
    resolve_device,
    seed_everything,
    software_versions,
    start_process_group,
    world_from_env,
)
from nsa_titan.components.train_step import full_param_shapes, token_loss_sum, train_step
from nsa_titan.config import load_job_config
from nsa_titan.models import build_model
from nsa_titan.models.nsa.flops import training_flops_per_token
from nsa_titan.parallelisms import ParallelDims, compile_loss, parallelize_nsa

# Failures that mean "does not fit": the allocator's own error, and library handles (cuBLAS, cuDNN) that cannot get
# their workspace when the caching allocator holds nearly all of the GPU (seen: 1b at 32k, fake group of 16).
OOM_MARKS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def ran_out_of_memory(text: str) -> bool:
    """Whether an error message or a probe's log says that memory ran out."""
    low = text.lower()
    return any(mark in low for mark in OOM_MARKS)


def init_fake_process_group(world_size: int) -> None:
    """This process becomes rank 0 of ``world_size`` ranks whose collectives do nothing (see module docstring)."""
    # Private testing module (may be absent from a torch build); importing it registers the backend "fake".
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415 - optional

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def memory_cap_fraction(cap_gib: float, total_gib: float) -> float:
    """The fraction of a ``total_gib`` GPU that leaves its allocator ``cap_gib``; the cap must fit the GPU."""
    if not 0 < cap_gib <= total_gib:
        raise ValueError(f"--memory-cap-gib {cap_gib:g} must be in (0, {total_gib:.2f}], this GPU's memory: the cap "
                         "mirrors a smaller GPU on a bigger one; lower it, or run on a GPU with at least that much")
    return cap_gib / total_gib


def apply_memory_cap(cap_gib: float | None, device: torch.device) -> None:
    if cap_gib is None:
        return
    if device.type != "cuda":
        raise ValueError(f"--memory-cap-gib caps the CUDA allocator, but this probe runs on {device.type}: drop the "
                         "cap or run on a GPU")
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    torch.cuda.set_per_process_memory_fraction(memory_cap_fraction(cap_gib, total), device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync ok: timing boundary of a measurement, not the trainer


def run_probe(argv: list[str], *, fake_world_size: int | None = None, warmup: int = 2, steps: int = 3,
              memory_cap_gib: float | None = None) -> dict[str, Any]:
    """Measure ``warmup + steps`` optimizer steps of the configuration that ``argv`` (trainer flags) describes."""
    cfg = load_job_config(argv)
    tc = cfg.training
    world = world_from_env()
    fake = bool(fake_world_size and fake_world_size > 1)
    if fake and world.world_size > 1:
        raise ValueError("--fake-world-size is for a single process (it stands in for rank 0 of N)")
    world_size = fake_world_size if fake else world.world_size
    device = resolve_device(tc.device, world.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    apply_memory_cap(memory_cap_gib, device)  # before anything is allocated
    if fake:
        init_fake_process_group(world_size)
    else:
        start_process_group(world, device)
    seed_everything(tc.seed)
    dims = ParallelDims.from_config(world_size, cfg.parallelism)
    args = cfg.model_args()
    result: dict[str, Any] = {"world_size": world_size, "fake_process_group": fake, "local_batch": tc.local_batch_size,
                              "grad_accum": tc.grad_accum_steps, "seq_len": tc.seq_len, "device": device_name(device),
                              "memory_cap_gib": memory_cap_gib, "oom": False, **software_versions()}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        result["device_total_gib"] = torch.cuda.get_device_properties(device).total_memory / GIB
    try:
        with torch.device("meta"):
            model = build_model(args)
        model = parallelize_nsa(model, dims, cfg, device)
        params = [p for p in model.parameters() if p.requires_grad]
        with full_param_shapes(model):
            optimizer = build_optimizer(model, cfg.optimizer, device.type)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        gen = torch.Generator(device=device).manual_seed(tc.seed)
        tokens = torch.randint(0, args.vocab_size, (tc.grad_accum_steps, tc.local_batch_size, tc.seq_len + 1),
                               device=device, generator=gen)
        batches = [{"input": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
        autocast = lambda: autocast_context(device, tc.mixed_precision)  # noqa: E731
        loss_fn = compile_loss(token_loss_sum, cfg.compile)  # as the trainer: its memory is the plan's
        t0 = time.perf_counter()
        for i in range(warmup + steps):
            if i == warmup:
                _sync(device)
                t0 = time.perf_counter()
            train_step(model, optimizer, scheduler, batches, params=params, max_norm=tc.max_norm, autocast=autocast,
                       dp_degree=dims.dp_degree, grad_sync=cfg.parallelism.grad_sync,
                       shard_local=cfg.optimizer.shard_local, loss_fn=loss_fn)
        _sync(device)
        step_s = (time.perf_counter() - t0) / steps
        tokens_per_step = tc.grad_accum_steps * tc.local_batch_size * tc.seq_len
        result.update(step_time_s=step_s, tokens_per_s_per_gpu=tokens_per_step / step_s)
        peak = peak_flops_for_name(result["device"])
        flops = training_flops_per_token(args, tc.seq_len)
        result["mfu"] = flops * result["tokens_per_s_per_gpu"] / peak if peak else None
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not (isinstance(e, torch.OutOfMemoryError) or ran_out_of_memory(str(e))):
            raise
        result.update(oom=True, error=str(e).strip().splitlines()[0][:300])
    alloc, reserved = peak_memory_gib(device)
    result.update(peak_alloc_gib=alloc, peak_reserved_gib=reserved, peak_active_gib=peak_active_gib(device))
    if result["oom"]:
        result["peak_reserved_gib"] = math.inf  # it did not fit, whatever was reserved when it failed
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--result", required=True, help="JSON file for the measurement (written by rank 0)")
    ap.add_argument("--fake-world-size", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation happens in the first)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--memory-cap-gib", type=float, default=None,
                    help="cap the CUDA caching allocator at this many GiB (plan for a smaller GPU)")
    a, train_args = ap.parse_known_args(argv)
    result = run_probe(train_args, fake_world_size=a.fake_world_size, warmup=a.warmup, steps=a.steps,
                       memory_cap_gib=a.memory_cap_gib)
    if world_from_env().rank == 0:
        Path(a.result).parent.mkdir(parents=True, exist_ok=True)
        Path(a.result).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
