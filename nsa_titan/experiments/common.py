"""Shared pieces of the experiments: running the trainer as a subprocess, steady-state numbers from its metrics,
resumable result caching, markdown tables and (optional) matplotlib plots.

Every run is a fresh process (``python -m nsa_titan.train`` or ``torchrun``), so memory and compile caches start
clean, and the parent never touches the GPU (a CUDA context in the parent would take memory from the runs).
A finished run leaves ``<out>/runs/<name>/row.json``; running the same command again reuses it (``--force`` re-runs;
a crashed run, anything but out of memory, always runs again), so an experiment can be spread over several short
calls (``--time-limit-s`` stops launching new runs in time).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from nsa_titan.components.metrics import windows_after
from nsa_titan.config import ConfigError, load_job_config

REPO = Path(__file__).resolve().parents[2]
# NVLink multicast off in every child (see README: run_train.sh exports the same).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Throughput runs: no validation, no checkpoints, no diagnostics (their log-step work is not training work).
QUIET_RUN = ["--metrics.val_freq", "0", "--checkpoint.enable", "false", "--metrics.nsa_diagnostics", "false"]


def visible_gpus() -> int:
    """GPUs this process could use, without creating a CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch_command(nproc: int, module: str, args: Sequence[str]) -> list[str]:
    """``python -m module args`` for one process, else torchrun with ``nproc`` local processes."""
    if nproc <= 1:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", module, *args]


_CAUSE = re.compile(r"^(config error:|[A-Za-z_.]*(Error|Exception):)")


def failure_line(lines: Sequence[str]) -> str:
    """What a failed run's log says went wrong: the first config error or exception line (what the trainer printed,
    in every rank's copy alike), else the last three lines. A torchrun job's log ends with torchrun's own report
    ("ChildFailedError", "error_file: <N/A>"), which names no cause."""
    for line in lines:
        text = line.strip()
        if _CAUSE.match(text) and not text.startswith(("torch.distributed.elastic", "ChildFailedError")):
            return text
    return " | ".join(lines[-3:])


def child_env(nproc: int, gpu: bool) -> dict[str, str]:
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if gpu and nproc <= 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = "0"  # a one-process run uses one GPU, the same one every time
    return env


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _weighted(rows: list[dict], key: str, weight: str = "window_s") -> float | None:
    have = [r for r in rows if r.get(key) is not None]
    total = sum(r[weight] for r in have)
    return sum(r[key] * r[weight] for r in have) / total if have and total > 0 else None


def steady_stats(records: list[dict[str, Any]], warmup: int) -> dict[str, Any] | None:
    """Steady state from the trainer's train records: log windows that start after step ``warmup``.

    Also ``first_step_s`` (the window of step 1 alone when log steps include 1): compilation, kernel
    autotuning and allocator warm-up land there.
    """
    train = [r for r in records if r.get("type") == "train"]
    steady = windows_after(train, warmup)
    if not steady:
        return None
    wall = sum(r["window_s"] for r in steady)
    steps = sum(r["window_steps"] for r in steady)
    first = next((r for r in train if r["step"] == 1 and r["window_steps"] == 1), None)
    peak = lambda key: max((r[key] for r in train if r.get(key) is not None), default=None)  # noqa: E731
    # Per-window step times: the median resists a slow window (a straggling rank, a collection), min-max shows noise.
    per_step = sorted(r["window_s"] / r["window_steps"] for r in steady)
    median = statistics.median(per_step)
    w = steady[0]
    tokens_per_gpu_step = w["tokens_per_s_per_gpu"] * w["window_s"] / w["window_steps"]  # the same every step
    return {
        "steps_timed": steps,
        "tokens_per_s": sum(r["window_tokens"] for r in steady) / wall,
        "tokens_per_s_per_gpu": _weighted(steady, "tokens_per_s_per_gpu"),
        "step_time_s": wall / steps,
        "step_time_median_s": median,
        "step_time_min_s": per_step[0],
        "step_time_max_s": per_step[-1],
        "tokens_per_s_per_gpu_median": tokens_per_gpu_step / median,
        "tflops_per_gpu": _weighted(steady, "tflops_per_gpu"),
        "mfu": _weighted(steady, "mfu"),
        "gpu_busy": _weighted(steady, "gpu_busy"),
        "data_share": _weighted(steady, "data_share"),
        "peak_mem_gib": peak("peak_mem_gib"),
        "peak_mem_active_gib": peak("peak_mem_active_gib"),
        "peak_mem_reserved_gib": peak("peak_mem_reserved_gib"),
        "first_step_s": first["window_s"] if first else None,
        "loss_first": train[0]["loss"],
        "loss_last": train[-1]["loss"],
    }


class Runner:
    """Runs named trainer jobs into ``out/runs/<name>``, caching each finished run's row (see module docstring)."""

    def __init__(self, out: Path, *, warmup: int, steps: int, timeout_s: float, time_limit_s: float | None = None,
                 force: bool = False, gpu: bool = True, log: Callable[[str], None] = print):
        self.out, self.warmup, self.steps, self.timeout_s = Path(out), warmup, steps, timeout_s
        self.deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        self.force, self.gpu, self.log = force, gpu, log
        self._told_warmup = False
        self.pending: list[str] = []  # runs not started because the time limit was reached

    def cached(self, name: str, cmd: Sequence[str] | None = None) -> dict[str, Any] | None:
        """The finished run ``name``'s row, when it is a result: not a crash (an out-of-memory row is one: the
        cell does not fit), and, given ``cmd``, run by that same command. A run that failed, say on a config error,
        runs again once the flags are mended, instead of its error being reused under the same name."""
        path = self.out / "runs" / name / "row.json"
        if self.force or not path.exists():
            return None
        row = json.loads(path.read_text())
        if row.get("error") not in (None, "out of memory"):
            return None
        return row if cmd is None or row.get("command") == " ".join(cmd) else None

    def short_warmup(self, args: Sequence[str]) -> list[str]:
        """``--lr_scheduler.warmup_steps W`` when the config's lr warm-up is longer than the runs (the trainer refuses
        a warm-up longer than training.steps, and every config meant for training has one: nsa_1b's and m7c's are
        100 steps, these runs 12-40): W = the untimed steps, so the ramp ends before the timing starts. Throughput
        does not depend on the lr. Nothing when the flags name a warm-up themselves (the trainer then judges it) or
        do not parse (the run reports that)."""
        if any(a == "--lr_scheduler.warmup_steps" or a.startswith("--lr_scheduler.warmup_steps=") for a in args):
            return []
        try:
            warmup = load_job_config(list(args)).lr_scheduler.warmup_steps
        except (ConfigError, SystemExit):
            return []
        if warmup <= self.steps:
            return []
        short = min(self.warmup, self.steps)
        if not self._told_warmup:
            self.log(f"the config's lr warm-up ({warmup} steps) is longer than these {self.steps}-step runs: they use "
                     f"--lr_scheduler.warmup_steps {short} (name your own after --)")
            self._told_warmup = True
        return ["--lr_scheduler.warmup_steps", str(short)]

    def run(self, name: str, nproc: int, args: Sequence[str], meta: dict[str, Any]) -> dict[str, Any] | None:
        """One trainer job (``args``: config + overrides); None when the time limit stops it from starting."""
        run_dir = self.out / "runs" / name
        train_args = [*args, *QUIET_RUN, "--training.steps", str(self.steps), "--metrics.log_freq", str(self.warmup),
                      *self.short_warmup(args), "--job.dump_folder", str(run_dir)]
        cmd = launch_command(nproc, "nsa_titan.train", train_args)
        row = self.cached(name, cmd)
        if row is not None:
            return row
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.pending.append(name)
            return None
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log(f"[{name}] $ {' '.join(cmd)}")
        t0 = time.monotonic()
        with open(run_dir / "train.log", "w") as logf:
            try:
                rc: int | str = subprocess.run(cmd, cwd=REPO, env=child_env(nproc, self.gpu), stdout=logf,
                                               stderr=subprocess.STDOUT, timeout=self.timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        row: dict[str, Any] = {"run": name, "gpus": nproc, **meta, "wall_s": time.monotonic() - t0,
                               "command": " ".join(cmd)}
        stats = steady_stats(read_jsonl(run_dir / "metrics.jsonl"), self.warmup)
        summary_file = run_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        row.update(device=summary.get("device"), torch=summary.get("torch"), triton=summary.get("triton"),
                   compile=summary.get("compile"),
                   flops_per_token=(summary.get("model") or {}).get("training_flops_per_token"))
        if rc != 0 or stats is None:
            lines = (run_dir / "train.log").read_text().splitlines()
            oom = any("out of memory" in line.lower() for line in lines)
            row["error"] = "out of memory" if oom else f"exit {rc}: {failure_line(lines)[-300:]}"
        else:
            row.update(stats)
        if rc != "timeout":  # a timed-out run may succeed with more time: not cached
            (run_dir / "row.json").write_text(json.dumps(row, indent=2) + "\n")
        self.log(f"[{name}] " + (row.get("error") or f"{row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, "
                                 f"{row['step_time_s']:.3f} s/step, "
                                 f"peak {fmt(row['peak_mem_reserved_gib'], '.1f')} GiB reserved"))
        return row


# ---- reports -------------------------------------------------------------------------------------------------------
def fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "n/a"
    if spec.endswith("%"):
        return format(value, spec)
    return format(value, spec) if spec else str(value)


def md_table(rows: list[dict[str, Any]], columns: list[tuple[str, str | Callable[[dict], Any], str]]) -> list[str]:
    """Markdown table lines; each column is (header, key or row -> value, format spec)."""
    out = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [fmt(get(r) if callable(get) else r.get(get), spec) for _, get, spec in columns]
        out.append("| " + " | ".join(cells) + " |")
    return out


def environment_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Device and versions as the runs reported them (the parent process never initialises the GPU)."""
    first = next((r for r in rows if r and r.get("device")), {})
    return {"device": first.get("device"), "torch": first.get("torch"), "triton": first.get("triton"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def save_plot(path: Path, draw: Callable[[Any], None]) -> str | None:
    """Draw with ``draw(pyplot)`` into ``path`` (PNG); returns a note instead when matplotlib is missing."""
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt  # noqa: PLC0415 - optional
    except ImportError:
        return (f"{path.name} not written: matplotlib is not installed (pip install matplotlib, or the `plot` "
                "extra), the tables have every number")
    plt.close("all")
    draw(plt)
    plt.tight_layout()
    plt.savefig(path, dpi=120)
    plt.close("all")
    return None


def draw_speed_and_memory(plt, rows: list[dict[str, Any]], labels: list[str], colors: list[str],
                          speed_key: str, speed_title: str, suptitle: str) -> None:
    """Two bar charts side by side: throughput, and peak memory (reserved, else allocated)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], speed_key, speed_title),
                           (axes[1], "peak_mem_reserved_gib", "peak memory (GiB; reserved, else allocated)")):
        # CPU runs have no reserved memory: show the allocated peak there instead of nothing.
        ax.bar(range(len(rows)), [r.get(key) or r.get("peak_mem_gib") or 0 for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(suptitle)


def write_report(out: Path, stem: str, result: dict[str, Any], md_lines: list[str],
                 draw: Callable[[Any], None] | None = None) -> dict[str, Path]:
    """``stem``.json, ``stem``.md and, given ``draw``, ``stem``.png (or a line in the markdown saying why not)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    if draw is not None:
        note = save_plot(out / f"{stem}.png", draw)
        md_lines = [*md_lines, "", note] if note else md_lines
    paths["json"].write_text(json.dumps(result, indent=2, default=str) + "\n")
    paths["md"].write_text("\n".join(md_lines) + "\n")
    return paths


def pending_note(pending: list[str]) -> list[str]:
    if not pending:
        return []
    return ["", f"**Incomplete:** the time limit stopped {len(pending)} run(s) from starting ({', '.join(pending)}); "
            "run the same command again to continue (finished runs are reused)."]
