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


pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py says why


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
    # A window in which torch.compile compiled (a recompile at steps 9-12) is no steady state either.
    recs[3].update(window_s=20.0, compile_steps=1)
    st = common.steady_stats(recs, warmup=4)
    assert st["steps_timed"] == 4 and st["tokens_per_s"] == pytest.approx(200.0)


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


TORCHRUN_LOG = """Setting OMP_NUM_THREADS environment variable for each process to be 1 in default
config error: lr_scheduler.warmup_steps (100) exceeds training.steps (30); lower --lr_scheduler.warmup_steps
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""


def test_a_failed_run_reports_its_cause_and_runs_again_once_mended(tmp_path, monkeypatch):
    """A torchrun job's log ends with torchrun's report, which names no cause: the error column shows the trainer's
    config error. The crash is not reused by the next invocation (its flags may be mended); an out-of-memory row is
    (the cell does not fit), but only for the same command."""
    launched = []

    def fake_run(cmd, stdout=None, **kw):
        launched.append(cmd)
        stdout.write(TORCHRUN_LOG if len(launched) == 1 else "torch.OutOfMemoryError: CUDA out of memory.\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(subprocess, "run", fake_run)
    runner = common.Runner(tmp_path, warmup=1, steps=2, timeout_s=10, gpu=False, log=lambda _: None)
    row = runner.run("r", 2, ["--config", "x.toml"], {})
    assert row["error"].startswith("exit 1: config error: lr_scheduler.warmup_steps (100)"), row["error"]
    assert runner.run("r", 2, ["--config", "x.toml"], {})["error"] == "out of memory" and len(launched) == 2
    assert runner.run("r", 2, ["--config", "x.toml"], {})["error"] == "out of memory" and len(launched) == 2
    runner.run("r", 2, ["--config", "x.toml", "--training.local_batch_size", "1"], {})
    assert len(launched) == 3
    assert common.failure_line(["a", "b", "c", "d"]) == "b | c | d"
    assert common.failure_line(["x", "ValueError: bad", "RuntimeError: later"]) == "ValueError: bad"


def test_runs_shorter_than_the_configs_lr_warmup_get_a_short_warmup(tmp_path, monkeypatch):
    """nsa_1b.toml warms the lr up over 100 steps, and the trainer refuses a warm-up longer than training.steps: the
    documented `dp_compare --config train_configs/nsa_1b.toml` (12 steps) failed every run on that. The runner hands
    the runs a warm-up of its untimed steps instead, says so once, and leaves a warm-up the flags name alone."""
    launched, said = [], []

    def fake_run(cmd, stdout=None, **kw):
        launched.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(subprocess, "run", fake_run)
    runner = common.Runner(tmp_path, warmup=4, steps=12, timeout_s=10, gpu=False, log=said.append)
    for name in ("a", "b"):
        runner.run(name, 1, ["--config", "train_configs/nsa_1b.toml"], {})
    for cmd in launched:
        i = cmd.index("--lr_scheduler.warmup_steps")
        assert cmd[i + 1] == "4" and cmd.count("--lr_scheduler.warmup_steps") == 1
    assert sum("lr warm-up (100 steps)" in x for x in said) == 1
    runner.run("c", 1, ["--config", "train_configs/nsa_1b.toml", "--lr_scheduler.warmup_steps", "50"], {})
    common.Runner(tmp_path, warmup=4, steps=20, timeout_s=10, gpu=False, log=said.append).run(
        "d", 1, ["--config", "train_configs/debug_model.toml"], {})  # its 15-step warm-up fits 20 steps
    assert launched[2].count("--lr_scheduler.warmup_steps") == 1 and "50" in launched[2]
    assert "--lr_scheduler.warmup_steps" not in launched[3]


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


def test_dp_compare_with_a_step_graph_asks_for_fsdp2_only(tmp_path, monkeypatch):
    """compile.step_graph cannot capture DDP or FSDP1 steps: dp_compare says so before it starts any run, naming the
    fix, instead of filling the table with their config errors; with --data-parallel fsdp2 it plans the runs."""
    monkeypatch.setattr(common.Runner, "run", lambda self, name, gpus, args, fields: {
        "run": name, "gpus": gpus, "error": "not run", **fields})
    argv = ["--config", "train_configs/m7c_125m.toml", "--gpus", "1,2", "--ac", "none", "--out", str(tmp_path)]
    graph = ["--", "--compile.enable", "--compile.step_graph", "--metrics.nsa_diagnostics", "false"]
    with pytest.raises(SystemExit, match="--data-parallel fsdp2"):
        dp_compare.main([*argv, *graph])
    result = dp_compare.main([*argv, "--data-parallel", "fsdp2", *graph])
    assert sorted(r["data_parallel"] for r in result["rows"]) == ["fsdp2", "none"]


def test_dp_compare_step_graph_option_captures_the_runs_that_can_be_captured(tmp_path, monkeypatch):
    """--step-graph: the one-GPU and FSDP2 runs capture their steps, DDP and FSDP1 run as they are, and the table
    says which run is which (FSDP2's best against FSDP1's). Without --compile.enable: an error naming the fix."""
    seen = {}

    def fake_run(self, name, gpus, args, fields):
        seen[name] = args
        return {"run": name, "gpus": gpus, "tokens_per_s_per_gpu": 1000.0, "step_time_s": 1.0, **fields}

    monkeypatch.setattr(common.Runner, "run", fake_run)
    monkeypatch.setattr(dp_compare, "visible_gpus", lambda: 2)
    argv = ["--config", "train_configs/m7c_125m.toml", "--gpus", "1,2", "--ac", "none", "--out", str(tmp_path),
            "--step-graph"]
    with pytest.raises(SystemExit, match="add --compile.enable"):
        dp_compare.main(argv)
    with pytest.raises(SystemExit, match="drop one of them"):
        dp_compare.main([*argv, "--cpu", "--", "--compile.enable"])
    assert not seen
    result = dp_compare.main([*argv, "--", "--compile.enable"])
    graphed = {name: "--compile.step_graph" in args for name, args in seen.items()}
    assert graphed == {"ac-none_1gpu": True, "ac-none_2gpu_fsdp2": True, "ac-none_2gpu_fsdp1": False,
                       "ac-none_2gpu_ddp": False}
    assert all(("--metrics.nsa_diagnostics" in args) == graphed[name] for name, args in seen.items())
    assert {r["data_parallel"]: r["step_graph"] for r in result["rows"]} == {"none": True, "fsdp2": True,
                                                                             "fsdp1": False, "ddp": False}
    md = (tmp_path / "dp_compare_dp.md").read_text()
    assert "| step graph |" in md and "FSDP2 with the step graph, FSDP1 without" in md
