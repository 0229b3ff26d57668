"""Communication estimate for the planner's fake-process-group rows: FSDP2's collectives per optimizer step, timed
from measured bandwidth, with FSDP2's overlap (docs/experiments.md, "Communication estimate").

A fake process group makes collectives return at once, so such a probe measures compute only. This adds what the
collectives would cost on N real GPUs:

- **Time of one collective** (alpha-beta): ``alpha + bytes * (N - 1) / N / busbw`` for a tensor of ``bytes`` (the
  full, unsharded size), alpha = the time of the smallest measured message (latency), busbw = the bus bandwidth
  of the largest (NCCL's convention, as ``benchmarks/bench_parallel.py --comm`` prints it). Without a measurement
  ``DEFAULT_BANDWIDTH`` (2 H200 over NVLink NV18, measured) stands in, and the rows say so.
- **Units** as ``apply_fsdp2`` makes them, in forward order: the embedding, each block, [norm + output]. A unit
  all-gathers its parameters (param dtype) before its forward, again before its backward when it was resharded
  after forward, and reduce-scatters its gradients (reduce dtype) after its backward.
- **Compute per unit**: the measured compute time of a micro-batch split in proportion to forward FLOPs, with
  backward = 2 forwards plus the recompute (1 forward for a checkpointed block, 0.5 for selective_op).
- **Overlap** (FSDP2: the next unit's all-gather runs during this unit's compute; a reduce-scatter runs during the
  next unit's backward): only what a unit's compute cannot hide is exposed,
  forward  ``AG(u0) + sum_i max(0, AG(u_i+1) - F(u_i))``,
  backward ``[AG(u_last) if resharded] + sum_i max(0, AG(u_i-1) [if resharded] + RS(u_i+1) - B(u_i)) + RS(u0)``
  (the all-gather and reduce-scatter of one process group share one NCCL stream, so they add up).
  With gradient accumulation and ``grad_sync = last_micro_batch`` only the last micro-batch reduce-scatters.

Left out (each makes the estimate optimistic): host time of FSDP's hooks and copies, slower compute kernels
while NCCL kernels share the SMs, waiting for a slower rank, and the lower bandwidth between nodes (rows above
one node's GPUs use the measured intra-node figure: the report marks them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nsa_titan.models import build_model
from nsa_titan.models.nsa.flops import forward_flops_breakdown
from nsa_titan.parallelisms.activation_checkpoint import ratio_block_ids

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
# Extra forwards a block's backward runs per AC mode (selective_op recomputes about half of the forward's work).
RECOMPUTE = {"none": 0.0, "full": 1.0, "selective_op": 0.5, "memory_budget": 0.0}


@dataclass(frozen=True)
class Collective:
    latency_s: float
    busbw_bytes_per_s: float

    def time_s(self, nbytes: float, world: int) -> float:
        if world <= 1:
            return 0.0
        return self.latency_s + nbytes * (world - 1) / world / self.busbw_bytes_per_s


@dataclass(frozen=True)
class Bandwidth:
    all_gather: Collective
    reduce_scatter: Collective
    source: str

    @classmethod
    def from_measurement(cls, rows: list[dict[str, Any]], source: str) -> Bandwidth:
        """From ``bench_parallel.py --comm`` rows ({op, MiB, ms, busbw_GBps}): latency = the smallest message's
        time, bandwidth = the largest message's busbw, per operation."""
        ops = {}
        for op in ("all_gather", "reduce_scatter"):
            mine = sorted((r for r in rows if r.get("op") == op), key=lambda r: r["MiB"])
            if len(mine) < 2:
                raise ValueError(f"{source}: needs {op} measured at two message sizes at least (latency and "
                                 f"bandwidth), found {len(mine)}; rerun benchmarks/bench_parallel.py --comm")
            ops[op] = Collective(mine[0]["ms"] / 1e3, mine[-1]["busbw_GBps"] * 1e9)
        return cls(ops["all_gather"], ops["reduce_scatter"], source)

    @classmethod
    def load(cls, path: str | Path) -> Bandwidth:
        """A ``parallel_<tag>.json`` of bench_parallel.py (its "collectives"), or a bare list of its rows."""
        data = json.loads(Path(path).read_text())
        rows = data.get("collectives") if isinstance(data, dict) else data
        if not rows:
            raise ValueError(f"{path}: no collective measurements in it (run benchmarks/bench_parallel.py --comm)")
        device = data.get("device", "?") if isinstance(data, dict) else "?"
        return cls.from_measurement(rows, f"measured: {Path(path).name} ({device})")


# busbw at 256 MiB and time at 4 KiB, 2 x H200 over NVLink NV18, NCCL, torch 2.11 (2026-11-22):
# benchmarks/results/parallel_h200x2_seq8192_m7c_fsdp2_probe.md.
DEFAULT_BANDWIDTH = Bandwidth(Collective(25.1e-6, 244.4e9), Collective(23.0e-6, 230.0e9),
                              "default: 2 x H200 NVLink, 244/230 GB/s all-gather/reduce-scatter busbw "
                              "(parallel_h200x2_seq8192_m7c_fsdp2_probe.md); pass --collectives for a measurement")


@dataclass(frozen=True)
class UnitSpec:
    """One FSDP2 unit: its parameters, forward FLOPs per token, extra forwards in backward, and whether it is
    resharded after forward (then all-gathered again for backward)."""

    name: str
    params: int
    fwd_flops: float
    recompute: float
    regather: bool


@dataclass(frozen=True)
class UnitTimes:
    """One unit in one micro-batch: compute (forward, backward with recompute) and its collectives, seconds."""

    fwd_s: float
    bwd_s: float
    ag_s: float
    rs_s: float
    regather: bool


def exposed_comm(units: list[UnitTimes], reduce: bool) -> dict[str, float]:
    """Seconds of communication that compute does not hide in one micro-batch (module docstring's formulas)."""
    n = len(units)
    fwd = units[0].ag_s + sum(max(0.0, units[i + 1].ag_s - units[i].fwd_s) for i in range(n - 1))
    bwd = units[-1].ag_s if units[-1].regather else 0.0
    for i in reversed(range(n)):
        comm = units[i - 1].ag_s if i > 0 and units[i - 1].regather else 0.0
        if reduce and i + 1 < n:
            comm += units[i + 1].rs_s
        bwd += max(0.0, comm - units[i].bwd_s)
    if reduce:
        bwd += units[0].rs_s
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd}


def unit_times(specs: list[UnitSpec], compute_s: float, bandwidth: Bandwidth, world: int, param_bytes: int,
               reduce_bytes: int) -> list[UnitTimes]:
    """Split one micro-batch's measured compute ``compute_s`` over the units in proportion to their work (forward
    1, backward 2 + recompute, times forward FLOPs) and time each unit's collectives."""
    work = sum((3.0 + s.recompute) * s.fwd_flops for s in specs)
    k = compute_s / work if work > 0 else 0.0
    return [UnitTimes(fwd_s=k * s.fwd_flops, bwd_s=k * (2.0 + s.recompute) * s.fwd_flops,
                      ag_s=bandwidth.all_gather.time_s(s.params * param_bytes, world),
                      rs_s=bandwidth.reduce_scatter.time_s(s.params * reduce_bytes, world), regather=s.regather)
            for s in specs]


def step_comm(units: list[UnitTimes], grad_accum: int, sync_every_micro_batch: bool) -> dict[str, float]:
    """Exposed and total communication of one optimizer step of ``grad_accum`` micro-batches."""
    reducing = grad_accum if sync_every_micro_batch else 1  # last_micro_batch: only the last one reduce-scatters
    exposed = (reducing * exposed_comm(units, reduce=True)["total"]
               + (grad_accum - reducing) * exposed_comm(units, reduce=False)["total"])
    gathers = sum(u.ag_s * (2 if u.regather else 1) for u in units)
    total = grad_accum * gathers + reducing * sum(u.rs_s for u in units)
    return {"exposed_s": exposed, "total_s": total}


class CommEstimator:
    """FSDP2 communication of the trainer configuration ``job_config`` (the planner's trainer arguments)."""

    def __init__(self, job_config: Any, bandwidth: Bandwidth = DEFAULT_BANDWIDTH):
        self.cfg, self.bandwidth = job_config, bandwidth
        pc, tc = job_config.parallelism, job_config.training
        self.args = job_config.model_args()
        self.seq_len = tc.seq_len
        # The probes run on GPUs: 'auto' means bf16 parameters under bf16 autocast (resolve_param_dtype).
        auto = "bf16" if tc.mixed_precision == "bf16" else "fp32"
        self.param_bytes = DTYPE_BYTES[auto if pc.param_dtype == "auto" else pc.param_dtype]
        self.reduce_bytes = DTYPE_BYTES[pc.reduce_dtype]
        self.sync_every = pc.grad_sync == "every_micro_batch"
        self.unsupported = None
        if pc.data_parallel != "fsdp2":
            self.unsupported = f"the estimate models FSDP2 only (parallelism.data_parallel is {pc.data_parallel})"
        elif pc.fsdp_reshard_after_forward not in ("default", "always", "never"):
            self.unsupported = "the estimate does not model an int parallelism.fsdp_reshard_after_forward"
        with torch.device("meta"):
            model = build_model(self.args)
        numel = lambda *mods: sum(p.numel() for m in mods for p in m.parameters())  # noqa: E731
        self.params = {"embedding": numel(model.tok_embeddings), "block": numel(model.layers["0"]),
                       "head": numel(model.norm, model.output)}
        parts = forward_flops_breakdown(self.args, self.seq_len)
        self.head_flops = 2.0 * self.args.dim * self.args.vocab_size
        self.block_flops = (sum(parts.values()) - self.head_flops) / self.args.n_layers

    def units(self, ac_mode: str, ratio: float) -> list[UnitSpec]:
        policy = self.cfg.parallelism.fsdp_reshard_after_forward
        blocks_regather = policy in ("default", "always")
        n = self.args.n_layers
        checkpointed = set(ratio_block_ids(n, ratio)) if ac_mode == "ratio" else set()
        specs = [UnitSpec("embedding", self.params["embedding"], 0.0, 0.0, blocks_regather)]
        k = self.cfg.parallelism.fsdp_blocks_per_unit
        for i in range(0, n, k):  # a unit of several blocks: their parameters and FLOPs, their mean recompute
            ids = range(i, min(i + k, n))
            rs = [(1.0 if j in checkpointed else 0.0) if ac_mode == "ratio" else RECOMPUTE[ac_mode] for j in ids]
            name = f"block {i}" if len(ids) == 1 else f"blocks {i}-{ids[-1]}"
            specs.append(UnitSpec(name, self.params["block"] * len(ids), self.block_flops * len(ids),
                                  sum(rs) / len(rs), blocks_regather))
        specs.append(UnitSpec("norm + output", self.params["head"], self.head_flops, 0.0, policy == "always"))
        return specs

    def estimate(self, world: int, grad_accum: int, compute_step_s: float, ac_mode: str = "ratio",
                 ratio: float = 0.0) -> dict[str, Any]:
        """``compute_step_s``: the measured compute-only time of a full step (``grad_accum`` micro-batches)."""
        if self.unsupported:
            return {"comm_model": None, "comm_note": self.unsupported}
        times = unit_times(self.units(ac_mode, ratio), compute_step_s / grad_accum, self.bandwidth, world,
                           self.param_bytes, self.reduce_bytes)
        comm = step_comm(times, grad_accum, self.sync_every)
        return {"comm_model": "fsdp2_overlap", "compute_step_s": compute_step_s, "comm_exposed_s": comm["exposed_s"],
                "comm_total_s": comm["total_s"], "step_time_s": compute_step_s + comm["exposed_s"],
                "bandwidth_source": self.bandwidth.source}
