"""NSA diagnostics, profiling and the CPU-bound (GPU-busy) warning, on CPU with the tiny model."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nsa_titan.components.diagnostics import (
    DISTANCE_BINS,
    NSADiagnostics,
    output_shares,
    sampled_branch_outputs,
    selection_stats,
)
from nsa_titan.components.metrics import MetricsLogger
from nsa_titan.components.profiling import TrainProfiler
from nsa_titan.config import load_job_config
from nsa_titan.config.job_config import Compile
from nsa_titan.models import build_model, get_model_args
from nsa_titan.models.nsa import reference
from nsa_titan.models.nsa.common import NSAParams
from nsa_titan.parallelisms import apply_ac, apply_compile

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=96, cmp_block=8, cmp_stride=4,
            slc_block=16, slc_top_n=3, window=24)
TINY_CLI = [x for k, v in TINY.items() for x in (f"--model.{k}", str(v))] + ["--training.seq_len", "64"]
P = NSAParams(cmp_block=8, cmp_stride=4, slc_block=16, slc_top_n=3, window=24)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py says why


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    model = build_model(get_model_args("debug", **{**TINY, **kw}))
    model.init_weights()
    return model


# ---- values on hand-built cases ------------------------------------------------------------------------------
def test_gates_at_one_half_give_entropy_log3_per_head():
    model = tiny_model()
    for block in model.layers.values():
        torch.nn.init.zeros_(block.attention.wgate.weight)  # sigmoid(0) = 0.5 for every branch
    diag = NSADiagnostics.attach(model)
    with diag.collecting():
        model(torch.randint(0, 256, (2, 64)))
    out = diag.read()
    assert len(out["layers"]) == 2
    for rec in out["layers"]:
        assert rec["gate_mean"] == pytest.approx([0.5] * 3)
        assert rec["gate_entropy"] == pytest.approx([math.log(3)] * 4, abs=1e-6)  # one value per query head
    assert diag.read() is None  # read clears: nothing new since


def test_output_shares_follow_value_norms_and_visibility():
    """Constant values per branch make each branch output that constant wherever a key is visible, so the
    shares are the norms' ratios: cmp |1|, slc |2|, win |1| -> 1/4, 1/2, 1/4; before the first compressed
    token (t < l - 1) the compressed branch is 0 -> 0, 2/3, 1/3."""
    b, t, hq, hkv, d = 1, 64, 4, 2, 16
    q = torch.randn(b, t, hq, d)
    tc = P.num_cmp_tokens(t)
    unit = torch.zeros(d)
    unit[0] = 1.0

    def const(n, scale):
        return (unit * scale).expand(b, n, hkv, d).clone()

    kv_cmp = (torch.randn(b, tc, hkv, d), const(tc, 1.0))
    kv_slc = (torch.randn(b, t, hkv, d), const(t, 2.0))
    kv_win = (torch.randn(b, t, hkv, d), const(t, 1.0))
    gates = torch.full((b, t, hq, 3), 0.5)
    block_idx = reference_blocks(q, kv_cmp[0], kv_slc[0])
    late, early = torch.tensor([20, 40, 63]), torch.tensor([0, 3, 6])
    for pos, expected in ((late, [0.25, 0.5, 0.25]), (early, [0.0, 2 / 3, 1 / 3])):
        branch = sampled_branch_outputs(q, kv_cmp, kv_slc, kv_win, block_idx, P, pos)
        assert output_shares(branch, gates[0, pos]).tolist() == pytest.approx(expected, abs=1e-6)
    # Gates weigh in: g = (1, 0.5, 0.5) on norms (1, 2, 1) -> gated norms 1, 1, 0.5 -> 0.4, 0.4, 0.2.
    branch = sampled_branch_outputs(q, kv_cmp, kv_slc, kv_win, block_idx, P, late)
    uneven = torch.tensor([1.0, 0.5, 0.5]).expand(len(late), hq, 3)
    assert output_shares(branch, uneven).tolist() == pytest.approx([0.4, 0.4, 0.2], abs=1e-6)


def reference_blocks(q, k_cmp, k_slc):
    """The reference's own selection, as block indices [B, HKV, T, n]."""
    from nsa_titan.components.diagnostics import block_indices

    _, p_cmp = reference.compressed_attention(q, k_cmp, k_cmp, P)
    chosen = reference.select_blocks(reference.block_importance(p_cmp, k_slc.shape[2], P), P)
    return block_indices(chosen, P.slc_top_n)


def test_sampled_branch_outputs_equal_the_reference_branches():
    torch.manual_seed(1)
    b, t, hq, hkv, d = 2, 64, 4, 2, 16
    q = torch.randn(b, t, hq, d)
    kc, vc = torch.randn(b, P.num_cmp_tokens(t), hkv, d), torch.randn(b, P.num_cmp_tokens(t), hkv, d)
    ks, vs, kw, vw = (torch.randn(b, t, hkv, d) for _ in range(4))
    _, p_cmp = reference.compressed_attention(q, kc, vc, P)
    chosen = reference.select_blocks(reference.block_importance(p_cmp, hkv, P), P)
    want = torch.stack([reference.compressed_attention(q, kc, vc, P)[0],
                        reference.selected_attention(q, ks, vs, chosen, P),
                        reference.window_attention(q, kw, vw, P.window)])[:, 0]  # [3, T, HQ, Dv], sequence 0
    pos = torch.arange(t)
    got = sampled_branch_outputs(q, (kc, vc), (ks, vs), (kw, vw), reference_blocks(q, kc, ks), P, pos)
    torch.testing.assert_close(got, want[:, pos], atol=1e-5, rtol=1e-5)


def test_record_is_fp32_under_bf16_autocast():
    """The training forward runs under bf16 autocast; the statistics must not be computed in bf16."""
    torch.manual_seed(2)
    b, t, hq, hkv, d = 1, 64, 4, 2, 16
    q = torch.randn(b, t, hq, d)
    tc = P.num_cmp_tokens(t)
    kv_cmp, kv_slc, kv_win = ((torch.randn(b, n, hkv, d), torch.randn(b, n, hkv, d)) for n in (tc, t, t))
    gates = torch.rand(b, t, hq, 3)
    blocks = reference_blocks(q, kv_cmp[0], kv_slc[0])
    diag = NSADiagnostics()
    want = diag.record(q, kv_cmp, kv_slc, kv_win, gates, blocks, P)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = diag.record(q, kv_cmp, kv_slc, kv_win, gates, blocks, P)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_selection_stats_on_hand_built_choices():
    # l' = 16; query 63 sits in block 3. Slots: [0, 3, 2] -> distances 3, 0, 1 (all forced: block 0, own,
    # previous); query 40 (block 2): [2, 1, -1] -> 0, 1 and an unused slot; query 60 (block 3): [3, 1, 0] ->
    # 0, 2 (block 1 is not forced), 3.
    idx = torch.full((1, 1, 64, 3), -1)
    idx[0, 0, 63] = torch.tensor([0, 3, 2])
    idx[0, 0, 40] = torch.tensor([2, 1, -1])
    idx[0, 0, 60] = torch.tensor([3, 1, 0])
    stats = selection_stats(idx, 16)
    dists = [3, 0, 1, 0, 1, 0, 2, 3]  # 8 valid slots; bins: 0 -> "0", 1 -> "1", 2 and 3 -> "2-3"
    hist = stats["slc_distance_hist"].tolist()
    assert DISTANCE_BINS[:3] == ["0", "1", "2-3"] and DISTANCE_BINS[-1].startswith(">=")
    assert hist[:3] == pytest.approx([3 / 8, 2 / 8, 3 / 8]) and sum(hist[3:]) == 0
    assert stats["slc_mean_distance"].item() == pytest.approx(sum(dists) / 8)
    assert stats["forced_share"].item() == pytest.approx(7 / 8)


# ---- hot path: nothing when disabled, no host sync when enabled ------------------------------------------------
class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique", "item")


def test_disabled_collector_adds_no_work_and_enabled_one_does_not_sync(monkeypatch):
    tokens = torch.randint(0, 256, (2, 64))
    plain, with_diag = tiny_model(), tiny_model()
    diag = NSADiagnostics.attach(with_diag)
    logs = {}
    for name, model, enabled in (("plain", plain, False), ("disabled", with_diag, False), ("enabled", with_diag, True)):
        def boom(*a, **k):
            raise AssertionError("host sync during the forward")

        for attr in ("item", "tolist", "__float__", "__int__", "__bool__", "nonzero"):
            monkeypatch.setattr(torch.Tensor, attr, boom)
        with diag.collecting(enabled), OpLog() as log:
            model(tokens).float().pow(2).mean().backward()
        monkeypatch.undo()
        logs[name] = log.ops
    assert logs["disabled"] == logs["plain"]  # the same op sequence: a disabled collector costs nothing
    assert len(logs["enabled"]) > len(logs["plain"])
    assert not [op for op in logs["enabled"] if any(s in op for s in SYNC_OPS)]
    assert diag.read()["layers"][0]["forced_share"] > 0  # the one sync, on the log step


def test_compiled_checkpointed_blocks_record_the_same_values_with_one_extra_graph():
    from torch._dynamo.utils import counters

    tokens = torch.randint(0, 256, (2, 64))
    eager = tiny_model()
    eager_diag = NSADiagnostics.attach(eager)
    with eager_diag.collecting():
        eager(tokens)
    want = eager_diag.read()

    torch._dynamo.reset()
    model = tiny_model()
    apply_ac(model, SimpleNamespace(mode="full", ratio=1.0))
    apply_compile(model, Compile(enable=True), backend="eager")  # the tracing, not code generation
    diag = NSADiagnostics.attach(model)
    start = counters["stats"]["unique_graphs"]
    model(tokens).sum().backward()
    plain_graphs = counters["stats"]["unique_graphs"] - start
    for _ in range(2):
        with diag.collecting():
            model(tokens).sum().backward()  # the recompute in backward must not break or duplicate anything
    got = diag.read()
    model(tokens).sum().backward()
    assert plain_graphs == 1 and counters["stats"]["unique_graphs"] - start == 2  # not one graph per layer
    for a, b in zip(got["layers"], want["layers"]):
        for key in ("gate_mean", "gate_entropy", "output_share", "slc_distance_hist"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key


def test_dense_model_has_nothing_to_collect():
    diag = NSADiagnostics.attach(tiny_model(attn_type="dense"))
    with diag.collecting():
        pass
    assert not diag.attached and diag.read() is None


# ---- the CPU-bound warning ------------------------------------------------------------------------------------
class SimulatedClock:
    """A clock that only moves when the test says so: the warning logic is checked without depending on how
    busy the CI machine is (a real-clock version failed on a loaded 2-core runner)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


class StepSpanBusy:
    """Stands in for the CUDA events: the device counts as busy exactly while a step runs."""

    def __init__(self, clock):
        self.clock, self.busy, self._t = clock, 0.0, 0.0

    def start(self):
        self._t = self.clock()

    def stop(self):
        self.busy += self.clock() - self._t

    def collect(self):
        b, self.busy = self.busy, 0.0
        return b


@pytest.mark.parametrize("stall_s, compute_s, cpu_bound", [(0.06, 0.01, True), (0.0, 0.08, False), (0.01, 0.08, True)])
def test_gpu_busy_flags_a_slow_data_loader(tmp_path, stall_s, compute_s, cpu_bound):
    lines = []
    clock = SimulatedClock()
    cfg = SimpleNamespace(log_freq=4, jsonl_file="m.jsonl", enable_tensorboard=False)
    logger = MetricsLogger(cfg, dump_folder=tmp_path, total_steps=8, device=torch.device("cpu"), flops_per_token=1e6,
                           clock=clock, busy_timer=StepSpanBusy(clock), print_fn=lines.append)
    for step in range(1, 9):
        with logger.data_loading():
            clock.sleep(stall_s)  # the loader keeps the device waiting between steps
        clock.sleep(0.001)  # host work outside the loader (optimizer bookkeeping, Python)
        logger.step_start()
        clock.sleep(compute_s)
        logger.step_end(step, torch.tensor(1.0), torch.tensor(1.0), 100)
        if logger.should_log(step):
            logger.log(step, lr=1e-3)
    last = logger.records[-1]  # steps 5..8 (the window holding step 1 never warns)
    assert logger.records[0]["gpu_busy_warning"] is False  # step 1's window holds compilation: never a warning
    assert last["gpu_busy_warning"] is cpu_bound
    want_busy = compute_s / (compute_s + stall_s + 0.001)
    assert last["gpu_busy"] == pytest.approx(want_busy, rel=1e-6)
    assert last["data_time_s"] == pytest.approx(stall_s, abs=1e-9)
    assert last["data_share"] == pytest.approx(stall_s / (compute_s + stall_s + 0.001), abs=1e-9)
    if cpu_bound:
        assert "WARNING: GPU busy" in lines[-1] and "data loading" in lines[-1]
    else:
        assert "WARNING" not in lines[-1]
    assert last["tflops_per_gpu"] == pytest.approx(1e6 * last["tokens_per_s_per_gpu"] / 1e12)


# ---- profiling -------------------------------------------------------------------------------------------------
def test_memory_snapshot_on_request_and_on_oom(tmp_path):
    cfg = load_job_config(["--profiling.memory_snapshot_steps", "2", "--profiling.enable_memory_snapshot"]).profiling
    written, logs = [], []
    prof = TrainProfiler(cfg, dump_folder=tmp_path, rank=0, device=torch.device("cpu"), log=logs.append,
                         snapshot_fn=written.append)
    prof.start()
    with pytest.raises(torch.OutOfMemoryError):
        try:
            for step in (1, 2, 3):
                prof.step(step)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        except BaseException as e:
            prof.close(e)
            raise
    assert [p.name for p in written] == ["rank0_step2.pickle", "rank0_oom.pickle"]
    assert "out of memory at step 4" in logs[-1]

    quiet = TrainProfiler(cfg, dump_folder=tmp_path, rank=0, device=torch.device("cpu"), log=logs.append)
    assert "need CUDA" in logs[-1] and quiet.snapshot("x") is None  # no CUDA, nothing injected: says so


def test_trainer_writes_diagnostics_traces_and_new_metrics(tmp_path, monkeypatch):
    from nsa_titan.train import main

    calls = []
    real_record = NSADiagnostics.record
    monkeypatch.setattr(NSADiagnostics, "record", lambda self, *a: calls.append(1) or real_record(self, *a))
    summary = main([*TINY_CLI, "--training.device", "cpu", "--training.local_batch_size", "2", "--training.steps", "4",
                    "--metrics.log_freq", "2", "--lr_scheduler.warmup_steps", "1", "--job.dump_folder", str(tmp_path),
                    "--profiling.enable_profiling", "--profiling.profile_freq", "2"])
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["type"] == "nsa_diag"] == [1, 2, 4]  # log steps only
    assert len(calls) == 3 * 2  # recorded during the forwards of the 3 log steps only (2 layers, no recompute)
    train = [r for r in recs if r["type"] == "train"]
    assert all(r["tflops_per_gpu"] > 0 and r["data_time_s"] >= 0 and "peak_mem_active_gib" in r for r in train)
    assert summary["tflops_per_gpu"] > 0 and summary["data_share"] is not None
    traces = sorted(p.parent.name for p in (tmp_path / "profile_traces").glob("*/rank0_trace.json"))
    assert traces == ["iteration_2", "iteration_4"]
