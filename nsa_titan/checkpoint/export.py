"""Model-only export for inference: one ``model.safetensors`` (bf16 by default) with Hugging Face style
names, plus ``config.json`` (the NSAModelArgs and the name map) that ``transformers`` reads:

- an NSA model: ``config.json`` has ``model_type: "nsa_titan"`` and an ``auto_map`` naming the classes of
  ``modeling_nsa.py`` (copied beside it from ``nsa_titan/checkpoint/hf/``: plain PyTorch, no nsa_titan
  import), so ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads it;
- a dense model (``attn_type = "dense"``, value head dim = key head dim): a plain Llama checkpoint
  (``LlamaForCausalLM``; the fused ``kv_proj`` is split into ``k_proj`` / ``v_proj``), loadable without remote code.

    python -m nsa_titan.checkpoint.export OUTPUTS/checkpoints/step-00001000 [OUT_DIR] [--dtype bf16|fp32] \
        [--tokenizer TOKENIZER_FOLDER]

Names follow the Llama convention where a Llama counterpart exists (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj``, ``mlp.gate_proj`` ...); NSA's own tensors keep their module names
under ``self_attn`` (``kv_proj``, ``g_proj``, ``compress_k.fc1`` ...). The RoPE tables are not exported
(inference recomputes them from ``rope_theta``). Needs the optional ``safetensors`` package.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from nsa_titan.checkpoint.folder import TMP_PREFIX, export_dir_name, inspect_checkpoint
from nsa_titan.checkpoint.safe_load import load_tensors
from nsa_titan.data import build_tokenizer
from nsa_titan.models import NSAModelArgs, build_model

_DTYPES = types.MappingProxyType({"bf16": torch.bfloat16, "fp32": torch.float32})  # read-only
# (our name pattern, HF-style replacement); the first match wins, so the order matters.
_NAME_MAP = (
    (r"^tok_embeddings\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^layers\.(\d+)\.attention\.wq\.", r"model.layers.\1.self_attn.q_proj."),
    (r"^layers\.(\d+)\.attention\.wkv\.", r"model.layers.\1.self_attn.kv_proj."),
    (r"^layers\.(\d+)\.attention\.wo\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^layers\.(\d+)\.attention\.wgate\.", r"model.layers.\1.self_attn.g_proj."),
    (r"^layers\.(\d+)\.attention\.", r"model.layers.\1.self_attn."),
    (r"^layers\.(\d+)\.feed_forward\.w1\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w3\.", r"model.layers.\1.mlp.up_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w2\.", r"model.layers.\1.mlp.down_proj."),
    (r"^layers\.(\d+)\.attention_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
)
_NOT_EXPORTED = re.compile(r"(^|\.)rope_(cos|sin)$")


def require_safetensors() -> Any:
    """The safetensors.torch module, or an ImportError that says how to get it."""
    try:
        import safetensors.torch  # noqa: PLC0415 - optional
    except ImportError:
        raise ImportError("model export writes safetensors files and needs the `safetensors` package: "
                          "pip install safetensors (or turn off --checkpoint.export_at_end)") from None
    return safetensors.torch


def hf_name(name: str) -> str:
    for pattern, repl in _NAME_MAP:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return "model." + name  # a tensor added later still gets exported, under a predictable name


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 tensors with clean names on rank 0 ({} elsewhere); collective when sharded."""
    # cpu_offload gathers straight into host memory (no full copy on the GPU); only for device tensors:
    # with CPU tensors it buys nothing, and FSDP1 + cpu_offload segfaults on CPU-only gloo ranks (torch 2.13).
    on_device = any(p.device.type != "cpu" for p in model.parameters())
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=on_device))


MODELING_FILE = Path(__file__).with_name("hf") / "modeling_nsa.py"


def is_llama(model_args: dict[str, Any]) -> bool:
    """Dense attention with equal key and value head dims is exactly Llama's architecture."""
    return model_args.get("attn_type") == "dense" and model_args.get("v_head_dim") in (None, model_args["head_dim"])


def hf_config(model_args: dict[str, Any], dtype: str, special_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """The transformers-facing part of config.json (Llama's names where they apply)."""
    a = model_args
    cfg: dict[str, Any] = {
        "vocab_size": a["vocab_size"], "hidden_size": a["dim"], "intermediate_size": a["ffn_hidden_dim"],
        "num_hidden_layers": a["n_layers"], "num_attention_heads": a["n_heads"], "num_key_value_heads": a["n_kv_heads"],
        "head_dim": a["head_dim"], "max_position_embeddings": a["max_seq_len"], "rms_norm_eps": a["norm_eps"],
        "rope_theta": a["rope_theta"], "tie_word_embeddings": False,
        # dtype: transformers 5; torch_dtype: the name transformers 4 reads.
        "dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype],
        "torch_dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype],
        **(special_ids or {}),
    }
    if is_llama(a):
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
                   mlp_bias=False, rope_parameters={"rope_type": "default", "rope_theta": a["rope_theta"]})
    else:
        cfg.update(architectures=["NSAForCausalLM"], model_type="nsa_titan", use_cache=False,
                   auto_map={"AutoConfig": "modeling_nsa.NSAConfig",
                             "AutoModelForCausalLM": "modeling_nsa.NSAForCausalLM"})
    return cfg


def _split_kv(tensors: dict[str, torch.Tensor], model_args: dict[str, Any]) -> None:
    """Llama layout: our fused kv_proj rows are [head][k dims, v dims]; Llama has k_proj and v_proj."""
    hkv, dk = model_args["n_kv_heads"], model_args["head_dim"]
    for name in [n for n in tensors if n.endswith("self_attn.kv_proj.weight")]:
        w = tensors.pop(name).view(hkv, 2 * dk, -1)
        tensors[name.replace("kv_proj", "k_proj")] = w[:, :dk].reshape(hkv * dk, -1).contiguous()
        tensors[name.replace("kv_proj", "v_proj")] = w[:, dk:].reshape(hkv * dk, -1).contiguous()


def write_export(state: dict[str, torch.Tensor], out_dir: str | os.PathLike, *, model_args: dict[str, Any],
                 dtype: str = "bf16", special_ids: dict[str, int] | None = None) -> Path:
    """Write ``state`` (clean names) as ``out_dir/model.safetensors`` + ``config.json`` (+ ``modeling_nsa.py``
    unless it is a Llama checkpoint), atomically. ``special_ids``: e.g. {"eos_token_id": 2} for generate()."""
    st = require_safetensors()
    if dtype not in _DTYPES:
        raise ValueError(f"checkpoint.export_dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    tensors, names = {}, {}
    for name, t in state.items():
        if _NOT_EXPORTED.search(name):
            continue
        new = hf_name(name)
        if new in tensors:
            raise ValueError(f"export: {name!r} and another tensor both map to {new!r}")
        tensors[new] = t.detach().to("cpu", _DTYPES[dtype]).contiguous()
        names[new] = name
    llama = is_llama(model_args)
    if llama:  # names maps exported tensors back to ours; the split k/v halves have no single counterpart
        _split_kv(tensors, model_args)
        names = {k: v for k, v in names.items() if k in tensors}
    tmp = out.with_name(f"{TMP_PREFIX}{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    st.save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "dtype": dtype})
    # nsa_model_args and names: what nsa_titan's own loaders read (generate, evals); transformers ignores them.
    config = {**hf_config(model_args, dtype, special_ids), "nsa_model_args": model_args, "names": names}
    (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    if not llama:
        shutil.copyfile(MODELING_FILE, tmp / "modeling_nsa.py")
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def export_model(model: nn.Module, out_dir: str | os.PathLike, *, model_args: dict[str, Any], dtype: str = "bf16",
                 rank: int = 0, tokenizer: str | None = None, eos_token: str | None = None,
                 bos_token: str | None = None) -> Path | None:
    """Export a live (possibly sharded) model; every rank calls it, rank 0 writes and returns the folder.
    ``tokenizer`` (data.tokenizer, with data.eos_token / bos_token): its files and special ids go with it."""
    require_safetensors()  # fail on every rank before the collective gather, not on rank 0 after it
    state = full_model_state(model)
    if rank != 0:
        return None
    special_ids, files = tokenizer_extras(tokenizer, eos_token, bos_token)
    out = write_export(state, out_dir, model_args=model_args, dtype=dtype, special_ids=special_ids)
    _copy_tokenizer(out, tokenizer, files)
    return out


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_extras(tokenizer_path: str | None, eos_token: str | None = None,
                     bos_token: str | None = None) -> tuple[dict[str, int], list[Path]]:
    """(special token ids for config.json, tokenizer files to copy) of a tokenizer ("byte", a folder, a
    tokenizer.json or a *.tiktoken file), so that transformers' generate() stops at its EOS and the tokenizer
    loads from the export folder alone."""
    if not tokenizer_path:
        return {}, []
    tok = build_tokenizer(tokenizer_path, eos_token=eos_token, bos_token=bos_token)
    ids = {k: v for k, v in (("eos_token_id", tok.eos_id), ("bos_token_id", tok.bos_id),
                             ("pad_token_id", getattr(tok, "pad_id", None))) if v is not None}
    p = Path(tokenizer_path)
    if p.is_dir():
        files = [p / n for n in _TOKENIZER_FILES if (p / n).is_file()] + sorted(p.glob("*.tiktoken"))
    else:
        files = [p] if p.suffix in (".json", ".tiktoken") else []
    return ids, files


def _copy_tokenizer(out: Path, tokenizer: str | None, files: list[Path]) -> None:
    """The tokenizer files beside the weights (a lone tokenizer.json under the name transformers looks for), and
    ``nsa_tokenizer.json`` saying what data.tokenizer was, so that a byte-level model is decodable from here too."""
    if not tokenizer:
        return
    lone = not Path(tokenizer).is_dir()
    for f in files:
        shutil.copyfile(f, out / ("tokenizer.json" if lone and f.suffix == ".json" else f.name))
    kind = "byte" if tokenizer == "byte" else "tiktoken" if any(f.suffix == ".tiktoken" for f in files) else "hf"
    (out / "nsa_tokenizer.json").write_text(json.dumps({"kind": kind, "files": sorted(
        "tokenizer.json" if lone and f.suffix == ".json" else f.name for f in files)}, indent=1) + "\n")


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                      dtype: str = "bf16", tokenizer: str | None = None) -> Path:
    """Offline: read the model part of a DCP checkpoint in this single process and export it (with the files of
    ``tokenizer``, a tokenizer folder or tokenizer.json, when given)."""
    require_safetensors()
    path = Path(checkpoint)
    meta, problem = inspect_checkpoint(path)
    if problem:
        raise ValueError(f"{path} is not a complete checkpoint ({problem})")
    args = NSAModelArgs(**meta["model_args"])
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    load_tensors(state, path, no_dist=True)  # reads (and reshards) only the model tensors; unpickles no code
    out = Path(out_dir) if out_dir else path.with_name(export_dir_name(path.name))
    special_ids, files = tokenizer_extras(tokenizer)
    out = write_export(state["model"], out, model_args=meta["model_args"], dtype=dtype, special_ids=special_ids)
    _copy_tokenizer(out, tokenizer, files)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nsa_titan.checkpoint.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a complete step-NNNNNNNN checkpoint folder")
    parser.add_argument("out_dir", nargs="?", help="output folder (default: export-<name> beside the checkpoint)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--tokenizer", help="tokenizer folder or tokenizer.json the model was trained with: its files "
                                            "are copied and its EOS/BOS ids written to config.json")
    ns = parser.parse_args(argv)
    try:
        out = export_checkpoint(ns.checkpoint, ns.out_dir, ns.dtype, tokenizer=ns.tokenizer)
    except (ImportError, ValueError) as e:
        print(f"export error: {e}", file=sys.stderr)
        return 2
    print(f"exported {ns.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
