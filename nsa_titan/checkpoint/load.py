"""Loading a model to run (generate.py and every nsa_titan.eval tool): its config, its args, its weights.

``load_inference_config`` / ``resolve_inference_args`` / ``build_inference_model`` below; the weights from
whatever training or export produced:

Accepted ``path``s:
- a ``torch.save``'d state dict (.pt/.pth/.bin; may sit under a "model" or "state_dict" key; the prefixes
  torch.compile ("_orig_mod.") and DDP ("module.") add are stripped);
- a ``.safetensors`` file, or an export folder holding ``model.safetensors`` + ``config.json``
  (``python -m nsa_titan.checkpoint.export``: Hugging Face style names, mapped back through the config's
  "names" table);
- a DCP checkpoint folder (``torch.distributed.checkpoint``: a ``.metadata`` file), with the model's tensors
  stored as "model.<name>" (nsa_titan.checkpoint) or at top level. When the folder has the marker of
  nsa_titan.checkpoint, it is validated with that package's ``inspect_checkpoint`` first. Its ``.metadata``
  is unpickled with an allow-list and only tensor entries are read (``nsa_titan.checkpoint.safe_load``), so
  loading runs no code from the folder; a safetensors export is still the format to share weights in.

Safetensors files are read by the small parser below (the format is an 8-byte length, a JSON header and
raw little-endian tensors), so inference needs no extra package.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nsa_titan.checkpoint.folder import MARKER, inspect_checkpoint
from nsa_titan.checkpoint.safe_load import load_tensors, read_metadata_safely
from nsa_titan.config import load_inference_config  # noqa: F401 - re-exported: the one loader of inference tools
from nsa_titan.models import NSAModelArgs, build_model

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")
_NOT_SAVED = ("rope_cos", "rope_sin")  # non-persistent buffers: recomputed, never in a checkpoint


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise ValueError(f"{path}: not a safetensors file (unreadable header: {e})") from None
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _ST_DTYPES[info["dtype"]]
        flat = torch.frombuffer(bytearray(body[begin:end]), dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(info["shape"])
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Minimal writer (tests, and exports on machines without the safetensors package)."""
    names = {v: k for k, v in _ST_DTYPES.items()}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the body to 8 bytes
    Path(path).write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _export_config(folder: Path) -> dict[str, Any]:
    cfg = folder / "config.json"
    return json.loads(cfg.read_text()) if cfg.is_file() else {}


def saved_model_args(path: str | os.PathLike) -> dict[str, Any] | None:
    """NSAModelArgs fields recorded beside the weights (DCP marker or export config.json), else None."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    marker = folder / MARKER
    if marker.is_file():
        return json.loads(marker.read_text()).get("model_args") or None
    return _export_config(folder).get("nsa_model_args") or None


def _strip(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _load_dcp(model: nn.Module, folder: Path) -> None:
    if (folder / MARKER).is_file():
        _, problem = inspect_checkpoint(folder)
        if problem:
            raise ValueError(f"{folder}: incomplete checkpoint ({problem}); pick another step-* folder")
    saved = read_metadata_safely(folder).state_dict_metadata
    mine = {k: v for k, v in model.state_dict().items() if k not in _NOT_SAVED}
    nested = any(k.startswith("model.") for k in saved)  # nsa_titan.checkpoint: {"model": ..., "optimizer": ...}
    prefix = "model." if nested else ""
    theirs = {k[len(prefix):]: m for k, m in saved.items() if k.startswith(prefix)}
    if not nested:  # a flat checkpoint may hold other entries too: only tensors named like the model's count
        theirs = {k: m for k, m in theirs.items() if k.split(".")[0] in {n.split(".")[0] for n in mine}}
    missing, unexpected = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    wrong = sorted(k for k in set(mine) & set(theirs) if tuple(getattr(theirs[k], "size", ())) != tuple(mine[k].shape))
    if missing or unexpected or wrong:
        raise ValueError(f"{folder}: DCP checkpoint lacks this model's tensors or holds others (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}, other shapes {wrong[:3]}): check that --config / --model.* "
                         "describe the trained model")
    load_tensors({"model": mine} if nested else mine, folder, no_dist=True)


def _fuse_llama_kv(tensors: dict[str, torch.Tensor], names: dict[str, str], model_args: dict[str, Any]) -> None:
    """A dense model exported as Llama has k_proj / v_proj where our attention has one fused wkv ([head][k dims,
    v dims] rows, checkpoint/export.py's _split_kv): put them back together, under the name the layer's q_proj
    maps to with wq -> wkv (the export's name table has no entry for the split halves)."""
    for k_name in [n for n in tensors if n.endswith("self_attn.k_proj.weight")]:
        v_name, q_name = k_name.replace("k_proj", "v_proj"), k_name.replace("k_proj", "q_proj")
        if v_name not in tensors or q_name not in names or not model_args:
            raise ValueError(f"export: {k_name} without its v_proj, q_proj name or nsa_model_args in config.json; "
                             "re-export the checkpoint with python -m nsa_titan.checkpoint.export")
        hkv, dk = model_args["n_kv_heads"], model_args["head_dim"]
        k, v = tensors.pop(k_name).view(hkv, dk, -1), tensors.pop(v_name).view(hkv, dk, -1)
        fused = k_name.replace("k_proj", "kv_proj")
        tensors[fused] = torch.cat([k, v], dim=1).reshape(2 * hkv * dk, -1)
        names[fused] = names[q_name].replace(".wq.", ".wkv.")


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a file or export folder under the model's own parameter names (not for DCP folders)."""
    p = Path(path)
    if p.is_dir():
        if not (p / "model.safetensors").is_file():
            raise ValueError(f"{p}: a folder must be a DCP checkpoint (.metadata) or an export (model.safetensors)")
        p = p / "model.safetensors"
    if p.suffix == ".safetensors":
        tensors = read_safetensors(p)
        config = _export_config(p.parent)
        names = config.get("names") or {}
        _fuse_llama_kv(tensors, names, config.get("nsa_model_args") or {})
        return {names.get(k, k): v for k, v in tensors.items()}
    obj = torch.load(p, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{p}: expected a state dict of tensors (torch.save(model.state_dict(), path))")
    return {_strip(k): v for k, v in obj.items()}


def load_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Fill ``model`` (already materialised) from ``path``; every tensor must match by name and shape."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if p.is_dir() and (p / ".metadata").is_file():
        _load_dcp(model, p)
        return
    state = {k: v for k, v in read_state_dict(p).items() if k not in _NOT_SAVED}
    mine = {k for k in model.state_dict() if k not in _NOT_SAVED}
    missing, unexpected = sorted(mine - set(state)), sorted(set(state) - mine)
    if missing or unexpected:
        raise ValueError(f"{p}: weights do not fit the model (missing {missing[:4]}, unexpected {unexpected[:4]}); "
                         "check that --config / --model.* describe the trained model")
    model.load_state_dict(state, strict=False)  # strict=False only because rope_* buffers are not saved


_FREE_FIELDS = ("attn_impl", "max_seq_len")  # may differ from training without touching the weights


def resolve_inference_args(job_config, checkpoint: str | None, min_seq_len: int = 0) -> NSAModelArgs:
    """The checkpoint's recorded args (else the config's), with attn_impl / max_seq_len overrides applied."""
    overrides = job_config.model.overrides()
    saved = saved_model_args(checkpoint) if checkpoint else None
    if saved is not None:
        names = {f.name for f in dataclasses.fields(NSAModelArgs)}
        args = NSAModelArgs(**{k: v for k, v in saved.items() if k in names})
        args = dataclasses.replace(args, **{k: v for k, v in overrides.items() if k in _FREE_FIELDS})
    else:
        args = job_config.model_args(training=False)
    # RoPE angles are a function of the position, not learned: a longer table only adds positions.
    args.max_seq_len = max(args.max_seq_len, min_seq_len)
    args.validate()
    return args


def build_inference_model(args: NSAModelArgs, checkpoint: str | None, device: torch.device):
    """The model in eval mode on ``device``, with the checkpoint's weights (none: its initialisation)."""
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device)
    model.init_weights()  # also computes the RoPE tables, which checkpoints do not hold
    if checkpoint:
        load_weights(model, checkpoint)
    return model.eval()
