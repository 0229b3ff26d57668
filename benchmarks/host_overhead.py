"""Is the NSA attention op bound by the host? Host time to enqueue one forward+backward vs the GPU's time for it.

    python benchmarks/host_overhead.py --cases m7c:8192:2,m7c:2048:8,1b:8192:2 [--out DIR]

For each case (config:T:B, configs as in profile_block.py) it measures, on random bf16 inputs:
- ``gpu_ms``: median event time of one fwd+bwd with the queue kept full (so launch gaps do not count);
- ``host_ms``: host time to enqueue one fwd+bwd while the GPU is held busy by a sleep kernel (so no launch
  waits for the GPU, and no GPU time is counted);
- ``wall_ms``: fwd+bwd calls back to back, synchronised at the end: max(host, gpu) if nothing else stalls;
- ``launches`` per call and the top host functions of the enqueue (cProfile, by own time).
host_ms > gpu_ms means a model made of this op alone runs at the host's pace, whatever the kernels do.
Writes host_overhead_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_checks import run_header, write_results  # noqa: E402
from profile_block import attention_fwdbwd  # noqa: E402


def _host_ms(fn, iters: int) -> float:
    """Enqueue ``iters`` calls behind a long sleep kernel: the host never waits for the GPU."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles: longer than the enqueue below
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    return host


def _gpu_ms(fn, iters: int) -> float:
    """Event time per call while the queue stays full (enqueued behind a sleep kernel, then drained)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _wall_ms(fn, iters: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def _launches(fn) -> float:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def _top_host(fn, iters: int, top: int, dump: str | None = None) -> list:
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    if dump:  # the whole profile, for pstats / snakeviz elsewhere
        pr.dump_stats(dump)
    st = pstats.Stats(pr)
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append((f"{os.path.basename(file)}:{line}:{func}", nc / iters, tt / iters * 1e3, ct / iters * 1e3))
    rows.sort(key=lambda r: -r[2])
    return [dict(fn=f, calls=round(c, 1), own_ms=round(tt, 4), cum_ms=round(ct, 4)) for f, c, tt, ct in rows[:top]]


def case(name: str, T: int, B: int, iters: int, dump_dir: str | None = None) -> dict:
    fn = attention_fwdbwd(name, T, B)[0]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    row = dict(config=name, T=T, B=B)
    row["host_ms"] = min(_host_ms(fn, iters) for _ in range(3))
    row["gpu_ms"] = min(_gpu_ms(fn, iters) for _ in range(3))
    row["wall_ms"] = min(_wall_ms(fn, iters) for _ in range(3))
    row["launches"] = _launches(fn)
    row["host_us_per_launch"] = row["host_ms"] * 1e3 / row["launches"]
    dump = os.path.join(dump_dir, f"host_{name}_{T}_{B}.pstats") if dump_dir else None
    row["top_host"] = _top_host(fn, iters, 30, dump)
    return row


def to_markdown(payload: dict) -> str:
    lines = [f"# Host overhead of the NSA attention op: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}. One fwd+bwd of the "
             "whole NSA attention (random bf16 inputs). host = time to enqueue with the GPU held busy; gpu = "
             "event time with the queue full; wall = back-to-back calls.", "",
             "| config | T | B | host ms | GPU ms | wall ms | launches | host us / launch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['config']} | {r['T']} | {r['B']} | {r['host_ms']:.2f} | {r['gpu_ms']:.2f} | "
                     f"{r['wall_ms']:.2f} | {r['launches']} | {r['host_us_per_launch']:.1f} |")
    for r in payload["rows"]:
        lines += ["", f"## Top host functions, {r['config']} T={r['T']} B={r['B']} (per call)", "",
                  "| function | calls | own ms | cumulative ms |", "|---|---|---|---|"]
        lines += [f"| `{h['fn']}` | {h['calls']} | {h['own_ms']} | {h['cum_ms']} |" for h in r["top_host"][:20]]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="m7c:8192:2,m7c:2048:8,1b:8192:2")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--dump", default=None, help="folder for each case's whole cProfile (.pstats)")
    a = ap.parse_args()
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
    rows = []
    for spec in a.cases.split(","):
        name, T, B = spec.split(":")
        rows.append(case(name, int(T), int(B), a.iters, a.dump))
        r = rows[-1]
        print(f"{name} T={T} B={B}: host {r['host_ms']:.2f} ms, gpu {r['gpu_ms']:.2f} ms, wall {r['wall_ms']:.2f} ms,"
              f" {r['launches']} launches", flush=True)
    payload = dict(benchmark="host_overhead", **run_header(), rows=rows)
    dev = payload["device"].replace(" ", "_")
    write_results(a.out, f"host_overhead{('_' + a.tag) if a.tag else ''}_{dev}", payload, to_markdown(payload))


if __name__ == "__main__":
    main()
