"""What was alive at the peak of allocated CUDA memory, read from a caching-allocator snapshot.

    python benchmarks/memory_peak.py SNAPSHOT.pickle [more.pickle ...] [--device 0] [--top 25]
        [--match nsa_titan,torchinductor,benchmarks] [--out DIR --tag NAME]

SNAPSHOT.pickle is ``torch.cuda.memory._snapshot()`` (or ``_dump_snapshot``) taken while
``torch.cuda.memory._record_memory_history(...)`` was on: the file https://pytorch.org/memory_viz reads. The
device's trace of allocator events is replayed to find when allocated bytes peaked; the allocations alive
then are grouped by the source line that made them (the first frame matching --match, else the first frame
outside torch). Also the allocator's pools at the snapshot, one per stream (segments, reserved, allocated and
free bytes): where reserved-but-unused memory sits, e.g. FSDP's all-gather and reduce-scatter streams against the
compute stream. Pure pickle analysis, so it runs on a machine without CUDA. Prints markdown per snapshot; with
--out writes memory_peak_<tag>.json and .md.

The peak is not torch.cuda.max_memory_allocated, for two reasons (both seen on an H100, torch 2.11): bytes
are *requested* bytes, since the allocator records an event's size as the size asked for
(``block->requested_size`` in CUDACachingAllocator.cpp), not the rounded block size its stats count; and a
block counts from alloc to free_completed, as in memory_viz's plot, so a tensor freed while another stream
still uses it (record_stream) counts until that stream is done, where the allocated_bytes stat drops it at
the free request (its active_bytes stat keeps it, which makes that the closer number to compare with).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from collections import defaultdict

DEFAULT_MATCH = ("nsa_titan", "torchinductor", "benchmarks")
# "active_pending_free": freed by the tensor but still in use by another stream, so it has had free_requested
# and not yet free_completed; the replay counts it as allocated, and so must the end state. _snapshot's
# docstring calls this state "active_awaiting_free"; the C++ writer emits "active_pending_free". Accept both.
LIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")
BEFORE_WINDOW = "(allocated before the recorded window)"
GIB = 1024**3


def load(path: str) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


def end_bytes(snapshot: dict, device: int) -> int:
    """Bytes allocated on ``device`` when the snapshot was taken, in the trace's unit (requested bytes)."""
    total = 0
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:  # very old snapshots have no "device": one GPU
            continue
        for b in seg.get("blocks", []):
            if b.get("state") in LIVE_STATES:
                # Trace events carry the requested size; a block's "size" is rounded up (to 512 B at least),
                # so summing "size" would put the whole replay off by the rounding of every live block.
                total += b.get("requested_size", b["size"])
    return total


def device_trace(snapshot: dict, device: int) -> list[dict]:
    traces = snapshot.get("device_traces", [])
    return traces[device] if device < len(traces) else []


def find_peak(trace: list[dict], end: int) -> tuple[int, int, int]:
    """(start_bytes, peak_bytes, peak_index): replay the trace from the start value that lands on ``end``.

    Only alloc and free_completed change allocated bytes: free_requested only marks a block whose memory is
    still in use by another stream (its free_completed follows), and segment_* events are reserved memory
    (cudaMalloc / expandable-segment mapping), not allocations. peak_index is the event after which the
    earliest maximum holds, -1 when the maximum is the state before the first event.
    """
    net = sum(_delta(e) for e in trace)
    start = end - net
    cur, peak, peak_index = start, start, -1
    for i, e in enumerate(trace):
        cur += _delta(e)
        if cur > peak:
            peak, peak_index = cur, i
    return start, peak, peak_index


def _delta(e: dict) -> int:
    action = e["action"]
    return e["size"] if action == "alloc" else -e["size"] if action == "free_completed" else 0


def live_at(trace: list[dict], index: int) -> tuple[list[dict], int]:
    """The traced allocs alive just after event ``index``, and the bytes of pre-window allocations freed by then.

    A free_completed whose address has no live traced alloc frees memory allocated before the trace began:
    before _record_memory_history, or in events the ring buffer (max_entries) has since overwritten. The
    ring buffer drops the oldest events, so what is kept is a contiguous suffix and matching by address in
    order is exact (an address is reused only after its free_completed).
    """
    live: dict[int, dict] = {}
    freed_pre_window = 0
    for e in trace[: index + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            if live.pop(e["addr"], None) is None:
                freed_pre_window += e["size"]
    return list(live.values()), freed_pre_window


def frame_str(f: dict) -> str:
    return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"


def site_of(frames: list[dict], match: tuple[str, ...] | list[str] = DEFAULT_MATCH) -> str:
    """The line an allocation is charged to; ``frames`` are innermost first, as the allocator records them.

    The innermost frame in the code being studied (``match``) says which of our lines allocated; failing that
    the innermost frame outside torch's package (its own frames are the same few dispatch lines for every
    tensor). C++ frames (stacks="all") are skipped there too: they name allocator internals, not a call site.
    """
    for f in frames:
        if any(m in f["filename"] for m in match):
            return frame_str(f)
    for f in frames:
        if "/torch/" not in f["filename"] and f["filename"].endswith(".py"):
            return frame_str(f)
    return frame_str(frames[0]) if frames else "<no frames>"


def analyze(snapshot: dict, device: int = 0, match: tuple[str, ...] | list[str] = DEFAULT_MATCH) -> dict:
    trace = device_trace(snapshot, device)
    end = end_bytes(snapshot, device)
    start, peak, peak_index = find_peak(trace, end)
    live, freed_pre_window = live_at(trace, peak_index)
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live:
        row = by_site[site_of(e.get("frames") or [], match)]  # no "frames" key when no context was recorded
        row[0] += e["size"]
        row[1] += 1
    sites = [{"site": s, "bytes": b, "count": c} for s, (b, c) in by_site.items()]
    sites.sort(key=lambda r: (-r["bytes"], r["site"]))
    return {
        "pools_at_snapshot": pools_by_stream(snapshot, device),
        "device": device, "peak_bytes": peak, "start_bytes": start, "end_bytes": end,
        "peak_event_index": peak_index, "n_events": len(trace), "sites": sites,
        # Allocated when the trace began and not yet freed at the peak. Negative means the end state and the
        # trace disagree (e.g. a snapshot of another device's segments), which the markdown flags.
        "before_window_bytes": start - freed_pre_window,
    }


def pools_by_stream(snapshot: dict, device: int) -> list[dict]:
    """The caching allocator's pools on ``device`` at the snapshot, one per stream (a block freed on one stream is
    not handed to another, so reserved memory is the sum of these pools): segments, reserved bytes (segment sizes),
    allocated bytes (blocks in a live state: allocated, or freed while another stream still uses them), free bytes
    and the largest free block. Largest pool first; the compute stream is usually stream 0."""
    pools: dict = defaultdict(lambda: {"segments": 0, "reserved": 0, "allocated": 0, "free": 0, "largest_free": 0})
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        pool = pools[seg.get("stream", 0)]
        pool["segments"] += 1
        pool["reserved"] += seg.get("total_size", sum(b["size"] for b in seg.get("blocks", [])))
        for b in seg.get("blocks", []):
            if b.get("state") in LIVE_STATES:
                pool["allocated"] += b["size"]
            elif b.get("state") == "inactive":
                pool["free"] += b["size"]
                pool["largest_free"] = max(pool["largest_free"], b["size"])
    return sorted(({"stream": k, **v} for k, v in pools.items()), key=lambda p: (-p["reserved"], str(p["stream"])))


def to_markdown(report: dict, top: int = 25, label: str = "") -> str:
    gib = lambda n: f"{n / GIB:.3f}"  # noqa: E731
    r = report
    lines = [f"### {label or 'snapshot'} (device {r['device']})", ""]
    at = "before the first event" if r["peak_event_index"] < 0 else f"after event {r['peak_event_index']}"
    lines.append(f"Peak allocated **{gib(r['peak_bytes'])} GiB** {at} of {r['n_events']}; "
                 f"{gib(r['start_bytes'])} GiB at the trace's start, {gib(r['end_bytes'])} GiB at the snapshot.")
    if r["before_window_bytes"] < 0:
        lines.append(f"\n**Inconsistent snapshot**: before-window bytes are {r['before_window_bytes']} "
                     "(the segments' live blocks do not match the trace).")
    lines += ["", "| GiB | share | count | site |", "|---:|---:|---:|---|"]
    share = lambda n: f"{100 * n / r['peak_bytes']:.1f}%" if r["peak_bytes"] else "-"  # noqa: E731
    if r["before_window_bytes"]:
        lines.append(f"| {gib(r['before_window_bytes'])} | {share(r['before_window_bytes'])} | | {BEFORE_WINDOW} |")
    for s in r["sites"][:top]:
        site = s["site"].replace("|", "\\|")  # a pipe in a name would split the table cell
        lines.append(f"| {gib(s['bytes'])} | {share(s['bytes'])} | {s['count']} | `{site}` |")
    rest = r["sites"][top:]
    if rest:
        n = sum(s["bytes"] for s in rest)
        lines.append(f"| {gib(n)} | {share(n)} | {sum(s['count'] for s in rest)} | ({len(rest)} more sites) |")
    pools = r.get("pools_at_snapshot") or []
    if pools:  # reserved = allocated + free over every stream's pool, at the snapshot (not at the peak)
        lines += ["", f"Reserved at the snapshot, by stream: {gib(sum(p['reserved'] for p in pools))} GiB", "",
                  "| stream | segments | reserved GiB | allocated GiB | free GiB | largest free GiB |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {p['stream']} | {p['segments']} | {gib(p['reserved'])} | {gib(p['allocated'])} | "
                  f"{gib(p['free'])} | {gib(p['largest_free'])} |" for p in pools]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshots", nargs="+", help="pickles from torch.cuda.memory._dump_snapshot")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--top", type=int, default=25, help="sites listed in the markdown (the JSON has all)")
    ap.add_argument("--match", default=",".join(DEFAULT_MATCH),
                    help="comma-separated filename substrings that mark our own frames")
    ap.add_argument("--out", help="directory for memory_peak_<tag>.json and .md")
    ap.add_argument("--tag", help="file name tag (default: the first snapshot's name)")
    a = ap.parse_args(argv)
    match = [m for m in a.match.split(",") if m]
    reports, sections = [], []
    names = [os.path.basename(p) for p in a.snapshots]
    for path in a.snapshots:  # the path as given when two snapshots share a file name (rank0_step2.pickle ...)
        name = os.path.basename(path) if names.count(os.path.basename(path)) == 1 else path
        report = {"file": name, **analyze(load(path), a.device, match)}
        reports.append(report)
        sections.append(to_markdown(report, a.top, label=name))
        print(sections[-1])
    if a.out:
        tag = a.tag or os.path.splitext(os.path.basename(a.snapshots[0]))[0]
        os.makedirs(a.out, exist_ok=True)
        base = os.path.join(a.out, f"memory_peak_{tag}")
        with open(base + ".json", "w") as f:
            json.dump({"match": match, "snapshots": reports}, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(f"## Allocated memory at the peak ({tag})\n\n" + "\n".join(sections))
        print(f"wrote {base}.json and .md", file=sys.stderr)
    return reports


if __name__ == "__main__":
    main()
