"""The planner's study-layout grid, the labelling of fake-process-group rows, the FSDP2 communication estimate
(worked out by hand below) and the memory cap, all on CPU without probes."""

from __future__ import annotations

import json

import pytest
import torch

from nsa_titan.config import load_job_config
from nsa_titan.experiments import ac_planner
from nsa_titan.experiments.ac_planner import Point, add_comm_estimates, plan
from nsa_titan.experiments.comm_model import (
    Bandwidth,
    Collective,
    CommEstimator,
    UnitSpec,
    UnitTimes,
    exposed_comm,
    step_comm,
    unit_times,
)
from nsa_titan.experiments.plan_report import study_grid, write_plan_report
from nsa_titan.experiments.probe import apply_memory_cap, memory_cap_fraction
from nsa_titan.models import build_model, get_model_args

TINY = ["--model.dim", "64", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.head_dim", "16", "--model.ffn_hidden_dim", "96", "--model.cmp_block", "8", "--model.cmp_stride", "4",
        "--model.slc_block", "16", "--model.slc_top_n", "3", "--model.window", "24", "--training.seq_len", "64"]


# ---- the estimate's arithmetic, by hand ---------------------------------------------------------------------------
UNITS = [UnitTimes(fwd_s=0, bwd_s=0, ag_s=1, rs_s=2, regather=True),    # embedding
         UnitTimes(fwd_s=4, bwd_s=6.5, ag_s=5, rs_s=10, regather=True),  # a block
         UnitTimes(fwd_s=2, bwd_s=4, ag_s=3, rs_s=6, regather=False)]   # norm + output, kept gathered


def test_exposed_communication_follows_fsdp2_overlap():
    # forward: AG0 + max(0, AG1 - F0) + max(0, AG2 - F1) = 1 + 5 + 0
    # backward (last unit kept: no AG first): unit 2 hides AG1 (5) in B2 (4) -> 1; unit 1 hides AG0 + RS2 (1 + 6:
    # one NCCL stream, they add up) in B1 (6.5) -> 0.5; unit 0 hides RS1 (10) in B0 (0) -> 10; then RS0 (2) -> 13.5
    assert exposed_comm(UNITS, reduce=True) == {"forward": 6, "backward": 13.5, "total": 19.5}
    # without reduce-scatters (a micro-batch before the last): only unit 2's 1 s is left in backward
    assert exposed_comm(UNITS, reduce=False) == {"forward": 6, "backward": 1, "total": 7}
    # GA 3: the last micro-batch reduce-scatters (19.5) and two do not (7 each); all-gathers 2 + 10 + 3 per
    # micro-batch (the kept unit once), reduce-scatters 18 per reducing micro-batch
    assert step_comm(UNITS, 3, sync_every_micro_batch=False) == {"exposed_s": 33.5, "total_s": 3 * 15 + 18}
    assert step_comm(UNITS, 3, sync_every_micro_batch=True) == {"exposed_s": 58.5, "total_s": 3 * 15 + 3 * 18}
    # a resharded last unit is gathered again at the very start of backward, with nothing to hide it
    resharded = [*UNITS[:2], UnitTimes(fwd_s=2, bwd_s=4, ag_s=3, rs_s=6, regather=True)]
    assert exposed_comm(resharded, reduce=False)["backward"] == 3 + 1


def test_collective_time_and_bandwidth_from_bench_parallel(tmp_path):
    c = Collective(latency_s=1e-5, busbw_bytes_per_s=1e11)
    assert c.time_s(2e9, 2) == pytest.approx(1e-5 + 1e9 / 1e11)     # half the bytes cross per rank
    assert c.time_s(2e9, 4) == pytest.approx(1e-5 + 1.5e9 / 1e11)   # (N - 1) / N of them
    assert c.time_s(2e9, 1) == 0.0
    rows = [{"op": op, "MiB": mib, "ms": ms, "busbw_GBps": bw} for op in ("all_gather", "reduce_scatter")
            for mib, ms, bw in ((256, 0.6, 200.0), (0.004, 0.02, 0.1), (8, 0.04, 110.0))]
    (tmp_path / "parallel_x.json").write_text(json.dumps({"device": "GPU X", "collectives": rows}))
    bw = Bandwidth.load(tmp_path / "parallel_x.json")
    assert bw.all_gather == Collective(2e-5, 200e9) and bw.reduce_scatter == Collective(2e-5, 200e9)
    assert "parallel_x.json (GPU X)" in bw.source
    with pytest.raises(ValueError, match="bench_parallel.py --comm"):
        Bandwidth.from_measurement(rows[:3], "only all_gather")


def test_compute_is_split_by_flops_with_the_recompute():
    specs = [UnitSpec("embedding", 100, 0.0, 0.0, True), UnitSpec("block", 10**9, 10.0, 1.0, True),
             UnitSpec("head", 50, 5.0, 0.0, False)]
    flat = Bandwidth(Collective(0.0, 1e11), Collective(0.0, 1e11), "test")
    # work: (3 + 1) * 10 + 3 * 5 = 55 FLOP units for 5.5 s -> 0.1 s each; a checkpointed block's backward is 3 of them
    emb, block, head = unit_times(specs, 5.5, flat, world=2, param_bytes=2, reduce_bytes=4)
    assert (block.fwd_s, block.bwd_s, head.fwd_s, head.bwd_s, emb.fwd_s) == pytest.approx((1.0, 3.0, 0.5, 1.0, 0.0))
    assert (block.ag_s, block.rs_s) == pytest.approx((2e9 * 0.5 / 1e11, 4e9 * 0.5 / 1e11))  # bf16 gather, fp32 reduce


def estimator(*overrides: str) -> CommEstimator:
    return CommEstimator(load_job_config(["--training.device", "cpu", *TINY, *overrides]))


def test_estimator_units_match_the_model_and_the_reshard_policy():
    est = estimator()
    with torch.device("meta"):
        model = build_model(est.args)
    units = est.units("ratio", 0.5)
    assert [u.name for u in units] == ["embedding", *[f"block {i}" for i in range(4)], "norm + output"]
    assert sum(u.params for u in units) == sum(p.numel() for p in model.parameters())
    assert [u.recompute for u in units] == [0, 1, 0, 1, 0, 0]  # ratio 0.5 of 4 checkpoints blocks 0 and 2
    assert [u.regather for u in units] == [True] * 5 + [False]  # 'default' keeps the last unit gathered
    assert not any(u.regather for u in estimator("--parallelism.fsdp_reshard_after_forward", "never").units("none", 0))
    # GPU probes: 'auto' parameters are bf16 under bf16 autocast, gradients reduce in fp32
    assert (est.param_bytes, est.reduce_bytes) == (2, 4)
    e = est.estimate(world=8, grad_accum=4, compute_step_s=2.0, ac_mode="full")
    assert e["step_time_s"] == pytest.approx(2.0 + e["comm_exposed_s"]) and 0 < e["comm_exposed_s"] <= e["comm_total_s"]
    assert est.estimate(world=1, grad_accum=4, compute_step_s=2.0)["comm_exposed_s"] == 0.0
    ddp = estimator("--parallelism.data_parallel", "ddp").estimate(8, 4, 2.0)
    assert ddp["comm_model"] is None and "FSDP2 only" in ddp["comm_note"]


def test_estimator_units_of_several_blocks():
    """parallelism.fsdp_blocks_per_unit 3 over 4 blocks: units [0-2] and [3], with their blocks' parameters and
    FLOPs, and the mean recompute of their blocks; the same total bytes, fewer (larger) collectives."""
    one, three = estimator(), estimator("--parallelism.fsdp_blocks_per_unit", "3")
    units = three.units("ratio", 0.5)
    assert [u.name for u in units] == ["embedding", "blocks 0-2", "block 3", "norm + output"]
    block = one.units("none", 0)[1]
    assert [(u.params, u.fwd_flops) for u in units[1:3]] == [(3 * block.params, 3 * block.fwd_flops),
                                                               (block.params, block.fwd_flops)]
    assert [u.recompute for u in units[1:3]] == [pytest.approx(2 / 3), 0.0]  # blocks 0 and 2 of [0, 1, 2]
    assert sum(u.params for u in units) == sum(u.params for u in one.units("none", 0))


# ---- labelling and the study layout --------------------------------------------------------------------------------
def constant_comm(row, compute_s):
    return {"comm_model": "test", "compute_step_s": compute_s, "comm_exposed_s": 1.0, "comm_total_s": 3.0,
            "step_time_s": compute_s + 1.0, "bandwidth_source": "test"}


def test_fake_rows_get_the_estimate_and_real_rows_its_error(tmp_path):
    def measure(p: Point):  # a 2-GPU machine: 4 and 16 GPUs run as fake process groups
        return {"peak_reserved_gib": 1.0, "peak_alloc_gib": 1.0, "tokens_per_s_per_gpu": 1000.0, "seq_len": 100,
                "oom": False, "fake_process_group": p.gpus > 2, "mfu": 0.4}

    rows = plan([1, 2, 4, 16], [1], 16, [0.0, 1.0], measure, budget=lambda r: 10.0)
    add_comm_estimates(rows, constant_comm, fake_compute=lambda r: 0.5, gpus_per_node=8)
    by = {r["gpus"]: r for r in rows}
    assert [by[g]["fake_process_group"] for g in (1, 2, 4, 16)] == [False, False, True, True]
    # 4 GPUs, bs=1, GA 4: 400 tokens per GPU-step at 1000 tok/s = 0.4 s compute, + 1 s of communication
    assert by[4]["compute_step_s"] == pytest.approx(0.4) and by[4]["step_time_s"] == pytest.approx(1.4)
    assert by[4]["tokens_per_s_per_gpu"] == pytest.approx(400 / 1.4) and by[4]["mfu"] == pytest.approx(0.4 * 0.4 / 1.4)
    assert "estimated FSDP2 communication" in by[4]["time_source"] and not by[4]["beyond_one_node"]
    assert by[16]["beyond_one_node"]
    # the real 2-GPU row (GA 8: 0.8 s measured) keeps its measurement; the estimate 0.5 + 1 s is 87.5 % above it
    assert by[2]["step_time_s"] == pytest.approx(0.8) and by[2]["estimated_step_time_s"] == pytest.approx(1.5)
    assert by[2]["estimate_error"] == pytest.approx(1.5 / 0.8 - 1) and "estimate_error" not in by[1]
    meta = {"effective_batch": 16, "metric": "reserved", "ratios": [0, 1], "train_args": [], "seq_len": 100}
    md = write_plan_report(tmp_path, "e", rows, meta) and (tmp_path / "ac_plan_e.md").read_text()
    assert "- 2 GPUs: bs=1 AC=0 GA=8: measured 0.800 s/step, estimate 1.500 s (+87.5%): MISSED" in md
    assert "| estimate s | estimate error |" in md and "| 1.50 | +87.5% |" in md


STUDY_ROWS = [
    {"gpus": 1, "local_batch": 1, "grad_accum": 64, "ac_ratio": 0.4, "status": "fits", "tokens_per_s_per_gpu": 100.0,
     "step_time_s": 10.0, "time_source": "measured on 1 device(s)"},
    {"gpus": 1, "local_batch": 2, "grad_accum": 32, "ac_ratio": 0.85, "status": "fits", "tokens_per_s_per_gpu": 125.0,
     "step_time_s": 8.0, "time_source": "measured on 1 device(s)"},
    {"gpus": 1, "local_batch": 4, "grad_accum": 16, "status": "does_not_fit"},
    {"gpus": 16, "local_batch": 1, "status": "skipped"},
    {"gpus": 16, "local_batch": 2, "grad_accum": 2, "ac_ratio": 0.0, "status": "fits", "tokens_per_s_per_gpu": 200.0,
     "step_time_s": 2.0, "fake_process_group": True, "beyond_one_node": True, "time_source": "fake"},
    {"gpus": 16, "local_batch": 4, "grad_accum": 1, "ac_ratio": 0.5, "status": "fits", "tokens_per_s_per_gpu": 190.0,
     "step_time_s": 2.1, "fake_process_group": True, "beyond_one_node": True, "time_source": "fake"},
]


def test_study_grid_has_the_studys_layout_and_marks_estimates():
    assert study_grid(STUDY_ROWS) == [
        "|         | bs=1 | bs=2 | bs=4 |", "|---|---|---|---|",
        "| GPUs=1 | AC=0.4, GA=64 | **AC=0.85, GA=32** | - |",
        "| GPUs=16 | n/a | **AC=0, GA=2†‡** | AC=0.5, GA=1†‡ |"]
    assert study_grid(STUDY_ROWS, "time")[2:] == ["| GPUs=1 | 10.00 s | **8.00 s** | - |",
                                                  "| GPUs=16 | n/a | **2.00 s†‡** | 2.10 s†‡ |"]


def test_plan_report_labels_fake_rows_in_every_table_and_the_json(tmp_path):
    meta = {"effective_batch": 64, "metric": "reserved", "ratios": [0, 1], "train_args": [], "seq_len": 8192,
            "device": "NVIDIA H100 80GB HBM3", "torch": "2.13", "memory_cap_gib": 79.1, "bandwidth_source": "test"}
    write_plan_report(tmp_path, "t", [dict(r) for r in STUDY_ROWS], meta)
    md = (tmp_path / "ac_plan_t.md").read_text()
    assert "- 16 GPUs: bs=2 AC=0 GA=2  (2.00 s/step†‡" in md and "- 1 GPU: bs=2 AC=0.85 GA=32  (8.00 s/step," in md
    assert "| 16 | 2 | 2 | 0 | fits | n/a | n/a | 200†‡ | 2.00†‡ | † compute only |" in md
    assert "| 1 | 2 | 32 | 0.85 | fits | n/a | n/a | 125 | 8.00 | measured |" in md
    assert "allocator capped at 79.1 GiB" in md and "| GPUs=1 | AC=0.4, GA=64 |" in md
    rows = json.loads((tmp_path / "ac_plan_t.json").read_text())["rows"]
    assert [bool(r.get("fake_process_group")) for r in rows if r["status"] == "fits"] == [False, False, True, True]


# ---- memory cap ------------------------------------------------------------------------------------------------------
def test_memory_cap_mirrors_a_smaller_gpu_and_refuses_what_it_cannot(tmp_path):
    assert memory_cap_fraction(79.1, 139.8) == pytest.approx(79.1 / 139.8)
    with pytest.raises(ValueError, match="--memory-cap-gib 150 must be in"):
        memory_cap_fraction(150, 139.8)
    apply_memory_cap(None, torch.device("cpu"))  # no cap: nothing to do anywhere
    with pytest.raises(ValueError, match="caps the CUDA allocator"):
        apply_memory_cap(79.1, torch.device("cpu"))
    if torch.cuda.is_available():
        pytest.skip("the planner's refusal is for machines without a GPU")
    with pytest.raises(SystemExit, match="no GPU is visible"):
        ac_planner.main(["--config", "train_configs/debug_model.toml", "--effective-batch", "4", "--memory-cap-gib",
                         "79.1", "--out", str(tmp_path)])
    assert get_model_args("qwen7b").n_rep == 7  # the study's flavor is registered for --model.flavor


def test_the_estimate_check_probe_has_its_own_cache_entry(tmp_path):
    """A rebuilt report (same command on a machine without the GPUs: every probe from the cache) must still tell a
    real 2-GPU measurement from the fake-process-group probe of the same cell that --check-estimate added."""
    runner = ac_planner.ProbeRunner(tmp_path, ["--config", "x.toml"], warmup=1, steps=1, timeout_s=1,
                                    time_limit_s=0, in_process=True)  # no time left: only cache hits answer
    real, fake = {"fake_process_group": False, "step_time_s": 1.0}, {"fake_process_group": True, "step_time_s": 0.9}
    key = f"{runner.fingerprint}/g2-b1-ga2-r0.5"
    runner.cache.update({key: real, f"{key}-fake": fake})
    assert runner(Point(2, 1, 8, 0.5)) is real and runner(Point(2, 1, 8, 0.5), force_fake=True) is fake
    assert runner(Point(4, 1, 8, 0.5)) is None  # not cached, and the time limit allows no probe


def test_a_fake_probe_cached_on_fewer_gpus_is_measured_for_real_where_the_gpus_exist(tmp_path):
    """Probes cached on a 1-GPU machine hold fake-process-group results under the 2-GPU cells' keys. On a 2-GPU
    machine those cells must be measured for real (before, the cached estimate came back as the row, and
    --check-estimate compared the estimate with itself); the fake result stays as the cell's fake probe."""
    runner = ac_planner.ProbeRunner(tmp_path, ["--config", "x.toml"], warmup=1, steps=1, timeout_s=1,
                                    time_limit_s=0, in_process=True)  # no time left: a needed probe returns None
    fake = {"fake_process_group": True, "step_time_s": 0.9}
    key = f"{runner.fingerprint}/g2-b1-ga2-r0.5"
    runner.cache[key] = fake
    runner.gpus = 1  # rebuilding the report where only one GPU is visible: the fake result is the row
    assert runner(Point(2, 1, 8, 0.5)) is fake
    runner.gpus = 2  # the GPUs exist: the real probe is due (the time limit stops it here), the fake one is kept
    assert runner(Point(2, 1, 8, 0.5)) is None
    assert runner(Point(2, 1, 8, 0.5), force_fake=True) is fake and key not in runner.cache


CUBLAS_OOM = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


@pytest.mark.parametrize("error, oom", [(CUBLAS_OOM, True), ("boom", False)])
def test_a_probe_whose_cublas_handle_finds_no_memory_does_not_fit(monkeypatch, error, oom):
    """cuBLAS failing to allocate its handle is how a nearly full GPU failed one probe (1b at 32k, fake group of 16):
    a 'does not fit' like torch's OutOfMemoryError, not a crash that marks the cell as an error. Any other
    RuntimeError still propagates."""
    from nsa_titan.experiments import probe

    def fail(*a, **k):
        raise RuntimeError(error)

    monkeypatch.setattr(probe, "train_step", fail)
    argv = ["--config", "train_configs/debug_model.toml", "--training.device", "cpu", *TINY]
    if not oom:
        with pytest.raises(RuntimeError, match="boom"):
            probe.run_probe(argv, warmup=0, steps=1)
        return
    result = probe.run_probe(argv, warmup=0, steps=1)
    assert result["oom"] and "CUBLAS_STATUS_ALLOC_FAILED" in result["error"]
    assert probe.ran_out_of_memory(f"[rank0]: RuntimeError: {CUBLAS_OOM}\n")  # the planner's reading of a probe log
