"""Generation, weight loading, perplexity and needle evaluation; CPU smoke runs of the GPU scripts."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from nsa_titan.checkpoint.load import load_weights, read_safetensors, saved_model_args, write_safetensors
from nsa_titan.data import ByteTokenizer, RetrievalTask
from nsa_titan.eval import compare, needle, perplexity, retrieval_diagnostics
from nsa_titan.eval import compare_report as report
from nsa_titan.generate import generate, sample_next
from nsa_titan.generate import main as generate_main
from nsa_titan.models import build_model, get_model_args

REPO = Path(__file__).resolve().parents[1]
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=96, cmp_block=8,
            cmp_stride=4, slc_block=16, slc_top_n=4, window=24, max_seq_len=256, attn_impl="torch")
TINY_FLAGS = [x for k, v in TINY.items() for x in (f"--model.{k}", str(v))]


def tiny_model(seed=0, **kw):
    with torch.device("meta"):
        model = build_model(get_model_args("debug", **{**TINY, **kw}))
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model.eval()


def test_greedy_generation_equals_argmax_of_full_forwards():
    model = tiny_model()
    prompt = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
    new, stats = generate(model, prompt, 12)
    seq = prompt
    for _ in range(12):  # no cache: re-run the whole sequence each time
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(new, seq[:, 21:]) and stats["new_tokens"] == 12


def test_sampling_seed_top_p_and_eos():
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.0, -3.0]]).repeat(64, 1)
    draw = lambda seed, **kw: sample_next(logits, generator=torch.Generator().manual_seed(seed), **kw)  # noqa: E731
    assert torch.equal(sample_next(logits), torch.zeros(64, 1, dtype=torch.long))  # temperature 0: greedy
    assert torch.equal(draw(1, temperature=1.0), draw(1, temperature=1.0))
    assert not torch.equal(draw(1, temperature=1.0), draw(2, temperature=1.0))
    assert set(draw(3, temperature=1.0, top_p=0.7).flatten().tolist()) == {0, 1}  # the nucleus is {0, 1}
    assert set(draw(3, temperature=1.0, top_p=0.3).flatten().tolist()) == {0}
    model = tiny_model()
    prompt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    first = generate(model, prompt, 1)[0].item()
    new, _ = generate(model, prompt, 10, eos_id=first)  # stops as soon as every row emitted "EOS"
    assert new.tolist() == [[first]]
    # Two rows: a row that emitted EOS keeps emitting it while the other goes on.
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    free, _ = generate(model, prompt, 8)
    eos = next(x for x in free[0].tolist()[:-1] if x not in free[1].tolist())
    new, _ = generate(model, prompt, 8, eos_id=eos)
    stop = free[0].tolist().index(eos)
    assert new[0].tolist() == free[0, :stop + 1].tolist() + [eos] * (7 - stop) and torch.equal(new[1], free[1])


def test_weights_roundtrip_all_formats(tmp_path):
    src = tiny_model(seed=1)
    tokens = torch.randint(0, 256, (1, 40))
    want = src(tokens)
    sd = src.state_dict()
    # torch.save of a compiled model's state dict, nested as a trainer might store it
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in sd.items()}}, tmp_path / "w.pt")
    # export folder: bf16 safetensors with renamed tensors + config.json (names table, model args)
    export = tmp_path / "export"
    export.mkdir()
    write_safetensors({f"hf.{k}": v.to(torch.bfloat16) for k, v in sd.items() if "rope" not in k},
                      export / "model.safetensors")
    (export / "config.json").write_text(json.dumps({"names": {f"hf.{k}": k for k in sd},
                                                    "nsa_model_args": {**TINY, "dim": 64}}))
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {k: v for k, v in sd.items() if "rope" not in k}}, checkpoint_id=str(tmp_path / "dcp"),
             no_dist=True)
    for path, tol in ((tmp_path / "w.pt", 0.0), (export, 0.05), (tmp_path / "dcp", 0.0)):
        dst = tiny_model(seed=2)
        load_weights(dst, path)
        assert (dst(tokens) - want).abs().max().item() <= tol, path
    assert read_safetensors(export / "model.safetensors")["hf.output.weight"].dtype == torch.bfloat16
    assert saved_model_args(export)["dim"] == 64 and saved_model_args(tmp_path / "w.pt") is None
    with pytest.raises(ValueError, match="do not fit"):
        load_weights(tiny_model(n_layers=3), tmp_path / "w.pt")
    with pytest.raises(ValueError, match="lacks this model's tensors"):
        load_weights(tiny_model(attn_type="dense"), tmp_path / "dcp")


def test_generate_cli_loads_checkpoint_and_is_seeded(tmp_path, capsys):
    torch.save(tiny_model(seed=3).state_dict(), tmp_path / "m.pt")
    argv = ["--checkpoint", str(tmp_path / "m.pt"), "--prompt", "def f(x):", "--max-new-tokens", "6",
            "--temperature", "0.9", "--top-p", "0.9", "--json", "--no-stop-at-eos", *TINY_FLAGS]
    a, b = generate_main([*argv, "--seed", "5"]), generate_main([*argv, "--seed", "5"])
    assert a["tokens"] == b["tokens"] and len(a["tokens"][0]) == 6
    assert generate_main([*argv, "--seed", "6"])["tokens"] != a["tokens"]
    for wrong_model in (["--model.n_layers", "1"], ["--model.attn_type", "dense"]):
        with pytest.raises(ValueError, match="do not fit"):
            generate_main([*argv, *wrong_model])
    capsys.readouterr()


def test_needle_bins_queries_by_depth_and_scales_only_the_filler():
    kw = dict(num_pairs=6, num_queries=6, key_len=1, value_len=2, min_gap=24)
    short, long = (RetrievalTask(ByteTokenizer(), n, stream=needle.NEEDLE_STREAM, **kw) for n in (128, 512))
    _, labels, depth = needle.draw_batch(long, [0, 1])
    assert labels.shape == (2, 512) and depth.shape == (2, 6) and ((labels != -100).sum(1) == 12).all()
    assert needle.depth_bin_of(np.array([0.0, 0.24, 0.25, 0.99, 1.0]), 4).tolist() == [0, 0, 1, 3, 3]
    # Longer contexts keep the pairs and queries and push the pairs further from their queries.
    gap = lambda task: np.mean([(lay.answer_pos - lay.pair_value_pos).mean()  # noqa: E731
                                for lay in (task.sample_with_layout(i)[2] for i in range(8))])
    assert gap(long) > 2 * gap(short)


class _Oracle(nn.Module):
    """Predicts the true next token of the samples it was given, except at the answers of the queries whose
    depth bin is in ``wrong_bins`` (there it predicts token 0)."""

    def __init__(self, task, n, wrong_bins=()):
        super().__init__()
        self.next = {}
        for i in range(n):
            tokens, _, lay = task.sample_with_layout(i)
            nxt = torch.as_tensor(tokens[1:]).clone()
            for a, b in zip(lay.answer_pos, needle.depth_bin_of(lay.depth, 2)):
                if b in wrong_bins:
                    nxt[a - 1] = 0
            self.next[tuple(tokens[:-1].tolist())] = nxt

    def forward(self, tokens):
        return torch.nn.functional.one_hot(torch.stack([self.next[tuple(t.tolist())] for t in tokens]), 260).float()


def test_needle_eval_counts_correct_queries_per_depth_bin():
    tok = ByteTokenizer()
    kw = dict(num_pairs=8, num_queries=8, key_len=1, value_len=1, min_gap=16)
    task = RetrievalTask(tok, 128, stream=needle.NEEDLE_STREAM, **kw)
    run = lambda model: needle.evaluate_needle(model, tok, lengths=[128], depth_bins=2, samples=3,  # noqa: E731
                                               device=torch.device("cpu"), batch_size=2, task_kwargs=kw,
                                               log=lambda _: None)
    right, half = run(_Oracle(task, 3)), run(_Oracle(task, 3, wrong_bins=(1,)))
    assert [r["accuracy"] for r in right] == [1.0, 1.0] and sum(r["queries"] for r in right) == 3 * 8
    assert [r["accuracy"] for r in half] == [1.0, 0.0]
    by_len = needle.accuracy_by_length(half)[128]
    assert abs(by_len - half[0]["queries"] / 24) < 1e-9
    assert "| 128 | 100.0 | 0.0 |" in needle.accuracy_table(half, "nsa")
    results = {"nsa": {"accuracy_by_length": {"128": 0.97, "256": 0.5}},
               "dense": {"accuracy_by_length": {128: 0.98, 256: 0.6}}}
    targets = report.check_targets("retrieval", results, 128)
    assert targets["dense_ge_95pct_at_train_len"] and targets["nsa_ge_dense_minus_2pts_at_train_len"]
    assert targets["nsa_ge_dense_at_2x"] is False and targets["nsa_ge_dense_at_8x"] is None


def test_retrieval_diagnostics_per_layer():
    tok = ByteTokenizer()
    task = RetrievalTask(tok, 192, num_pairs=8, num_queries=8, min_gap=24, stream=needle.NEEDLE_STREAM)
    diag = retrieval_diagnostics.retrieval_diagnostics(tiny_model(), task, samples=2, device=torch.device("cpu"))
    assert len(diag["layers"]) == 2 and diag["pair_distance_blocks"] > 24 / 16
    for layer in diag["layers"]:
        assert abs(sum(layer["output_share"]) - 1) < 1e-4 and abs(sum(layer["slc_distance_hist"]) - 1) < 1e-4
        assert 0 <= layer["pair_block_hit"] <= 1
    assert 0 < diag["pair_block_hit_chance"] <= 1
    assert retrieval_diagnostics.retrieval_diagnostics(tiny_model(attn_type="dense"), task, samples=1,
                                                       device=torch.device("cpu")) is None


def test_loss_curves_keep_every_step_and_the_last_of_repeats(tmp_path):
    first = [{"type": "train", "step": 1, "loss": 5.0, "step_losses": [5.0]},
             {"type": "train", "step": 3, "loss": 4.0, "step_losses": [4.5, 3.5]},
             {"type": "val", "step": 3, "val_loss": 4.1}]  # an interrupted attempt, set aside by compare
    resumed = [{"type": "train", "step": 3, "loss": 3.0, "step_losses": [3.2, 2.8]}]  # resumed at step 2
    for name, recs in (("m.attempt-000.jsonl", first), ("m.jsonl", resumed)):
        (tmp_path / name).write_text("".join(json.dumps(x) + "\n" for x in recs))
    curves = report.loss_curves(tmp_path / "m.jsonl")
    assert curves["train"] == [[1, 5.0], [2, 3.2], [3, 2.8]] and curves["val"] == [[3, 4.1, None]]


class _Uniform(nn.Module):
    def forward(self, tokens):
        return torch.zeros(*tokens.shape, 260)


def test_perplexity_of_uniform_model_is_vocab_size():
    from nsa_titan.config import Data

    res = perplexity.evaluate_perplexity(_Uniform(), Data(), ByteTokenizer(), seq_len=64, batch_size=2,
                                         device=torch.device("cpu"), max_batches=3)
    assert res["tokens"] == 3 * 2 * 64 and res["batches"] == 3 and not res["full_pass"]
    assert math.isclose(res["ppl"], 260, rel_tol=1e-6)


def test_gpu_scripts_smoke_run_on_cpu(tmp_path, monkeypatch):
    argv = [*TINY_FLAGS, "--model.n_layers", "1", "--training.seq_len", "128", "--training.steps", "3",
            "--training.local_batch_size", "1", "--lr_scheduler.warmup_steps", "1", "--training.device", "cpu",
            "--metrics.log_freq", "2", "--data.retrieval_num_pairs", "6", "--data.retrieval_num_queries", "6",
            "--data.retrieval_filler", "letters", "--job.dump_folder", str(tmp_path / "dump"), "--lengths", "128,256",
            "--samples", "1", "--diag-samples", "1", "--out", str(tmp_path), "--tag", "t"]
    out = compare.main(argv)
    assert set(out["results"]) == {"nsa", "dense"} and (tmp_path / "t.md").is_file()
    # Trained by the trainer into DCP checkpoints, evaluated from them (args from the checkpoint's marker).
    nsa = out["results"]["nsa"]
    assert nsa["checkpoint"].endswith("compare-t/nsa/checkpoints/step-00000003") and nsa["steps"] == 3
    assert [s for s, _ in nsa["curves"]["train"]] == [1, 2, 3]  # every step, though logged every 2
    assert set(nsa["accuracy_by_length"]) == {128, 256} and len(nsa["diagnostics"]["layers"]) == 1
    assert out["results"]["dense"]["diagnostics"] is None and "pair block selected" in (tmp_path / "t.md").read_text()
    # Resumable: a rerun trains and evaluates nothing again; other settings in the same folder are refused.
    monkeypatch.setattr(compare, "train_main", lambda *a: pytest.fail("trained again"))
    monkeypatch.setattr(compare, "evaluate_needle", lambda *a, **k: pytest.fail("evaluated again"))
    assert compare.main(argv)["results"]["nsa"]["accuracy_by_length"] == {"128": nsa["accuracy_by_length"][128],
                                                                          "256": nsa["accuracy_by_length"][256]}
    with pytest.raises(ValueError, match="other settings.*another --tag"):
        compare.main([*argv, "--training.seed", "1"])
    spec = importlib.util.spec_from_file_location("bench_decode", REPO / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--device", "cpu", "--flavor", "debug", "--contexts", "512", "--batches", "1", "--iters", "1",
                      "--dtype", "fp32", "--out", str(tmp_path), "--tag", "d"])
    rows = {(r["variant"], r["mode"]): r for r in res["rows"]}
    assert len(rows) == 4
    assert rows[("nsa", "model")]["kv_bytes_per_step"] < rows[("dense", "model")]["kv_bytes_per_step"]
    assert json.loads((tmp_path / "d.json").read_text())["torch"] == torch.__version__
    assert all(r["compute_ops"] > 0 for r in rows.values())
    # The op counter counts what computes or writes (ones, add, mul_), never views (view, t, reshape).
    assert bench.compute_ops_per_step([lambda: torch.ones(3).view(3, 1).t().add(1).reshape(3).mul_(2)]) == 3


def test_inference_config_skips_only_the_training_length_check():
    """generate and the eval tools load the training flags without the training-only rule that training.seq_len
    fits model.max_seq_len (no '--training.seq_len 2' trick); every other check still applies."""
    from nsa_titan.checkpoint.load import load_inference_config
    from nsa_titan.config import ConfigError, load_job_config

    cfg = load_inference_config(["--model.max_seq_len", "64"])
    assert cfg.training.seq_len == 1024 and cfg.model_args(training=False).max_seq_len == 64
    with pytest.raises(ConfigError, match="max_seq_len"):
        load_job_config(["--model.max_seq_len", "64"])
    with pytest.raises(ConfigError, match="training.gc_freq"):
        load_inference_config(["--training.gc_freq", "-1"])


@pytest.mark.parametrize("attn_type", ["dense", "nsa"])
def test_an_export_loads_back_into_the_model_bit_for_bit(tmp_path, attn_type):
    """export -> load_weights -> the same parameters: also for a dense model, whose export is a plain Llama
    checkpoint with k_proj / v_proj split out of our fused wkv (generate --checkpoint EXPORT used to fail there)."""
    pytest.importorskip("safetensors")
    import dataclasses

    from nsa_titan.checkpoint.export import write_export
    from nsa_titan.checkpoint.load import load_weights
    from nsa_titan.models import build_model, get_model_args

    args = get_model_args("debug", attn_type=attn_type)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    write_export(model.state_dict(), tmp_path / "export", model_args=dataclasses.asdict(args), dtype="fp32")
    if attn_type == "dense":
        assert "model.layers.0.self_attn.k_proj.weight" in read_safetensors(tmp_path / "export" / "model.safetensors")
    torch.manual_seed(1)
    fresh = build_model(args)
    fresh.init_weights()
    assert not torch.equal(fresh.output.weight, model.output.weight)  # the load below has something to do
    load_weights(fresh, tmp_path / "export")
    want, got = model.state_dict(), fresh.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want if not k.startswith("rope")), attn_type
