"""End-to-end CPU runs of nsa_titan.train.main (tiny NSA model on the embedded byte corpus)."""

import json

import pytest
import torch

from nsa_titan.config import ConfigError
from nsa_titan.train import main

# A 2-layer, 64-wide NSA model: big enough to learn byte statistics, small enough for a CPU test.
TINY = ["--model.flavor", "debug", "--model.n_layers", "2", "--model.dim", "64", "--model.ffn_hidden_dim", "192",
        "--model.n_heads", "4", "--model.n_kv_heads", "1", "--model.head_dim", "16", "--model.max_seq_len", "256"]


pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py says why


def run_args(tmp_path, *extra):
    return [*TINY, "--training.device", "cpu", "--training.seq_len", "256", "--training.local_batch_size", "4",
            "--training.steps", "80", "--metrics.log_freq", "10", "--optimizer.lr", "3e-3",
            "--lr_scheduler.warmup_steps", "10", "--job.dump_folder", str(tmp_path), *extra]


def test_debug_run_learns_and_writes_outputs(tmp_path, capsys):
    summary = main(run_args(tmp_path, "--metrics.val_freq", "40", "--metrics.val_steps", "2"))
    out = capsys.readouterr().out
    assert "[training]" in out and "GFLOP/token" in out  # resolved config and model line printed
    assert "attn_impl=torch (auto)" in out  # what runs, not the setting 'auto'

    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["type"] == "train"]
    val = [r for r in recs if r["type"] == "val"]
    assert [r["step"] for r in train] == [1, 10, 20, 30, 40, 50, 60, 70, 80]
    assert [r["step"] for r in val] == [40, 80]
    first, last = train[0]["loss"], train[-1]["loss"]
    print(f"loss {first:.3f} -> {last:.3f}, {summary['tokens_per_s']:.0f} tok/s")
    assert last < first - 1.0, (first, last)
    assert val[-1]["val_loss"] < first - 1.0
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None and r["gpu_busy"] is None for r in train)

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["steps"] == 80 and not on_disk["interrupted"]
    assert on_disk["initial_loss"] == pytest.approx(first) and on_disk["final_loss"] == pytest.approx(last)
    assert on_disk["tokens"] == 80 * 4 * 256
    assert on_disk["config"]["training"]["steps"] == 80 and on_disk["model"]["params"] > 0
    assert on_disk["torch"] and on_disk["device"].startswith("cpu")
    assert on_disk["model"]["attn_impl"] == "torch" and on_disk["model"]["args"]["attn_impl"] == "auto"


def test_grad_accumulation_run(tmp_path):
    summary = main(run_args(tmp_path, "--training.steps", "3", "--training.grad_accum_steps", "2",
                            "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1"))
    assert summary["steps"] == 3 and summary["tokens"] == 3 * 2 * 4 * 256


def test_keyboard_interrupt_writes_partial_summary(tmp_path, monkeypatch):
    import nsa_titan.train as train_mod

    real_step, calls = train_mod.train_step, []

    def interrupted_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_mod, "train_step", interrupted_step)
    summary = main(run_args(tmp_path, "--metrics.log_freq", "1"))
    assert summary["interrupted"] and summary["steps"] == 2
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["interrupted"] and on_disk["steps"] == 2 and on_disk["final_loss"] is not None


def test_unknown_flavor_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown flavor 'gigantic'.*debug"):
        main(["--model.flavor", "gigantic", "--job.dump_folder", str(tmp_path)])


def test_tokenizer_larger_than_model_vocab(tmp_path):
    with pytest.raises(ValueError, match="--model.vocab_size 260"):
        main(run_args(tmp_path, "--model.vocab_size", "100"))


def test_warmup_longer_than_run(tmp_path):
    with pytest.raises(ValueError, match="warmup_steps"):
        main(run_args(tmp_path, "--training.steps", "5", "--lr_scheduler.warmup_steps", "10"))


def test_multi_process_degrees_checked_before_any_process_group(tmp_path, monkeypatch):
    # Two-process training itself is tested in test_parallelisms.py (run_train.sh with NGPU=2 on gloo).
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="dp_replicate=3 does not divide the world size 2"):
        main(run_args(tmp_path, "--parallelism.dp_replicate", "3"))


def test_compiled_run_compiles_what_it_expects_and_trains_like_eager(tmp_path):
    """compile.enable with validation: the blocks' graphs (training, no_grad evaluation) and the compiled loss's
    (compile.loss, default on: training, evaluation) are expected, not recompiles, and the losses match an eager run
    up to fp32 summation order. Catches a compiled loss wired to the wrong tensors or left out of validation, and a
    compile counter that reports the loss's graphs as recompiles."""
    torch._dynamo.reset()  # graphs cached by other tests' compiles would not be compiled (nor counted) here
    runs = {}
    for mode in ("compiled", "eager"):
        summary = main(run_args(tmp_path / mode, "--training.steps", "2", "--metrics.log_freq", "1",
                                "--lr_scheduler.warmup_steps", "1", "--metrics.val_freq", "2",
                                "--metrics.val_steps", "1", "--metrics.nsa_diagnostics", "false",
                                *(["--compile.enable"] if mode == "compiled" else [])))
        recs = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        runs[mode] = summary, [r["loss"] for r in recs if r["type"] == "train"], \
            [r["val_loss"] for r in recs if r["type"] == "val"]
        # The trainer marks the steps that compiled (step 1's blocks and loss; validation compiles between steps).
        assert [r["compile_steps"] for r in recs if r["type"] == "train"] == ([1, 0] if mode == "compiled" else [0, 0])
    stats = runs["compiled"][0]["compile"]
    assert stats == {**stats, "graphs": 4, "expected_graphs": 4, "recompiles": 0}, stats  # 1 + 1 blocks, 2 loss
    assert runs["compiled"][1] == pytest.approx(runs["eager"][1], rel=1e-4)
    assert runs["compiled"][2] == pytest.approx(runs["eager"][2], rel=1e-4) and len(runs["eager"][2]) == 1
