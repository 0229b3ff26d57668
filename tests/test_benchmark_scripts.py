"""The benchmark scripts' own logic on CPU, without a GPU: their tables and reports from hand-made payloads
(benchmarks/*.py are scripts, loaded here by path), and bench_train.py's run order."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from nsa_titan.experiments import common


def _load_benchmark(name):
    spec = importlib.util.spec_from_file_location(name, common.REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_analyze_trace_reports_what_the_fsdp2_ac_hypotheses_need(tmp_path):
    """A hand-made trace of one step (times in microseconds): every number below is worked out by hand."""
    mod = _load_benchmark("analyze_trace")

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
    mod = _load_benchmark("ncu_attention")
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
    mod = _load_benchmark("fsdp_unit_overhead")
    rows = [{"k": "no dp", "step_time_s": 0.100, "tokens_per_s_per_gpu": 1000.0},
            {"k": 1, "units": 12, "step_time_s": 0.250, "tokens_per_s_per_gpu": 400.0},
            {"k": 4, "units": 3, "step_time_s": 0.1375, "tokens_per_s_per_gpu": 727.3},
            {"k": 6, "units": 2, "error": "probe exit 1: boom"}]
    md = mod.to_markdown(dict(tag="t", device="cpu", torch="2", date="now", world=2, warmup=1, steps=2,
                              train_args=["--config", "x.toml"], rows=rows))
    assert "| 1 | 12 | 250.0 | +150.0 | 400 |" in md and "| 4 | 3 | 137.5 | +37.5 | 727 |" in md
    assert "| 6 | - | error: probe exit 1: boom |" in md


def test_ab_profile_compares_rounds_by_median_and_names_the_kernels_that_moved(tmp_path):
    """benchmarks/ab_profile.py's comparison on two rounds of profile_block payloads per tree (an attention case and
    a block case), and its refusal of a baseline that is not a checkout."""
    path = common.REPO / "benchmarks" / "ab_profile.py"
    mod = _load_benchmark("ab_profile")

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
    mod = _load_benchmark("whole_model_table")

    def row(variant, tps):
        return dict(variant=variant, last_window_tokens_per_s_per_gpu=tps, model=dict(flavor="m7c"),
                    training=dict(seq_len=8192, local_batch_size=2), peak_mem_gib=7.5)

    alone = mod.ratio_rows(dict(tag="paths", rows=[row("triton_compile_cg", 300e3), row("torch_compile_cg", 100e3)]))
    paired = mod.ratio_rows(dict(tag="pair", rows=[row("triton_compile_cg", 300e3), row("dense_compile_cg", 360e3),
                                                   row("triton_compile", 380e3), row("dense_compile", 370e3)]))
    md = mod.markdown(alone + paired, dict(device="H100", torch="t", triton="x"))
    assert md.count(">= 1.0 (no dense run)") == 2 and "missed | 7.5 | - | paths" not in md
    assert "| 0.8333 | >= 1.0 missed |" in md and "| 1.0270 | >= 1.0 met |" in md
    # The step graph (compile.step_graph) is its own mode: its NSA run is divided by the dense step-graph run.
    graphs = mod.ratio_rows(dict(tag="sg", rows=[row("triton_compile_cg", 350e3), row("dense_compile_cg", 368e3),
                                                 row("triton_compile_sg", 352e3), row("dense_compile_sg", 320e3)]))
    assert [(r["variant"], r["dense_variant"], r["ratio"]) for r in graphs] == [
        ("triton_compile_cg", "dense_compile_cg", 350 / 368), ("triton_compile_sg", "dense_compile_sg", 352 / 320)]
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
    mod = _load_benchmark("bench_attention")
    row = dict(nsa_fwd_ms=0.8, sdpa_fwd_ms=0.3, sdpa_fwdbwd_ms=1.0, speedup_fwd=0.4, speedup_fwdbwd=0.5)
    payload = dict(device="H100 x", torch="t", triton="r", date="d", note="three runs, merged", bench=[
        dict(row, config="m7c", T=8192, nsa_fwdbwd_ms=2.1, nsa_fwdbwd_kernel_ms=1.3),
        dict(row, config="m7c", T=32768, nsa_fwdbwd_ms=6.0, nsa_fwdbwd_kernel_ms=5.9),
        dict(row, config="1b", T=8192, nsa_fwdbwd_ms=2.5),  # an older run's JSON: no kernel time
        dict(row, config="qwen7b", T=4096, nsa_fwdbwd_ms=3.8, nsa_fwdbwd_kernel_ms=2.2, nsa_fwdbwd_graph_ms=2.31)])
    mod.write(str(tmp_path), payload)
    lines = (tmp_path / "attention_H100_x.md").read_text().splitlines()
    assert lines[2].endswith("for the analysis. three runs, merged")  # a merged table says so in its header
    rows = {tuple(x.split(" | ")[:2]): x for x in lines if x.startswith("| m7c") or x.startswith("| 1b")}
    assert "| 1.30 (host-bound) |" in rows[("| m7c", "8192")]
    assert "| 5.90 |" in rows[("| m7c", "32768")] and "host-bound" not in rows[("| m7c", "32768")]
    assert "host-bound" not in rows[("| 1b", "8192")] and "| 2.50 | - |" in rows[("| 1b", "8192")]
    qwen = next(x for x in lines if x.startswith("| qwen7b | 4096"))
    assert "| 2.20 (host-bound; graph 2.31) |" in qwen  # a host-bound row replayed from a CUDA graph too


def test_bench_train_from_json_rewrites_the_markdown_of_a_run(tmp_path, monkeypatch):
    """bench_train.py --from-json: the markdown of a run whose device call brought back only its JSON, with the
    same rows (a failed variant included) as the run itself writes."""
    mod = _load_benchmark("bench_train")
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


def test_bench_train_rows_keep_each_training_log_window_and_skip_validation_records(tmp_path):
    """bench_train.log_windows: every training log window's step, tokens/s per GPU and loss from the trainer's
    metrics.jsonl in a run's dump folder, in step order; validation records (no throughput) are left out, and a
    folder without the file gives []."""
    mod = _load_benchmark("bench_train")
    records = [dict(type="train", step=5, window_steps=4, tokens_per_s_per_gpu=3.5e5, loss=3.1),
               dict(type="train", step=1, window_steps=1, tokens_per_s_per_gpu=900.0, loss=5.9),
               dict(type="val", step=5, loss=3.0, perplexity=20.1),
               dict(type="train", step=10, window_steps=5, tokens_per_s_per_gpu=3.4e5, loss=2.8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert mod.log_windows(tmp_path) == [
        dict(step=1, tokens_per_s_per_gpu=900.0, loss=5.9), dict(step=5, tokens_per_s_per_gpu=3.5e5, loss=3.1),
        dict(step=10, tokens_per_s_per_gpu=3.4e5, loss=2.8)]
    assert mod.log_windows(tmp_path / "elsewhere") == []


def test_bench_train_rounds_alternate_the_order_and_name_each_row_s_round(tmp_path, monkeypatch):
    """bench_train.py --rounds R runs the variant list R times, every other round reversed (a drift during the
    command moves every variant alike), and its rows and markdown name their round; --rounds 0 is refused."""
    mod = _load_benchmark("bench_train")
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
    mod = _load_benchmark("bench_window")
    row = dict(config="m7c", T=8192, B=2, band_ms=0.9, band_err=0.0, band_det=True, torch_flash_ms=0.7,
               torch_flash_err=2e-3, torch_flash_det=False, fastest="torch_flash")
    md = mod.to_markdown(dict(device="H100", torch="t", triton="r", date="d", window=512, rows=[row]))
    header = next(x for x in md.splitlines() if x.startswith("| config"))
    assert "band ms | torch_flash ms |" in header and "flex" not in header and "band det | torch_flash det" in header
    assert "| 0.900 | 0.700 | 0.0e+00 | 2.0e-03 | yes | no | torch_flash |" in md



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


def test_write_table_names_the_files_by_device_and_writes_one_table(tmp_path):
    """attention_checks.write_table: <stem>_<device with underscores>.json holds the payload, .md the title with the
    device, the versions and date line with the note, and the table."""
    mod = _load_benchmark("attention_checks")
    payload = dict(device="NVIDIA H100 80GB HBM3", torch="2.11", triton="3.6", date="2026-11-27T12:00:00", rows=[1])
    mod.write_table(str(tmp_path), "probe", payload, "A probe", "m7c shapes.", ["a", "b"], [["1", "x"], ["2", "y"]])
    stem = tmp_path / "probe_NVIDIA_H100_80GB_HBM3"
    assert json.loads(stem.with_suffix(".json").read_text()) == payload
    want = ("# A probe: NVIDIA H100 80GB HBM3\n\ntorch 2.11, triton 3.6, 2026-11-27; m7c shapes.\n\n"
            "| a | b |\n|---|---|\n| 1 | x |\n| 2 | y |\n")
    assert stem.with_suffix(".md").read_text() == want


def test_bench_attention_targets_give_the_kernel_ratio_of_host_bound_rows_only():
    """The m7c / qwen7b target lines judge wall times; a host-bound row (batch 1, eager launches) also gets SDPA's
    wall time over NSA's kernel time, what a CUDA-graphed step pays, and a row that is not host-bound does not."""
    mod = _load_benchmark("bench_attention")
    rows = [dict(config="m7c", T=8192, nsa_fwdbwd_ms=3.74, nsa_fwdbwd_kernel_ms=1.11, sdpa_fwdbwd_ms=0.98,
                 speedup_fwdbwd=0.98 / 3.74),
            dict(config="m7c", T=32768, nsa_fwdbwd_ms=5.33, nsa_fwdbwd_kernel_ms=5.27, sdpa_fwdbwd_ms=13.09,
                 speedup_fwdbwd=13.09 / 5.33)]
    line = next(x for x in mod.targets(rows) if x.startswith("- m7c fwd+bwd vs SDPA"))
    assert "8k 0.26x (host-bound; SDPA wall / NSA kernels 0.88x) vs >= 1x: MISSED by 3.82x" in line
    assert "32k 2.46x vs >= 4x: MISSED by 1.63x" in line
    rows[0].update(nsa_fwdbwd_graph_ms=1.2, sdpa_fwdbwd_graph_ms=0.96)  # both replayed from CUDA graphs as well
    line = next(x for x in mod.targets(rows) if x.startswith("- m7c fwd+bwd vs SDPA"))
    assert ("8k 0.26x (host-bound; SDPA wall / NSA kernels 0.88x; both replayed from CUDA graphs 0.80x (1.20 / 0.96 "
            "ms)) vs >= 1x: MISSED by 3.82x") in line


def test_step_graph_probe_dry_run_restores_the_state_it_checks(tmp_path):
    """step_graph_probe.py (a GPU probe) on the CPU without the graph: it builds the model as the trainer does, times
    eager steps, and its state check (save, step, restore, step again) finds the two steps from one state equal. With
    the restore broken the same check must say so: a patched copy that skips it reports a mismatch."""
    probe = common.REPO / "benchmarks" / "step_graph_probe.py"
    broken = tmp_path / "probe_no_restore.py"
    src = probe.read_text()
    assert "            t.copy_(s)\n" in src
    broken.write_text(src.replace("            t.copy_(s)\n", "            pass\n"))
    results = {}
    for name, script in (("probe", probe), ("broken", broken)):
        proc = subprocess.run(
            [sys.executable, str(script), "--config", str(common.REPO / "train_configs" / "debug_model.toml"), "--cpu",
             "--steps", "1", "--warmup", "1", "--out", str(tmp_path), "--tag", name, "--",
             "--training.seq_len", "64", "--training.local_batch_size", "1"],
            capture_output=True, text=True, timeout=300, cwd=common.REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = json.loads((tmp_path / f"step_graph_{name}.json").read_text())
    assert "graph_error" not in results["probe"], results["probe"].get("graph_traceback")
    assert results["probe"]["replay_loss_equal"] and results["probe"]["replay_params_equal"]
    assert not results["broken"]["replay_params_equal"]
    assert results["probe"]["eager_step_s"] > 0 and len(results["probe"]["eager_losses"]) == 1


def test_step_graph_probe_refuses_profiling_without_a_gpu(tmp_path):
    """--profile and --trace read kernels from graph replays, which the CPU dry run does not make: an error that names
    the fix, not a run that silently profiles nothing."""
    proc = subprocess.run(
        [sys.executable, str(common.REPO / "benchmarks" / "step_graph_probe.py"), "--config",
         str(common.REPO / "train_configs" / "debug_model.toml"), "--cpu", "--profile", "2", "--out", str(tmp_path),
         "--tag", "x"], capture_output=True, text=True, timeout=120, cwd=common.REPO)
    assert proc.returncode == 2 and "leave them out with --cpu" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_cmp_fold_sdpa_folds_the_compressed_branch_into_plain_causal_attention():
    """The fold that attempt 104 timed computes the compressed branch exactly: float64, T not a multiple of d."""
    fold = _load_benchmark("cmp_fold_sdpa")
    D_STRIDE, L, folded_attention = fold.D_STRIDE, fold.L, fold.folded_attention  # noqa: N806 - the module's names
    torch.manual_seed(0)
    b, t, hq, hkv, d = 2, 131, 6, 2, 8
    tc = (t - L) // D_STRIDE + 1
    q = torch.randn(b, t, hq, d, dtype=torch.float64)
    k, v = torch.randn(2, b, tc, hkv, d, dtype=torch.float64)
    seen = torch.arange(tc)[None] * D_STRIDE + L - 1 <= torch.arange(t)[:, None]  # [T, Tc]: key i visible to t
    s = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(hq // hkv, 2)) / d**0.5
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)  # rows that see nothing: zeros
    ref = torch.einsum("bhts,bshd->bthd", p, v.repeat_interleave(hq // hkv, 2))
    torch.testing.assert_close(folded_attention(q, k, v, hkv), ref, rtol=1e-12, atol=1e-12)


def _probe(step_s, kernel_ms, categories, tokens=4096):
    return {"tag": "t", "device": "GPU", "torch": "2.x", "date": "2026-11-28T00:00:00+00:00", "graph_step_s": step_s,
            "tokens_per_step_per_rank": tokens, "replay_profile": {"kernel_ms": kernel_ms, "categories": categories}}


def test_bounds_report_splits_steps_and_prices_the_target(tmp_path):
    """Hand-made replay profiles: dense 100 ms (SDPA 60, rest 40 of kernels), NSA 50 ms (attention kernels 12 + 8 + 2
    + 1, rest 30). Every number below is worked out by hand from them."""
    mod = _load_benchmark("bounds_report")
    dense = _probe(0.100, 100.0, {"sdpa/flash": 60.0, "matmul": 35.0, "other": 5.0})
    nsa = _probe(0.050, 53.0, {"nsa: compressed/window": 12.0, "nsa: selected": 8.0, "nsa: select": 2.0,
                               "nsa: combine/rowdot": 1.0, "matmul": 28.0, "other": 2.0})
    (tmp_path / "d.json").write_text(json.dumps(dense))
    (tmp_path / "n.json").write_text(json.dumps(nsa))
    rep = mod.main(["--flavor", "debug", "--seq", "1024", "--target", "2.5", "--dense", str(tmp_path / "d.json"),
                    "--nsa", str(tmp_path / "n.json"), "--variant", f"NSA again={tmp_path / 'n.json'}",
                    "--out", str(tmp_path), "--tag", "t"])
    b = rep["bounds"]
    assert [r["rest_ms"] for r in rep["rows"]] == pytest.approx([40.0, 30.0, 30.0])
    assert b["ratio"] == pytest.approx(2.0)
    assert b["ceiling_free_attention"] == pytest.approx(100 / 30)
    assert b["attention_now_ms"] == pytest.approx(20.0)  # 50 - 30: the step, not the kernels' overlapping sum
    assert b["nsa_step_needed_ms"] == pytest.approx(40.0)
    assert b["attention_needed_ms"] == pytest.approx(10.0)
    assert b["attention_speedup_needed"] == pytest.approx(2.0)
    f = b["useful_tflop"]
    assert b["useful_tflops_per_s"]["nsa_now"] == pytest.approx(f["nsa"] / 20.0 * 1e3)
    assert b["useful_tflops_per_s"]["sdpa"] == pytest.approx(f["dense"] / 60.0 * 1e3)
    md = (tmp_path / "bounds_t.md").read_text()
    assert "| NSA (debug) | 50.0 | 30.0 | 12.0; 2.0; 8.0; 1.0 | 2.000x |" in md  # profile_block.CATEGORIES order
    assert "**2.00x** faster attention" in md
    assert json.loads((tmp_path / "bounds_t.json").read_text())["rows"][2]["label"] == "NSA again"
    # a target the rest alone cannot reach (100 / 30 = 3.33x at most) is said to be out of reach
    out = mod.bounds(mod.split_step(dense), mod.split_step(nsa), 4.0, f)
    assert out["attention_speedup_needed"] is None and out["useful_tflops_per_s"]["nsa_needed"] is None


def test_bounds_report_attention_flops_follow_the_flops_module():
    """NSA's training attention FLOPs per token: forward (with the selection's QK^T) once, twice under full AC, plus a
    backward 2.5x the forward attention; dense alike without a selection."""
    mod = _load_benchmark("bounds_report")
    from nsa_titan.models.nsa.args import get_model_args
    from nsa_titan.models.nsa.flops import forward_flops_breakdown, mean_keys_per_query

    args = get_model_args("debug")
    fwd = sum(v for k, v in forward_flops_breakdown(args, 2048).items() if k.startswith("attn_"))
    sel = args.n_layers * 2.0 * args.head_dim * args.n_heads * mean_keys_per_query(args, 2048)["cmp"]
    none, full = mod.attention_tflop("debug", 2048, 1000, False), mod.attention_tflop("debug", 2048, 1000, True)
    assert none["nsa"] == pytest.approx((fwd + sel + 2.5 * fwd) * 1000 / 1e12)
    assert full["nsa"] - none["nsa"] == pytest.approx((fwd + sel) * 1000 / 1e12)
    dense_args = get_model_args("debug", attn_type="dense")
    dfwd = sum(v for k, v in forward_flops_breakdown(dense_args, 2048).items() if k.startswith("attn_"))
    assert none["dense"] == pytest.approx(3.5 * dfwd * 1000 / 1e12)


def test_bounds_report_executed_flops_count_the_deterministic_backward_and_the_selected_dq_form(tmp_path):
    """Executed = the forwards (with the selection) + 7 backward units per 2 forward units for the band branches and
    5 (dQ from stored dS) or 7 (recomputed) for the selected branch; the form follows the dS buffer's bytes against
    dq_buffer_gib. --from-json rewrites an earlier report with it."""
    mod = _load_benchmark("bounds_report")
    from nsa_titan.models.nsa.args import get_model_args
    from nsa_titan.models.nsa.flops import forward_flops_breakdown, mean_keys_per_query

    args = get_model_args("1b")
    parts = forward_flops_breakdown(args, 32768)
    sel = args.n_layers * 2.0 * args.head_dim * args.n_heads * mean_keys_per_query(args, 32768)["cmp"]
    fwd = parts["attn_cmp"] + parts["attn_slc"] + parts["attn_win"]
    # the 1b's dS: tokens x 16 heads x 16 slots x 64 keys x 2 B = 2 GiB at 65536 tokens, its budget
    assert mod.selected_dq_form("1b", 65536) == "ds" and mod.selected_dq_form("1b", 65537) == "recompute"
    got = mod.attention_tflop("1b", 32768, 32768, False)
    band = 3.5 * (parts["attn_cmp"] + parts["attn_win"])
    assert got["nsa_executed"] == pytest.approx((fwd + sel + band + 2.5 * parts["attn_slc"]) * 32768 / 1e12)
    assert got["nsa_executed"] - got["nsa"] == pytest.approx((parts["attn_cmp"] + parts["attn_win"]) * 32768 / 1e12)
    rc = mod.attention_tflop("1b", 32768, 4 * 32768, True)  # 128k tokens: dQ recomputed; full AC: forwards twice
    assert rc["nsa_executed"] == pytest.approx((2 * (fwd + sel) + band + 3.5 * parts["attn_slc"]) * 4 * 32768 / 1e12)

    dense = _probe(0.100, 100.0, {"sdpa/flash": 60.0, "matmul": 40.0}, tokens=32768)
    nsa = _probe(0.050, 50.0, {"nsa: compressed/window": 12.0, "nsa: selected": 8.0, "matmul": 30.0}, tokens=32768)
    (tmp_path / "d.json").write_text(json.dumps(dense))
    (tmp_path / "n.json").write_text(json.dumps(nsa))
    first = mod.main(["--flavor", "1b", "--seq", "32768", "--target", "2.0", "--dense", str(tmp_path / "d.json"),
                      "--nsa", str(tmp_path / "n.json"), "--out", str(tmp_path), "--tag", "a"])
    e = first["bounds"]["executed_tflops_per_s"]
    assert e["nsa_now"] == pytest.approx(got["nsa_executed"] / 20.0 * 1e3)  # attention 50 - 30 ms
    assert e["nsa_needed"] == pytest.approx(got["nsa_executed"] / 20.0 * 1e3)  # needs 100 / 2 - 30 ms
    old = json.loads((tmp_path / "bounds_a.json").read_text())
    del old["bounds"]["executed_tflops_per_s"], old["bounds"]["useful_tflop"]["nsa_executed"]  # a report before it
    (tmp_path / "old.json").write_text(json.dumps(old))
    again = mod.main(["--from-json", str(tmp_path / "old.json"), "--out", str(tmp_path), "--tag", "b"])
    assert again["bounds"] == first["bounds"]
    ratio = e["nsa_needed"] / first["bounds"]["useful_tflops_per_s"]["sdpa"]
    assert f"= **{ratio:.0%} of SDPA's rate** in the same step." in (tmp_path / "bounds_b.md").read_text()
    with pytest.raises(SystemExit, match="--target, --dense"):
        mod.main(["--flavor", "1b", "--seq", "32768", "--nsa", str(tmp_path / "n.json")])


def _summary(peak, params, attn_type="nsa", seq=65536, ac="full", gpus=1, optimizer="adamw"):
    return {"peak_mem_gib": peak, "tokens_per_s": 100.0 * gpus, "tokens_per_s_per_gpu": 100.0, "device": "GPU X",
            "torch": "2.x", "triton": "3.x", "date": "2026-12-06",
            "model": {"params_with_embedding": params, "args": {"attn_type": attn_type, "compress": "mlp",
                                                                "shared_kv": False}},
            "config": {"optimizer": {"name": optimizer}, "training": {"seq_len": seq},
                       "activation_checkpoint": {"mode": ac}}}


def test_memory_bound_prices_extra_parameters_at_their_state_bytes(tmp_path):
    """Dense 10 GiB with 1M parameters; an NSA run with 2^30 / 12 * 3 more parameters carries 3 GiB more state, so it is
    predicted at 13 GiB and a measured 13.5 GiB leaves +0.5 GiB of activations. Other lengths, AC modes, GPU counts and
    optimizers are refused with the fix."""
    mod = _load_benchmark("memory_bound")
    extra = 3 * 2**30 // 12
    paths = {}
    for name, s in {"d": _summary(10.0, 10**6, "dense"), "n": _summary(13.5, 10**6 + extra),
                    "len": _summary(13.5, 10**6 + extra, seq=8192), "dp": _summary(13.5, 10**6 + extra, gpus=2),
                    "opt": _summary(13.5, 10**6 + extra, optimizer="lion")}.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(s))
    mod.main(["--baseline", str(paths["d"]), str(paths["n"]), "--out", str(tmp_path), "--tag", "t"])
    row = json.loads((tmp_path / "memory_bound_t.json").read_text())["runs"][0]
    assert row["extra_params"] == extra
    assert row["extra_state_gib"] == pytest.approx(3.0)
    assert row["predicted_gib"] == pytest.approx(13.0)
    assert row["residual_gib"] == pytest.approx(0.5)
    assert "| NSA (compress mlp) | 269,435,456 | 268,435,456 | 13.500 | +3.500 | 3.000 | 13.000 | +0.5000 |" in (
        tmp_path / "memory_bound_t.md").read_text()
    for bad, words in (("len", "one length and AC mode"), ("dp", "pass one-GPU runs"), ("opt", "no state size")):
        with pytest.raises(SystemExit, match=words):
            mod.main(["--baseline", str(paths["d"]), str(paths[bad])])


def test_memory_bound_state_bytes_are_what_the_trainer_s_adamw_holds():
    """The 12 B per parameter the bound charges: the trainer's AdamW (components/optimizer.py) after one step holds an
    fp32 master weight and two fp32 moments per parameter, nothing else of parameter size."""
    from nsa_titan.components.optimizer import build_optimizer
    from nsa_titan.config.job_config import Optimizer

    mod = _load_benchmark("memory_bound")
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 24), torch.nn.LayerNorm(24))
    opt = build_optimizer(model, Optimizer(), "cpu")
    model(torch.arange(4)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.numel() > 1)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert (weights + state) / n == mod.PARAM_STATE_BYTES["adamw"]


def test_ab_band_dkdv_reads_cases_and_takes_the_median_speedup():
    """ab_band_dkdv.py's pure parts: CONFIG:T[:B] cases (a bad one names the form), each plan's median and the
    speed-up uniform / plan per case in the JSON rows and the markdown."""
    mod = _load_benchmark("ab_band_dkdv")
    assert mod.parse_cases("1b:32768,m7c:8192:2") == [("1b", 32768, 1), ("m7c", 8192, 2)]
    with pytest.raises(SystemExit, match="CONFIG:T or CONFIG:T:B"):
        mod.parse_cases("1b")
    rows = mod.summarize({"1b T=32768 B=1": {"uniform": [1.0, 3.0, 2.0], "balanced": [1.0, 0.5, 2.0],
                                             "tuned": [4.0, 4.0, 5.0]}})
    assert rows[0]["speedup"] == pytest.approx({"balanced": 2.0, "tuned": 0.5})  # medians 2 / 1, 2 / 4
    md = mod.to_markdown({"device": "GPU", "torch": "2.x", "triton": "3.x", "date": "2026-12-07", "rounds": 3}, rows)
    assert ("| 1b T=32768 B=1 | 1.000 / 3.000 / 2.000 | 1.000 / 0.500 / 2.000 | 4.000 / 4.000 / 5.000 | 2.000x | "
            "0.500x |") in md
    assert set(mod.PLANS) >= {"uniform", "balanced"} and mod.PLANS["uniform"] == {"balanced": False}


def test_ab_eager_fork_takes_the_median_of_per_pair_speedups_and_writes_its_table():
    """benchmarks/ab_eager_fork.py: the speed-up is the median of per-pair ratios (one stream / forked), not the
    ratio of medians, and too few pairs are refused; the table names each case's default choice."""
    mod = _load_benchmark("ab_eager_fork")
    # The medians alone would say 10 / 10 = 1.0; the pairs say the fork won 2 of 3 by 2x.
    s = mod.summarize([10.0, 10.0, 20.0], [5.0, 10.0, 10.0])
    assert s["one_stream_ms"] == 10.0 and s["forked_ms"] == 10.0
    assert s["speedup_median"] == 2.0 and s["pairs"] == 3
    with pytest.raises(ValueError, match="pairs"):
        mod.summarize([1.0], [1.0])
    row = dict(config="m7c", T=8192, B=2, q_values=12582912, forks_by_default=False, bitwise_same=True,
               reps_per_sample=6, **mod.summarize([2.7, 2.8], [2.9, 2.9]))
    md = mod.to_markdown(dict(device="GPU X", torch="2.11", triton="3.6", date="d", threshold=1 << 24, cases=[row]))
    assert "| m7c 8192 B=2 | 12.6M | False |" in md and "16777216" in md


def test_eager_fork_forces_the_backward_s_stream_choice_and_restores_the_threshold():
    """attention_checks.eager_fork (the float64 check's 1-vs-2-streams determinism, ab_eager_fork.py): on, the
    smallest shape forks; off, the largest does not; the threshold comes back after, also after an error."""
    import torch

    from nsa_titan.kernels import ops

    mod = _load_benchmark("attention_checks")
    small, large = torch.empty(1, 1, 1, 1, device="meta"), torch.empty(8, 1 << 17, 64, 128, device="meta")
    keep = ops.EAGER_FORK_VALUES
    with mod.eager_fork(True):
        assert ops.eager_backward_forks(small)
    with mod.eager_fork(False):
        assert not ops.eager_backward_forks(large)
    with pytest.raises(RuntimeError), mod.eager_fork(True):
        raise RuntimeError
    assert ops.EAGER_FORK_VALUES == keep and ops.eager_backward_forks(large) and not ops.eager_backward_forks(small)


def test_ab_walk_order_switches_the_tables_token_order_off_and_back_and_writes_its_table():
    """benchmarks/ab_walk_order.py: off, the walk's table entry has no many_pairs shape (every launch in block order,
    also at the largest launch); on and after (also after an error) the entry is as it was; the table row."""
    pytest.importorskip("triton")
    from nsa_titan.kernels import selected_bwd
    from nsa_titan.kernels.tuned import TUNED

    mod = _load_benchmark("ab_walk_order")
    entry = dict(TUNED[mod.ENTRY])
    big = 1 << 30
    with mod.token_order(False):
        assert selected_bwd.walk_shape(TUNED[mod.ENTRY], big, None).get("order", "blocks") == "blocks"
    with pytest.raises(RuntimeError), mod.token_order(False):
        raise RuntimeError
    with mod.token_order(True):
        assert selected_bwd.walk_shape(TUNED[mod.ENTRY], big, None)["order"] == "tokens"
    assert TUNED[mod.ENTRY] == entry
    row = dict(config="paper", T=32768, B=1, block_order_ms=42.685, token_order_ms=42.199, speedup_median=1.016,
               speedup_q1=1.005, speedup_q3=1.022, pairs=30, reps_per_sample=1, grad_rel_diff=2e-7)
    md = mod.to_markdown(dict(device="GPU X", torch="2.11", triton="3.6", date="d", cases=[row]))
    assert "| paper 32768 B=1 | 42.685 | 42.199 | 1.016 (1.005-1.022) | 30 x 1 | 2.0e-07 |" in md



def test_profile_sel_bwd_table_sums_the_dq_kernels_and_names_the_cfg():
    """benchmarks/profile_sel_bwd.py's table: the walk, the dQ kernels (from stored dS, recomputed or partials
    summed) added up, the reduce (0 where it did not run), the cfg as JSON."""
    mod = _load_benchmark("profile_sel_bwd")
    rows = [dict(config="paper", T=65536, round=1, cfg={"order": "tokens"}, total_ms=26.5,
                 kernels_ms={"_sel_bwd_dkdv": 15.9, "_sel_bwd_dq_ds_tokens": 8.0, "_sel_dq_sum": 0.25,
                             "_rowdot": 0.7}),
            dict(config="1b", T=8192, round=0, cfg={}, total_ms=0.75, kernels_ms={"_sel_bwd_dkdv": 0.45})]
    md = mod.to_markdown(dict(device="GPU X", torch="2.11", triton="3.6", date="d", cases=rows))
    assert '| paper 65536 | 1 | `{"order": "tokens"}` | 26.50 | 15.90 | 8.25 | 0.00 |' in md
    assert "| 1b 8192 | 0 | `{}` | 0.75 | 0.45 | 0.00 | 0.00 |" in md


def test_ab_fla_refuses_bad_and_unsupported_cases_by_name_and_writes_the_paired_ratio():
    """benchmarks/ab_fla.py: CONFIG:T:B cases, an unknown config or one fla-core cannot run (G 6) refused with the
    reason before any GPU work; the table's ratio column is the per-pair median it is given."""
    pytest.importorskip("triton")
    mod = _load_benchmark("ab_fla")
    bench = _load_benchmark("bench_attention")
    assert mod.parse_cases("paper:65536:1,1b:8192:2", bench.CONFIGS) == [("paper", 65536, 1), ("1b", 8192, 2)]
    with pytest.raises(SystemExit, match="CONFIG:T:B"):
        mod.parse_cases("paper:65536", bench.CONFIGS)
    with pytest.raises(SystemExit, match="unknown config 'gpt'"):
        mod.parse_cases("gpt:8192:1", bench.CONFIGS)
    with pytest.raises(SystemExit, match="power of 2 >= 16, here 6"):
        mod.parse_cases("m7c:8192:1", bench.CONFIGS)
    row = dict(config="paper", T=65536, B=1, nsa_ms=108.2, fla_ms=216.0, nsa_vs_fla=1.994, nsa_vs_fla_q1=1.981,
               nsa_vs_fla_q3=2.01, pairs=18, reps_per_sample=1)
    md = mod.to_markdown(dict(device="GPU X", torch="2.11", triton="3.6", date="d", cases=[row]))
    assert "| paper 65536 B=1 | 108.20 | 216.00 | 1.994x (1.981-2.010) | 18 x 1 |" in md
