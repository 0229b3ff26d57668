"""Summarise a torch.profiler chrome trace: where a step's GPU time goes and how much of it is idle.

    python benchmarks/analyze_trace.py outputs/run/profile_traces/iteration_8/rank0_trace.json [--top 15]

Prints (and with --json writes) the traced window's wall time, the share of it in which some GPU kernel
runs (union of kernel intervals: idle gaps inside a step count against it, unlike CUDA-event timing), the
time in communication kernels (NCCL) and how much of it overlaps compute, kernel launch counts, and the top
kernels by total time. ``fsdp_and_host`` adds, per traced step, what the FSDP2 + activation-checkpointing
hypotheses of docs/experiments.md need: collectives by kind (count, ms), host syncs and stream waits, the
host time of FSDP2's hooks (its ``FSDP::`` ranges), the busiest host threads, allocator calls, and how much
slower compute kernels run while an NCCL kernel runs beside them.
"""

from __future__ import annotations

import argparse
import gzip
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
    # Host ranges only: on CUDA each ProfilerStep also has a gpu_user_annotation copy, which would count it twice.
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and e.get("ph") == "X"
             and e.get("cat") != "gpu_user_annotation"]
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
        **fsdp_and_host(events, kernels, lo, hi, max(len(steps), 1)),
        "idle_gaps": idle_gaps(events, kernels, lo, hi),
    }


def idle_gaps(events: list[dict], kernels: list[dict], lo: float, hi: float, top: int = 12) -> dict:
    """GPU idle time (no kernel on any stream) split by what the host was doing then: the longest gaps with the
    kernels on either side and the innermost FSDP / autograd range open on the host at the gap's start."""
    iv = sorted((max(e["ts"], lo), min(e["ts"] + e["dur"], hi), e["name"][:60]) for e in kernels)
    gaps, end, last = [], lo, "(start)"
    for s, t, name in iv:
        if s > end:
            gaps.append((s - end, end, last, name))
        if t > end:
            end, last = t, name
    if hi > end:
        gaps.append((hi - end, end, last, "(end)"))
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS
            and (e["name"].startswith("FSDP::") or e["name"].startswith("autograd::engine"))]

    def open_at(ts: float) -> str:
        inner = [e for e in host if e["ts"] <= ts < e["ts"] + e["dur"]]
        return min(inner, key=lambda e: e["dur"])["name"][:80] if inner else ""

    big = sorted(gaps, reverse=True)[:top]
    return {"total_ms": sum(g[0] for g in gaps) / 1e3, "count": len(gaps),
            "over_100us_ms": sum(g[0] for g in gaps if g[0] > 100) / 1e3,
            "longest": [{"ms": d / 1e3, "at_ms": (at - lo) / 1e3, "after": a, "before": b, "host": open_at(at)}
                        for d, at, a, b in big]}


def write_timeline(path: str, out: str) -> None:
    """A compact copy of a trace for reading later (the raw traces are too big to bring back): kernels, FSDP
    ranges, autograd nodes and host syncs as [ts_us, dur_us, lane, name] relative to the first step."""
    events = json.load(open(path))["traceEvents"]
    keep = []
    for e in events:
        if e.get("ph") != "X":
            continue
        name, cat = e.get("name", ""), e.get("cat")
        if cat == "kernel":
            lane = f"stream{e.get('args', {}).get('stream', e.get('tid'))}"
        elif cat in HOST_CATS and (name.startswith(("FSDP::", "ProfilerStep#", "autograd::engine"))
                                   or "checkpoint" in name.lower()):
            lane = f"host{e.get('tid', 0)}"
        elif cat == "cuda_runtime" and (name in SYNCS or name == "cudaStreamWaitEvent"):
            lane = f"rt{e.get('tid', 0)}"
        else:
            continue
        keep.append([e["ts"], e["dur"], lane, name[:100]])
    t0 = min((k[0] for k in keep if k[3].startswith("ProfilerStep#")), default=min(k[0] for k in keep))
    with gzip.open(out, "wt") as f:
        json.dump([[round(ts - t0, 1), round(d, 1), lane, n] for ts, d, lane, n in sorted(keep)], f)


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")
HOST_CATS = ("cpu_op", "user_annotation", "python_function")


def _kind(name: str) -> str:
    low = name.lower()
    for k in ("allgather", "reducescatter", "allreduce"):
        if k in low.replace("_", ""):
            return k
    return "other"


def fsdp_and_host(events: list[dict], kernels: list[dict], lo: float, hi: float, steps: int) -> dict:
    """Per-step numbers for the FSDP2 + AC hypotheses (module docstring); times in ms per traced step."""
    inside = [e for e in events if e.get("ph") == "X" and lo <= e["ts"] < hi]
    comm = [e for e in kernels if "nccl" in e["name"].lower()]
    coll: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in comm:
        coll[_kind(e["name"])][0] += 1 / steps
        coll[_kind(e["name"])][1] += e["dur"] / 1e3 / steps
    runtime = [e for e in inside if e.get("cat") == "cuda_runtime"]
    syncs = [e for e in runtime if e["name"] in SYNCS and e["name"] != "cudaMemcpyAsync"]
    fsdp: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in inside:
        if e.get("cat") in HOST_CATS and e["name"].startswith("FSDP::"):
            key = e["name"].split(" (")[0].split(" for ")[0]  # drop the unit's name: one row per hook kind
            fsdp[key][0] += 1 / steps
            fsdp[key][1] += e["dur"] / 1e3 / steps
    threads: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in inside:
        if e.get("cat") in HOST_CATS and not e["name"].startswith("ProfilerStep#"):  # the step spans all of it
            threads[e.get("tid", 0)].append((e["ts"], min(e["ts"] + e["dur"], hi)))
    host = sorted(((tid, union_length(iv) / 1e3 / steps) for tid, iv in threads.items()), key=lambda t: -t[1])
    # Compute kernels that ran while an NCCL kernel ran beside them (any overlap) vs alone, by kernel name.
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in comm)
    alone: dict[str, list[float]] = defaultdict(list)
    shared: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        if "nccl" in e["name"].lower():
            continue
        s, t = e["ts"], e["ts"] + e["dur"]
        (shared if any(a < t and s < b for a, b in spans) else alone)[e["name"][:90]].append(e["dur"])
    both = [n for n in shared if n in alone]
    slow = sum(sum(shared[n]) for n in both) / sum(len(shared[n]) * sum(alone[n]) / len(alone[n]) for n in both) \
        if both else None
    return {
        "per_step": {
            "collectives": {k: {"count": c, "ms": ms} for k, (c, ms) in sorted(coll.items())},
            "host_syncs": {"count": len(syncs) / steps, "ms": sum(e["dur"] for e in syncs) / 1e3 / steps,
                           "kinds": sorted({e["name"] for e in syncs})},
            "stream_waits": sum(e["name"] == "cudaStreamWaitEvent" for e in runtime) / steps,
            "allocator_calls": sum(e["name"] in ("cudaMalloc", "cudaFree") for e in runtime) / steps,
            "fsdp_host": {k: {"count": c, "ms": ms} for k, (c, ms) in sorted(fsdp.items())},
            "host_busy_ms_by_thread": [[tid, ms] for tid, ms in host[:3]],
        },
        # Duration of compute kernels that overlapped an NCCL kernel / their duration alone (same names): > 1
        # means communication slows compute down (SMs or memory bandwidth shared), which overlap models ignore.
        "compute_slowdown_beside_nccl": slow,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", help="write the summaries here")
    ap.add_argument("--timeline", help="also write each trace's compact timeline to <this prefix><i>.json.gz")
    a = ap.parse_args()
    if a.timeline:
        for i, t in enumerate(a.traces):
            write_timeline(t, f"{a.timeline}{i}.json.gz")
    out = [summarise(t, a.top) for t in a.traces]
    for s in out:
        print(f"\n{s['trace']}: {s['steps']} step(s), wall {s['wall_ms']:.1f} ms, kernel-busy {s['kernel_busy']:.1%}, "
              f"compute {s['compute_busy_ms']:.1f} ms, comm {s['comm_busy_ms']:.1f} ms "
              f"(exposed {s['comm_exposed_ms']:.1f} ms), {s['kernels']} kernels, {s['launches']} launches")
        for name, count, ms in s["top"]:
            print(f"  {ms:9.2f} ms {count:6d}x  {name}")
        print("  per step: " + json.dumps(s["per_step"]) + f"; compute slowdown beside NCCL: "
              f"{s['compute_slowdown_beside_nccl']}")
        g = s["idle_gaps"]
        print(f"  GPU idle: {g['total_ms']:.1f} ms in {g['count']} gaps ({g['over_100us_ms']:.1f} ms in gaps > 100 us);"
              " longest: " + "; ".join(f"{x['ms']:.2f} ms at {x['at_ms']:.0f} ({x['host']})" for x in g["longest"][:4]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
