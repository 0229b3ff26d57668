"""torch.profiler traces every N steps and CUDA memory snapshots (on request and on out-of-memory), for the trainer.

    prof = TrainProfiler(job_config.profiling, dump_folder=..., rank=..., device=..., start_step=first_step)
    prof.start()
    for step in ...:
        ...train step...
        prof.step(step)          # advances the profiler schedule; snapshot if step is in memory_snapshot_steps
    prof.close(error)            # on every exit path: stops both; an OutOfMemoryError writes the 'oom' snapshot

Traces: ``<dump>/<traces_folder>/iteration_<step>/rank<r>_trace.json`` (Perfetto, chrome://tracing), the last
``profile_active`` steps before every multiple of ``profile_freq`` (also after a resume: the schedule is offset
by the first step). Snapshots: ``<dump>/<memory_snapshot_folder>/rank<r>_<step<N>|oom>.pickle`` for
https://pytorch.org/memory_viz. The profiler's host work happens in ``step`` (between steps), never inside one.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def write_cuda_snapshot(path: Path) -> None:
    """The caching allocator's state (+ allocation history if it is being recorded), as memory_viz reads it."""
    with open(path, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)


class TrainProfiler:
    """Drives torch.profiler and the CUDA memory history for one training run (see module docstring).

    ``snapshot_fn(path)``: how a snapshot is written (default: the CUDA allocator's; tests inject one, which
    also makes snapshots work on CPU).
    """

    def __init__(self, cfg: Any, *, dump_folder: str | Path, rank: int, device: torch.device,
                 log: Callable[[str], None] = print, start_step: int = 1,
                 snapshot_fn: Callable[[Path], None] | None = None):
        self.cfg, self.rank, self.device, self.log = cfg, rank, device, log
        self.trace_dir = Path(dump_folder) / cfg.traces_folder
        self.snapshot_dir = Path(dump_folder) / cfg.memory_snapshot_folder
        self.start_step = start_step
        cuda = device.type == "cuda"
        self._snapshot_fn = snapshot_fn or (write_cuda_snapshot if cuda else None)
        self._record_history = cfg.enable_memory_snapshot and cuda
        if (cfg.enable_memory_snapshot or cfg.memory_snapshot_steps) and self._snapshot_fn is None:
            log("profiling: memory snapshots need CUDA; none will be written on this device")
        self._snapshot_steps = set(cfg.memory_snapshot_steps)
        self._prof: torch.profiler.profile | None = None
        self._step = start_step - 1
        self.traces: list[Path] = []
        self.snapshots: list[Path] = []

    # ---- lifecycle ----
    def start(self) -> None:
        cfg = self.cfg
        if self._record_history:
            torch.cuda.memory._record_memory_history(max_entries=cfg.memory_snapshot_max_entries,
                                                     stacks=cfg.memory_snapshot_stacks)
        if not cfg.enable_profiling:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # Each cycle is profile_freq steps whose last profile_active are recorded; skip_first aligns the cycle
        # ends with the multiples of profile_freq when the run starts (or resumes) at start_step.
        schedule = torch.profiler.schedule(
            wait=cfg.profile_freq - cfg.profile_active - cfg.profile_warmup, warmup=cfg.profile_warmup,
            active=cfg.profile_active, skip_first=(1 - self.start_step) % cfg.profile_freq)
        self._prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._export,
                                            record_shapes=False, with_stack=False)
        self._prof.start()

    def step(self, step: int) -> None:
        """After training step ``step`` (host side, between steps)."""
        self._step = step
        if self._prof is not None:
            self._prof.step()
        if step in self._snapshot_steps:
            self.snapshot(f"step{step}")

    def close(self, error: BaseException | None = None) -> None:
        """Stop profiling and history recording; an out-of-memory ``error`` first writes the 'oom' snapshot."""
        if isinstance(error, torch.OutOfMemoryError) and self.cfg.memory_snapshot_on_oom:
            path = self.snapshot("oom")
            if path is not None:
                self.log(f"[rank {self.rank}] out of memory at step {self._step + 1}: memory snapshot in {path} "
                         "(open at https://pytorch.org/memory_viz; --profiling.enable_memory_snapshot adds the "
                         "history)")
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.on_trace_ready = None  # a partial cycle at the end is not a trace anyone asked for
            prof.stop()
        if self._record_history:
            self._record_history = False
            torch.cuda.memory._record_memory_history(enabled=None)

    # ---- outputs ----
    def _export(self, prof: torch.profiler.profile) -> None:
        folder = self.trace_dir / f"iteration_{self._step}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        self.traces.append(path)
        self.log(f"[rank {self.rank}] profiler trace of steps {self._step - self.cfg.profile_active + 1}.."
                 f"{self._step} in {path}")

    def snapshot(self, tag: str) -> Path | None:
        """Write a memory snapshot now (CUDA, or an injected writer); returns its path, or None."""
        if self._snapshot_fn is None:
            return None
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        path = self.snapshot_dir / f"rank{self.rank}_{tag}.pickle"
        self._snapshot_fn(path)
        self.snapshots.append(path)
        return path
