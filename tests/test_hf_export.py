"""Exports other tools load (issue 14, item 6): the export folder's modeling_nsa.py reproduces our model's logits
(torch only, always run), transformers' AutoModelForCausalLM loads it with trust_remote_code and generates the
tokens nsa_titan.generate does, and a dense model exports as a plain Llama checkpoint."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import sys

import pytest
import torch

from nsa_titan.checkpoint.export import MODELING_FILE, write_export
from nsa_titan.generate import generate
from nsa_titan.models import build_model, get_model_args

pytest.importorskip("safetensors")

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=96, cmp_block=8, cmp_stride=4,
            slc_block=16, slc_top_n=4, window=24, max_seq_len=128)  # n=4 of 6 blocks at T=96: one is chosen
CASES = {"nsa_mlp": {}, "nsa_mean_shared_dv": dict(compress="mean", shared_kv=True, n_kv_heads=1, v_head_dim=8),
         "dense_dv": dict(attn_type="dense", v_head_dim=8)}


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    args = get_model_args("debug", **{**TINY, "attn_impl": "torch", **kw})
    model = build_model(args)
    model.init_weights()
    with torch.no_grad():  # random gates and compressors, not the init's near-constant ones, so every branch counts
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval(), args


def export(model, args, path, **kw):
    return write_export(model.state_dict(), path, model_args=dataclasses.asdict(args), dtype="fp32", **kw)


def load_modeling(folder):
    spec = importlib.util.spec_from_file_location(f"modeling_nsa_{abs(hash(str(folder)))}", folder / "modeling_nsa.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_modeling_file_is_self_contained():
    tree = ast.parse(MODELING_FILE.read_text())
    roots = {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    roots |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert roots <= {"__future__", "torch", "transformers"}, roots


@pytest.mark.parametrize("case", sorted(CASES))
def test_modeling_file_matches_our_logits(tmp_path, case):
    from safetensors.torch import load_file

    model, args = tiny_model(**CASES[case])
    out = export(model, args, tmp_path / "export")
    assert (out / "modeling_nsa.py").is_file()
    core = load_modeling(out).NSACausalLMCore(json.loads((out / "config.json").read_text())["nsa_model_args"])
    missing, unexpected = core.load_state_dict(load_file(str(out / "model.safetensors")), strict=True), None
    assert unexpected is None and not missing.missing_keys
    tokens = torch.randint(0, args.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens)
        assert torch.allclose(core(tokens), want, atol=2e-5, rtol=1e-5)
        ref = dataclasses.replace(args, attn_impl="reference")  # and the dense spec, through our reference path
        spec_model = build_model(ref)
        spec_model.load_state_dict(model.state_dict())
        assert torch.allclose(core(tokens), spec_model(tokens), atol=2e-5, rtol=1e-5)


def test_transformers_loads_the_nsa_export_and_generates_our_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, args = tiny_model()
    out = export(model, args, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_nsa.NSAForCausalLM" and cfg["model_type"] == "nsa_titan"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    prompt = torch.randint(0, args.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(hf(prompt).logits, model(prompt), atol=2e-5, rtol=1e-5)
        ours, _ = generate(model, prompt, 16)
        theirs = hf.generate(prompt, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(theirs[:, 20:], ours)


def test_dense_model_exports_as_a_plain_llama_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, args = tiny_model(attn_type="dense")
    out = export(model, args, tmp_path / "export", special_ids={"eos_token_id": 256, "bos_token_id": 257})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "auto_map" not in cfg and not (out / "modeling_nsa.py").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()  # no remote code
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.eos_token_id == 256
    prompt = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(hf(prompt).logits, model(prompt), atol=2e-5, rtol=1e-5)
        ours, _ = generate(model, prompt, 12)
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt),
                             eos_token_id=None)
    assert torch.equal(theirs[:, 24:], ours)


def test_modeling_file_without_transformers_still_imports(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    mod = load_modeling(MODELING_FILE.parent)
    assert mod.PreTrainedModel is None and hasattr(mod, "NSACausalLMCore")
