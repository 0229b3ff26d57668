"""Tests of nsa_titan.components (optimizer, LR schedule, metrics, train step) on tiny stand-in models."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from _reference_step import reference_forward_backward
from nsa_titan.components.device_stats import peak_flops_for_name
from nsa_titan.components.lr_scheduler import build_lr_scheduler, lr_factor
from nsa_titan.components.metrics import MetricsLogger
from nsa_titan.components.optimizer import build_optimizer, resolve_fused, split_decay_params
from nsa_titan.components.runtime import World, configure_cuda_allocator, world_from_env
from nsa_titan.components.train_step import clip_grad_norm, evaluate, forward_backward, train_step
from nsa_titan.config import load_job_config
from nsa_titan.data import IGNORE_INDEX


class Tiny(nn.Module):
    def __init__(self, vocab=11, dim=8, tie=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.out = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.proj(self.norm(self.emb(x)))))


def opt_cfg(**kw):
    base = dict(name="adamw", lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, fused="auto", shard_local=True)
    return SimpleNamespace(**{**base, **kw})


def sched_cfg(**kw):
    base = dict(warmup_steps=10, decay_type="cosine", min_lr_ratio=0.1, wsd_decay_ratio=0.2)
    return SimpleNamespace(**{**base, **kw})


def metrics_cfg(**kw):
    base = dict(log_freq=2, jsonl_file="metrics.jsonl", enable_tensorboard=False, val_freq=0, val_steps=1)
    return SimpleNamespace(**{**base, **kw})


# ---------------- optimizer ----------------
def test_decay_groups_exclude_embeddings_norms_biases():
    decay, no_decay = split_decay_params(Tiny())
    assert sorted(n for n, _ in decay) == ["out.weight", "proj.weight"]
    assert sorted(n for n, _ in no_decay) == ["emb.weight", "norm.bias", "norm.weight", "proj.bias"]

    opt = build_optimizer(Tiny(), opt_cfg(), "cpu")
    wds = sorted((g["weight_decay"], len(g["params"])) for g in opt.param_groups)
    assert wds == [(0.0, 4), (0.1, 2)]


def test_tied_embedding_is_not_decayed_and_counted_once():
    decay, no_decay = split_decay_params(Tiny(tie=True))
    assert [n for n, _ in decay] == ["proj.weight"]
    assert sum(p.numel() for _, p in decay + no_decay) == sum(p.numel() for p in Tiny(tie=True).parameters())


def test_fused_choice():
    assert resolve_fused("auto", "cuda") is True
    assert resolve_fused(True, "cuda") is True
    assert resolve_fused("auto", "cpu") is False
    assert resolve_fused(True, "cpu") is False
    assert resolve_fused(False, "cuda") is False
    with pytest.raises(ValueError, match="optimizer.fused"):
        resolve_fused("sometimes", "cuda")

    opt = build_optimizer(Tiny(), opt_cfg(), "cpu")
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    # torch also has a CPU fused AdamW, so the CUDA branch can be exercised here.
    opt = build_optimizer(Tiny(), opt_cfg(), "cuda")
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    assert opt.defaults["betas"] == (0.9, 0.95)


def test_unknown_optimizer_name():
    with pytest.raises(ValueError, match="unknown optimizer.name 'sgd'.*adamw"):
        build_optimizer(Tiny(), opt_cfg(name="sgd"), "cpu")


# ---------------- LR schedule ----------------
def factors(decay_type, total=100, **kw):
    cfg = sched_cfg(decay_type=decay_type, **kw)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_lr_scheduler(opt, cfg, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"] / 2.0)
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("decay_type", ["cosine", "linear", "wsd", "constant"])
def test_schedule_warmup_peak_end(decay_type):
    f = factors(decay_type)
    assert f[0] == pytest.approx(0.1)  # first step is not lr = 0
    assert f[4] == pytest.approx(0.5)
    assert f[9] == pytest.approx(1.0)  # peak at the end of warmup
    assert f[10] == pytest.approx(1.0)
    assert max(f) == pytest.approx(1.0)
    assert f[-1] == pytest.approx(1.0 if decay_type == "constant" else 0.1)  # floor on the last step
    assert all(a <= b + 1e-12 for a, b in zip(f[:10], f[1:10]))  # warmup is monotone


def test_cosine_and_linear_midpoints():
    # decay covers steps 10..99 (90 steps); progress 0.5 at step 10 + 44.5
    cos, lin = factors("cosine"), factors("linear")
    assert lin[10 + 45] == pytest.approx(0.1 + 0.9 * (1 - 45 / 89))
    assert cos[10 + 45] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 89)))
    assert cos[30] > lin[30]  # cosine stays high longer


def test_wsd_shape():
    # 10 warmup steps, then 90 post-warmup steps of which the last 25% (round(22.5) = 22) decay.
    f = factors("wsd", total=100, wsd_decay_ratio=0.25)
    assert all(x == pytest.approx(1.0) for x in f[9:79])  # stable phase
    decay = f[78:]
    assert len(decay) == 22
    diffs = [a - b for a, b in zip(decay, decay[1:])]
    assert all(d == pytest.approx(0.9 / 21) for d in diffs)  # linear
    assert decay[-1] == pytest.approx(0.1)


def test_schedule_validation_and_state_dict():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=r"warmup_steps \(20\) exceeds training.steps \(10\)"):
        build_lr_scheduler(opt, sched_cfg(warmup_steps=20), 10)
    with pytest.raises(ValueError, match="decay_type"):
        build_lr_scheduler(opt, sched_cfg(decay_type="step"), 10)
    sched = build_lr_scheduler(opt, sched_cfg(warmup_steps=0), 10)
    for _ in range(3):
        opt.step()
        sched.step()
    assert sched.state_dict()["last_epoch"] == 3
    no_warmup = lr_factor(0, warmup_steps=0, total_steps=10, decay_type="linear", min_lr_ratio=0.0, wsd_decay_ratio=0.2)
    assert no_warmup == 1.0


# ---------------- metrics ----------------
class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeBusy:
    """Reports a fixed busy fraction of each simulated step."""

    def __init__(self, clock, fraction):
        self.clock, self.fraction, self.busy, self._t = clock, fraction, 0.0, None

    def start(self):
        self._t = self.clock()

    def stop(self):
        self.busy += (self.clock() - self._t) * self.fraction

    def collect(self):
        b, self.busy = self.busy, 0.0
        return b


def run_logger(tmp_path, busy_fraction, steps=6, lines=None):
    clock = FakeClock()
    logger = MetricsLogger(
        metrics_cfg(), dump_folder=tmp_path, total_steps=steps, device=torch.device("cpu"), world_size=2,
        flops_per_token=1e9, peak_flops=1e12, clock=clock, busy_timer=FakeBusy(clock, busy_fraction),
        print_fn=(lines.append if lines is not None else lambda s: None),
    )
    for step in range(1, steps + 1):
        logger.step_start()
        clock.t += 0.5  # each step: 0.5 s, 1000 tokens on this rank, loss = step
        logger.step_end(step, torch.tensor(float(step)), torch.tensor(2.0), 1000)
        if logger.should_log(step):
            logger.log(step, lr=1e-3)
    logger.close()
    return logger


def test_fresh_run_moves_an_earlier_log_aside_and_resumed_run_appends(tmp_path):
    from nsa_titan.plot import read_curves

    run_logger(tmp_path, busy_fraction=1.0)  # run 1: steps 1..6
    first = (tmp_path / "metrics.jsonl").read_text()
    lines = []
    run_logger(tmp_path, busy_fraction=1.0, lines=lines)  # run 2, fresh: run 1's log must not be erased
    assert (tmp_path / "metrics.1.jsonl").read_text() == first and any("metrics.1.jsonl" in s for s in lines)
    logger = MetricsLogger(metrics_cfg(), dump_folder=tmp_path, total_steps=8, device=torch.device("cpu"),
                           resumed_at_step=4)  # run 3 resumes run 2 from its step-4 checkpoint
    logger.step_start()
    logger.step_end(5, torch.tensor(50.0), torch.tensor(1.0), 10)
    logger.log(5, lr=1e-3)
    logger.close()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["type"], r["step"]) for r in recs] == [("train", 1), ("train", 2), ("train", 4), ("train", 6),
                                                      ("resume", 4), ("train", 5)]
    curves = read_curves(tmp_path)["train"]  # the last record of each step wins
    assert sorted(curves) == [1, 2, 4, 5, 6] and curves[5]["loss"] == 50.0


def test_wandb_gets_the_same_scalars_as_tensorboard_on_rank_0_only(tmp_path, monkeypatch):
    """metrics.enable_wandb: the run's config goes to wandb.init (offline by default), every train / val / extra
    scalar to run.log at its step, finish() at close; other ranks open nothing. A fake wandb module stands in."""
    import sys
    import types

    calls = {"init": [], "log": [], "finish": 0}

    class Run:
        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["finish"] += 1

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls["init"].append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = metrics_cfg(enable_wandb=True, wandb_project="p", wandb_run_name="r", wandb_mode="offline")
    for rank in (1, 0):
        logger = MetricsLogger(cfg, dump_folder=tmp_path, total_steps=2, device=torch.device("cpu"), rank=rank,
                               run_config={"training": {"steps": 2}})
        logger.step_start()
        logger.step_end(1, torch.tensor(3.0), torch.tensor(1.0), 10)
        logger.step_start()
        logger.step_end(2, torch.tensor(2.0), torch.tensor(1.0), 10)
        logger.log(2, lr=1e-3)
        logger.log_val(2, {"val_loss": 2.5})
        logger.log_extra("nsa_diag", 2, {}, scalars={"nsa/x": 0.5})
        logger.close()
        if rank == 1:
            assert calls == {"init": [], "log": [], "finish": 0}
    assert calls["init"] == [{"project": "p", "name": "r", "mode": "offline", "dir": str(tmp_path),
                              "config": {"training": {"steps": 2}}}]
    logged = {name: (step, value) for step, data in calls["log"] for name, value in data.items()}
    assert logged["train/loss"] == (2, 2.5) and logged["val/val_loss"] == (2, 2.5) and logged["nsa/x"] == (2, 0.5)
    assert logged["train/lr"] == (2, 1e-3) and calls["finish"] == 1


def test_wandb_without_the_package_is_a_config_error_naming_the_fix(monkeypatch):
    import importlib.util

    from nsa_titan.config import ConfigError, load_job_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        load_job_config(["--metrics.enable_wandb"])


def test_plot_writes_one_png_for_several_runs(tmp_path):
    pytest.importorskip("matplotlib")
    from nsa_titan.plot import main as plot_main

    for name in ("a", "b"):
        run_logger(tmp_path / name, busy_fraction=1.0)
    plot_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c.png")])
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="dump folder"):
        plot_main([str(tmp_path / "missing")])


def test_metrics_jsonl_keys_and_values(tmp_path):
    lines = []
    logger = run_logger(tmp_path, busy_fraction=1.0, lines=lines)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 4, 6]
    expected = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "peak_mem_gib",
                "peak_mem_reserved_gib", "gpu_busy", "gpu_busy_warning", "eta_s", "tokens", "elapsed_s"}
    assert expected <= set(recs[0])
    r = recs[2]  # window = steps 3, 4
    assert r["loss"] == pytest.approx(3.5)  # mean over the window
    assert r["grad_norm"] == pytest.approx(2.0)
    assert r["tokens_per_s_per_gpu"] == pytest.approx(2000.0)
    assert r["tokens_per_s"] == pytest.approx(4000.0)
    assert r["mfu"] == pytest.approx(1e9 * 2000 / 1e12)
    assert r["eta_s"] == pytest.approx(2 * 0.5)
    assert r["tokens"] == 4 * 1000 * 2
    assert r["peak_mem_gib"] > 0  # CPU: process RSS
    assert not r["gpu_busy_warning"] and r["gpu_busy"] == pytest.approx(1.0)
    assert len(lines) == 4 and "WARNING" not in "".join(lines) and "step      4/6" in lines[2]
    s = logger.summary()
    assert s["initial_loss"] == 1.0 and s["final_loss"] == pytest.approx(5.5)
    assert s["tokens_per_s"] == pytest.approx(4000.0)


def test_summary_reports_the_last_window_apart_from_the_mean(tmp_path):
    clock = FakeClock()
    logger = MetricsLogger(metrics_cfg(), dump_folder=tmp_path, total_steps=6, device=torch.device("cpu"),
                           world_size=2, clock=clock, busy_timer=FakeBusy(clock, 1.0), print_fn=lambda s: None)
    for step in range(1, 7):
        logger.step_start()
        clock.t += 1.0 if step <= 4 else 0.25  # a slow start (compile, warm-up), then steady state
        logger.step_end(step, torch.tensor(1.0), torch.tensor(1.0), 1000)
        if logger.should_log(step):
            logger.log(step, lr=1e-3)
    logger.close()
    s = logger.summary()
    assert s["last_window_tokens_per_s_per_gpu"] == pytest.approx(1000 / 0.25)  # steps 5-6
    assert s["tokens_per_s_per_gpu"] == pytest.approx(5000 / 3.5)  # steps 2-6, first window left out


@pytest.mark.parametrize("warmup, resumed, slow, expect_from, expect_tps", [
    (4, 0, 4, 5, 1000 / 0.25),  # steps 1-4 compile / capture: windows 5-6 and 7-8 only
    (1, 0, 4, 2, 7000 / 4.0),  # the first step only: every window after step 1 (the behaviour before warmup_steps)
    (20, 0, 4, 2, 7000 / 4.0),  # longer than the run: falls back to every window after the first
    (2, 4, 2, 7, 1000 / 0.25),  # resumed after step 4: steps 5-6 warm up again
])
def test_summary_leaves_out_the_windows_that_hold_warmup_steps(tmp_path, warmup, resumed, slow, expect_from,
                                                               expect_tps):
    """With the step graph, steps 2-4 warm up and capture: a summary over every window after step 1 read 309k
    tokens/s in a 40-step m7c run whose windows after the capture ran at 355k."""
    clock = FakeClock()
    logger = MetricsLogger(metrics_cfg(), dump_folder=tmp_path, total_steps=8, device=torch.device("cpu"),
                           world_size=1, clock=clock, busy_timer=FakeBusy(clock, 1.0), print_fn=lambda s: None,
                           warmup_steps=warmup, resumed_at_step=resumed)
    for step in range(resumed + 1, 9):
        logger.step_start()
        clock.t += 1.0 if step <= resumed + slow else 0.25  # slow warm-up steps, then steady state
        logger.step_end(step, torch.tensor(1.0), torch.tensor(1.0), 1000)
        if logger.should_log(step):
            logger.log(step, lr=1e-3)
    logger.close()
    s = logger.summary()
    assert s["steady_from_step"] == expect_from
    assert s["tokens_per_s_per_gpu"] == pytest.approx(expect_tps)


def test_summary_leaves_out_the_windows_in_which_torch_compile_compiled(tmp_path):
    """A recompile late in a run (step 6 here) takes seconds: its window is not steady state. The records say how
    many of their steps compiled, and the summary says how many windows it left out."""
    clock = FakeClock()
    logger = MetricsLogger(metrics_cfg(), dump_folder=tmp_path, total_steps=8, device=torch.device("cpu"),
                           world_size=1, clock=clock, busy_timer=FakeBusy(clock, 1.0), print_fn=lambda s: None)
    for step in range(1, 9):
        logger.step_start()
        clock.t += 5.0 if step in (1, 6) else 0.25  # steps 1 and 6 compile
        logger.step_end(step, torch.tensor(1.0), torch.tensor(1.0), 1000, compiled=step in (1, 6))
        if logger.should_log(step):
            logger.log(step, lr=1e-3)
    logger.close()
    assert [r["compile_steps"] for r in logger.records] == [1, 0, 0, 1, 0]  # windows 1, 2, 3-4, 5-6, 7-8
    s = logger.summary()
    assert s["tokens_per_s_per_gpu"] == pytest.approx(1000 / 0.25) and s["steady_from_step"] == 2
    assert s["compiled_windows_left_out"] == 1


def test_trainer_warmup_steps_follow_the_compile_mode():
    from nsa_titan.config import load_job_config
    from nsa_titan.train import warmup_steps

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    base = ["--config", "train_configs/m7c_125m.toml", "--compile.enable", "--metrics.nsa_diagnostics", "false"]
    assert warmup_steps(load_job_config(base + ["--compile.step_graph"]), cuda, False) == 4
    assert warmup_steps(load_job_config(base + ["--compile.step_graph", "--compile.step_graph_warmup", "5"]), cuda,
                        True) == 6
    assert warmup_steps(load_job_config(base + ["--compile.mode", "reduce-overhead"]), cuda, False) == 2
    assert warmup_steps(load_job_config(base + ["--compile.mode", "auto"]), cuda, True) == 1  # FSDP: no graphs
    assert warmup_steps(load_job_config(base), cpu, False) == 1


def test_window_time_waits_for_the_device(tmp_path, monkeypatch):
    """The host runs ahead of the GPU: a window must end when its last step's GPU work has finished (the log
    step's sync), not when the host finished launching it. Simulated: launching a step takes 0.1 s of host
    time, running it 0.5 s of device time; a host read (.item()) waits for the device."""
    clock = FakeClock()
    device_done = [0.0]
    logger = MetricsLogger(metrics_cfg(), dump_folder=tmp_path, total_steps=6, device=torch.device("cpu"),
                           world_size=1, clock=clock, busy_timer=FakeBusy(clock, 1.0), print_fn=lambda s: None)
    real_item = torch.Tensor.item

    def item_waits(self):
        clock.t = max(clock.t, device_done[0])
        return real_item(self)

    monkeypatch.setattr(torch.Tensor, "item", item_waits)
    for step in range(1, 7):
        logger.step_start()
        clock.t += 0.1  # launch
        device_done[0] = max(device_done[0], clock.t) + 0.5
        logger.step_end(step, torch.tensor(1.0), torch.tensor(1.0), 1000)
        if logger.should_log(step):
            logger.log(step, lr=1e-3)
    logger.close()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 4, 6]
    # Windows after the first: the device idles while the first step is launched (0.1 s after the previous
    # log's sync), then runs two steps of 0.5 s back to back; reading the clock before the sync gave 0.2 s.
    assert [r["tokens_per_s_per_gpu"] for r in recs[2:]] == pytest.approx([2000 / 1.1] * 2)
    assert logger.summary()["last_window_tokens_per_s_per_gpu"] == pytest.approx(2000 / 1.1)


def test_gpu_busy_warning_when_cpu_bound(tmp_path):
    lines = []
    run_logger(tmp_path, busy_fraction=0.6, lines=lines)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["gpu_busy"] for r in recs] == pytest.approx([0.6] * 4)
    # step-1 window (compile / warm-up) never warns; later windows do
    assert [r["gpu_busy_warning"] for r in recs] == [False, True, True, True]
    assert "WARNING" not in lines[0] and "CPU-bound" in lines[1]


def test_metrics_hot_path_has_no_host_sync(tmp_path, monkeypatch):
    clock = FakeClock()
    logger = MetricsLogger(metrics_cfg(log_freq=100), dump_folder=tmp_path, total_steps=100,
                           device=torch.device("cpu"), clock=clock, print_fn=lambda s: None)

    def boom(*a, **k):
        raise AssertionError("host sync outside a log step")

    for name in ("item", "tolist", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for step in range(2, 5):
        logger.step_start()
        logger.step_end(step, torch.tensor(1.0), torch.tensor(1.0), 10)
    monkeypatch.undo()
    assert logger.log(4, lr=0.1)["loss"] == 1.0


def test_tensorboard_missing_warns_once(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "torch.utils.tensorboard":
            raise ImportError("no tensorboard")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    lines = []
    MetricsLogger(metrics_cfg(enable_tensorboard=True), dump_folder=tmp_path, total_steps=1,
                  device=torch.device("cpu"), print_fn=lines.append)
    assert len(lines) == 1 and "TensorBoard" in lines[0]


def test_tensorboard_events_written(tmp_path):
    pytest.importorskip("tensorboard")
    run_logger(tmp_path, busy_fraction=1.0)  # enable_tensorboard is off there: no events
    assert not (tmp_path / "tb").exists()
    logger = MetricsLogger(metrics_cfg(enable_tensorboard=True), dump_folder=tmp_path, total_steps=1,
                           device=torch.device("cpu"), print_fn=lambda s: None)
    logger.step_start()
    logger.step_end(1, torch.tensor(1.0), torch.tensor(1.0), 10)
    logger.log(1, lr=0.1)
    logger.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_peak_flops_table():
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_name("NVIDIA H200") == 989e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_name("NVIDIA GeForce RTX 3090") is None


# ---------------- train step ----------------
def make_batch(tokens, n_real):
    """[1, T] batch whose first n_real labels are real targets, the rest ignored."""
    x = torch.tensor([tokens])
    labels = torch.roll(x, -1, dims=1).clone()
    labels[0, n_real:] = IGNORE_INDEX
    return {"input": x, "labels": labels}


def grads_of(model, micro_batches, step=forward_backward):
    model.zero_grad(set_to_none=True)
    loss = step(model, micro_batches)
    return loss, [p.grad.clone() for p in model.parameters()]


def test_logits_are_freed_before_the_blocks_backward():
    """forward_backward must not keep the logits alive through the model's backward: the loss saved what it needs,
    and at the 1b's 64k a live name cost 3.9 GiB of peak memory. Checked when the first layer's gradient arrives."""
    import weakref

    torch.manual_seed(0)
    model, refs, seen = Tiny(), [], []

    class Watched(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            logits = self.inner(x)
            refs.append(weakref.ref(logits))
            return logits

    model.proj.weight.register_hook(lambda g: seen.append(refs[-1]() is None))
    # A loss whose backward node saves the logits themselves and releases them once it has run.
    forward_backward(Watched(), [make_batch([1, 2, 3, 4], 3)], loss_fn=lambda lg, lb: (lg * lg).sum())
    assert seen == [True]


def test_grad_accumulation_is_token_normalised():
    torch.manual_seed(0)
    model = Tiny()
    a = make_batch([1, 2, 3, 4, 5, 6, 7, 8], n_real=7)
    b = make_batch([9, 8, 7, 6, 5, 4, 3, 2], n_real=2)  # unequal real-token counts (7 vs 2)
    joint = {k: torch.cat([a[k], b[k]]) for k in a}
    loss_ga, g_ga = grads_of(model, [a, b])
    loss_one, g_one = grads_of(model, [joint])
    loss_ref, g_ref = grads_of(model, [a, b], step=reference_forward_backward)  # the oracle the DP tests use
    assert loss_ga == pytest.approx(loss_one.item(), rel=1e-6) and loss_ga == pytest.approx(loss_ref.item(), rel=1e-6)
    for x, y, z in zip(g_ga, g_one, g_ref):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-7)
    # The naive mean of per-micro-batch means differs, so this test can tell the two apart.
    _, g_a = grads_of(model, [a])
    _, g_b = grads_of(model, [b])
    assert not torch.allclose((g_a[0] + g_b[0]) / 2, g_one[0], atol=1e-6)


def test_train_step_clips_and_steps():
    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(model, opt_cfg(lr=0.1), "cpu")
    sched = build_lr_scheduler(opt, sched_cfg(warmup_steps=2), 4)
    before = [p.detach().clone() for p in model.parameters()]
    batch = make_batch([1, 2, 3, 4, 5, 6], n_real=5)
    params = list(model.parameters())
    loss, gnorm = train_step(model, opt, sched, [batch], params=params, max_norm=1e-3)
    assert gnorm.item() > 1e-3  # the returned norm is the pre-clip norm
    assert all(p.grad is None for p in params)  # zero_grad(set_to_none=True)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # scheduler advanced: warmup step 2 of 2
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert loss.item() > 0


def test_evaluate_matches_manual_loss():
    torch.manual_seed(0)
    model = Tiny().train()
    batches = [make_batch([1, 2, 3, 4], 3), make_batch([5, 6, 7, 8], 1)]
    calls = []

    def retrieval(logits, labels, is_retrieval):
        calls.append(is_retrieval)
        return torch.tensor(1.0), torch.tensor(2.0)

    out = evaluate(model, batches, torch.device("cpu"), retrieval_fn=retrieval)
    with torch.no_grad():
        logits = torch.cat([model(b["input"]) for b in batches])
        labels = torch.cat([b["labels"] for b in batches])
        ref = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    assert out["val_loss"] == pytest.approx(ref.item(), rel=1e-6)
    assert out["retrieval_acc"] == pytest.approx(0.5) and len(calls) == 2
    assert model.training  # mode restored


def test_world_from_env():
    assert world_from_env({}) == World(0, 0, 1)
    assert world_from_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}) == World(3, 1, 4)
    with pytest.raises(ValueError):
        world_from_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_forward_backward_and_clip_have_no_host_sync(monkeypatch):
    """The GA loop and grad clipping must not read device values (the optimizer's CPU step counters may)."""
    model = Tiny()
    batches = [make_batch([1, 2, 3, 4, 5], 4), make_batch([5, 4, 3, 2, 1], 2)]

    def boom(*a, **k):
        raise AssertionError("host sync in the hot path")

    for name in ("item", "tolist", "nonzero", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    loss = forward_backward(model, batches)
    norm = clip_grad_norm(model, list(model.parameters()), 1.0)
    norm_unclipped = clip_grad_norm(model, list(model.parameters()), 0.0)
    monkeypatch.undo()
    assert loss.item() > 0 and norm.item() > 0 and norm_unclipped.item() > 0


def test_expandable_segments_set_only_on_cuda_and_when_asked(monkeypatch):
    """training.expandable_segments reaches the CUDA caching allocator, and nothing happens on CPU or when off."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    configure_cuda_allocator(torch.device("cpu"), True)
    configure_cuda_allocator(torch.device("cuda", 0), False)
    assert calls == []
    configure_cuda_allocator(torch.device("cuda", 0), True)
    assert calls == ["expandable_segments:True"]
    assert load_job_config(["--training.expandable_segments"]).training.expandable_segments is True
