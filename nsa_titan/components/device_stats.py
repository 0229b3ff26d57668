"""Device statistics for the metrics: peak FLOP/s by GPU name, peak memory, and the GPU-busy timers.

GPU-busy share (components/metrics.py) = sum over a window's steps of the CUDA time between each step's start and
end events / the window's host wall time; the timers here record those events without host syncs and read them
back only in ``collect`` (a log step).
"""

from __future__ import annotations

import resource
import sys
from typing import Protocol

import torch

GIB = float(2**30)


def peak_flops_for_name(name: str) -> float | None:
    """Dense bf16 tensor-core peak FLOP/s by device name (None = unknown -> MFU reported as n/a)."""
    n = name.upper()
    if "H100" in n or "H200" in n:
        return 756e12 if "PCIE" in n else 989e12  # SXM / HBM3(e) parts; the PCIe H100 is clocked lower
    if "A100" in n:
        return 312e12
    return None


def peak_flops_for_device(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None  # CPU MFU is not meaningful
    return peak_flops_for_name(torch.cuda.get_device_name(device))


def peak_memory_gib(device: torch.device) -> tuple[float, float | None]:
    """(peak allocated, peak reserved) on CUDA; (process peak RSS, None) elsewhere. No device sync."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes
    return rss_bytes / GIB, None


def peak_active_gib(device: torch.device) -> float | None:
    """Peak active bytes on CUDA (allocator bookkeeping on the host: no device sync); None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("active_bytes.all.peak", 0) / GIB


class BusyTimer(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def collect(self) -> float | None: ...  # busy seconds since last collect (None = not measured)


class NullBusyTimer:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def collect(self) -> float | None:
        return None


class CudaBusyTimer:
    """CUDA events around each step on the current stream; read back only in ``collect`` (a log step)."""

    def __init__(self, device: torch.device):
        self._device = device
        self._start: torch.cuda.Event | None = None
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _record(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self._device))
        return ev

    def start(self) -> None:
        self._start = self._record()

    def stop(self) -> None:
        if self._start is not None:
            self._spans.append((self._start, self._record()))
            self._start = None

    def collect(self) -> float | None:
        if not self._spans:
            return 0.0
        self._spans[-1][1].synchronize()  # host sync ok: log step
        busy_ms = sum(s.elapsed_time(e) for s, e in self._spans)  # host sync ok: log step
        self._spans.clear()
        return busy_ms / 1000.0
