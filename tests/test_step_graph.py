"""compile.step_graph's bookkeeping on the CPU (components/step_graph.py): the CUDA capture itself needs a GPU
(benchmarks/step_graph_probe.py checks a replay bitwise against an eager step there); here an eager stand-in with
the same contract shows that what surrounds it (static batch buffers, the learning rate tensors, the scheduler,
copied outputs, the non-finite guard's records) trains exactly as the plain train_step does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from _step_graph_stand_in import stand_in
from nsa_titan.components.lr_scheduler import build_lr_scheduler
from nsa_titan.components.step_graph import StepGraph
from nsa_titan.components.train_step import train_step
from nsa_titan.config import load_job_config
from nsa_titan.fault.failure import NonFiniteGuard

VOCAB, T, B = 32, 16, 2


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.out = nn.Linear(24, VOCAB)

    def forward(self, x):
        return self.out(torch.tanh(self.emb(x)))


def _batches(steps: int, ga: int = 2) -> list[list[dict]]:
    g = torch.Generator().manual_seed(7)
    return [[{"input": torch.randint(0, VOCAB, (B, T), generator=g),
              "labels": torch.randint(0, VOCAB, (B, T), generator=g)} for _ in range(ga)] for _ in range(steps)]


def _setup(tensor_lr: bool = False):
    """``tensor_lr``: the learning rate a float32 tensor, as the captured step reads it (the scheduler fills it)."""
    torch.manual_seed(0)
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # fused takes a tensor lr on the CPU too
    cfg = load_job_config(["--lr_scheduler.warmup_steps", "3", "--lr_scheduler.decay_type", "cosine"])
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, 8)  # the lr changes every step: a stale one would show
    if tensor_lr:  # after the scheduler took its float base lr; it fills the tensor from then on
        for g in opt.param_groups:
            g["lr"] = torch.tensor(float(g["lr"]))
    return model, opt, sched


def _step_fn(model, opt):
    params = [p for p in model.parameters()]
    return lambda batches, sched: train_step(model, opt, sched, batches, params=params, max_norm=1.0)


def test_step_graph_trains_exactly_as_the_plain_step():
    """Bitwise against train_step with the learning rate as a float32 tensor: what the replayed AdamW reads. (A
    Python float lr differs from it by one float32 rounding of the lr: 1.2e-7 in the weights here on the CPU.)"""
    steps = _batches(7)
    model, opt, sched = _setup(tensor_lr=True)
    plain = []
    for mbs in steps:
        plain.append(_step_fn(model, opt)(mbs, sched)[0].item())
    expected = [p.detach().clone() for p in model.parameters()]

    model, opt, sched = _setup()
    graph = StepGraph(_step_fn(model, opt), opt, sched, warmup_steps=2, device=torch.device("cpu"),
                      capture=stand_in(opt))
    graphed, lrs = [], []
    for i, mbs in enumerate(steps):
        lrs.append(sched.get_last_lr()[0])
        loss, grad_norm = graph(mbs)
        graphed.append(loss.item())
        assert graph.captured == (i >= 2)  # two eager warm-up steps, then capture + replay
        if graph.captured:
            assert loss is not graph._outputs[0]  # a copy: the next replay overwrites the captured output
            assert isinstance(opt.param_groups[0]["lr"], float)  # checkpoints keep float learning rates
            assert graph._lr[0].item() == pytest.approx(lrs[-1], rel=1e-6)  # filled from the scheduler per step
    assert len(set(lrs[2:])) == 4  # the replayed steps: each with its own learning rate (a stale one would show)
    assert graphed == plain
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p.detach(), e)
    assert sched.last_epoch == len(steps)  # stepped once per step, outside the captured step


def test_step_graph_rejects_a_batch_unlike_the_captured_one():
    model, opt, sched = _setup()
    graph = StepGraph(_step_fn(model, opt), opt, sched, warmup_steps=1, device=torch.device("cpu"),
                      capture=stand_in(opt))
    first, second = _batches(2)
    graph(first)
    graph(second)  # captured with these shapes
    short = [{k: v[:, : T // 2] for k, v in mb.items()} for mb in first]
    with pytest.raises(ValueError, match="compile.step_graph") as err:
        graph(short)
    assert "local_batch_size" in str(err.value) and f"({B}, {T // 2})" in str(err.value)


def test_guard_records_each_replayed_step_with_its_own_number():
    """In graph-safe form the guard's step number is a device tensor and each step's flag is recorded after the
    step (the captured Python runs once): the first bad step and the skipped steps come out right."""
    model, opt, _ = _setup()
    guard = NonFiniteGuard("skip", torch.device("cpu"))
    guard.use_step_graph()
    for step in range(1, 6):
        guard.step_start(step)
        loss = torch.tensor(float("nan") if step in (3, 5) else 1.0)
        guard.before_optimizer_step(opt, loss, torch.tensor(1.0))
        assert guard.check() is None  # nothing recorded until the step has run (the last check read the rest)
        guard.record_graphed_step()
        report = guard.check()
        if step in (3, 5):
            assert report.first_step == 3 and guard.skipped_steps == [3, 5][: report.count]
        else:
            assert report is None
    assert guard.skipped_steps == [3, 5]


def test_trainer_refuses_a_step_graph_without_a_gpu(tmp_path):
    """training.device 'auto' on a machine without a GPU: a config error naming the flag, before any model is built."""
    from nsa_titan.config import ConfigError
    from nsa_titan.train import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the step graph would run")
    config = Path(__file__).resolve().parents[1] / "train_configs" / "debug_model.toml"
    with pytest.raises(ConfigError, match="compile.step_graph") as err:
        main(["--config", str(config), "--compile.step_graph", "--metrics.nsa_diagnostics", "false",
              "--training.steps", "20", "--job.dump_folder", str(tmp_path)])
    assert "run on a GPU" in str(err.value)


def test_trainer_with_a_step_graph_trains_as_without(tmp_path, monkeypatch):
    """The trainer's wiring of compile.step_graph (train.py): the eager stand-in in place of the CUDA capture, a
    tiny model with grad accumulation and validation between replays, against the same run without it. The losses
    match to float32 rounding of the learning rate (the replays read it from a float32 tensor); a scheduler stepped
    twice, a batch not loaded or a guard record missing would not."""
    import json

    import nsa_titan.train as train_mod
    from nsa_titan.train import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: training.device 'auto' would train there")
    made = []

    class CPUStepGraph(StepGraph):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            eager_capture, self.replays = stand_in(self.optimizer), 0

            def capture(fn):
                outputs, replay, release = eager_capture(fn)

                def counted():
                    self.replays += 1
                    replay()

                return outputs, counted, release

            self._capture_fn = capture
            made.append(self)

    monkeypatch.setattr(train_mod, "StepGraph", CPUStepGraph)
    monkeypatch.setattr(train_mod, "require_cuda", lambda device: None)
    torch.set_num_threads(1)
    tiny = ["--model.flavor", "debug", "--model.n_layers", "2", "--model.dim", "64", "--model.ffn_hidden_dim", "192",
            "--model.n_heads", "4", "--model.n_kv_heads", "1", "--model.head_dim", "16", "--model.max_seq_len", "128",
            "--training.seq_len", "128", "--training.local_batch_size", "2", "--training.grad_accum_steps", "2",
            "--training.steps", "12", "--metrics.log_freq", "1", "--metrics.val_freq", "5", "--metrics.val_steps", "1",
            "--metrics.nsa_diagnostics", "false", "--lr_scheduler.warmup_steps", "3", "--optimizer.lr", "3e-3"]
    runs = {}
    for name, extra in (("plain", []), ("graphed", ["--compile.step_graph"])):
        main([*tiny, *extra, "--job.dump_folder", str(tmp_path / name)])
        recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = recs
    # 3 eager warm-up steps, then the capture and 9 replays; the trainer released the graph at the end
    assert len(made) == 1 and made[0].replays == 9 and not made[0].captured
    for kind in ("train", "val"):
        plain = [(r["step"], r["loss" if kind == "train" else "val_loss"]) for r in runs["plain"] if r["type"] == kind]
        graphed = [(r["step"], r["loss" if kind == "train" else "val_loss"]) for r in runs["graphed"]
                   if r["type"] == kind]
        assert [s for s, _ in graphed] == [s for s, _ in plain] and len(plain) >= 2
        for (_, a), (_, b) in zip(plain, graphed):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    lrs = [r["lr"] for r in runs["graphed"] if r["type"] == "train"]
    assert lrs == [r["lr"] for r in runs["plain"] if r["type"] == "train"]
