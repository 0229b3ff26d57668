"""Summarise a torch.profiler chrome trace: where a step's GPU time goes and how much of it is idle.

    python benchmarks/analyze_trace.py outputs/run/profile_traces/iteration_8/rank0_trace.json [--top 15]

Prints (and with --json writes) the traced window's wall time, the share of it in which some GPU kernel
runs (union of kernel intervals: idle gaps inside a step count against it, unlike CUDA-event timing), the
time in communication kernels (NCCL) and how much of it overlaps compute, kernel launch counts, and the top
kernels by total time.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def summarise(path: str, top: int = 15) -> dict:
    events = json.load(open(path))["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and e.get("ph") == "X"]
    if steps:
        lo = min(e["ts"] for e in steps)
        hi = max(e["ts"] + e["dur"] for e in steps)
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    if not steps:
        lo, hi = min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels)
    kernels = [e for e in kernels if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    clip = lambda e: (max(e["ts"], lo), min(e["ts"] + e["dur"], hi))  # noqa: E731
    is_comm = lambda e: "nccl" in e["name"].lower()  # noqa: E731
    comm = [clip(e) for e in kernels if is_comm(e)]
    comp = [clip(e) for e in kernels if not is_comm(e)]
    wall = hi - lo
    busy = union_length(comm + comp)
    comp_busy, comm_busy = union_length(comp), union_length(comm)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e["name"][:90]][0] += 1
        by_name[e["name"][:90]][1] += e["dur"]
    launches = sum(1 for e in events if e.get("cat") == "cuda_runtime" and "Launch" in e.get("name", ""))
    return {
        "trace": path, "steps": len(steps), "wall_ms": wall / 1e3, "kernel_busy": busy / wall,
        "compute_busy_ms": comp_busy / 1e3, "comm_busy_ms": comm_busy / 1e3,
        "comm_exposed_ms": (busy - comp_busy) / 1e3, "kernels": len(kernels), "launches": launches,
        "top": sorted(([n, c, d / 1e3] for n, (c, d) in by_name.items()), key=lambda r: -r[2])[:top],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", help="write the summaries here")
    a = ap.parse_args()
    out = [summarise(t, a.top) for t in a.traces]
    for s in out:
        print(f"\n{s['trace']}: {s['steps']} step(s), wall {s['wall_ms']:.1f} ms, kernel-busy {s['kernel_busy']:.1%}, "
              f"compute {s['compute_busy_ms']:.1f} ms, comm {s['comm_busy_ms']:.1f} ms "
              f"(exposed {s['comm_exposed_ms']:.1f} ms), {s['kernels']} kernels, {s['launches']} launches")
        for name, count, ms in s["top"]:
            print(f"  {ms:9.2f} ms {count:6d}x  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
