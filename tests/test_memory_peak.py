"""benchmarks/memory_peak.py on hand-built allocator snapshots (the torch.cuda.memory._snapshot() format)."""

import importlib.util
import json
import pickle
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("memory_peak", REPO / "benchmarks" / "memory_peak.py")
mp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mp)

MIB = 1 << 20
OURS = {"filename": "/work/main/nsa_titan/model.py", "line": 42, "name": "forward"}
OURS_B = {"filename": "/work/main/nsa_titan/attention.py", "line": 7, "name": "attn"}
TORCH = {"filename": "/venv/lib/python3.11/site-packages/torch/nn/functional.py", "line": 100, "name": "linear"}
USER = {"filename": "/home/me/train_script.py", "line": 5, "name": "<module>"}


def ev(action, addr, size, *frames):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


def snap(trace, live_blocks=(), device=0):
    """A snapshot whose end state holds ``live_blocks`` [(addr, size)] as allocated, plus a free block.

    Blocks get a rounded "size" larger than "requested_size" so that using the wrong field shows up.
    """
    blocks = [{"address": a, "size": s + 512, "requested_size": s, "state": "active_allocated", "frames": []}
              for a, s in live_blocks]
    blocks.append({"address": 1 << 40, "size": 64 * MIB, "requested_size": 0, "state": "inactive", "frames": []})
    traces = [[] for _ in range(device + 1)]
    traces[device] = trace
    return {"segments": [{"device": device, "address": 0, "total_size": 1 << 41, "blocks": blocks}],
            "device_traces": traces}


def test_peak_in_the_middle_live_set_and_sites():
    trace = [
        ev("alloc", 0x100, 10 * MIB, OURS, TORCH),
        ev("alloc", 0x200, 20 * MIB, TORCH, OURS_B),  # innermost is torch's; charged to our caller
        ev("alloc", 0x300, 5 * MIB, OURS),
        ev("free_requested", 0x200, 20 * MIB, TORCH, OURS_B),
        ev("free_completed", 0x200, 20 * MIB, TORCH, OURS_B),
        ev("alloc", 0x400, 1 * MIB, USER),
        ev("free_requested", 0x300, 5 * MIB, OURS),
        ev("free_completed", 0x300, 5 * MIB, OURS),
        ev("segment_free", 0x9000, 64 * MIB),  # reserved memory: no effect on allocated bytes
    ]
    r = mp.analyze(snap(trace, [(0x100, 10 * MIB), (0x400, 1 * MIB)]))
    assert r["start_bytes"] == 0
    assert r["end_bytes"] == 11 * MIB
    assert r["peak_bytes"] == 35 * MIB
    assert r["peak_event_index"] == 2
    assert r["n_events"] == len(trace)
    assert r["before_window_bytes"] == 0
    assert r["sites"] == [
        {"site": "attention.py:7 attn", "bytes": 20 * MIB, "count": 1},
        {"site": "model.py:42 forward", "bytes": 15 * MIB, "count": 2},
    ]
    md = mp.to_markdown(r, top=1, label="x.pickle")
    assert "**0.034 GiB** after event 2 of 9" in md
    assert "`attention.py:7 attn`" in md and "(1 more sites)" in md and "model.py" not in md


def test_allocations_before_the_window():
    # 0x10 (8 MiB) was allocated before recording and is still live; 0x20 (4 MiB) too, freed mid-trace.
    trace = [
        ev("alloc", 0x100, 16 * MIB, OURS),
        ev("free_completed", 0x20, 4 * MIB, TORCH),
        ev("alloc", 0x200, 2 * MIB, OURS_B),
    ]
    r = mp.analyze(snap(trace, [(0x10, 8 * MIB), (0x100, 16 * MIB), (0x200, 2 * MIB)]))
    assert r["end_bytes"] == 26 * MIB
    assert r["start_bytes"] == 12 * MIB
    assert (r["peak_bytes"], r["peak_event_index"]) == (28 * MIB, 0)
    assert r["before_window_bytes"] == 12 * MIB  # nothing pre-window freed yet at event 0
    assert r["before_window_bytes"] + sum(s["bytes"] for s in r["sites"]) == r["peak_bytes"]
    assert "(allocated before the recorded window)" in mp.to_markdown(r)


def test_peak_after_a_pre_window_free_and_at_the_start():
    # The ring buffer kept a free_completed whose alloc was overwritten: it must not be matched to anything,
    # and the 6 MiB it frees is no longer "before the window" at a later peak.
    trace = [
        ev("free_requested", 0x50, 6 * MIB),
        ev("free_completed", 0x50, 6 * MIB),
        ev("alloc", 0x100, 10 * MIB, OURS),
    ]
    r = mp.analyze(snap(trace, [(0x10, 1 * MIB), (0x100, 10 * MIB)]))
    assert r["start_bytes"] == 7 * MIB
    assert (r["peak_bytes"], r["peak_event_index"]) == (11 * MIB, 2)
    assert r["before_window_bytes"] == 1 * MIB
    assert r["sites"] == [{"site": "model.py:42 forward", "bytes": 10 * MIB, "count": 1}]

    # A trace that only frees peaks before its first event, with everything alive from before the window.
    r = mp.analyze(snap(trace[:2], [(0x10, 1 * MIB)]))
    assert (r["peak_bytes"], r["peak_event_index"], r["before_window_bytes"]) == (7 * MIB, -1, 7 * MIB)
    assert r["sites"] == []
    assert "before the first event" in mp.to_markdown(r)


def test_free_requested_alone_keeps_bytes_allocated():
    # Freed by the tensor but still in use by another stream: active_pending_free at the snapshot.
    trace = [ev("alloc", 0x100, 3 * MIB, OURS), ev("free_requested", 0x100, 3 * MIB, OURS),
             ev("alloc", 0x200, 4 * MIB, OURS_B)]
    s = snap(trace, [(0x200, 4 * MIB)])
    s["segments"][0]["blocks"].append(
        {"address": 0x100, "size": 3 * MIB + 512, "requested_size": 3 * MIB, "state": "active_pending_free"})
    r = mp.analyze(s)
    assert r["start_bytes"] == 0 and r["end_bytes"] == 7 * MIB
    assert (r["peak_bytes"], r["peak_event_index"]) == (7 * MIB, 2)
    assert {x["site"]: x["bytes"] for x in r["sites"]} == {"model.py:42 forward": 3 * MIB,
                                                          "attention.py:7 attn": 4 * MIB}


def test_other_device_and_old_blocks_without_requested_size():
    trace = [ev("alloc", 0x100, 2048)]
    s = snap(trace, device=1)
    s["segments"][0]["blocks"].append({"address": 0x100, "size": 2048, "state": "active_allocated"})
    s["segments"].append({"device": 0, "address": 0, "blocks": [
        {"address": 0, "size": 512, "requested_size": 512, "state": "active_allocated"}]})
    r = mp.analyze(s, device=1)
    assert (r["start_bytes"], r["peak_bytes"], r["end_bytes"]) == (0, 2048, 2048)
    assert r["sites"] == [{"site": "<no frames>", "bytes": 2048, "count": 1}]  # no frames recorded
    r0 = mp.analyze(s, device=0)
    assert (r0["n_events"], r0["peak_bytes"], r0["before_window_bytes"]) == (0, 512, 512)


@pytest.mark.parametrize("frames, match, site", [
    ([TORCH, USER, OURS], mp.DEFAULT_MATCH, "model.py:42 forward"),  # match beats an outer user frame
    ([TORCH, USER, OURS], ("nothing",), "train_script.py:5 <module>"),  # else innermost outside torch
    ([{"filename": "/pytorch/c10/cuda/CUDACachingAllocator.cpp", "line": 1, "name": "malloc"}, TORCH, USER],
     ("nothing",), "train_script.py:5 <module>"),  # C++ frames are not a call site
    ([{"filename": "/tmp/torchinductor_me/ab/cabc.py", "line": 9, "name": "call"}, OURS], mp.DEFAULT_MATCH,
     "cabc.py:9 call"),  # generated inductor code is innermost and matches
    ([TORCH], mp.DEFAULT_MATCH, "functional.py:100 linear"),  # only torch frames: the innermost
    ([], mp.DEFAULT_MATCH, "<no frames>"),
])
def test_site_rules(frames, match, site):
    assert mp.site_of(frames, match) == site


def test_cli_writes_json_and_md(tmp_path, capsys):
    trace = [ev("alloc", 0x100, 3 * MIB, OURS), ev("alloc", 0x200, 5 * MIB, USER),
             ev("free_completed", 0x200, 5 * MIB, USER)]
    paths = []
    for name, t in (("a.pickle", trace), ("b.pickle", trace[:1])):
        paths.append(tmp_path / name)
        paths[-1].write_bytes(pickle.dumps(snap(t, [(0x100, 3 * MIB)])))
    out = tmp_path / "out"
    reports = mp.main([str(p) for p in paths] + ["--out", str(out), "--tag", "t1", "--top", "5",
                                                 "--match", "nsa_titan"])
    assert [r["peak_bytes"] for r in reports] == [8 * MIB, 3 * MIB]
    data = json.loads((out / "memory_peak_t1.json").read_text())
    assert data["match"] == ["nsa_titan"]
    assert [s["file"] for s in data["snapshots"]] == ["a.pickle", "b.pickle"]
    assert data["snapshots"][0]["sites"][0] == {"site": "train_script.py:5 <module>", "bytes": 5 * MIB, "count": 1}
    md = (out / "memory_peak_t1.md").read_text()
    assert "### a.pickle (device 0)" in md and "### b.pickle (device 0)" in md
    assert "### a.pickle" in capsys.readouterr().out


def test_cli_labels_snapshots_of_one_name_by_their_paths(tmp_path):
    """Two runs' snapshots are both rank0_step2.pickle: each section must say which run it is."""
    trace = [ev("alloc", 0x100, 3 * MIB, OURS)]
    paths = []
    for run in ("nsa", "dense"):
        (tmp_path / run).mkdir()
        paths.append(tmp_path / run / "rank0_step2.pickle")
        paths[-1].write_bytes(pickle.dumps(snap(trace, [(0x100, 3 * MIB)])))
    reports = mp.main([str(p) for p in paths])
    assert [r["file"] for r in reports] == [str(p) for p in paths]


def test_pools_by_stream_split_reserved_memory_per_stream():
    """Reserved memory is the sum of per-stream pools; each pool's allocated, free and largest free block come from its
    own segments' blocks (a block freed while another stream uses it still counts as allocated)."""
    def seg(stream, blocks, device=0):
        return {"device": device, "stream": stream, "address": 0, "total_size": sum(b[1] for b in blocks),
                "blocks": [{"address": 0, "size": size, "requested_size": size, "state": state, "frames": []}
                           for state, size in blocks]}
    snapshot = {"segments": [
        seg(0, [("active_allocated", 6 * MIB), ("inactive", 2 * MIB)]),
        seg(0, [("inactive", 20 * MIB)]),
        seg(7, [("active_pending_free", 4 * MIB), ("inactive", 1 * MIB)]),
        seg(9, [("inactive", 3 * MIB)]),
        seg(0, [("active_allocated", 50 * MIB)], device=1),  # another device: not counted
    ], "device_traces": [[]]}
    pools = mp.pools_by_stream(snapshot, 0)
    assert [p["stream"] for p in pools] == [0, 7, 9]  # largest pool first
    assert pools[0] == {"stream": 0, "segments": 2, "reserved": 28 * MIB, "allocated": 6 * MIB, "free": 22 * MIB,
                        "largest_free": 20 * MIB}
    assert pools[1] == {"stream": 7, "segments": 1, "reserved": 5 * MIB, "allocated": 4 * MIB, "free": 1 * MIB,
                        "largest_free": 1 * MIB}
    assert pools[2]["reserved"] == 3 * MIB and pools[2]["allocated"] == 0
    report = {"file": "s", **mp.analyze(snapshot)}
    assert report["pools_at_snapshot"] == pools
    md = mp.to_markdown(report)
    assert "Reserved at the snapshot, by stream: 0.035 GiB" in md
    assert "| 7 | 1 | 0.005 | 0.004 | 0.001 | 0.001 |" in md
