"""Portable vectorised NSA (CPU and GPU): the default path until the Triton kernels take over on CUDA.

Same semantics as ``reference.py`` (the spec), built for speed and for ``torch.compile(fullgraph=True)``:
no Python loops over tokens, blocks or heads, no host syncs, every shape static. Differences from the
reference are in construction only:
- the overlap map is counted per sub-block of d positions, not by a token membership product;
- top-n is a stable descending sort (ties keep the lower index) instead of an all-pairs ranking;
- selected attention runs through ``scaled_dot_product_attention`` with a boolean mask; the window through
  ``local_attention`` (flash-attn, FlexAttention or a banded form: no [T, T] mask, packed documents included).
Memory is still O(T^2) per KV head for the selection mask; the kernels issue removes that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nsa_titan.models.nsa import local_attention
from nsa_titan.models.nsa.common import NSAParams


def _heads_first(x: torch.Tensor, n_rep: int = 1) -> torch.Tensor:
    """[B, S, H, D] -> [B, H * n_rep, S, D] (query head h reads KV head h // n_rep)."""
    x = x.transpose(1, 2)
    return x.repeat_interleave(n_rep, dim=1) if n_rep > 1 else x


def _doc_start(doc_start, b: int, t: int) -> torch.Tensor | None:
    """[B, 1, T, 1] int64 (broadcasts against [B, H, T, S] masks), or None for one document per sequence."""
    return None if doc_start is None else doc_start.long().view(b, 1, t, 1)


def compressed_attention(q, k_cmp, v_cmp, p: NSAParams, doc_start=None):
    """Returns (o_cmp [B, T, HQ, Dv], group-summed probabilities [B, HKV, T, Tc] (no grad))."""
    b, t, hq, dk = q.shape
    tc, hkv = k_cmp.shape[1], k_cmp.shape[2]
    g = hq // hkv
    if tc == 0:
        return q.new_zeros(b, t, hq, v_cmp.shape[-1]), q.new_zeros(b, hkv, t, 0)
    qg = q.reshape(b, t, hkv, g, dk).permute(0, 2, 3, 1, 4)  # [B, HKV, G, T, Dk]
    kc = k_cmp.permute(0, 2, 3, 1)  # [B, HKV, Dk, Tc]
    scores = torch.matmul(qg, kc.unsqueeze(2))  # [B, HKV, G, T, Tc]
    # Softmax in at least fp32 (bf16 under autocast would lose the small probabilities selection needs).
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * dk**-0.5
    tpos = torch.arange(t, device=q.device)[:, None]
    ipos = torch.arange(tc, device=q.device)[None, :]
    visible = ipos * p.cmp_stride + p.cmp_block - 1 <= tpos  # [T, Tc]
    ds = _doc_start(doc_start, b, t)
    if ds is not None:  # the whole compressed span inside the query's document: [B, 1, 1, T, Tc]
        visible = (visible & (ipos * p.cmp_stride >= ds)).unsqueeze(1)
    # A finite fill keeps rows with nothing visible NaN-free (forward and backward); multiplying by the
    # mask then zeroes them.
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1) * visible
    out = torch.matmul(probs.to(v_cmp.dtype), v_cmp.transpose(1, 2).unsqueeze(2))  # [B, HKV, G, T, Dv]
    out = out.permute(0, 3, 1, 2, 4).reshape(b, t, hq, v_cmp.shape[-1])
    return out, probs.detach().sum(dim=2)


def overlap_weights(seq_len: int, p: NSAParams, device=None, dtype=torch.float32) -> torch.Tensor:
    """[Tc, Nb]: |[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / d, counted in sub-blocks of d positions.

    Compressed token i covers sub-blocks i .. i + l/d - 1, and sub-block u lies in selection block
    u // (l'/d): a one-hot per covered sub-block, summed (small integers: exact in fp32). The loop runs
    over the l/d sub-blocks of one compression block (2 at paper sizes), never over tokens.
    """
    i = torch.arange(p.num_cmp_tokens(seq_len), device=device)[:, None]
    j = torch.arange(p.num_slc_blocks(seq_len), device=device)[None, :]
    subs_per_block = p.slc_block // p.cmp_stride
    w = torch.zeros(i.shape[0], j.shape[1], device=device, dtype=dtype)
    for r in range(p.cmp_block // p.cmp_stride):  # F.one_hot would validate indices with a host sync
        w = w + ((i + r) // subs_per_block == j).to(dtype)
    return w


def select_blocks(group_probs, p: NSAParams, doc_start=None) -> torch.Tensor:
    """group_probs [B, HKV, T, Tc] -> block indices [B, HKV, T, n] (int64, -1 = unused slot)."""
    b, t_len = group_probs.shape[0], group_probs.shape[2]
    nb = p.num_slc_blocks(t_len)
    # fp32 even under autocast: bf16 importances would create ties that the reference does not have.
    with torch.autocast(group_probs.device.type, enabled=False):
        importance = group_probs.float() @ overlap_weights(t_len, p, group_probs.device)
    t = torch.arange(t_len, device=group_probs.device)[:, None]
    j = torch.arange(nb, device=group_probs.device)[None, :]
    current = t // p.slc_block
    ds = _doc_start(doc_start, b, t_len)
    first = 0 if ds is None else ds // p.slc_block  # the document's first block
    forced = (j == first) | (j == current) | (j == current - 1)
    key = torch.where(forced, float("inf"), importance)
    candidate = j * p.slc_block <= t
    if ds is not None:
        candidate = candidate & ((j + 1) * p.slc_block > ds)
    key = torch.where(candidate, key, float("-inf"))
    if nb < p.slc_top_n:  # pad so that the output always has n slots (static shape)
        key = F.pad(key, (0, p.slc_top_n - nb), value=float("-inf"))
    sorted_key, order = torch.sort(key, dim=-1, descending=True, stable=True)
    top_key, top_idx = sorted_key[..., : p.slc_top_n], order[..., : p.slc_top_n]
    return torch.where(top_key > float("-inf"), top_idx, -1)


def blocks_to_mask(block_idx, seq_len: int, p: NSAParams) -> torch.Tensor:
    """[B, HKV, T, n] indices -> [B, HKV, T, Nb] bool (unused slots dropped)."""
    nb = p.num_slc_blocks(seq_len)
    onehot = torch.zeros(*block_idx.shape[:-1], nb + 1, dtype=torch.bool, device=block_idx.device)
    # Unused slots (-1) land in the extra last column, which is then cut off.
    onehot.scatter_(-1, torch.where(block_idx < 0, nb, block_idx), True)
    return onehot[..., :nb]


def _causal_in_doc(t: int, doc_start, b: int, device) -> torch.Tensor:
    """[T, T] causal mask, or [B, 1, T, T] with keys before the query's document masked."""
    s = torch.arange(t, device=device)
    mask = s[None, :] <= s[:, None]
    ds = _doc_start(doc_start, b, t)
    return mask if ds is None else mask & (s >= ds)


def selected_attention(q, k, v, block_idx, p: NSAParams, doc_start=None):
    b, t, hq, _ = q.shape
    n_rep = hq // k.shape[2]
    s = torch.arange(t, device=q.device)
    chosen = blocks_to_mask(block_idx, t, p)  # [B, HKV, T, Nb]
    mask = chosen[..., s // p.slc_block] & _causal_in_doc(t, doc_start, b, q.device)  # [B, HKV, T, T]
    mask = mask.repeat_interleave(n_rep, dim=1) if n_rep > 1 else mask
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), _heads_first(k, n_rep), _heads_first(v, n_rep), attn_mask=mask
    )
    return out.transpose(1, 2)


def window_attention(q, k, v, window: int, doc_start=None):
    """Banded on CPU, FlexAttention or flash-attn on CUDA (local_attention.py): no [T, T] mask. Packed documents
    (doc_start): the banded form on CPU, FlexAttention with a document mask_mod on CUDA."""
    if doc_start is None:
        return local_attention.window_attention(q, k, v, window)
    return local_attention.document_attention(q, k, v, doc_start, window)


def nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, p: NSAParams, doc_start=None):
    """Same contract as reference.nsa_attention, but returns block indices [B, HKV, T, n] (-1 unused)."""
    o_cmp, group_probs = compressed_attention(q, k_cmp, v_cmp, p, doc_start)
    block_idx = select_blocks(group_probs, p, doc_start)
    o_slc = selected_attention(q, k_slc, v_slc, block_idx, p, doc_start)
    o_win = window_attention(q, k_win, v_win, p.window, doc_start)
    g = gates.unsqueeze(-1).to(o_cmp.dtype)
    out = g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc.to(o_cmp.dtype) + g[..., 2, :] * o_win.to(o_cmp.dtype)
    return out, block_idx
