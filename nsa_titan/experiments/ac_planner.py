"""GA/AC planner: for each (GPU count, local batch), the smallest activation-checkpointing ratio that fits the memory
budget and the gradient accumulation that keeps the effective batch; then which of those trains fastest.

    python -m nsa_titan.experiments.ac_planner --config train_configs/nsa_1b.toml --gpus 1,2,4,8,16 \\
        --effective-batch 64 --local-batches 1,2,4,8 --memory-cap-gib 79.1 --collectives PARALLEL.json \\
        --out benchmarks/results --tag 1b_seq8192 [-- trainer overrides]

Writes ``ac_plan_<tag>.md`` (recommendations such as "1 GPU: bs=1 AC=0.4 GA=64", the study-layout grid of
``AC=r, GA=g`` cells and of step times, and the long table; ``plan_report.py``), ``ac_plan_<tag>.json`` and
``ac_plan_<tag>.png`` (time per optimizer step vs AC ratio, one line per GPU count).

Search. GA = effective batch / (GPUs x local batch) (combinations that do not divide are skipped). The ratio
(``activation_checkpoint.mode ratio``: that fraction of the blocks fully checkpointed) is searched over ``--ratios``
by bisection, since memory falls as the ratio rises. Local batches are visited in increasing order: at a fixed
probe GA, memory grows with the batch, so the previous batch's ratio is a lower bound and a batch that does not
fit even fully checkpointed rules out every larger one.

Measurement (``probe.py``): a few synthetic steps of exactly the trainer's model and step, with GA capped at 2 (GA 2
already holds gradients across micro-batches, the memory GA adds; the time per token barely depends on GA, so the
full step time is extrapolated as tokens per step / measured tokens per second). GPU counts up to the machine's
run on that many GPUs (torchrun); larger ones on one GPU with a fake process group of that world size: per-rank
memory as on N GPUs, compute-only time, to which ``comm_model.py`` adds the estimated FSDP2 communication
(``--collectives``: measured bandwidth); such rows carry ``fake_process_group: true`` and a dagger in the tables.
``--check-estimate`` also probes the real multi-GPU cells with a fake process group and reports the estimate's
error against the measurement. ``--memory-cap-gib`` caps each probe's CUDA allocator
(``torch.cuda.set_per_process_memory_fraction``) so that a bigger GPU plans for a smaller one (79.1: an 80 GB
H100). Probes are cached in ``<out>/ac_plan_<tag>/``: the same command continues after ``--time-limit-s``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nsa_titan.config import load_job_config
from nsa_titan.experiments.comm_model import DEFAULT_BANDWIDTH, Bandwidth, CommEstimator
from nsa_titan.experiments.common import REPO, child_env, environment_of, launch_command, visible_gpus
from nsa_titan.experiments.plan_report import describe, recommendations, write_plan_report
from nsa_titan.experiments.probe import ran_out_of_memory, run_probe

__all__ = ["Point", "add_comm_estimates", "describe", "main", "plan", "recommendations", "smallest_fitting"]


@dataclass(frozen=True)
class Point:
    gpus: int
    local_batch: int
    grad_accum: int
    ratio: float

    @property
    def probe_ga(self) -> int:
        return min(self.grad_accum, 2)


Measure = Callable[[Point], "dict[str, Any] | None"]  # None: not measured (time limit); {"failed": ...}: crashed


class ProbeFailed(Exception):
    """A probe that crashed for another reason than running out of memory: an error, not a 'does not fit'."""


def memory_gib(result: dict[str, Any], metric: str) -> float:
    """The probe's peak for ``metric`` (reserved / alloc / active), falling back to allocated (CPU: RSS)."""
    value = result.get(f"peak_{metric}_gib")
    return math.inf if result.get("oom") else float(value if value is not None else result["peak_alloc_gib"])


def smallest_fitting(n: int, lo: int, fits: Callable[[int], bool | None]) -> tuple[int | None, bool]:
    """Smallest index in [lo, n) with fits(i), for fits monotone (False ... False True ... True).

    Returns (index or None when none fits, complete); complete is False when ``fits`` returned None (not measured).
    """
    first = fits(lo)
    if first is None:
        return None, False
    if first:
        return lo, True
    hi = n - 1
    if hi == lo:
        return None, True
    last = fits(hi)
    if last is None:
        return None, False
    if not last:
        return None, True
    while hi - lo > 1:  # fits(lo) is False, fits(hi) is True
        mid = (lo + hi) // 2
        f = fits(mid)
        if f is None:
            return None, False
        lo, hi = (lo, mid) if f else (mid, hi)
    return hi, True


def plan(gpus: Sequence[int], local_batches: Sequence[int], effective_batch: int, ratios: Sequence[float],
         measure: Measure, budget: Callable[[dict[str, Any]], float], metric: str = "reserved") -> list[dict[str, Any]]:
    """One row per (GPU count, local batch); ``budget(result)``: the memory budget in GiB (may read the device size)."""
    ratios = sorted(ratios)
    rows = []
    for g in gpus:
        lo, none_fit_from, prev_ga = 0, None, None
        for b in sorted(local_batches):
            row: dict[str, Any] = {"gpus": g, "local_batch": b}
            if effective_batch % (g * b):
                rows.append({**row, "status": "skipped", "note": f"{effective_batch} is not a multiple of {g} x {b}"})
                continue
            ga = effective_batch // (g * b)
            row["grad_accum"] = ga
            if Point(g, b, ga, 0.0).probe_ga != prev_ga:  # bounds carry over only at the same probe GA
                lo, none_fit_from, prev_ga = 0, None, Point(g, b, ga, 0.0).probe_ga
            if none_fit_from is not None:
                rows.append({**row, "status": "does_not_fit", "note": f"bs={none_fit_from} already did not fit"})
                continue
            seen: dict[int, dict[str, Any]] = {}

            def fits(i: int) -> bool | None:
                result = measure(Point(g, b, ga, ratios[i]))
                if result is None:
                    return None
                if result.get("failed"):
                    raise ProbeFailed(result.get("error", "probe failed"))
                seen[i] = result
                mem = memory_gib(result, metric)
                return mem != math.inf and mem <= budget(result)  # an OOM result may not know the device size

            try:
                idx, complete = smallest_fitting(len(ratios), lo, fits)
            except ProbeFailed as e:
                rows.append({**row, "status": "error", "probes": len(seen), "note": " ".join(str(e).split())[-200:]})
                continue
            row["probes"] = len(seen)
            if not complete:
                rows.append({**row, "status": "pending", "note": "time limit: run the command again to continue"})
                continue
            if idx is None:
                none_fit_from = b
                worst = seen[max(seen)] if seen else {}
                rows.append({**row, "status": "does_not_fit", "ac_ratio": ratios[-1],
                             "mem_gib": memory_gib(worst, metric) if worst else None,
                             "note": f"over budget even at ratio {ratios[-1]:g}"})
                continue
            lo = idx
            r = seen[idx] if idx in seen else measure(Point(g, b, ga, ratios[idx]))
            tps = r.get("tokens_per_s_per_gpu")
            tokens_per_gpu_step = b * ga * r["seq_len"]
            rows.append({**row, "status": "fits", "ac_ratio": ratios[idx], "mem_gib": memory_gib(r, metric),
                         "budget_gib": budget(r), "tokens_per_s_per_gpu": tps, "mfu": r.get("mfu"),
                         "step_time_s": tokens_per_gpu_step / tps if tps else None,
                         "fake_process_group": bool(r.get("fake_process_group")),
                         "time_source": r.get("time_source", ""), "note": ""})
    return rows


class ProbeRunner:
    """The real ``Measure``: runs probe.py (subprocess, or in this process with ``in_process``) and caches results."""

    def __init__(self, work: Path, train_args: Sequence[str], *, warmup: int, steps: int, timeout_s: float,
                 time_limit_s: float | None, in_process: bool = False, force: bool = False,
                 memory_cap_gib: float | None = None, log: Callable[[str], None] = print):
        self.work, self.train_args, self.memory_cap_gib = Path(work), list(train_args), memory_cap_gib
        self.warmup, self.steps, self.timeout_s, self.in_process, self.log = warmup, steps, timeout_s, in_process, log
        self.deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        self.gpus = 0 if in_process else visible_gpus()
        self.cache_file = self.work / "probes.json"
        fresh = force or not self.cache_file.exists()
        self.cache: dict[str, Any] = {} if fresh else json.loads(self.cache_file.read_text())
        # Results are only reused for the same trainer arguments and memory cap.
        what = self.train_args if memory_cap_gib is None else [self.train_args, memory_cap_gib]
        self.fingerprint = hashlib.sha1(json.dumps(what).encode()).hexdigest()[:10]

    def __call__(self, p: Point, force_fake: bool = False) -> dict[str, Any] | None:
        """Probe ``p``; ``force_fake``: on one GPU with a fake process group even where the machine has p.gpus
        (the compute-only time that the communication estimate starts from, to check it against a real row)."""
        fake = p.gpus > 1 and (force_fake or p.gpus > self.gpus)
        # Its own cache entry, apart from the real row's, also when the report is rebuilt from the cache on a
        # machine with fewer GPUs (where every multi-GPU key looks fake; the results say what they are).
        suffix = "-fake" if force_fake and p.gpus > 1 else ""
        key = f"{self.fingerprint}/g{p.gpus}-b{p.local_batch}-ga{p.probe_ga}-r{p.ratio:g}{suffix}"
        hit = self.cache.get(key)
        if hit is not None and hit.get("fake_process_group") and not fake:
            # A fake-process-group probe cached on a machine with fewer GPUs, where this one can measure the cell
            # for real: it becomes the cell's fake probe (what --check-estimate compares with), and the real
            # row is measured below instead of reusing the estimate as if it were a measurement (past the time
            # limit the cell is pending until then, not shown as measured).
            self.cache.setdefault(f"{key}-fake", self.cache.pop(key))
            hit = None
        if hit is not None:
            return hit
        if self.deadline is not None and time.monotonic() > self.deadline:
            return None
        if self.memory_cap_gib is not None and self.gpus == 0:  # checked here: a cached plan rebuilds anywhere
            raise SystemExit("--memory-cap-gib caps the CUDA allocator of each probe, but no GPU is visible: run "
                             "on a GPU, or drop it (--memory-budget-gib compares CPU peaks with a budget)")
        args = [*self.train_args, "--training.local_batch_size", str(p.local_batch), "--training.grad_accum_steps",
                str(p.probe_ga), "--activation_checkpoint.mode", "ratio", "--activation_checkpoint.ratio", str(p.ratio)]
        self.log(f"probe {key.split('/')[1]}" + (f" (fake process group of {p.gpus})" if fake else ""))
        result = self._in_process(args, p, fake) if self.in_process else self._subprocess(args, p, fake, key)
        if result is None or result.get("failed"):
            return result  # a timeout (None: like the time limit) or a crash is not cached: the next run retries
        result["time_source"] = (f"fake process group of {p.gpus}: compute measured on one device" if fake
                                 else f"measured on {p.gpus} device(s)")
        self.cache[key] = result
        self.work.mkdir(parents=True, exist_ok=True)
        self.cache_file.write_text(json.dumps(self.cache, indent=1, default=str) + "\n")
        return result

    def _in_process(self, args: list[str], p: Point, fake: bool) -> dict[str, Any]:
        torch._dynamo.reset()  # a fresh model per probe: stale compiled graphs would count against recompile limits
        return run_probe(args, fake_world_size=p.gpus if p.gpus > 1 else None, warmup=self.warmup, steps=self.steps,
                         memory_cap_gib=self.memory_cap_gib)

    def _subprocess(self, args: list[str], p: Point, fake: bool, key: str) -> dict[str, Any] | None:
        name = key.replace("/", "_")
        result_file, log_file = self.work / f"{name}.json", self.work / f"{name}.log"
        self.work.mkdir(parents=True, exist_ok=True)
        result_file.unlink(missing_ok=True)
        probe_args = ["--result", str(result_file), "--warmup", str(self.warmup), "--steps", str(self.steps),
                      *(["--fake-world-size", str(p.gpus)] if fake else []),
                      *(["--memory-cap-gib", str(self.memory_cap_gib)] if self.memory_cap_gib else []), *args]
        nproc = 1 if (p.gpus == 1 or fake) else p.gpus
        with open(log_file, "w") as log:
            try:
                rc = subprocess.run(launch_command(nproc, "nsa_titan.experiments.probe", probe_args), cwd=REPO,
                                    env=child_env(nproc, gpu=True), stdout=log, stderr=subprocess.STDOUT,
                                    timeout=self.timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if result_file.exists():
            return json.loads(result_file.read_text())
        text = log_file.read_text()
        if rc == "timeout":
            self.log(f"probe timed out after {self.timeout_s:.0f} s (raise --probe-timeout-s); see {log_file}")
            return None
        if ran_out_of_memory(text):  # outside the measured steps (e.g. NCCL buffers): still does not fit
            return {"oom": True, "error": text[-300:], "peak_alloc_gib": math.inf, "seq_len": 0}
        return {"failed": True, "error": f"probe exit {rc}, see {log_file}: {text[-300:]}"}


def add_comm_estimates(rows: list[dict[str, Any]], estimate: Callable[[dict[str, Any], float], dict[str, Any]],
                       fake_compute: Callable[[dict[str, Any]], float | None] | None = None,
                       gpus_per_node: int = 8) -> None:
    """In place. Fake-process-group rows: step time = measured compute + ``estimate(row, compute_s)``'s exposed
    communication (tokens/s and MFU follow), labelled as estimated. With ``fake_compute`` (a fake-process-group
    probe of the same cell), real multi-GPU rows also get the estimate and its error against the measurement."""
    for r in rows:
        if r["status"] != "fits" or not r.get("step_time_s"):
            continue
        if r.get("fake_process_group"):
            r["beyond_one_node"] = r["gpus"] > gpus_per_node
            est = estimate(r, r["step_time_s"])
            if est.get("comm_model") is None:
                r.update(comm_model=None, time_source=f"{r['time_source']}; no communication: {est['comm_note']}")
                continue
            compute, tps = r["step_time_s"], r["tokens_per_s_per_gpu"]
            r.update(est)
            r["compute_tokens_per_s_per_gpu"] = tps
            r["tokens_per_s_per_gpu"] = tps * compute / r["step_time_s"]
            if r.get("mfu") is not None:
                r["mfu"] = r["mfu"] * compute / r["step_time_s"]
            r["time_source"] = (f"fake process group of {r['gpus']}: compute measured on one device + estimated "
                                "FSDP2 communication")
        elif r["gpus"] > 1 and fake_compute is not None:
            compute = fake_compute(r)
            est = estimate(r, compute) if compute else {}
            if est.get("comm_model"):
                r.update(estimated_step_time_s=est["step_time_s"], estimate_compute_step_s=compute,
                         estimate_comm_exposed_s=est["comm_exposed_s"],
                         estimate_error=est["step_time_s"] / r["step_time_s"] - 1.0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--gpus", default="1,2,4,8,16",
                    help="GPU counts (the study's); those beyond the machine's run as fake process groups")
    ap.add_argument("--effective-batch", type=int, required=True, help="sequences per optimizer step, all GPUs")
    ap.add_argument("--local-batches", default="1,2,4,8")
    ap.add_argument("--ratios", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1")
    ap.add_argument("--memory-budget-gib", type=float, default=None,
                    help="default: --memory-fraction of --memory-cap-gib, else of the GPU")
    ap.add_argument("--memory-fraction", type=float, default=0.9)
    ap.add_argument("--memory-cap-gib", type=float, default=None,
                    help="cap each probe's CUDA allocator at this (set_per_process_memory_fraction) to plan for a "
                         "smaller GPU on a bigger one; 79.1 = an 80 GB H100 (its total_memory); fails on a GPU "
                         "with less memory than the cap")
    ap.add_argument("--collectives", default=None,
                    help="bench_parallel.py --comm results (parallel_<tag>.json) for the communication estimate of "
                         "fake-process-group rows; default: the measured 2 x H200 figures in comm_model.py")
    ap.add_argument("--check-estimate", action="store_true",
                    help="also probe real multi-GPU cells with a fake process group: the estimate next to the "
                         "measurement, with its error")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPU counts above this are marked: the estimate "
                    "assumes one node's bandwidth")
    ap.add_argument("--memory-metric", choices=("reserved", "alloc", "active"), default="reserved")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--probe-timeout-s", type=float, default=300)
    ap.add_argument("--time-limit-s", type=float, default=None, help="start no new probe after this")
    ap.add_argument("--in-process", action="store_true", help="probe in this process (CPU checks; not for GPUs)")
    ap.add_argument("--force", action="store_true", help="ignore cached probes")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--tag", default="plan")
    a, extra = ap.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    train_args = ["--config", a.config, *extra]
    out = Path(a.out)
    runner = ProbeRunner(out / f"ac_plan_{a.tag}", train_args, warmup=a.warmup, steps=a.steps,
                         timeout_s=a.probe_timeout_s, time_limit_s=a.time_limit_s, in_process=a.in_process,
                         force=a.force, memory_cap_gib=a.memory_cap_gib)
    estimator = CommEstimator(load_job_config(train_args),
                              Bandwidth.load(a.collectives) if a.collectives else DEFAULT_BANDWIDTH)

    def budget(result: dict[str, Any]) -> float:
        if a.memory_budget_gib is not None:
            return a.memory_budget_gib
        if a.memory_cap_gib is not None:
            return a.memory_fraction * a.memory_cap_gib
        if result.get("device_total_gib") is None:
            raise SystemExit("no GPU memory size to take a fraction of: pass --memory-budget-gib")
        return a.memory_fraction * result["device_total_gib"]

    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ratios = sorted(float(x) for x in a.ratios.split(","))
    rows = plan(ints(a.gpus), ints(a.local_batches), a.effective_batch, ratios, runner, budget, a.memory_metric)

    def estimate(row: dict[str, Any], compute_step_s: float) -> dict[str, Any]:
        return estimator.estimate(row["gpus"], row["grad_accum"], compute_step_s, "ratio", row["ac_ratio"])

    def fake_compute(row: dict[str, Any]) -> float | None:
        r = runner(Point(row["gpus"], row["local_batch"], row["grad_accum"], row["ac_ratio"]), force_fake=True)
        tps = (r or {}).get("tokens_per_s_per_gpu")
        return row["local_batch"] * row["grad_accum"] * r["seq_len"] / tps if tps else None

    add_comm_estimates(rows, estimate, fake_compute if a.check_estimate else None, a.gpus_per_node)
    probes = [v for k, v in runner.cache.items() if k.startswith(runner.fingerprint)]
    meta = {"effective_batch": a.effective_batch, "metric": a.memory_metric, "ratios": ratios, "train_args": train_args,
            "seq_len": next((p.get("seq_len") for p in probes if p.get("seq_len")), None),
            "memory_cap_gib": a.memory_cap_gib, "bandwidth_source": estimator.bandwidth.source,
            **environment_of(probes)}
    result = write_plan_report(out, a.tag, rows, meta)
    print((out / f"ac_plan_{a.tag}.md").read_text())
    return result


if __name__ == "__main__":
    main()
