"""GA/AC planner: for each (GPU count, local batch), the smallest activation-checkpointing ratio that fits the memory
budget and the gradient accumulation that keeps the effective batch; then which of those trains fastest.

    python -m nsa_titan.experiments.ac_planner --config train_configs/nsa_1b.toml --gpus 1,2,4,8 \\
        --effective-batch 64 --local-batches 1,2,4,8 --out benchmarks/results --tag 1b_seq8192 [-- overrides]

Writes ``ac_plan_<tag>.md`` (table + one recommendation per GPU count, e.g. "1 GPU: bs=1 AC=0.4 GA=64"),
``ac_plan_<tag>.json`` and ``ac_plan_<tag>.png`` (time per optimizer step vs AC ratio, one line per GPU count).

Search. GA = effective batch / (GPUs x local batch) (combinations that do not divide are skipped). The ratio
(``activation_checkpoint.mode ratio``: that fraction of the blocks fully checkpointed) is searched over ``--ratios``
by bisection, since memory falls as the ratio rises. Local batches are visited in increasing order: at a fixed
probe GA, memory grows with the batch, so the previous batch's ratio is a lower bound and a batch that does not
fit even fully checkpointed rules out every larger one.

Measurement (``probe.py``): a few synthetic steps of exactly the trainer's model and step, with GA capped at 2 (GA 2
already holds gradients across micro-batches, the memory GA adds; the time per token barely depends on GA, so the
full step time is extrapolated as tokens per step / measured tokens per second). GPU counts up to the machine's
run on that many GPUs (torchrun); larger ones on one GPU with a fake process group of that world size: per-rank
memory as on N GPUs, time without communication (marked in the table). Probes are cached in ``<out>/ac_plan_<tag>/``:
the same command continues after ``--time-limit-s`` stopped it.
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

from nsa_titan.experiments.common import (
    REPO,
    child_env,
    environment_of,
    fmt,
    launch_command,
    md_table,
    visible_gpus,
    write_report,
)
from nsa_titan.experiments.probe import run_probe


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
                rows.append({**row, "status": "error", "probes": len(seen), "note": str(e)[-200:]})
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
                         "time_source": r.get("time_source", ""), "note": ""})
    return rows


def recommendations(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per GPU count, the fitting row with the highest tokens/s per GPU (same effective batch: shortest step)."""
    best: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["status"] == "fits" and r.get("tokens_per_s_per_gpu"):
            if r["gpus"] not in best or r["tokens_per_s_per_gpu"] > best[r["gpus"]]["tokens_per_s_per_gpu"]:
                best[r["gpus"]] = r
    return best


def describe(r: dict[str, Any]) -> str:
    gpus = f"{r['gpus']} GPU{'s' if r['gpus'] > 1 else ''}"
    return f"{gpus}: bs={r['local_batch']} AC={r['ac_ratio']:g} GA={r['grad_accum']}"


class ProbeRunner:
    """The real ``Measure``: runs probe.py (subprocess, or in this process with ``in_process``) and caches results."""

    def __init__(self, work: Path, train_args: Sequence[str], *, warmup: int, steps: int, timeout_s: float,
                 time_limit_s: float | None, in_process: bool = False, force: bool = False,
                 log: Callable[[str], None] = print):
        self.work, self.train_args = Path(work), list(train_args)
        self.warmup, self.steps, self.timeout_s, self.in_process, self.log = warmup, steps, timeout_s, in_process, log
        self.deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        self.gpus = 0 if in_process else visible_gpus()
        self.cache_file = self.work / "probes.json"
        fresh = force or not self.cache_file.exists()
        self.cache: dict[str, Any] = {} if fresh else json.loads(self.cache_file.read_text())
        # Results are only reused for the same trainer arguments.
        self.fingerprint = hashlib.sha1(json.dumps(self.train_args).encode()).hexdigest()[:10]

    def __call__(self, p: Point) -> dict[str, Any] | None:
        key = f"{self.fingerprint}/g{p.gpus}-b{p.local_batch}-ga{p.probe_ga}-r{p.ratio:g}"
        if key in self.cache:
            return self.cache[key]
        if self.deadline is not None and time.monotonic() > self.deadline:
            return None
        fake = p.gpus > 1 and p.gpus > self.gpus
        args = [*self.train_args, "--training.local_batch_size", str(p.local_batch), "--training.grad_accum_steps",
                str(p.probe_ga), "--activation_checkpoint.mode", "ratio", "--activation_checkpoint.ratio", str(p.ratio)]
        self.log(f"probe {key.split('/')[1]}" + (f" (fake process group of {p.gpus})" if fake else ""))
        result = self._in_process(args, p, fake) if self.in_process else self._subprocess(args, p, fake, key)
        if result is None or result.get("failed"):
            return result  # a timeout (None: like the time limit) or a crash is not cached: the next run retries
        result["time_source"] = (f"fake process group of {p.gpus}: compute only, no communication" if fake
                                 else f"measured on {p.gpus} device(s)")
        self.cache[key] = result
        self.work.mkdir(parents=True, exist_ok=True)
        self.cache_file.write_text(json.dumps(self.cache, indent=1, default=str) + "\n")
        return result

    def _in_process(self, args: list[str], p: Point, fake: bool) -> dict[str, Any]:
        torch._dynamo.reset()  # a fresh model per probe: stale compiled graphs would count against recompile limits
        return run_probe(args, fake_world_size=p.gpus if p.gpus > 1 else None, warmup=self.warmup, steps=self.steps)

    def _subprocess(self, args: list[str], p: Point, fake: bool, key: str) -> dict[str, Any] | None:
        name = key.replace("/", "_")
        result_file, log_file = self.work / f"{name}.json", self.work / f"{name}.log"
        self.work.mkdir(parents=True, exist_ok=True)
        result_file.unlink(missing_ok=True)
        probe_args = ["--result", str(result_file), "--warmup", str(self.warmup), "--steps", str(self.steps),
                      *(["--fake-world-size", str(p.gpus)] if fake else []), *args]
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
        if "out of memory" in text.lower():  # outside the measured steps (e.g. NCCL buffers): still does not fit
            return {"oom": True, "error": text[-300:], "peak_alloc_gib": math.inf, "seq_len": 0}
        return {"failed": True, "error": f"probe exit {rc}, see {log_file}: {text[-300:]}"}


def write_plan_report(out: Path, tag: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    best = recommendations(rows)
    stem = f"ac_plan_{tag}"
    lines = [f"# GA/AC plan: {tag}", "",
             f"{meta.get('device')}, torch {meta.get('torch')}; effective batch {meta['effective_batch']} sequences of "
             f"{meta.get('seq_len')} tokens; memory metric: peak {meta['metric']} vs budget; ratios {meta['ratios']}; "
             f"trainer args {meta['train_args']}", "", "Recommendations (fastest fitting setting per GPU count):", ""]
    lines += [f"- {describe(r)}  ({fmt(r['step_time_s'], '.2f')} s/step, {fmt(r['tokens_per_s_per_gpu'], ',.0f')} "
              f"tok/s/GPU{'; ' + r['time_source'] if 'fake' in r['time_source'] else ''})" for r in best.values()]
    if not best:
        lines.append("- none yet (nothing measured fits, or the plan is incomplete)")
    lines += ["", *md_table(rows, [("GPUs", "gpus", ""), ("local batch", "local_batch", ""), ("GA", "grad_accum", ""),
                                    ("AC ratio", "ac_ratio", "g"), ("status", "status", ""),
                                    ("peak GiB", "mem_gib", ".1f"), ("budget GiB", "budget_gib", ".1f"),
                                    ("tok/s/GPU", "tokens_per_s_per_gpu", ",.0f"), ("step s", "step_time_s", ".2f"),
                                    ("MFU", "mfu", ".1%"), ("probes", "probes", ""), ("note", "note", "")])]
    lines += ["", "Step time: full optimizer step at the planned GA, extrapolated from probes with GA <= 2."]

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for g in sorted({r["gpus"] for r in rows}):
            pts = sorted((r["ac_ratio"], r["step_time_s"], r["local_batch"]) for r in rows
                         if r["gpus"] == g and r["status"] == "fits" and r.get("step_time_s"))
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{g} GPU{'s' if g > 1 else ''}")
            for x, y, b in pts:
                ax.annotate(f"bs={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            if g in best:
                ax.plot([best[g]["ac_ratio"]], [best[g]["step_time_s"]], "k*", markersize=12)
        ax.set_xlabel("AC ratio (fraction of blocks checkpointed)")
        ax.set_ylabel(f"time per optimizer step (s), effective batch {meta['effective_batch']}")
        ax.set_title(f"{tag}: smallest fitting AC ratio per local batch (* = fastest)")
        ax.legend()
        ax.grid(alpha=0.3)

    result = {"experiment": "ac_plan", "tag": tag, **meta, "rows": rows,
              "recommendations": {str(g): describe(r) for g, r in best.items()}}
    write_report(out, stem, result, lines, draw)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--effective-batch", type=int, required=True, help="sequences per optimizer step, all GPUs")
    ap.add_argument("--local-batches", default="1,2,4,8")
    ap.add_argument("--ratios", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1")
    ap.add_argument("--memory-budget-gib", type=float, default=None, help="default: --memory-fraction of the GPU")
    ap.add_argument("--memory-fraction", type=float, default=0.9)
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
                         force=a.force)

    def budget(result: dict[str, Any]) -> float:
        if a.memory_budget_gib is not None:
            return a.memory_budget_gib
        if result.get("device_total_gib") is None:
            raise SystemExit("no GPU memory size to take a fraction of: pass --memory-budget-gib")
        return a.memory_fraction * result["device_total_gib"]

    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ratios = sorted(float(x) for x in a.ratios.split(","))
    rows = plan(ints(a.gpus), ints(a.local_batches), a.effective_batch, ratios, runner, budget, a.memory_metric)
    probes = [v for k, v in runner.cache.items() if k.startswith(runner.fingerprint)]
    meta = {"effective_batch": a.effective_batch, "metric": a.memory_metric, "ratios": ratios, "train_args": train_args,
            "seq_len": next((p.get("seq_len") for p in probes if p.get("seq_len")), None),
            **environment_of(probes)}
    result = write_plan_report(out, a.tag, rows, meta)
    print((out / f"ac_plan_{a.tag}.md").read_text())
    return result


if __name__ == "__main__":
    main()
