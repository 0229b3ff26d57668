"""Generation, weight loading, perplexity and needle evaluation; CPU smoke runs of the GPU scripts."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from nsa_titan.data import ByteTokenizer, RetrievalTask
from nsa_titan.eval import compare, needle, perplexity
from nsa_titan.eval.weights import load_weights, read_safetensors, saved_model_args, write_safetensors
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


def test_needle_depth0_is_the_training_sample_and_depth_moves_the_pair():
    tok = ByteTokenizer()
    filler = np.frombuffer(b"some filler text\n" * 50, np.uint8).astype(np.uint16)
    for kw in ({}, {"filler_tokens": filler, "filler_eos_id": 256}):
        task = needle.NeedleTask(tok, 512, seed=3, **kw)
        ref = RetrievalTask(tok, 512, seed=3, stream=needle.NEEDLE_STREAM, **kw)
        for i in range(3):
            tokens, mask, _ = task.sample(i, 0.0)
            ref_tokens, ref_mask = ref.sample(i)
            assert np.array_equal(tokens, ref_tokens) and np.array_equal(mask, ref_mask)
    task = needle.NeedleTask(tok, 1024, seed=0)
    positions = []
    for depth in (0.0, 0.5, 1.0):
        tokens, mask, pos = task.sample(7, depth)
        answer = tokens[mask]
        key = tokens[np.flatnonzero(mask)[0] - 5: np.flatnonzero(mask)[0] - 1]  # QUERY key SEP value
        assert len(tokens) == 1025 and np.array_equal(tokens[pos: pos + 4], key)
        assert np.array_equal(tokens[pos + 5: pos + 9], answer)
        positions.append(pos)
    assert positions[0] < 200 and abs(positions[1] - 512) < 20 and positions[2] > 800


class _Oracle(nn.Module):
    """Predicts the true next token of the needle samples it was given (or always token 0)."""

    def __init__(self, samples, right=True):
        super().__init__()
        self.next = {tuple(s[:-1].tolist()): s[1:] for s in samples}
        self.right = right

    def forward(self, tokens):
        nxt = torch.stack([torch.as_tensor(self.next[tuple(t.tolist())]) for t in tokens])
        return torch.nn.functional.one_hot(nxt if self.right else torch.zeros_like(nxt), 260).float()


def test_needle_eval_counts_correct_samples():
    tok = ByteTokenizer()
    samples = [needle.NeedleTask(tok, n).sample(i, d)[0] for n in (256, 512) for d in (0.0, 1.0) for i in range(3)]
    kw = dict(lengths=[256, 512], depths=[0.0, 1.0], samples=3, device=torch.device("cpu"), batch_size=2,
              log=lambda _: None)
    right = needle.evaluate_needle(_Oracle(samples), tok, **kw)
    wrong = needle.evaluate_needle(_Oracle(samples, right=False), tok, **kw)
    assert [r["accuracy"] for r in right] == [1.0] * 4 and [r["accuracy"] for r in wrong] == [0.0] * 4
    table = needle.accuracy_table(right, "nsa")
    assert "| 512 | 100.0 | 100.0 | 100.0 |" in table
    targets = compare.check_targets({"nsa": {"rows": [{**r, "context_len": 8192} for r in right]},
                                     "dense": {"rows": [{**r, "context_len": 8192} for r in wrong]}})
    assert targets["nsa_8k_ge_dense"] is True and targets["nsa_32k_ge_99pct"] is None


class _Uniform(nn.Module):
    def forward(self, tokens):
        return torch.zeros(*tokens.shape, 260)


def test_perplexity_of_uniform_model_is_vocab_size():
    from nsa_titan.config import Data

    res = perplexity.evaluate_perplexity(_Uniform(), Data(), ByteTokenizer(), seq_len=64, batch_size=2,
                                         device=torch.device("cpu"), max_batches=3)
    assert res["tokens"] == 3 * 2 * 64 and res["batches"] == 3 and not res["full_pass"]
    assert math.isclose(res["ppl"], 260, rel_tol=1e-6)


def test_gpu_scripts_smoke_run_on_cpu(tmp_path):
    out = compare.main([*TINY_FLAGS, "--model.n_layers", "1", "--data.dataset", "retrieval", "--training.seq_len",
                        "256", "--training.steps", "2", "--training.local_batch_size", "1",
                        "--lr_scheduler.warmup_steps", "1", "--training.device", "cpu",
                        "--job.dump_folder", str(tmp_path / "dump"),
                        "--lengths", "256", "--depths", "0,1", "--samples", "1", "--out", str(tmp_path), "--tag", "t"])
    assert set(out["results"]) == {"nsa", "dense"} and (tmp_path / "t.md").is_file()
    # Trained by the trainer into DCP checkpoints, evaluated from them (args from the checkpoint's marker).
    assert out["results"]["nsa"]["checkpoint"].endswith("compare-t/nsa/checkpoints/step-00000002")
    assert out["results"]["dense"]["steps"] == 2
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
