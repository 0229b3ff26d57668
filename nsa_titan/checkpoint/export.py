"""Model-only export for inference: one ``model.safetensors`` (bf16 by default) with Hugging Face style
names, plus ``config.json`` (the NSAModelArgs and the name map).

    python -m nsa_titan.checkpoint.export OUTPUTS/checkpoints/step-00001000 [OUT_DIR] [--dtype bf16|fp32]

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


def write_export(state: dict[str, torch.Tensor], out_dir: str | os.PathLike, *, model_args: dict[str, Any],
                 dtype: str = "bf16") -> Path:
    """Write ``state`` (clean names) as ``out_dir/model.safetensors`` + ``config.json``, atomically."""
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
    tmp = out.with_name(f"{TMP_PREFIX}{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    st.save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "dtype": dtype})
    config = {"architectures": ["NSATransformer"], "model_type": "nsa", "torch_dtype":
              {"bf16": "bfloat16", "fp32": "float32"}[dtype], "nsa_model_args": model_args, "names": names}
    (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def export_model(model: nn.Module, out_dir: str | os.PathLike, *, model_args: dict[str, Any], dtype: str = "bf16",
                 rank: int = 0) -> Path | None:
    """Export a live (possibly sharded) model; every rank calls it, rank 0 writes and returns the folder."""
    require_safetensors()  # fail on every rank before the collective gather, not on rank 0 after it
    state = full_model_state(model)
    if rank != 0:
        return None
    return write_export(state, out_dir, model_args=model_args, dtype=dtype)


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                      dtype: str = "bf16") -> Path:
    """Offline: read the model part of a DCP checkpoint in this single process and export it."""
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
    return write_export(state["model"], out, model_args=meta["model_args"], dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nsa_titan.checkpoint.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a complete step-NNNNNNNN checkpoint folder")
    parser.add_argument("out_dir", nargs="?", help="output folder (default: export-<name> beside the checkpoint)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    ns = parser.parse_args(argv)
    try:
        out = export_checkpoint(ns.checkpoint, ns.out_dir, ns.dtype)
    except (ImportError, ValueError) as e:
        print(f"export error: {e}", file=sys.stderr)
        return 2
    print(f"exported {ns.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
