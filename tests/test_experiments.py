"""Experiments on CPU: the FLOP formula against FlopCounterMode, the GA/AC planner's search, the fake-process-group
probe, the trainer runner with its cache, and the reports' files."""

from __future__ import annotations

import builtins
import json
import math
import subprocess

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nsa_titan.experiments import ac_planner, common, compile_report, dp_compare
from nsa_titan.experiments.ac_planner import Point, plan, recommendations, smallest_fitting
from nsa_titan.models import build_model, get_model_args
from nsa_titan.models.nsa.common import NSAParams
from nsa_titan.models.nsa.flops import forward_flops_breakdown, training_flops_per_token

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=96, cmp_block=8, cmp_stride=4,
            slc_block=16, slc_top_n=3, window=24)
TINY_CLI = [x for k, v in TINY.items() for x in (f"--model.{k}", str(v))] + \
    ["--training.seq_len", "64", "--training.device", "cpu", "--lr_scheduler.warmup_steps", "1"]
B, T = 2, 64


@pytest.fixture(autouse=True)
def one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops on a shared 2-core box (see test_train.py)
    yield
    torch.set_num_threads(before)


# ---- the FLOP formula against FlopCounterMode -------------------------------------------------------------------
def counted(args, train: bool) -> dict[str, int]:
    """FlopCounterMode's matmul FLOPs of one forward (+ backward) on [B, T]; SDPA in its math form so that the
    counter sees its matmuls (it has no formula for the CPU flash kernel)."""
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        if train:
            model(tokens).float().pow(2).mean().backward()
        else:
            with torch.no_grad():
                model(tokens)
    return {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}


def test_dense_flops_equal_the_formula_with_dense_equivalent_attention():
    """Linear layers exactly; the attention matmuls see all T keys (masking is not skipping), which the formula's
    coefficients price exactly when given T keys per query instead of the causal average (T + 1) / 2."""
    args = get_model_args("debug", **TINY, attn_type="dense")
    parts = forward_flops_breakdown(args, T)
    dense_equiv = forward_flops_breakdown(args, T, keys={"dense": T})
    for train, factor in ((False, 1), (True, 3)):  # training = 3 x forward, exactly, for every matmul
        c = counted(args, train)
        assert c["aten.mm"] == factor * B * T * parts["linear"]
        assert c["aten.bmm"] == factor * B * T * dense_equiv["attn_dense"]
    assert parts["attn_dense"] == dense_equiv["attn_dense"] * (T + 1) / 2 / T  # causal: half the keys (+ diagonal)
    assert training_flops_per_token(args, T) == 3 * sum(parts.values())


def test_nsa_flops_equal_the_formula_on_the_dense_reference():
    """The reference computes every NSA branch with dense masked matmuls: compressed over all Tc compressed tokens,
    selected and window over all T keys. Linear layers and phi (the exact number of compressed tokens) match
    exactly; the attention matches the formula priced at those dense key counts; what remains is the selection's
    importance map (group probabilities @ overlap, and the overlap matrix itself), which the formula leaves out as
    O(T/d) per token and which runs without gradient (1x in training)."""
    args = get_model_args("debug", **TINY, attn_impl="reference")
    p = NSAParams.from_args(args)
    tc, nb = p.num_cmp_tokens(T), p.num_slc_blocks(T)
    parts = forward_flops_breakdown(args, T)
    dense_equiv = forward_flops_breakdown(args, T, keys={"cmp": tc, "slc": T, "win": T})
    importance = args.n_layers * (2 * B * args.n_kv_heads * T * tc * nb + 2 * tc * T * nb)
    # phi of the keys and the values runs as batched matmuls when both are MLPs of one width (compress_pair)
    batched_phi = args.compress == "mlp" and args.head_dim == args.dv
    assert batched_phi  # the debug flavor's case; the unbatched one is each Compressor alone (test_model.py)
    for train, factor in ((False, 1), (True, 3)):
        c = counted(args, train)
        assert c["aten.mm"] == factor * B * T * parts["linear"] + importance
        assert c["aten.bmm"] == factor * B * T * (parts["phi"] + sum(dense_equiv[f"attn_{k}"]
                                                                     for k in ("cmp", "slc", "win")))
    # The real (sparse) work is smaller than the reference's dense-equivalent in every branch.
    assert all(parts[f"attn_{k}"] < dense_equiv[f"attn_{k}"] for k in ("cmp", "slc", "win"))


# ---- planner search logic with a fake memory model ---------------------------------------------------------------
def fake_memory(p: Point, ga_gib: float = 3.0) -> float:
    """GiB: sharded weights/optimizer + activations that checkpointing removes + unsharded grads held by GA >= 2."""
    return 12.0 / p.gpus + 6.0 * p.local_batch * (1.0 - 0.9 * p.ratio) + (ga_gib if p.probe_ga > 1 else 0.0)


def fake_speed(p: Point) -> float:
    """Tokens/s per GPU: bigger batches are more efficient, recomputation costs up to a third."""
    return 1000.0 * (1 + math.log2(p.local_batch)) / (1 + p.ratio / 3)


RATIOS = [round(0.1 * i, 1) for i in range(11)]


def run_plan(budget=30.0, gpus=(1, 2, 4), batches=(1, 2, 4, 8, 16, 32), limit=None, effective=64, ga_gib=3.0):
    calls = []

    def measure(p: Point):
        if limit is not None and len(calls) >= limit:
            return None
        calls.append(p)
        return {"peak_reserved_gib": fake_memory(p, ga_gib), "peak_alloc_gib": 0.0,
                "tokens_per_s_per_gpu": fake_speed(p), "seq_len": 8192, "oom": False}

    rows = plan(list(gpus), list(batches), effective, RATIOS, measure, budget=lambda r: budget)
    return rows, calls


def test_planner_finds_the_smallest_fitting_ratio_and_keeps_the_effective_batch():
    rows, calls = run_plan()
    by = {(r["gpus"], r["local_batch"]): r for r in rows}
    for (g, b), r in by.items():
        if r["status"] == "skipped":
            assert 64 % (g * b) and "grad_accum" not in r
            continue
        ga = 64 // (g * b)
        assert r["grad_accum"] == ga and g * b * ga == 64
        fitting = [x for x in RATIOS if fake_memory(Point(g, b, ga, x)) <= 30.0]  # brute force
        if fitting:
            assert r["status"] == "fits" and r["ac_ratio"] == fitting[0], (g, b, r)
            assert r["step_time_s"] == pytest.approx(b * ga * 8192 / fake_speed(Point(g, b, ga, fitting[0])))
        else:
            assert r["status"] == "does_not_fit"
    # Values of the fake model, worked out by hand: 12 + 6 * 4 * (1 - 0.9 r) + 3 <= 30 needs r >= 0.42 -> 0.5.
    assert by[(1, 1)]["ac_ratio"] == 0.0 and by[(1, 4)]["ac_ratio"] == 0.5 and by[(1, 32)]["status"] == "does_not_fit"
    # Bisection: at most 2 + ceil(log2 11) probes per cell, far fewer than trying every ratio.
    per_cell = {}
    for p in calls:
        per_cell[(p.gpus, p.local_batch)] = per_cell.get((p.gpus, p.local_batch), 0) + 1
    assert max(per_cell.values()) <= 6 and len(calls) < 0.3 * len(RATIOS) * len(rows)
    best = recommendations(rows)
    assert ac_planner.describe(best[1]) == "1 GPU: bs=16 AC=1 GA=4"  # fastest fitting, in the study's shape
    assert ac_planner.describe(best[4]) == "4 GPUs: bs=16 AC=0.8 GA=1"


def test_planner_rules_out_larger_batches_without_probing_them():
    """bs=32 (GA 4, probed with GA 2) does not fit even fully checkpointed, so bs=64 (GA 2, same probe GA, more
    activations) cannot either: it gets no probe."""
    rows, calls = run_plan(gpus=(1,), batches=(32, 64), effective=128)
    assert [r["status"] for r in rows] == ["does_not_fit", "does_not_fit"]
    assert {p.local_batch for p in calls} == {32} and "bs=32" in rows[1]["note"]


def test_planner_bounds_reset_when_the_probe_ga_changes():
    """With GA >= 2 gradients are held between micro-batches (here 30 GiB): bs=32 at GA 2 does not fit, but bs=64 at
    GA 1 holds none and fits fully checkpointed (12 + 384 * 0.1 = 50.4 <= 55). Nothing may be inferred across."""
    rows, calls = run_plan(budget=55.0, gpus=(1,), batches=(32, 64), ga_gib=30.0)
    assert [r["status"] for r in rows] == ["does_not_fit", "fits"] and rows[1]["ac_ratio"] == 1.0


def test_planner_skips_indivisible_batches_and_stops_cleanly_at_the_time_limit():
    rows, _ = run_plan(gpus=(3,), batches=(1, 2))
    assert {r["status"] for r in rows} == {"skipped"} and "not a multiple" in rows[0]["note"]
    rows, calls = run_plan(limit=3)
    assert len(calls) == 3 and [r["status"] for r in rows].count("pending") >= 1
    assert all(r["status"] in ("fits", "pending", "does_not_fit", "skipped") for r in rows)


def test_a_crashed_probe_is_an_error_not_a_cell_that_does_not_fit():
    def measure(p: Point):
        if p.local_batch == 2:
            return {"failed": True, "error": "probe exit 1:\n  x = f()\n      ^^^\nRuntimeError: boom\n"}
        return {"peak_reserved_gib": 1.0, "peak_alloc_gib": 0.0, "tokens_per_s_per_gpu": 1.0, "seq_len": 8,
                "oom": False}

    rows = plan([1], [1, 2, 4], 64, RATIOS, measure, budget=lambda r: 30.0)
    assert [r["status"] for r in rows] == ["fits", "error", "fits"] and "boom" in rows[1]["note"]
    assert "\n" not in rows[1]["note"]  # one line: it is a markdown table cell


@pytest.mark.parametrize("pattern, lo, expected", [
    ("FFFTTT", 0, 3), ("TTTTTT", 0, 0), ("FFFFFF", 0, None), ("FFFFFT", 0, 5), ("FFFFTT", 4, 4), ("F", 0, None),
    ("FFFTTT", 5, 5)])
def test_smallest_fitting(pattern, lo, expected):
    seen = []
    idx, complete = smallest_fitting(len(pattern), lo, lambda i: seen.append(i) or pattern[i] == "T")
    assert (idx, complete) == (expected, True) and len(seen) <= 2 + math.ceil(math.log2(len(pattern)))


# ---- real measurement on CPU: the fake process group -------------------------------------------------------------
def test_probe_runs_rank0_of_a_fake_world_and_the_planner_cli_writes_its_files(tmp_path):
    result = ac_planner.main(["--config", "train_configs/debug_model.toml", "--gpus", "1,2", "--effective-batch", "4",
                              "--local-batches", "1,2", "--ratios", "0,1", "--memory-budget-gib", "1000",
                              "--in-process", "--warmup", "1", "--steps", "1", "--out", str(tmp_path),
                              "--tag", "cpu", "--", *TINY_CLI])
    probes = json.loads((tmp_path / "ac_plan_cpu" / "probes.json").read_text())
    fake = [v for v in probes.values() if v["fake_process_group"]]
    assert fake and all(v["world_size"] == 2 and v["tokens_per_s_per_gpu"] > 0 for v in fake)
    assert "fake process group of 2" in fake[0]["time_source"]
    assert set(result["recommendations"]) == {"1", "2"}
    md = (tmp_path / "ac_plan_cpu.md").read_text()
    assert "1 GPU: bs=" in md and "| GPUs | local batch | GA | AC ratio |" in md
    # The 2-GPU rows are fake: labelled in the JSON and the grid, their time = compute + estimated communication.
    two = [r for r in result["rows"] if r["gpus"] == 2 and r["status"] == "fits"]
    assert two and all(r["fake_process_group"] and r["comm_model"] == "fsdp2_overlap" for r in two)
    assert all(r["step_time_s"] == pytest.approx(r["compute_step_s"] + r["comm_exposed_s"]) for r in two)
    assert "| GPUs=2 | AC=" in md and "†" in md.split("## Every cell")[0]
    assert json.loads((tmp_path / "ac_plan_cpu.json").read_text())["rows"]
    assert_png_or_note(tmp_path / "ac_plan_cpu.png", md)


def assert_png_or_note(png, md):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in md
        return
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- trainer runs: steady state, cache, reports ------------------------------------------------------------------
def test_steady_stats_use_windows_after_warmup():
    recs = [{"type": "train", "step": s, "window_steps": w, "window_s": ws, "window_tokens": tok, "loss": 1.0,
             "tokens_per_s_per_gpu": tok / ws, "peak_mem_gib": 1.0}
            for s, w, ws, tok in ((1, 1, 30.0, 100), (4, 3, 3.0, 300), (8, 4, 2.0, 400), (12, 4, 2.0, 400))]
    st = common.steady_stats(recs + [{"type": "val", "step": 12}], warmup=4)
    assert st["steps_timed"] == 8 and st["step_time_s"] == pytest.approx(0.5)
    assert st["tokens_per_s"] == pytest.approx(200.0) and st["first_step_s"] == 30.0


def test_dp_compare_runs_the_trainer_once_then_reuses_the_run(tmp_path, monkeypatch):
    argv = ["--config", "train_configs/debug_model.toml", "--cpu", "--gpus", "1", "--ac", "none", "--steps", "4",
            "--warmup", "2", "--out", str(tmp_path), "--tag", "cpu", "--", *TINY_CLI,
            "--training.local_batch_size", "2"]
    first = dp_compare.main(argv)
    row = first["rows"][0]
    assert "error" not in row, row.get("error")
    assert row["tokens_per_s_per_gpu"] > 0 and row["steps_timed"] == 2 and row["first_step_s"] > 0
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a cached run was started again"))
    again = dp_compare.main(argv)
    assert again["rows"][0]["tokens_per_s_per_gpu"] == row["tokens_per_s_per_gpu"]


@pytest.mark.parametrize("extra, mode", [([], "default"), (["--compile.mode", "reduce-overhead"], "reduce-overhead"),
                                         (["--compile.mode=auto"], "auto")])
def test_dp_compare_compares_one_gpu_in_the_wrappers_compile_mode(tmp_path, monkeypatch, extra, mode):
    """compile.mode 'auto' (m7c's) would give the 1-GPU baseline CUDA graphs that no data-parallel run can use:
    dp_compare pins 'default' unless the user names a mode."""
    seen = []

    def fake_run(self, name, gpus, args, fields):
        seen.append(args)
        return {"run": name, "gpus": gpus, "error": "not run", **fields}

    monkeypatch.setattr(common.Runner, "run", fake_run)
    dp_compare.main(["--config", "train_configs/m7c_125m.toml", "--cpu", "--gpus", "1", "--ac", "none", "--out",
                     str(tmp_path), "--", "--compile.enable", *extra])
    assert seen
    for a in seen:
        modes = [a[i + 1] for i, x in enumerate(a) if x == "--compile.mode"]
        modes += [x.split("=", 1)[1] for x in a if x.startswith("--compile.mode=")]
        assert modes == [mode], a


def fake_row(gpus, dp, ac, tps, **kw):
    return {"run": f"{ac}_{gpus}_{dp}", "gpus": gpus, "data_parallel": dp, "ac": ac, "tokens_per_s_per_gpu": tps,
            "tokens_per_s": tps * gpus, "step_time_s": 8192 / tps, "peak_mem_gib": 40.0 / gpus,
            "peak_mem_reserved_gib": 45.0 / gpus, "mfu": 0.3, "device": "NVIDIA H200", "torch": "2.13", **kw}


def test_dp_report_computes_scaling_and_targets(tmp_path):
    rows = [fake_row(1, "none", "none", 1000.0), fake_row(2, "fsdp2", "none", 960.0), fake_row(2, "ddp", "none", 900.0),
            fake_row(1, "none", "full", 800.0), fake_row(2, "fsdp2", "full", 700.0),
            {"run": "x", "gpus": 2, "data_parallel": "fsdp1", "ac": "full", "error": "out of memory"}]
    result = dp_compare.write_dp_report(tmp_path, "t", rows, {"steps": 12, "warmup": 4, "train_args": []}, ["later"])
    assert rows[1]["scaling"] == pytest.approx(0.96) and rows[4]["scaling"] == pytest.approx(0.875)
    # scaling of none (96%: met) and full (87.5%: missed), then AC full's cost: 8192/700 / (8192/960) = 1.37x > 1.35x
    assert [t.split(":")[-1].strip()[:6] for t in result["targets"]] == ["MET", "MISSED", "MISSED"]
    assert "1.37x AC none's" in result["targets"][2]
    md = (tmp_path / "dp_compare_t.md").read_text()
    assert "out of memory" in md and "Incomplete" in md and "96.0%" in md
    assert_png_or_note(tmp_path / "dp_compare_t.png", md)


def test_dp_targets_compare_fsdp2_with_fsdp1_and_take_the_flavor_scaling_target():
    rows = [fake_row(1, "none", "none", 1000.0), fake_row(2, "fsdp2", "none", 920.0, peak_mem_reserved_gib=9.0),
            fake_row(2, "fsdp1", "none", 930.0, peak_mem_reserved_gib=10.0)]
    dp_compare.add_scaling(rows)
    lines = dp_compare.targets(rows, scaling_target=0.90)
    assert lines[0].endswith("MET") and "target >= 90%" in lines[0]  # 92% passes m7c's 90%, not 1b's 95%
    assert dp_compare.targets(rows)[0].endswith("MISSED by 3.0%")
    speed = next(line for line in lines if "FSDP2 / FSDP1" in line)
    memory = next(line for line in lines if "peak reserved" in line)
    assert "0.989" in speed and speed.endswith("MISSED by 1.1%")
    assert "90.0% of FSDP1's" in memory and memory.endswith("MET")


def test_compile_report_derives_compile_time_and_nsa_vs_dense(tmp_path, monkeypatch):
    def row(attn, compiled, tps, first, mfu):
        return {"seq_len": 8192, "attn": attn, "compiled": compiled, "tokens_per_s": tps, "first_step_s": first,
                "mfu": mfu, "compile": {"recompiles": 0} if compiled else None, "device": "NVIDIA H200"}

    rows = [row("nsa", False, 50e3, 9.0, 0.25), row("nsa", True, 80e3, 70.0, 0.42), row("dense", False, 40e3, 3.0, 0.3),
            row("dense", True, 60e3, 40.0, 0.45)]
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = compile_report.write_compile_report(tmp_path, "t", rows, {"steps": 12, "warmup": 4, "train_args": []}, [])
    assert rows[1]["compile_time_s"] == pytest.approx(61.0) and rows[1]["speedup"] == pytest.approx(1.6)
    assert rows[0]["nsa_vs_dense"] == pytest.approx(1.25) and rows[1]["nsa_vs_dense"] == pytest.approx(80 / 60)
    assert result["targets"][0].endswith("MET") and all(t.endswith("MET") for t in result["targets"])
    md = (tmp_path / "compile_t.md").read_text()
    assert "matplotlib is not installed" in md and not (tmp_path / "compile_t.png").exists()  # says so, no crash


def test_analyze_trace_reports_what_the_fsdp2_ac_hypotheses_need(tmp_path):
    """A hand-made trace of one step (times in microseconds): every number below is worked out by hand."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("analyze_trace", common.REPO / "benchmarks" / "analyze_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def x(name, ts, dur, cat, tid=1):
        return {"name": name, "ts": ts, "dur": dur, "cat": cat, "ph": "X", "tid": tid}

    events = [x("ProfilerStep#1", 0, 1000, "user_annotation"),
              x("ProfilerStep#1", 0, 990, "gpu_user_annotation"),  # the GPU's copy of the range: the same step
              x("ncclDevKernel_AllGather_RING_LL", 100, 200, "kernel"),
              x("ncclDevKernel_ReduceScatter_Sum", 600, 100, "kernel"),
              x("gemm", 0, 100, "kernel"), x("gemm", 150, 200, "kernel"), x("attn", 400, 100, "kernel"),
              x("aten::mm", 0, 400, "cpu_op"), x("FSDP::pre_backward (layers.0)", 20, 30, "cpu_op"),
              x("FSDP::backward_prefetch for layers.0", 60, 5, "cpu_op"), x("aten::add", 500, 100, "cpu_op", tid=2),
              x("cudaStreamSynchronize", 500, 50, "cuda_runtime"), x("cudaStreamWaitEvent", 30, 1, "cuda_runtime"),
              x("cudaStreamWaitEvent", 40, 1, "cuda_runtime"), x("cudaMalloc", 45, 2, "cuda_runtime"),
              x("cudaLaunchKernel", 10, 3, "cuda_runtime")]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = mod.summarise(str(path))
    assert s["kernel_busy"] == pytest.approx(0.55) and s["launches"] == 1  # [0, 350] + [400, 500] + [600, 700]
    step = s["per_step"]
    assert step["collectives"] == {"allgather": {"count": 1, "ms": 0.2}, "reducescatter": {"count": 1, "ms": 0.1}}
    assert step["host_syncs"] == {"count": 1, "ms": 0.05, "kinds": ["cudaStreamSynchronize"]}
    assert (step["stream_waits"], step["allocator_calls"]) == (2, 1)
    assert step["fsdp_host"] == {"FSDP::backward_prefetch": {"count": 1, "ms": 0.005},
                                 "FSDP::pre_backward": {"count": 1, "ms": 0.03}}
    assert step["host_busy_ms_by_thread"] == [[1, 0.4], [2, 0.1]]  # thread 1: [0, 400] holds its FSDP ranges
    assert s["compute_slowdown_beside_nccl"] == pytest.approx(2.0)  # gemm: 200 us beside the all-gather, 100 alone
    assert s["steps"] == 1
    gaps = s["idle_gaps"]  # no kernel in [350, 400], [500, 600], [700, 1000]
    assert gaps["total_ms"] == pytest.approx(0.45) and gaps["count"] == 3
    assert gaps["over_100us_ms"] == pytest.approx(0.3)
    assert gaps["longest"][0] == {"ms": 0.3, "at_ms": 0.7, "after": "ncclDevKernel_ReduceScatter_Sum",
                                  "before": "(end)", "host": ""}
    assert [(g["ms"], g["at_ms"]) for g in gaps["longest"][1:]] == [(0.1, 0.5), (0.05, 0.35)]
    mod.write_timeline(str(path), str(tmp_path / "t.json.gz"))
    import gzip

    timeline = json.load(gzip.open(tmp_path / "t.json.gz", "rt"))
    assert [e[3] for e in timeline if e[2].startswith("stream")].count("gemm") == 2
    assert {e[3] for e in timeline if e[2].startswith("rt")} == {"cudaStreamSynchronize", "cudaStreamWaitEvent"}


def test_ncu_attention_reads_the_raw_csv_and_sorts_the_stalls():
    """benchmarks/ncu_attention.py's parser on ncu's raw page layout (a header row, a units row, a row per
    kernel; ncu's own ==PROF== lines and the program's prints around it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ncu_attention", common.REPO / "benchmarks" / "ncu_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", "launch__registers_per_thread",
              "sm__warps_active.avg.pct_of_peak_sustained_active", stall.format("long_scoreboard"),
              stall.format("barrier"), stall.format("mio_throttle")]
    text = "\n".join(["==PROF== Connected to process 1", "a print of the program",
                      ",".join(f'"{h}"' for h in header), '"","","usecond","register/thread","%","","",""',
                      '"0","_sel_bwd_dkdv","645.5","240","11.2","9.5","1.25","3.0"',
                      '"1","_band_fwd","110","255","12.4","0.5","n/a","2"', "==PROF== Disconnected"])
    rows = mod.parse_raw(text)
    assert [r["kernel"] for r in rows] == ["_sel_bwd_dkdv", "_band_fwd"]
    assert rows[0]["duration"] == 645.5 and rows[0]["duration_unit"] == "usecond" and rows[0]["registers"] == 240
    assert list(rows[0]["stalls"].items()) == [("long_scoreboard", 9.5), ("mio_throttle", 3.0), ("barrier", 1.25)]
    assert list(rows[1]["stalls"]) == ["mio_throttle", "long_scoreboard"]  # "n/a" is left out, not zero
    assert "long_scoreboard 9.5" in mod.to_markdown(dict(case="m7c:8192:2", device="d", torch="t", triton="x",
                                                          date="now", command="ncu", kernels=rows))


def test_fsdp_unit_overhead_table_subtracts_the_step_without_data_parallelism():
    import importlib.util

    path = common.REPO / "benchmarks" / "fsdp_unit_overhead.py"
    spec = importlib.util.spec_from_file_location("fsdp_unit_overhead", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [{"k": "no dp", "step_time_s": 0.100, "tokens_per_s_per_gpu": 1000.0},
            {"k": 1, "units": 12, "step_time_s": 0.250, "tokens_per_s_per_gpu": 400.0},
            {"k": 4, "units": 3, "step_time_s": 0.1375, "tokens_per_s_per_gpu": 727.3},
            {"k": 6, "units": 2, "error": "probe exit 1: boom"}]
    md = mod.to_markdown(dict(tag="t", device="cpu", torch="2", date="now", world=2, warmup=1, steps=2,
                              train_args=["--config", "x.toml"], rows=rows))
    assert "| 1 | 12 | 250.0 | +150.0 | 400 |" in md and "| 4 | 3 | 137.5 | +37.5 | 727 |" in md
    assert "| 6 | - | error: probe exit 1: boom |" in md


def test_dp_rounds_keep_the_median_run_and_report_the_spread():
    slow, mid, fast = fake_row(1, "none", "none", 800.0), fake_row(1, "none", "none", 1000.0), \
        fake_row(1, "none", "none", 1100.0)
    row = dp_compare.merge_rounds([fast, {**slow, "step_time_s": 8192 / 800.0}, mid])
    assert row["tokens_per_s_per_gpu"] == 1000.0 and row["step_time_s"] == mid["step_time_s"]  # one real run
    assert row["rounds_tokens_per_s_per_gpu"] == [1100.0, 800.0, 1000.0] and row["round_spread"] == pytest.approx(0.3)
    # an even count takes the lower middle round; failed rounds are left out but counted
    two = dp_compare.merge_rounds([fast, {"run": "x", "gpus": 1, "error": "exit 1"}, slow])
    assert two["tokens_per_s_per_gpu"] == 800.0 and two["rounds_failed"] == 1
    only_errors = [{"run": "x", "gpus": 1, "error": "out of memory"}, {"run": "x_r2", "gpus": 1, "error": "exit 1"}]
    assert dp_compare.merge_rounds(only_errors)["error"] == "out of memory"
    assert [dp_compare.round_name("ac-none_1gpu", k) for k in (1, 2)] == ["ac-none_1gpu", "ac-none_1gpu_r2"]


def test_dp_compare_interleaves_rounds(tmp_path, monkeypatch):
    """--rounds 2: every cell once, then every cell again (not cell by cell), and one merged row per cell."""
    seen = []

    def fake_run(self, name, gpus, args, fields):
        seen.append(name)
        return fake_row(gpus, fields["data_parallel"], fields["ac"], 1000.0 + len(seen))

    monkeypatch.setattr(common.Runner, "run", fake_run)
    result = dp_compare.main(["--config", "train_configs/debug_model.toml", "--cpu", "--gpus", "1", "--ac",
                              "none,full", "--rounds", "2", "--out", str(tmp_path)])
    assert seen == ["ac-none_1gpu", "ac-full_1gpu", "ac-none_1gpu_r2", "ac-full_1gpu_r2"]
    assert [r["rounds_tokens_per_s_per_gpu"] for r in result["rows"]] == [[1001.0, 1003.0], [1002.0, 1004.0]]
    assert "2 rounds per cell" in (tmp_path / "dp_compare_dp.md").read_text()


def test_ab_profile_compares_rounds_by_median_and_names_the_kernels_that_moved(tmp_path):
    """benchmarks/ab_profile.py's comparison on two rounds of profile_block payloads per tree (an attention case and
    a block case), and its refusal of a baseline that is not a checkout."""
    import importlib.util
    import subprocess
    import sys

    path = common.REPO / "benchmarks" / "ab_profile.py"
    spec = importlib.util.spec_from_file_location("ab_profile", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def payload(attn_ms, sel_ms, block_ms):
        prof = dict(kernel_ms=attn_ms, top=[("_sel_fwd", sel_ms, 1), ("_band_fwd", attn_ms - sel_ms, 2)])
        return dict(attention=[dict(config="1b", T=8192, B=2, profile=prof)],
                    blocks=[dict(flavor="m7c", attn_type="nsa", T=8192, B=2,
                                 profile=dict(kernel_ms=block_ms, top=[("mm", block_ms, 6)]))])

    base = [mod.kernel_times(payload(2.7, 0.57, 4.3)), mod.kernel_times(payload(2.6, 0.56, 4.4))]
    new = [mod.kernel_times(payload(2.5, 0.45, 4.2)), mod.kernel_times(payload(2.55, 0.46, 4.25))]
    rows = {r["case"]: r for r in mod.compare(base, new)}
    attn = rows["attention 1b T=8192 B=2"]
    assert attn["baseline_ms"] == [2.7, 2.6] and attn["new_median"] == 2.525
    assert abs(attn["speedup"] - 2.65 / 2.525) < 1e-12
    assert attn["moved"][0] == dict(kernel="_sel_fwd", baseline=0.565, new=0.455)  # moved most: 0.11 ms
    assert abs(rows["block m7c nsa T=8192 B=2"]["speedup"] - 4.35 / 4.225) < 1e-12
    # profile_block shortens kernel names, so two kernels can share one: their times add up
    twice = dict(attention=[dict(config="m7c", T=8192, B=2, profile=dict(
        kernel_ms=0.06, top=[("cub::Onesweep<..", 0.045, 4), ("cub::Onesweep<..", 0.011, 1), ("fill", 0.004, 1)]))])
    assert mod.kernel_times(twice)["attention m7c T=8192 B=2"]["kernels"]["cub::Onesweep<.."] == 0.045 + 0.011
    md = mod.markdown(list(rows.values()), dict(device="H100", baseline="/tmp/b", rounds=2))
    assert "| attention 1b T=8192 B=2 | 2.700 / 2.600 | 2.500 / 2.550 | 1.050x |" in md
    # written after every round: a call cut short keeps the rounds that both trees finished
    meta = dict(device="H100 x", baseline="/tmp/b", rounds=3)
    partial = mod.write_results(str(tmp_path / "out"), "_t", meta, {"baseline": base, "new": new[:1]})
    assert "1 of 3 interleaved rounds" in partial and "| 2.700 | 2.500 |" in partial
    saved = json.loads((tmp_path / "out" / "ab_profile_t_H100_x.json").read_text())
    assert saved["rounds_done"] == 1 and len(saved["rounds"]["baseline"]) == 2
    mod.write_results(str(tmp_path / "out2"), "t", meta, {"baseline": base, "new": new})  # a tag without its "_"
    assert [f.name for f in sorted((tmp_path / "out2").iterdir())] == ["ab_profile_t_H100_x.json",
                                                                         "ab_profile_t_H100_x.md"]
    res = subprocess.run([sys.executable, str(path), "--baseline", str(tmp_path), "--attention", "1b"],
                         capture_output=True, text=True)
    assert res.returncode != 0 and "no benchmarks/profile_block.py there" in res.stderr


def test_whole_model_table_judges_a_target_only_against_a_dense_run():
    """benchmarks/whole_model_table.py: an NSA row whose command ran no dense variant is marked '(no dense run)', not
    'missed'; with a dense run of the same compile mode the ratio decides met / missed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("whole_model_table",
                                                  common.REPO / "benchmarks" / "whole_model_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def row(variant, tps):
        return dict(variant=variant, last_window_tokens_per_s_per_gpu=tps, model=dict(flavor="m7c"),
                    training=dict(seq_len=8192, local_batch_size=2), peak_mem_gib=7.5)

    alone = mod.ratio_rows(dict(tag="paths", rows=[row("triton_compile_cg", 300e3), row("torch_compile_cg", 100e3)]))
    paired = mod.ratio_rows(dict(tag="pair", rows=[row("triton_compile_cg", 300e3), row("dense_compile_cg", 360e3),
                                                   row("triton_compile", 380e3), row("dense_compile", 370e3)]))
    md = mod.markdown(alone + paired, dict(device="H100", torch="t", triton="x"))
    assert md.count(">= 1.0 (no dense run)") == 2 and "missed | 7.5 | - | paths" not in md
    assert "| 0.8333 | >= 1.0 missed |" in md and "| 1.0270 | >= 1.0 met |" in md
    # Four decimals: a ratio just under the target does not print as the target.
    close = mod.ratio_rows(dict(tag="close", rows=[row("triton_compile_cg", 366.8e3), row("dense_compile_cg", 367e3)]))
    assert "| 0.9995 | >= 1.0 missed | 1 |" in mod.markdown(close, dict(device="H100", torch="t", triton="x"))
    # Rounds (bench_train.py --rounds): NSA and dense paired by round, the median of the rounds' ratios (not the
    # ratio of the medians), their range, and the median tokens/s; a round whose dense run failed has no pair.
    three = [dict(row("triton_compile_cg", nsa), round=i) for i, nsa in ((1, 330e3), (2, 340e3), (3, 345e3))]
    dense = [dict(row("dense_compile_cg", d), round=i) for i, d in ((1, 370e3), (2, 340e3), (3, 360e3))]
    (r,) = mod.ratio_rows(dict(tag="rounds", rows=three + dense + [dict(variant="dense_compile_cg", round=4,
                                                                        error="exit code 1")]))
    assert (r["nsa_tokens_per_s"], r["dense_tokens_per_s"], r["rounds"]) == (340e3, 360e3, 3)
    assert r["ratio"] == 345e3 / 360e3 and (r["ratio_min"], r["ratio_max"]) == (330e3 / 370e3, 1.0)
    assert "| 0.9583 | >= 1.0 missed | 3: 0.8919-1.0000 |" in mod.markdown([r], dict(device="H", torch="t", triton="x"))


def test_bench_attention_table_marks_rows_whose_wall_time_is_host_bound(tmp_path):
    """bench_attention.py's kernel table gives each row's GPU kernel time beside its wall time and marks a row whose
    wall time is above HOST_BOUND times its kernels' (an eager op bound by its launches), and only that row."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_attention", common.REPO / "benchmarks" / "bench_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = dict(nsa_fwd_ms=0.8, sdpa_fwd_ms=0.3, sdpa_fwdbwd_ms=1.0, speedup_fwd=0.4, speedup_fwdbwd=0.5)
    payload = dict(device="H100 x", torch="t", triton="r", date="d", note="three runs, merged", bench=[
        dict(row, config="m7c", T=8192, nsa_fwdbwd_ms=2.1, nsa_fwdbwd_kernel_ms=1.3),
        dict(row, config="m7c", T=32768, nsa_fwdbwd_ms=6.0, nsa_fwdbwd_kernel_ms=5.9),
        dict(row, config="1b", T=8192, nsa_fwdbwd_ms=2.5)])  # an older run's JSON: no kernel time
    mod.write(str(tmp_path), payload)
    lines = (tmp_path / "attention_H100_x.md").read_text().splitlines()
    assert lines[2].endswith("for the analysis. three runs, merged")  # a merged table says so in its header
    rows = {tuple(x.split(" | ")[:2]): x for x in lines if x.startswith("| m7c") or x.startswith("| 1b")}
    assert "| 1.30 (host-bound) |" in rows[("| m7c", "8192")]
    assert "| 5.90 |" in rows[("| m7c", "32768")] and "host-bound" not in rows[("| m7c", "32768")]
    assert "host-bound" not in rows[("| 1b", "8192")] and "| 2.50 | - |" in rows[("| 1b", "8192")]


def test_bench_train_from_json_rewrites_the_markdown_of_a_run(tmp_path, monkeypatch):
    """bench_train.py --from-json: the markdown of a run whose device call brought back only its JSON, with the
    same rows (a failed variant included) as the run itself writes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_train", common.REPO / "benchmarks" / "bench_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ok = dict(variant="triton_compile_cg", tokens_per_s=231862.4, last_window_tokens_per_s_per_gpu=323570.0,
              mfu=0.129, gpu_busy=0.994, peak_mem_gib=7.41, initial_loss=5.92, final_loss=2.85)
    result = dict(tag="m7c_x", device="H100", torch="t", triton="r", date="2026-11-26T18:00:00+00:00",
                  notes=["a note"], rows=[ok, dict(variant="dense_compile_cg", error="exit code 2")])
    (tmp_path / "train_m7c_x.json").write_text(json.dumps(result))
    monkeypatch.setattr("sys.argv", ["bench_train.py", "--from-json", str(tmp_path / "train_m7c_x.json")])
    mod.main()
    md = (tmp_path / "train_m7c_x.md").read_text()
    assert md.startswith("# Training throughput: m7c_x (H100, torch t, triton r, 2026-11-26)")
    assert "| triton_compile_cg | 231,862 | 323,570 | 12.9% | 99.4% | 7.4 | 5.92 -> 2.85 |" in md
    assert "| dense_compile_cg | failed: exit code 2 | | | | | |" in md and md.rstrip().endswith("a note")


def test_bench_train_rounds_alternate_the_order_and_name_each_row_s_round(tmp_path, monkeypatch):
    """bench_train.py --rounds R runs the variant list R times, every other round reversed (a drift during the
    command moves every variant alike), and its rows and markdown name their round; --rounds 0 is refused."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_train", common.REPO / "benchmarks" / "bench_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ran = []

    def fake_run(config, steps, name, extra):
        ran.append(name)
        return dict(variant=name, tokens_per_s=1.0 + len(ran), last_window_tokens_per_s_per_gpu=2.0, mfu=0.1,
                    gpu_busy=0.9, peak_mem_gib=1.0, initial_loss=5.0, final_loss=4.0)

    monkeypatch.setattr(mod, "train_run", fake_run)
    monkeypatch.setattr(mod, "environment", lambda: dict(device="H100", torch="t", triton="r"))
    argv = ["bench_train.py", "--variants", "triton_compile_cg,dense_compile_cg", "--tag", "r", "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", [*argv, "--rounds", "3"])
    mod.main()
    assert ran == ["triton_compile_cg", "dense_compile_cg", "dense_compile_cg", "triton_compile_cg",
                   "triton_compile_cg", "dense_compile_cg"]
    rows = json.loads((tmp_path / "train_r.json").read_text())["rows"]
    assert [(x["variant"][0], x["round"]) for x in rows] == [("t", 1), ("d", 1), ("d", 2), ("t", 2), ("t", 3), ("d", 3)]
    md = (tmp_path / "train_r.md").read_text()
    assert "| variant | round | tokens/s" in md and "| dense_compile_cg | 2 | 4 | 2 |" in md
    monkeypatch.setattr("sys.argv", [*argv, "--rounds", "0"])
    with pytest.raises(SystemExit, match="--rounds 0: give 1 or more"):
        mod.main()


def test_bench_window_table_lists_the_paths_that_ran_with_their_determinism():
    """bench_window.py's markdown has a column per path that ran (a subset from --paths leaves the others out), and
    says per path whether its two backward runs were bitwise equal."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_window", common.REPO / "benchmarks" / "bench_window.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = dict(config="m7c", T=8192, B=2, band_ms=0.9, band_err=0.0, band_det=True, torch_flash_ms=0.7,
               torch_flash_err=2e-3, torch_flash_det=False, fastest="torch_flash")
    md = mod.to_markdown(dict(device="H100", torch="t", triton="r", date="d", window=512, rows=[row]))
    header = next(x for x in md.splitlines() if x.startswith("| config"))
    assert "band ms | torch_flash ms |" in header and "flex" not in header and "band det | torch_flash det" in header
    assert "| 0.900 | 0.700 | 0.0e+00 | 2.0e-03 | yes | no | torch_flash |" in md


def _load_benchmark(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, common.REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("ac", ["none", "full"])
def test_roofline_splits_a_whole_model_row_into_attention_and_the_rest(ac):
    """benchmarks/roofline_whole_model.py: with the rest of the step R per token and the kernel table's times, a dense
    row of R + L * (SDPA f+b [+ SDPA fwd under full AC]) / T and an NSA row of R + L * (NSA kernels [+ NSA fwd]) / T
    give R back from both rows (their ratio 1); the attention speed-up the 8k target needs is NSA's attention time
    over dense's; the best case at SDPA's FLOP rate is R + NSA's useful FLOPs at that rate. A mode with no known
    recompute is refused."""
    pytest.importorskip("triton")
    mod = _load_benchmark("roofline_whole_model")
    L, T, rest = 2, 8192, 10e-6
    k = dict(config="1b", T=T, sdpa_fwdbwd_ms=2.0, sdpa_fwd_ms=0.5, nsa_fwdbwd_ms=3.0, nsa_fwdbwd_kernel_ms=2.5,
             nsa_fwd_ms=0.6)
    rc = 1.0 if ac == "full" else 0.0
    a_dense = L * (2.0 + rc * 0.5) / 1e3 / T
    a_nsa = L * (2.5 + rc * 0.6) / 1e3 / T
    args = dict(n_layers=L, n_heads=16, n_kv_heads=1, head_dim=128, v_head_dim=None, cmp_block=32, cmp_stride=16,
                slc_block=64, slc_top_n=16, window=512)

    def row(variant, seconds_per_token):
        return dict(variant=variant, last_window_tokens_per_s_per_gpu=1 / seconds_per_token,
                    model=dict(flavor="1b", args=args), training=dict(seq_len=T, local_batch_size=2),
                    activation_checkpoint=dict(mode=ac))

    result = dict(tag="t", rows=[row("triton_compile_cg", rest + a_nsa), row("dense_compile_cg", rest + a_dense)])
    (r,) = mod.roofline_rows(result, dict(bench=[k]))
    assert r["attention_config"] == "1b" and r["ac_full"] == (ac == "full")
    assert r["rest_nsa_over_dense"] == pytest.approx(1.0, rel=1e-9)
    assert r["rest_us_per_token"] == pytest.approx(rest * 1e6, rel=1e-9)
    assert r["measured_ratio"] == pytest.approx((rest + a_dense) / (rest + a_nsa), rel=1e-9)
    assert r["needed_attention_speedup"] == pytest.approx(a_nsa / a_dense, rel=1e-9)  # target 1.0 at 8k
    cfg = mod.CONFIGS["1b"]
    best = L * (mod.flops(T, cfg, False) / (mod.sdpa_flops(T, cfg, False) / 2.0e-3)
                + rc * mod.flops(T, cfg, True) / (mod.sdpa_flops(T, cfg, True) / 0.5e-3)) / T
    assert r["best_ratio_at_sdpa_rate"] == pytest.approx((rest + a_dense) / (rest + best), rel=1e-9)
    bad = dict(tag="t", rows=[dict(row("triton_compile_cg", 1e-5), activation_checkpoint=dict(mode="ratio")),
                              row("dense_compile_cg", 1e-5)])
    with pytest.raises(ValueError, match="only 'none' and 'full'"):
        mod.roofline_rows(bad, dict(bench=[k]))
    assert "no kernel-table row" in mod.roofline_rows(result, dict(bench=[dict(k, T=4096)]))[0]["skipped"]


def test_correlated_queries_are_a_unit_variance_ar1_along_t():
    """benchmarks/attention_checks.correlated_along_t (sweep_selected.py --q-corr): each value stays N(0, 1), the
    lag-1 and lag-3 correlations along T are corr and corr^3 (not across heads or batch rows), 0 returns the input,
    and a correlation of 1 or more is refused."""
    pytest.importorskip("triton")
    mod = _load_benchmark("attention_checks")
    x = torch.randn(2, 20000, 3, 4, generator=torch.Generator().manual_seed(0))
    assert mod.correlated_along_t(x, 0.0) is x
    y = mod.correlated_along_t(x, 0.8)
    assert y.shape == x.shape
    assert float(y.var()) == pytest.approx(1.0, abs=0.05) and float(y[:, :5].var()) == pytest.approx(1.0, abs=0.35)

    def lag_corr(z, k):
        a, b = z[:, k:].flatten(), z[:, :-k].flatten()
        return float(((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std()))

    assert lag_corr(y, 1) == pytest.approx(0.8, abs=0.02) and lag_corr(y, 3) == pytest.approx(0.512, abs=0.02)
    assert abs(float((y[:, :, 0] * y[:, :, 1]).mean())) < 0.05  # heads stay independent
    with pytest.raises(ValueError, match="0 <= q_corr < 1"):
        mod.correlated_along_t(x, 1.0)
