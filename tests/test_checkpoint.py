"""Checkpoints: exact resume (bit-identical losses on CPU), async save, keep_latest_k, atomicity under SIGKILL,
fallback from a corrupt checkpoint, named / bad resume sources, model-only export."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from _ckpt_util import STEPS, StopAt, args, ckpt_args, explain, losses, run, run_ranks, run_worker
from _fault_worker import full_state
from nsa_titan.checkpoint import inspect_checkpoint, list_checkpoints, step_dir_name
from nsa_titan.checkpoint.state import reshard_loader_state
from nsa_titan.config import ConfigError
from nsa_titan.fault import TrainHooks

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py says why


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: STEPS steps in one go, no checkpointing."""
    dump = tmp_path_factory.mktemp("straight")
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        run(args(dump))
    return losses(dump)


def first_half(dump, *extra, stop=11):
    summary, out = run(ckpt_args(dump, *extra), hooks=StopAt(stop))
    assert summary["interrupted"] and summary["steps"] == stop - 1
    return losses(dump), out


def assert_same(straight, got, steps):
    diff = {s: (straight[s], got.get(s)) for s in steps if got.get(s) != straight[s]}
    assert not diff, f"losses differ from the straight run at steps {diff}"


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_exact_resume(tmp_path, straight, mode):
    """10 steps + resume + 10 == 20 straight, bit for bit; async saves stage a copy (training goes on)."""
    a, out = first_half(tmp_path, "--checkpoint.async_mode", mode, "--checkpoint.keep_latest_k", "2")
    assert ("writing in the background" in out) == (mode == "async")
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [5, 10]
    _, out = run(ckpt_args(tmp_path, "--checkpoint.async_mode", mode, "--checkpoint.keep_latest_k", "2"))
    assert "resumed from" in out and step_dir_name(10) in out
    b = losses(tmp_path)
    assert sorted(b) == list(range(11, STEPS + 1))  # the resumed run did not redo steps 1..10
    log = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The resumed run appended: the first run's steps 1..10 are kept, then a resume marker at step 10.
    assert [(r["type"], r["step"]) for r in log if r["type"] in ("train", "resume")] == [
        *(("train", s) for s in range(1, 11)), ("resume", 10), *(("train", s) for s in range(11, STEPS + 1))]
    assert_same(straight, {**a, **b}, range(1, STEPS + 1))
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [15, 20]  # keep_latest_k=2
    meta, problem = inspect_checkpoint(tmp_path / "checkpoints" / step_dir_name(20))
    assert problem is None and meta["step"] == 20 and meta["tokens_seen"] == STEPS * 2 * 64
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tokens"] == STEPS * 2 * 64  # the token count continues across the resume


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, straight):
    """A SIGKILL after every file of step 10 is written but before it is committed: step 5 stays intact,
    the half-done step 10 is never used, and the resumed run loses nothing."""
    proc = run_worker("sigkill_commit", 10, ckpt_args(tmp_path))
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-3000:]
    folder = tmp_path / "checkpoints"
    assert (folder / f".tmp-{step_dir_name(10)}").is_dir()  # the killed save's files are there...
    assert [s for s, _ in list_checkpoints(folder)] == [5]  # ...but invisible
    _, out = run(ckpt_args(tmp_path))
    assert f"removing .tmp-{step_dir_name(10)}" in out and f"resumed from {folder / step_dir_name(5)}" in out
    assert_same(straight, losses(tmp_path), range(6, STEPS + 1))


def test_corrupt_latest_checkpoint_falls_back(tmp_path, straight):
    first_half(tmp_path)
    folder = tmp_path / "checkpoints"
    # Same size, garbage content: passes the size check, fails in DCP's reader.
    data = next(p for p in (folder / step_dir_name(10)).iterdir() if p.suffix == ".distcp")
    data.write_bytes(b"\0" * data.stat().st_size)
    _, out = run(ckpt_args(tmp_path))
    assert f"loading checkpoint {folder / step_dir_name(10)} failed" in out and "falling back" in out
    assert f"resumed from {folder / step_dir_name(5)}" in out
    assert_same(straight, losses(tmp_path), range(6, STEPS + 1))


def test_partial_checkpoints_are_detected(tmp_path):
    first_half(tmp_path, stop=6)
    ckpt = tmp_path / "checkpoints" / step_dir_name(5)
    assert inspect_checkpoint(ckpt)[1] is None
    copies = {}
    for name, damage in [("truncated", "truncate"), ("no_marker", "marker"), ("no_metadata", "metadata")]:
        bad = tmp_path / name
        shutil.copytree(ckpt, bad)
        if damage == "truncate":
            f = next(p for p in bad.iterdir() if p.suffix == ".distcp")
            f.write_bytes(f.read_bytes()[:100])
        elif damage == "marker":
            (bad / "nsa_checkpoint.json").unlink()
        else:
            (bad / ".metadata").unlink()
        copies[name] = inspect_checkpoint(bad)[1]
    assert "bytes" in copies["truncated"] and "did not finish" in copies["no_marker"]
    assert ".metadata is missing" in copies["no_metadata"]
    # 'latest' skips a partial newest checkpoint with a report, and uses the older complete one.
    newer = tmp_path / "checkpoints" / step_dir_name(7)
    shutil.copytree(tmp_path / "truncated", newer)
    _, out = run(ckpt_args(tmp_path, steps=6))
    assert f"{newer} is incomplete or corrupt" in out and f"resumed from {ckpt}" in out


def test_named_checkpoint_and_bad_resume_sources(tmp_path, monkeypatch):
    first_half(tmp_path, stop=6)
    _, out = run(ckpt_args(tmp_path, "--checkpoint.resume_from", step_dir_name(5), steps=6))
    assert f"resumed from {tmp_path / 'checkpoints' / step_dir_name(5)}" in out

    import nsa_titan.train as train_mod

    def no_model(*a, **k):
        raise AssertionError("the model was built before the bad checkpoint source was reported")

    monkeypatch.setattr(train_mod, "build_training_model", no_model)
    with pytest.raises(ConfigError, match=r"checkpoint.resume_from: '/no/such/ckpt' is not a complete checkpoint "
                                          r"\(does not exist\).*step-00000005"):
        run(ckpt_args(tmp_path, "--checkpoint.resume_from", "/no/such/ckpt"))
    (tmp_path / "half").mkdir()
    with pytest.raises(ConfigError, match="checkpoint.resume_from: .*did not finish"):
        run(ckpt_args(tmp_path, "--checkpoint.resume_from", str(tmp_path / "half")))
    with pytest.raises(ConfigError, match=r"holds another model \(model.dim: checkpoint 64, this run 32"):
        run(ckpt_args(tmp_path, "--model.dim", "32"))


def test_fresh_start_ignores_and_replaces_old_checkpoints(tmp_path):
    first_half(tmp_path, stop=6)
    _, out = run(ckpt_args(tmp_path, "--checkpoint.resume_from", "none", steps=5))
    assert "resumed" not in out and [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [5]


def test_model_export_bf16_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.torch")  # run_tests.sh installs it; the library keeps it optional
    from nsa_titan.checkpoint.export import export_checkpoint

    captured = {}

    class Capture(TrainHooks):
        def on_train_start(self, ctx):
            captured["model"] = ctx["model"]

    run(ckpt_args(tmp_path, "--checkpoint.export_at_end", steps=3), hooks=Capture())
    out = tmp_path / "checkpoints" / f"export-{step_dir_name(3)}"
    tensors = st.load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert config["nsa_model_args"]["dim"] == 64 and config["torch_dtype"] == "bfloat16"
    names = set(tensors)
    for expected in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                     "model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.compress_k.fc1.weight",
                     "model.layers.0.mlp.gate_proj.weight", "model.layers.0.post_attention_layernorm.weight"):
        assert expected in names
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    params = dict(captured["model"].named_parameters())
    assert len(tensors) == len(params)
    for new, old in config["names"].items():
        assert torch.equal(tensors[new], params[old].detach().to(torch.bfloat16)), new
    # The tokenizer travels with the weights: its special ids for generate(), and what it was (byte-level here).
    from nsa_titan.data import build_tokenizer

    byte = build_tokenizer("byte")
    assert (config["eos_token_id"], config["bos_token_id"]) == (byte.eos_id, byte.bos_id)
    assert json.loads((out / "nsa_tokenizer.json").read_text()) == {"kind": "byte", "files": []}
    # The offline exporter reads the same weights back from the DCP checkpoint.
    offline = export_checkpoint(tmp_path / "checkpoints" / step_dir_name(3), tmp_path / "offline")
    again = st.load_file(str(offline / "model.safetensors"))
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)


def test_export_without_safetensors_says_how_to_fix(monkeypatch):
    import importlib.util

    from nsa_titan.checkpoint.export import require_safetensors
    from nsa_titan.config import load_job_config

    monkeypatch.setitem(sys.modules, "safetensors", None)  # makes `import safetensors` raise ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match="pip install safetensors"):
        require_safetensors()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "safetensors" else real(n, *a))
    with pytest.raises(ConfigError, match="checkpoint.export_at_end: needs the `safetensors` package"):
        load_job_config(["--checkpoint.export_at_end"])


def test_reshard_loader_state_keeps_the_global_sample_count():
    saved = {"sample_index": 12, "world_size": 2, "rank": 0, "chunks_per_rank": 50, "seed": 1, "seq_len": 64}
    mine = {"sample_index": 0, "world_size": 1, "rank": 0, "chunks_per_rank": 100, "seed": 1, "seq_len": 64}
    out = reshard_loader_state(saved, mine)
    assert out["sample_index"] == 24 and out["world_size"] == 1 and out["chunks_per_rank"] == 100
    back = reshard_loader_state(out, {**saved, "rank": 1, "sample_index": 0})
    assert back["sample_index"] == 12 and back["rank"] == 1


def _same_state(want: dict, got: dict) -> None:
    assert sorted(want) == sorted(got)
    diff = [k for k in want if not torch.equal(want[k], got[k])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[:3]}"


def _copy_checkpoint(src_dump, step, dst_dump):
    name = step_dir_name(step)
    shutil.copytree(src_dump / "checkpoints" / name, dst_dump / "checkpoints" / name)


def test_two_rank_exact_resume_and_resharding(tmp_path):
    """2 gloo ranks: FSDP2 10 + resume + 10 == 20 straight (bit-identical); the FSDP2 checkpoint loads on 1
    rank (2 -> 1) with identical unsharded model and optimizer state; a 1-rank checkpoint loads under DDP
    (1 -> 2), DDP saves one, FSDP1 loads that one (DDP -> FSDP1) and saves one that 1 rank loads, each time
    with identical unsharded state."""
    d = {k: tmp_path / k for k in ("fsdp2", "resumed", "one", "ddp", "fsdp1", "back")}
    for path in d.values():
        path.mkdir()
    # async_mode: the background writes (on their own gloo group) must be exactly the state at the save step.
    res = run_ranks("none", 0, ckpt_args(d["fsdp2"] / "dump", "--checkpoint.keep_latest_k", "0",
                                         "--checkpoint.async_mode", "async"), tmp_path=d["fsdp2"],
                    worker_opts=("--ref", f"11:{tmp_path / 'after10.pt'}"))
    assert all(r["returncode"] == 0 for r in res), explain(res)
    straight = losses(d["fsdp2"] / "dump")

    _copy_checkpoint(d["fsdp2"] / "dump", 10, d["resumed"] / "dump")
    res = run_ranks("none", 0, ckpt_args(d["resumed"] / "dump"), tmp_path=d["resumed"])
    assert all(r["returncode"] == 0 for r in res), explain(res)
    assert_same(straight, losses(d["resumed"] / "dump"), range(11, STEPS + 1))

    class Capture(TrainHooks):
        def on_train_start(self, ctx):
            self.ctx, self.start = ctx, full_state(ctx["model"], ctx["optimizer"])

    cap = Capture()
    _copy_checkpoint(d["fsdp2"] / "dump", 10, d["one"])
    _, out = run(ckpt_args(d["one"], steps=12), hooks=cap)
    assert "saved by 2 rank(s), resumed on 1" in out
    _same_state(torch.load(tmp_path / "after10.pt"), cap.start)  # 2 -> 1
    after12 = full_state(cap.ctx["model"], cap.ctx["optimizer"])

    _copy_checkpoint(d["one"], 12, d["ddp"] / "dump")
    res = run_ranks("none", 0, ckpt_args(d["ddp"] / "dump", "--parallelism.data_parallel", "ddp", steps=14,
                                         interval=13), tmp_path=d["ddp"],
                    worker_opts=("--ref", f"0:{tmp_path / 'ddp_start.pt'}", "--ref", f"14:{tmp_path / 'ddp13.pt'}"))
    assert all(r["returncode"] == 0 for r in res), explain(res)
    _same_state(after12, torch.load(tmp_path / "ddp_start.pt"))  # 1 -> 2 (DDP)

    _copy_checkpoint(d["ddp"] / "dump", 13, d["fsdp1"] / "dump")
    res = run_ranks("none", 0, ckpt_args(d["fsdp1"] / "dump", "--parallelism.data_parallel", "fsdp1", steps=15,
                                         interval=14), tmp_path=d["fsdp1"],
                    worker_opts=("--ref", f"0:{tmp_path / 'fsdp1_start.pt'}",
                                 "--ref", f"15:{tmp_path / 'fsdp1_14.pt'}"))
    assert all(r["returncode"] == 0 for r in res), explain(res)
    _same_state(torch.load(tmp_path / "ddp13.pt"), torch.load(tmp_path / "fsdp1_start.pt"))  # DDP -> FSDP1

    cap = Capture()
    _copy_checkpoint(d["fsdp1"] / "dump", 14, d["back"])
    run(ckpt_args(d["back"], steps=14), hooks=cap)
    _same_state(torch.load(tmp_path / "fsdp1_14.pt"), cap.start)  # FSDP1 saves -> 1 rank


def test_state_dict_names_do_not_depend_on_wrappers():
    """Activation checkpointing and compile wrap the blocks; checkpoint keys must stay the plain module names,
    or a checkpoint could not move between configurations."""
    from nsa_titan.checkpoint.state import dcp_state_dict, rng_state
    from nsa_titan.components.optimizer import build_optimizer
    from nsa_titan.config import load_job_config
    from nsa_titan.models import build_model
    from nsa_titan.parallelisms import ParallelDims, parallelize_nsa

    keys = []
    for extra in ([], ["--compile.enable", "--activation_checkpoint.mode", "full"],
                  ["--activation_checkpoint.mode", "selective_op"]):
        cfg = load_job_config(["--training.device", "cpu", "--model.n_layers", "2", "--model.attn_impl", "torch",
                               *extra])
        with torch.device("meta"):
            model = build_model(cfg.model_args())
        model = parallelize_nsa(model, ParallelDims.from_config(1, cfg.parallelism), cfg, torch.device("cpu"))
        opt = build_optimizer(model, cfg.optimizer, "cpu", require_fused=True)
        host = {"train_state": {}, "lr_scheduler": {}, "loader": {}, "rng": rng_state(torch.device("cpu"))}
        state = dcp_state_dict(model, opt, host, rank=0)
        keys.append((sorted(state["model"]), sorted(state["optimizer"])))
        assert not any("_orig_mod" in k or "checkpoint_wrapped" in k for k in state["model"])
    assert keys[0] == keys[1] == keys[2]
