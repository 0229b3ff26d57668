"""Sliding-window and plain causal attention for the portable path, without a T x T mask (one exception: packed
documents in the dense baseline on CPU, below).

Which kernel runs is a pure function of (flash-attn installed, device type, dtype), so it is fixed for a run
and the trainer names it at start-up (``describe``):

- **flash-attn** (the ``flash_attn`` package, CUDA, fp16/bf16): ``flash_attn_func`` with ``causal=True`` and,
  for the window, ``window_size=(w - 1, 0)``. GQA is native (no K/V repeat).
- **flex** (CUDA otherwise): FlexAttention with a block mask built from block indices (``window_block_mask``:
  [T/128, T/128] block counts, the window rule as ``mask_mod`` inside partial blocks), compiled once per
  shape: eager FlexAttention would materialise the scores it exists to avoid.
- **band** (CPU): FlexAttention has no CPU backward (torch 2.13), so queries are cut in chunks of w and each
  chunk attends to its own and the previous chunk of keys: [T/w, w, 2w] scores, O(T w) memory.

The dense baseline keeps ``scaled_dot_product_attention(is_causal=True)`` without flash-attn: it builds no
mask either and already dispatches to PyTorch's fused flash / memory-efficient kernels, which a FlexAttention
causal mask would only re-derive.

Packed documents (``doc_start`` [B, T], the first position of each token's document; reference.py's rule: key s
is visible to query t iff doc_start[t] <= s <= t) go through ``document_attention``, which picks by device type
alone (``document_backend``), because the per-token rule is what limits the choice:

- **flex** (CUDA, any dtype): FlexAttention with ``mask_mod`` causal & kv >= doc_start[b, q] (& q - kv < w for
  the window), its BlockMask from ``create_block_mask`` per batch row (H=None: every head shares it). Both are
  compiled: eager ``create_block_mask`` would evaluate the mask_mod on the whole [B, 1, T, T] grid. flash-attn
  is not used even when installed: ``flash_attn_func`` takes no per-token mask, and its varlen form needs the
  document lengths on the host (a sync per step).
- **band** (CPU, the window): the banded form above with the document rule in its [B, T/w, w, 2w] mask.
- **sdpa-mask** (CPU, the dense baseline): SDPA with an explicit [B, 1, T, T] mask, O(T^2) memory. CPU runs only
  tests and tiny models, FlexAttention has no CPU backward (torch 2.13), and eager it materialises the scores
  anyway.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["FLASH_ATTN_ERROR", "causal_attention", "dense_backend", "describe", "document_attention",
           "document_backend", "document_mask_mod", "window_attention", "window_backend", "window_block_mask"]

# Resolved once at import (the forward runs under torch.compile and must not try imports).
try:
    from flash_attn import flash_attn_func as _flash_attn_func

    FLASH_ATTN_ERROR = None
except ImportError as _e:  # not installed (no wheels for many machines), or built for another torch
    _flash_attn_func, FLASH_ATTN_ERROR = None, _e

_HALF = (torch.float16, torch.bfloat16)


def window_backend(device_type: str, dtype: torch.dtype) -> str:
    if device_type == "cuda" and dtype in _HALF and _flash_attn_func is not None:
        return "flash-attn"
    return "flex" if device_type == "cuda" else "band"


def dense_backend(device_type: str, dtype: torch.dtype) -> str:
    return "flash-attn" if device_type == "cuda" and dtype in _HALF and _flash_attn_func is not None else "sdpa"


def document_backend(device_type: str, windowed: bool) -> str:
    """The kernel for packed documents; the module doc says why it depends on the device type only."""
    if device_type == "cuda":
        return "flex"
    return "band" if windowed else "sdpa-mask"


def describe(attn_type: str, attn_impl: str, device_type: str, mixed_precision: str, documents: bool = False) -> str:
    """The start-up log's name for the kernel of the dense baseline, or of the torch path's window branch
    (``documents``: data.document_mask, which takes ``document_backend`` instead)."""
    dtype = torch.bfloat16 if mixed_precision == "bf16" and device_type == "cuda" else torch.float32
    suffix = " (documents)" if documents else ""
    if attn_type == "dense":
        kernel = document_backend(device_type, False) if documents else dense_backend(device_type, dtype)
        return f"dense attention: {kernel}{suffix}"
    if attn_impl == "torch" or (attn_impl == "auto" and device_type != "cuda"):
        kernel = document_backend(device_type, True) if documents else window_backend(device_type, dtype)
        return f"window branch: {kernel}{suffix}"
    return ""  # the Triton kernels and the reference have their own window code


def causal_attention(q, k, v):
    """q [B, T, HQ, Dk], k [B, T, HKV, Dk], v [B, T, HKV, Dv] -> [B, T, HQ, Dv]."""
    if dense_backend(q.device.type, q.dtype) == "flash-attn":
        return _flash_attn_func(q, k, v, causal=True)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def window_attention(q, k, v, window: int):
    """Query t attends to keys t - window + 1 .. t. Shapes as ``causal_attention``."""
    return run_window(window_backend(q.device.type, q.dtype), q, k, v, window)


def run_window(backend: str, q, k, v, window: int):
    if backend == "flash-attn":
        return _flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0))
    if backend == "flex":
        return _flex_window(q, k, v, window)
    return band_window_attention(q, k, v, window)


def band_window_attention(q, k, v, window: int, doc_start=None):
    """Chunks of c = min(window, T) queries against their own and the previous chunk of keys. ``doc_start``
    [B, T] (packed documents) also masks keys before the query's document: a [B, T/w, w, 2w] mask, no [T, T]."""
    b, t, hq, dk = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    c = max(1, min(window, t))
    n = -(-t // c)
    pad = n * c - t
    # Keys/values: one chunk of zeros in front (the "previous chunk" of chunk 0), the tail padded to n chunks.
    kp = F.pad(k, (0, 0, 0, 0, c, pad)).unflatten(1, (n + 1, c))
    vp = F.pad(v, (0, 0, 0, 0, c, pad)).unflatten(1, (n + 1, c))
    kk = torch.cat([kp[:, :-1], kp[:, 1:]], dim=2)  # [B, n, 2c, HKV, Dk]
    vv = torch.cat([vp[:, :-1], vp[:, 1:]], dim=2)
    qq = F.pad(q, (0, 0, 0, 0, 0, pad)).unflatten(1, (n, c))  # [B, n, c, HQ, Dk]
    g = hq // hkv
    qg = qq.unflatten(3, (hkv, g)).permute(0, 1, 3, 4, 2, 5)  # [B, n, HKV, G, c, Dk]
    scores = torch.matmul(qg, kk.permute(0, 1, 3, 4, 2).unsqueeze(3))  # [B, n, HKV, G, c, 2c]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * dk**-0.5
    # Query i of chunk m sits at m*c + i; key j of its pair of chunks at (m - 1)*c + j.
    qi = torch.arange(c, device=q.device)[:, None] + c
    kj = torch.arange(2 * c, device=q.device)[None, :]
    local = (kj <= qi) & (kj > qi - window)  # [c, 2c], the same for every chunk
    first = local & (kj >= c)  # chunk 0's previous chunk is padding
    mask = torch.cat([first[None], local[None].expand(n - 1, -1, -1)])  # [n, c, 2c]
    if doc_start is not None:  # key (m - 1)*c + j at or after the document start of query m*c + i
        ds = F.pad(doc_start.long(), (0, pad)).view(b, n, c, 1)  # padded queries are cut off below
        kpos = torch.arange(n, device=q.device)[:, None, None] * c - c + kj  # [n, 1, 2c]
        mask = mask & (kpos >= ds)  # [B, n, c, 2c]
    mask = mask.unsqueeze(-3).unsqueeze(-3)  # [(B,) n, 1, 1, c, 2c]: broadcast over KV heads and groups
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, vv.permute(0, 1, 3, 2, 4).unsqueeze(3))  # [B, n, HKV, G, c, Dv]
    return out.permute(0, 1, 4, 2, 3, 5).reshape(b, n * c, hq, dv)[:, :t]


def window_block_mask(t: int, window: int, device, block: int = 128):
    """FlexAttention BlockMask of the causal window from block indices: a [T/block]^2 table, no T x T mask."""
    from torch.nn.attention.flex_attention import BlockMask  # noqa: PLC0415 - optional (the flex path only)

    n = -(-t // block)
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    touched = (j <= i) & ((j + 1) * block - 1 >= i * block - window + 1)  # some (q, k) pair is visible
    full = (j < i) & (j * block >= (i + 1) * block - window)  # every pair is visible: no mask_mod needed
    partial = touched & ~full

    def packed(m):  # (blocks per row, their indices first) as BlockMask stores them
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return m.sum(-1).to(torch.int32)[None, None], order[None, None]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - window)

    return BlockMask.from_kv_blocks(*packed(partial), *packed(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(t, t))


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415 - optional (the flex path only)

    return torch.compile(flex_attention, dynamic=False)


def _flex_window(q, k, v, window: int):
    mask = window_block_mask(q.shape[1], window, q.device)
    out = _compiled_flex()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                           enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def document_attention(q, k, v, doc_start, window: int | None = None):
    """Causal attention inside each packed document (``doc_start`` [B, T]), over the last ``window`` positions
    when given (the window branch; None: the dense baseline). Shapes as ``causal_attention``."""
    backend = document_backend(q.device.type, window is not None)
    if backend == "flex":
        return _flex_documents(q, k, v, doc_start, window)
    if backend == "band":
        return band_window_attention(q, k, v, window, doc_start)
    return _sdpa_documents(q, k, v, doc_start)


def document_mask_mod(doc_start, window: int | None = None):
    """FlexAttention mask_mod of reference.py's document rule: row b's query q sees key kv iff
    doc_start[b, q] <= kv <= q (and q - kv < window when given)."""

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (kv_idx <= q_idx) & (kv_idx >= doc_start[b, q_idx])
        return visible if window is None else visible & (q_idx - kv_idx < window)

    return mask_mod


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415 - optional (the flex path only)

    # A new mask_mod closure per step (a new doc_start) does not recompile: the captured tensor is a graph input.
    return torch.compile(create_block_mask, dynamic=False)


def _flex_documents(q, k, v, doc_start, window: int | None):
    b, t = doc_start.shape
    mask = _compiled_create_block_mask()(document_mask_mod(doc_start, window), b, None, t, t, device=q.device)
    out = _compiled_flex()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                           enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _sdpa_documents(q, k, v, doc_start):
    b, t = doc_start.shape
    s = torch.arange(t, device=q.device)
    mask = (s[None, :] <= s[:, None]) & (s >= doc_start.view(b, 1, t, 1))  # [B, 1, T, T]: the reason CPU only
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
