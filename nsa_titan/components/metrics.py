"""Training metrics: console line, JSONL, TensorBoard; throughput, MFU, memory, GPU-busy share, ETA.

Hot-path contract: ``step_start`` / ``step_end`` only enqueue device work (tensor adds, CUDA event records);
every host sync (``.item()``, event synchronisation) happens inside ``log()`` / ``log_val()``, i.e. on log
steps only.

GPU-busy share = sum over the window's steps of (CUDA time between the step-start and step-end events) / host
wall time of the window. It exposes GPU idle time *between* steps (data loading, host syncs, Python between
steps, logging); idle gaps *inside* a step (kernel-launch overhead) are not visible to it - use a profiler.
Data-loading time is the host time spent inside ``data_loading()`` (the trainer wraps its loader calls).
TFLOP/s per GPU = training FLOPs per token (models/nsa/flops.py: NSA's real attention work) x tokens/s/GPU;
MFU = that / the GPU's peak dense bf16 FLOP/s. Memory: peak allocated, active (allocated + blocks freed but
still in use by a stream) and reserved (held by the caching allocator: what decides an out-of-memory).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from nsa_titan.components.device_stats import (
    BusyTimer,
    CudaBusyTimer,
    NullBusyTimer,
    peak_active_gib,
    peak_flops_for_device,
    peak_memory_gib,
)
from nsa_titan.components.metric_sinks import open_sinks


def starts_after(record: dict[str, Any], step: int) -> bool:
    """Whether every step of a train log window comes after ``step`` (a window ends at its record's ``step`` and
    spans ``window_steps``)."""
    return record["step"] - record["window_steps"] >= step


def windows_after(records: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """The train log windows that start after ``step`` (starts_after) and in which torch.compile compiled nothing
    (``compile_steps``: a recompile late in a run, the diagnostics' first forward): the summary's and the
    experiments' steady state."""
    return [r for r in records if starts_after(r, step) and not r.get("compile_steps")]


def _fmt_pct(value: float | None, decimals: int) -> str:
    return "n/a" if value is None else f"{100 * value:.{decimals}f}%"


def format_train_line(r: dict[str, Any], total_steps: int) -> str:
    reserved = r["peak_mem_reserved_gib"]
    mem = f"{r['peak_mem_gib']:.2f}" + ("" if reserved is None else f"/{reserved:.2f}")
    line = (
        f"step {r['step']:>6d}/{total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | gnorm {r['grad_norm']:.3f}"
        f" | tok/s {r['tokens_per_s']:,.0f} ({r['tokens_per_s_per_gpu']:,.0f}/gpu)"
        f" | tflops {'n/a' if r['tflops_per_gpu'] is None else format(r['tflops_per_gpu'], '.1f')}"
        f" | mfu {_fmt_pct(r['mfu'], 1)} | mem {mem} GiB | data {1000 * r['data_time_s']:.1f}ms"
        f" | gpu-busy {_fmt_pct(r['gpu_busy'], 0)}"
        f" | eta {datetime.timedelta(seconds=int(r['eta_s']))}"
    )
    if r["gpu_busy_warning"]:
        line += (f" | WARNING: GPU busy {100 * r['gpu_busy']:.0f}% < 90%: CPU-bound between steps (data loading "
                 f"{100 * r['data_share']:.0f}% of wall time; else host syncs / Python)")
    return line


class MetricsLogger:
    """Accumulates per-step metrics on device; on log steps emits console + JSONL (+ TensorBoard / wandb).

    ``clock``, ``busy_timer`` and ``print_fn`` are injectable so tests can simulate timings.
    Only rank 0 writes/prints; other ranks keep no window state and never sync.
    """

    def __init__(
        self,
        metrics_cfg: Any,
        *,
        dump_folder: str | Path,
        total_steps: int,
        device: torch.device,
        world_size: int = 1,
        rank: int = 0,
        flops_per_token: float | None = None,
        peak_flops: float | None | str = "auto",
        clock: Callable[[], float] = time.perf_counter,
        busy_timer: BusyTimer | None = None,
        print_fn: Callable[[str], None] | None = None,
        busy_warn_threshold: float = 0.9,
        tokens_seen: int = 0,
        resumed_at_step: int = 0,
        run_config: dict[str, Any] | None = None,
        warmup_steps: int = 1,
    ):
        self.enabled = rank == 0
        self.total_steps = int(total_steps)
        self.log_freq = max(1, int(metrics_cfg.log_freq))
        self.device = device
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops_for_device(device) if peak_flops == "auto" else peak_flops
        self._clock = clock
        self._print = print_fn or (lambda s: print(s, flush=True))
        self.busy_warn_threshold = busy_warn_threshold
        # The run's first steps that compile, record CUDA graphs or capture the step graph: summary() leaves out every
        # log window holding one of them (steps are absolute: a resumed run warms up again after its resume step).
        self.warmup_until_step = int(resumed_at_step) + max(1, int(warmup_steps))
        if busy_timer is None:
            busy_timer = CudaBusyTimer(device) if (self.enabled and device.type == "cuda") else NullBusyTimer()
        self._busy = busy_timer
        self.records: list[dict[str, Any]] = []
        self.val_records: list[dict[str, Any]] = []
        self._t0: float | None = None
        self._tokens_total = int(tokens_seen)  # > 0 when resuming: the count continues from the checkpoint
        self._reset_window(start=None)

        self._jsonl = None
        self._sinks: list[Any] = []  # TensorBoard / wandb (components/metric_sinks.py)
        if self.enabled:
            folder = Path(dump_folder)
            folder.mkdir(parents=True, exist_ok=True)
            if metrics_cfg.jsonl_file:
                self.jsonl_path = folder / metrics_cfg.jsonl_file
                self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
                self._jsonl = self._open_jsonl(self.jsonl_path, resumed_at_step)
            self._sinks = open_sinks(metrics_cfg, folder, run_config, self._print)

    def _open_jsonl(self, path: Path, resumed_at_step: int):
        """Line-buffered (readable while running) and never losing an earlier record: a resumed run appends
        after a ``{"type": "resume"}`` marker (steps logged after the checkpoint by the interrupted run stay in
        the file; readers keep the last record of each step); a fresh run moves an existing log aside."""
        if resumed_at_step > 0 and path.exists():
            f = open(path, "a", buffering=1)
            f.write(json.dumps({"type": "resume", "step": resumed_at_step}) + "\n")
            return f
        if path.exists() and path.stat().st_size > 0:
            n = 1
            while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
                n += 1
            path.rename(kept)
            self._print(f"metrics: {path} held an earlier run's log; moved it to {kept.name}")
        return open(path, "w", buffering=1)

    # ---- hot path (no host syncs) ----
    def _reset_window(self, start: float | None) -> None:
        self._win_start = start
        self._win_excluded = 0.0
        self._win_data = 0.0
        self._win_steps = 0
        self._win_tokens = 0
        self._win_first_step = None
        self._win_loss: torch.Tensor | None = None
        self._win_step_losses: list[torch.Tensor] = []  # each step's loss, read on the log step (loss curves)
        self._win_gnorm: torch.Tensor | None = None
        self._win_compiled = 0  # steps of this window during which torch.compile compiled a graph

    def step_start(self) -> None:
        now = self._clock()
        if self._t0 is None:
            self._t0 = now
        if self._win_start is None:
            self._win_start = now
        self._busy.start()

    def step_end(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, num_tokens: int,
                 compiled: bool = False) -> None:
        """loss / grad_norm: 0-d device tensors (not read here); num_tokens: this rank's input tokens; compiled:
        torch.compile compiled a graph during this step (its window then stays out of the steady state)."""
        self._busy.stop()
        self._tokens_total += num_tokens * self.world_size
        if not self.enabled:
            return
        if self._win_first_step is None:
            self._win_first_step = step
        self._win_steps += 1
        self._win_tokens += num_tokens
        self._win_compiled += int(compiled)
        loss, grad_norm = loss.detach().float(), grad_norm.detach().float()
        self._win_loss = loss if self._win_loss is None else self._win_loss + loss
        self._win_step_losses.append(loss)
        self._win_gnorm = grad_norm if self._win_gnorm is None else self._win_gnorm + grad_norm

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    @contextlib.contextmanager
    def data_loading(self) -> Iterator[None]:
        """Time the enclosed host-side data work (loader calls) as this window's data-loading time."""
        t = self._clock()
        try:
            yield
        finally:
            if self._win_start is not None:  # before the first step_start there is no window to charge
                self._win_data += self._clock() - t

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Exclude the enclosed time (validation, checkpointing) from the throughput window."""
        t = self._clock()
        try:
            yield
        finally:
            if self._win_start is not None:
                self._win_excluded += self._clock() - t

    # ---- log steps (host syncs allowed) ----
    def log(self, step: int, lr: float) -> dict[str, Any] | None:
        """Mean loss / grad-norm over the steps since the last log; returns the record (rank 0) or None."""
        if not self.enabled or self._win_steps == 0:
            self._reset_window(start=self._clock())
            return None
        n = self._win_steps
        # Read the device values first: the host runs ahead of the GPU, and the window ends when its last
        # step's device work has finished, which this sync waits for (reading the clock before it credited
        # the window with the host's launch time only: a 1-step final window showed 176% MFU on an H100).
        loss = (self._win_loss / n).item()  # host sync ok: log step
        grad_norm = (self._win_gnorm / n).item()  # host sync ok: log step
        step_losses = torch.stack(self._win_step_losses).tolist()  # host sync ok: log step
        now = self._clock()
        wall = max(now - self._win_start - self._win_excluded, 1e-9)
        busy_s = self._busy.collect()
        per_gpu = self._win_tokens / wall
        mfu = None
        if self.flops_per_token is not None and self.peak_flops:
            mfu = self.flops_per_token * per_gpu / self.peak_flops
        tflops = None if self.flops_per_token is None else self.flops_per_token * per_gpu / 1e12
        gpu_busy = None if busy_s is None else min(1.0, busy_s / wall)  # clamp: event/host clock offsets
        mem, mem_reserved = peak_memory_gib(self.device)
        step_time = wall / n
        record = {
            "type": "train",
            "step": step,
            "loss": loss,
            "lr": float(lr),
            "grad_norm": grad_norm,
            "tokens": self._tokens_total,
            "tokens_per_s": per_gpu * self.world_size,
            "tokens_per_s_per_gpu": per_gpu,
            "mfu": mfu,
            "tflops_per_gpu": tflops,
            "peak_mem_gib": mem,
            "peak_mem_active_gib": peak_active_gib(self.device),
            "peak_mem_reserved_gib": mem_reserved,
            "data_time_s": self._win_data / n,
            "data_share": min(1.0, self._win_data / wall),
            "gpu_busy": gpu_busy,
            # The window holding step 1 includes compilation / allocator warm-up: not a CPU-bound signal.
            "gpu_busy_warning": bool(
                gpu_busy is not None and gpu_busy < self.busy_warn_threshold and self._win_first_step != 1
            ),
            "step_time_s": step_time,
            "eta_s": max(0, self.total_steps - step) * step_time,
            "elapsed_s": now - self._t0,
            "window_steps": n,
            "window_s": wall,
            "window_tokens": self._win_tokens * self.world_size,
            "compile_steps": self._win_compiled,
            "step_losses": step_losses,  # steps step - n + 1 .. step: per-step loss curves at any log_freq
        }
        self.records.append(record)
        self._print(format_train_line(record, self.total_steps))
        self._write(record)
        if self._sinks:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "tflops_per_gpu",
                        "peak_mem_gib", "peak_mem_active_gib", "peak_mem_reserved_gib", "data_time_s", "gpu_busy"):
                if record[key] is not None:
                    self._scalar(f"train/{key}", record[key], step)
        self._reset_window(start=self._clock())
        return record

    def log_val(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"type": "val", "step": step, **metrics}
        self.val_records.append(record)
        parts = [f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()]
        self._print(f"val  {step:>6d}/{self.total_steps} | " + " | ".join(parts))
        self._write(record)
        for k, v in metrics.items():
            self._scalar(f"val/{k}", v, step)

    def log_extra(self, kind: str, step: int, values: dict[str, Any], *, line: str | None = None,
                  scalars: dict[str, float] | None = None) -> None:
        """A record of another kind (e.g. NSA diagnostics) on a log step: JSONL ``{"type": kind, "step": step,
        **values}``, an optional console line and optional TensorBoard scalars (name -> value)."""
        if not self.enabled:
            return
        self._write({"type": kind, "step": step, **values})
        if line:
            self._print(line)
        for name, value in (scalars or {}).items():
            self._scalar(name, value, step)

    def _scalar(self, name: str, value: float, step: int) -> None:
        for sink in self._sinks:
            sink.scalar(name, value, step)

    def _write(self, record: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")

    def steady_records(self) -> list[dict[str, Any]]:
        """The log windows after the warm-up steps (``warmup_steps``) in which nothing compiled: none of their
        steps compiled, recorded or captured a graph. A run too short to have one falls back to every window but the
        first (then the whole run), which still holds later warm-up steps."""
        recs = self.records
        return windows_after(recs, self.warmup_until_step) or recs[1:] or recs

    def summary(self) -> dict[str, Any]:
        """Run aggregates; throughput/MFU/GPU-busy from the windows after the warm-up steps (steady_records)."""
        recs = self.records
        steady = self.steady_records()
        wall = sum(r["window_s"] for r in steady)
        tokens_per_s = sum(r["window_tokens"] for r in steady) / wall if wall > 0 else None
        per_gpu = None if tokens_per_s is None else tokens_per_s / self.world_size
        mfu = tflops = None
        if per_gpu is not None and self.flops_per_token is not None:
            tflops = self.flops_per_token * per_gpu / 1e12
            mfu = self.flops_per_token * per_gpu / self.peak_flops if self.peak_flops else None
        busy = [r for r in steady if r["gpu_busy"] is not None]
        steps = sum(r["window_steps"] for r in steady)
        gpu_busy = sum(r["gpu_busy"] * r["window_s"] for r in busy) / sum(r["window_s"] for r in busy) if busy else None
        finite = [r["loss"] for r in recs if math.isfinite(r["loss"])]
        return {
            "initial_loss": recs[0]["loss"] if recs else None,
            "final_loss": recs[-1]["loss"] if recs else None,
            "min_loss": min(finite) if finite else None,
            "steps": recs[-1]["step"] if recs else 0,
            "tokens": self._tokens_total,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": per_gpu,
            "steady_from_step": steady[0]["step"] - steady[0]["window_steps"] + 1 if steady else None,
            # Windows after the warm-up in which torch.compile compiled (a recompile) are not in the mean above.
            "compiled_windows_left_out": sum(1 for r in recs if starts_after(r, self.warmup_until_step)
                                             and r.get("compile_steps")),
            # The mean still holds other late warm-up (allocator growth); the last window is the closest to
            # steady state a short benchmark run gets.
            "last_window_tokens_per_s_per_gpu": (recs[-1]["window_tokens"] / recs[-1]["window_s"] / self.world_size
                                                 if recs and recs[-1]["window_s"] > 0 else None),
            "mfu": mfu,
            "tflops_per_gpu": tflops,
            "gpu_busy": gpu_busy,
            "data_time_s": sum(r["data_time_s"] * r["window_steps"] for r in steady) / steps if steps else None,
            "data_share": sum(r["data_share"] * r["window_s"] for r in steady) / wall if wall > 0 else None,
            "peak_mem_gib": max((r["peak_mem_gib"] for r in recs), default=None),
            "peak_mem_active_gib": recs[-1]["peak_mem_active_gib"] if recs else None,
            "peak_mem_reserved_gib": recs[-1]["peak_mem_reserved_gib"] if recs else None,
            "elapsed_s": recs[-1]["elapsed_s"] if recs else None,
            "final_val": self.val_records[-1] if self.val_records else None,
        }

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []
