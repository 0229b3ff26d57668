"""Plain-PyTorch dense reference of Native Sparse Attention: the spec every fast path is held to.

Everything here builds explicit dense masks (O(T^2) memory) and computes softmax by hand, so that each rule
of the paper (arXiv 2502.11089, section 3) is visible in one line. Shapes: queries q [B, T, HQ, Dk]; keys
and values of each branch [B, T, HKV, D] (compressed ones [B, Tc, HKV, D]); query head h belongs to KV head
h // G with G = HQ / HKV. Outputs are [B, T, HQ, Dv].

The rules:
- Compressed token i summarises positions [i*d, i*d + l) and is visible to query t iff i*d + l - 1 <= t.
  A query with no visible compressed token gets output 0 (not NaN).
- Block importance (eq. 9, read as spatial overlap): p_slc[j] = sum_i p_cmp[i] * |span_i ∩ block_j| / d,
  where span_i = [i*d, i*d + l) and block_j = [j*l', (j+1)*l'). The overlap counted in units of d equals
  the multiplicity of the paper's double sum (both are a convolution of two boxes of l/d and l'/d), and with
  l' = l = d it is the identity. Summed over the G heads of a group (eq. 10): one selection per KV head.
- Per (token t, KV head), among blocks that start at or before t, take the n most important; block 0 and
  the local blocks (the one holding t and the one before it) are always taken and count towards n; ties go
  to the lower block index. p_cmp at t only sees compressed tokens visible at t, so nothing leaks from the
  future.
- Selected attention: query t attends to the tokens s <= t of its selected blocks.
- Sliding window: query t attends to s in [t - w + 1, t].
- Gated output: o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win, gates in [0, 1] per head and branch.

Document masking (``doc_start`` [B, T]: the position where token t's document begins; None = one document):
every branch sees only the query's own document, s >= doc_start[t], on top of the rules above.
- A compressed token is visible only if its whole span lies in the document: i*d >= doc_start[t].
- Candidate blocks are those overlapping the document, (j+1)*l' > doc_start[t]; the forced first block is the
  document's first block, doc_start[t] // l', instead of block 0 (the same block when doc_start is 0).
- Selected and window attention mask keys s < doc_start[t].
"""

from __future__ import annotations

import torch

from nsa_titan.models.nsa.common import NSAParams


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, S, HKV, D] -> [B, HQ, S, D] with query head h reading KV head h // n_rep."""
    return x.transpose(1, 2).repeat_interleave(n_rep, dim=1)


def masked_attention(q, k, v, mask):
    """Softmax attention with an explicit boolean mask broadcastable to [B, HQ, T, S].

    Rows whose mask is all False give 0. Returns (out [B, T, HQ, Dv], probs [B, HQ, T, S]).
    """
    n_rep = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh, vh = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    scores = torch.einsum("bhtd,bhsd->bhts", qh, kh) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)  # exp(-inf) = 0 on masked entries
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.einsum("bhts,bhsd->bhtd", probs, vh)
    return out.transpose(1, 2), probs


def doc_starts(doc_start, batch: int, seq_len: int, device=None) -> torch.Tensor:
    """[B, 1, T, 1] int64 document start of every query (zeros when ``doc_start`` is None: one document)."""
    if doc_start is None:
        return torch.zeros(batch, 1, seq_len, 1, dtype=torch.long, device=device)
    return doc_start.long().view(batch, 1, seq_len, 1)


def compressed_visibility(seq_len: int, p: NSAParams, device=None, ds=None) -> torch.Tensor:
    """[T, Tc] bool (or [B, 1, T, Tc] with document starts ``ds`` [B, 1, T, 1]): compressed token i is
    visible to query t iff its whole block lies at or before t (and, with documents, in t's document)."""
    t = torch.arange(seq_len, device=device)[:, None]
    i = torch.arange(p.num_cmp_tokens(seq_len), device=device)[None, :]
    visible = i * p.cmp_stride + p.cmp_block - 1 <= t
    return visible if ds is None else visible & (i * p.cmp_stride >= ds)


def compressed_attention(q, k_cmp, v_cmp, p: NSAParams, doc_start=None):
    """Returns (o_cmp [B, T, HQ, Dv], p_cmp [B, HQ, T, Tc])."""
    b, t, hq, _ = q.shape
    if k_cmp.shape[1] == 0:  # sequence shorter than one compression block: nothing is visible
        return q.new_zeros(b, t, hq, v_cmp.shape[-1]), q.new_zeros(b, hq, t, 0)
    mask = compressed_visibility(t, p, q.device, doc_starts(doc_start, b, t, q.device))
    return masked_attention(q, k_cmp, v_cmp, mask)


def overlap_weights(seq_len: int, p: NSAParams, device=None) -> torch.Tensor:
    """[Tc, Nb]: |span_i ∩ block_j| / d, counted token by token through membership matrices."""
    s = torch.arange(seq_len, device=device)
    i = torch.arange(p.num_cmp_tokens(seq_len), device=device)[:, None]
    j = torch.arange(p.num_slc_blocks(seq_len), device=device)[:, None]
    in_span = (s >= i * p.cmp_stride) & (s < i * p.cmp_stride + p.cmp_block)  # [Tc, T]
    in_block = s // p.slc_block == j  # [Nb, T]
    return (in_span.double() @ in_block.double().T) / p.cmp_stride


def block_importance(p_cmp, n_kv_heads: int, p: NSAParams):
    """p_cmp [B, HQ, T, Tc] -> importance [B, HKV, T, Nb] (eq. 9 then the group sum of eq. 10)."""
    b, hq, t, tc = p_cmp.shape
    group_sum = p_cmp.reshape(b, n_kv_heads, hq // n_kv_heads, t, tc).sum(dim=2)
    w = overlap_weights(t, p, p_cmp.device).to(p_cmp.dtype)
    return group_sum @ w


def select_blocks(importance, p: NSAParams, doc_start=None) -> torch.Tensor:
    """importance [B, HKV, T, Nb] -> chosen [B, HKV, T, Nb] bool, by explicit ranking.

    A block's rank is the number of blocks that beat it: a higher key, or an equal key and a lower index.
    Forced blocks get key +inf, blocks starting after t (or ending before t's document) are not candidates.
    """
    b, t_len, nb = importance.shape[0], importance.shape[-2], importance.shape[-1]
    t = torch.arange(t_len, device=importance.device)[:, None]
    j = torch.arange(nb, device=importance.device)[None, :]
    ds = doc_starts(doc_start, b, t_len, importance.device)
    candidate = (j * p.slc_block <= t) & ((j + 1) * p.slc_block > ds)
    current = t // p.slc_block
    forced = (j == ds // p.slc_block) | (j == current) | (j == current - 1)
    key = torch.where(forced, torch.full_like(importance, float("inf")), importance)
    key = torch.where(candidate, key, torch.full_like(importance, float("-inf")))
    kj, kk = key[..., :, None], key[..., None, :]  # block j on dim -2, competitor k on dim -1
    k_is_lower = j.T > j  # [j, k]: True where k < j
    beats = (kk > kj) | ((kk == kj) & k_is_lower)
    rank = beats.sum(dim=-1)
    return candidate & (rank < p.slc_top_n)


def selected_attention(q, k, v, chosen, p: NSAParams, doc_start=None):
    """chosen [B, HKV, T, Nb] bool -> o_slc [B, T, HQ, Dv]; causal inside the current block."""
    b, t_len = q.shape[:2]
    n_rep = q.shape[2] // k.shape[2]
    s = torch.arange(t_len, device=q.device)
    block_of_s = s // p.slc_block
    in_doc = (s[None, :] <= s[:, None]) & (s >= doc_starts(doc_start, b, t_len, q.device))  # [B, 1, T, T]
    token_mask = chosen[..., block_of_s] & in_doc  # [B, HKV, T, T]
    return masked_attention(q, k, v, token_mask.repeat_interleave(n_rep, dim=1))[0]


def window_attention(q, k, v, window: int, doc_start=None):
    b, t_len = q.shape[:2]
    s = torch.arange(t_len, device=q.device)
    mask = (s[None, :] <= s[:, None]) & (s[None, :] > s[:, None] - window)
    mask = mask & (s >= doc_starts(doc_start, b, t_len, q.device))
    return masked_attention(q, k, v, mask)[0]


def nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, p: NSAParams, doc_start=None):
    """The whole NSA attention. gates [B, T, HQ, 3] in (cmp, slc, win) order; ``doc_start`` [B, T] or None.

    Returns (o [B, T, HQ, Dv], chosen [B, HKV, T, Nb] bool).
    """
    o_cmp, p_cmp = compressed_attention(q, k_cmp, v_cmp, p, doc_start)
    chosen = select_blocks(block_importance(p_cmp.detach(), k_slc.shape[2], p), p, doc_start)
    o_slc = selected_attention(q, k_slc, v_slc, chosen, p, doc_start)
    o_win = window_attention(q, k_win, v_win, p.window, doc_start)
    g = gates.unsqueeze(-1)
    return g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win, chosen
