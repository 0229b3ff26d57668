"""Causal "band" attention in Triton: one kernel family serves the compressed and the sliding-window branch.

Key i sits at position pos(i) = i * KSTRIDE + KOFF and query t sees it iff pos(i) <= t and, when WIN > 0,
pos(i) > t - WIN. Compressed attention is KSTRIDE = d, KOFF = l - 1 (token i covers [i*d, i*d + l)), no
window; sliding-window attention is KSTRIDE = 1, KOFF = 0, WIN = w.

GQA packing: the (token, query head) pairs of one (batch, KV head) are numbered R = token * G + head, and a
program owns ROWS consecutive R as matrix rows (row R -> token R // G, head R % G). Every key/value tile is
then loaded once for the whole group, small G still fills the MMA tile, and a G that is not a power of two
(m7c's 6, Qwen's 7) wastes no rows: padding the group to next_pow2(G) heads left 25 % of m7c's rows empty.
A token's heads may straddle two programs; every row is independent in the forward and dQ, and the dK/dV
walk steps through R the same way.

Scores are kept in log2 units (the softmax scale is folded with log2(e)), so LSE is a base-2 log-sum-exp.
Rows that see nothing get output 0 and LSE = +inf, which makes every recomputed probability exp2(s - LSE)
exactly 0 in the backward and in the block selection, without special cases.
The backward (dQ, and dK/dV per key tile without atomics) is in band_bwd.py; this file holds the forward and the
helpers both share.

Mask-free interior tiles (SPLIT, on by default): every loop runs in three parts, masked / unmasked / masked.
The middle part holds the whole tiles that every row of the program sees (keys at or before its first token
and, with a window, after its last token's window start), so it skips the [rows x keys] visibility mask;
only the causal diagonal and the window's far edge pay for it. Rows past the last token read q = dO = 0 and
LSE = +inf, so their probabilities are exactly 0 without the mask as well.

Tensor-descriptor loads (TMA, on by default on a GPU; tma.py): the forward and dQ load their K/V tiles, and dK/dV
with one KV head its Q/dO row tiles, through the copy engine instead of pointer arithmetic and masks. Tiles past a
tensor's end read zeros and keys past a program's range are masked as before, so the results are those of the
pointer loads (bit for bit on the interpreter). H100, profiled kernel time against the pointer kernels: the 1b's band
forwards 0.405 -> 0.341 ms and dK/dV 0.715 -> 0.685 at 8k batch 2; m7c forward 0.183 -> 0.167, dQ 0.190 -> 0.183.

Document masking (DOC, with DS = doc_start [B, T] int32): key i is also hidden from query t when its span
starts before t's document, i * KSTRIDE < DS[t]; the forward and dQ start their key loop at the tile's
earliest document start.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.combine import pow2
from nsa_titan.kernels.tma import kv_specs, launch_tma
from nsa_titan.kernels.tuned import TUNED

LOG2E = 1.4426950408889634


@triton.jit
def _rows(r0, kv, n_rows, G: tl.constexpr, ROWS: tl.constexpr):
    """ROWS packed rows from R = r0: token, query head, validity (R < n_rows). G is a constexpr, so the
    division is a multiply and shift."""
    R = r0 + tl.arange(0, ROWS)
    t = R // G
    return t, kv * G + R % G, R < n_rows


@triton.jit
def _visible(t, pos, kmask, WIN: tl.constexpr):
    vis = (pos[None, :] <= t[:, None]) & kmask[None, :]
    if WIN > 0:
        vis = vis & (pos[None, :] > t[:, None] - WIN)
    return vis


@triton.jit
def _doc_rows(DS, b, t, row_ok, T, DOC: tl.constexpr):
    """Document start of every row (0 without documents: nothing extra is masked)."""
    if DOC:
        return tl.load(DS + b * T + t, mask=row_ok, other=0)
    return t * 0


@triton.jit
def _doc_key_start(i_start, ds, row_ok, T, KSTRIDE: tl.constexpr, DOC: tl.constexpr):
    """Raise a tile's first key to the first one inside its earliest document."""
    if DOC:
        first = tl.min(tl.where(row_ok, ds, T))
        i_start = tl.maximum(i_start, (first + KSTRIDE - 1) // KSTRIDE)
    return i_start


@triton.jit
def _key_range(t_lo, t_hi, S, KSTRIDE: tl.constexpr, KOFF: tl.constexpr, WIN: tl.constexpr):
    """Keys [i_start, i_end) that any query in [t_lo, t_hi] can see (integer division truncates: guard < 0)."""
    i_end = tl.where(t_hi >= KOFF, (t_hi - KOFF) // KSTRIDE + 1, 0)
    i_end = tl.minimum(i_end, S)
    i_start = 0
    if WIN > 0:
        x = t_lo - WIN + 1 - KOFF
        i_start = tl.where(x > 0, (x + KSTRIDE - 1) // KSTRIDE, 0)
    return i_start, i_end


@triton.jit
def _unmasked_keys(t_lo, t_hi, i_start, i_end, KSTRIDE: tl.constexpr, KOFF: tl.constexpr, WIN: tl.constexpr,
                   BK: tl.constexpr, SPLIT: tl.constexpr):
    """[m1, m2): the whole BK-tiles of a key loop from i_start that every query in [t_lo, t_hi] sees."""
    m1 = i_end
    m2 = i_end
    if SPLIT:
        c1 = tl.minimum(tl.where(t_lo >= KOFF, (t_lo - KOFF) // KSTRIDE + 1, 0), i_end)  # keys < c1: pos <= t_lo
        a = i_start
        if WIN > 0:
            x = t_hi - WIN + 1 - KOFF  # keys >= a: inside the window of the last query
            a = tl.where(x > 0, (x + KSTRIDE - 1) // KSTRIDE, 0)
        m1 = tl.minimum(i_start + tl.cdiv(tl.maximum(a - i_start, 0), BK) * BK, i_end)
        m2 = m1 + (tl.maximum(c1 - m1, 0) // BK) * BK
    return m1, m2


@triton.jit
def _tile_keys(DS, pid_m, b, t, row_ok, T, TQ, S, G: tl.constexpr, ROWS: tl.constexpr, KSTRIDE: tl.constexpr,
               KOFF: tl.constexpr, WIN: tl.constexpr, BK: tl.constexpr, DOC: tl.constexpr, SPLIT: tl.constexpr):
    """The keys a query tile (pid_m, rows t) walks, for the forward and dQ: -> (ds: its rows' document starts,
    i_start, i_end: its key range, [m1, m2): the whole key tiles that every row sees, no mask needed)."""
    t_lo = (pid_m * ROWS) // G
    t_hi = tl.minimum((pid_m * ROWS + ROWS - 1) // G, TQ - 1)
    i_start, i_end = _key_range(t_lo, t_hi, S, KSTRIDE, KOFF, WIN)
    ds = _doc_rows(DS, b, t, row_ok, T, DOC)
    i_start = _doc_key_start(i_start, ds, row_ok, T, KSTRIDE, DOC)
    m1, m2 = _unmasked_keys(t_lo, t_hi, i_start, i_end, KSTRIDE, KOFF, WIN, BK, SPLIT)
    return ds, i_start, i_end, m1, m2


@triton.jit
def _scores(q, kb, vb, sks, svs, i0, i_end, t, ds, bkv, qk_scale, KSTRIDE: tl.constexpr, KOFF: tl.constexpr,
            WIN: tl.constexpr, BK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
            DVP: tl.constexpr, DOC: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr):
    """One key tile: (k, v, scores in log2 units, -inf where hidden). kb/vb point at (batch, KV head), or with
    TMA are [B, S, HKV, D] tensor descriptors and bkv = (batch, KV head): the copy engine loads the tile (zeros
    past S; keys past i_end are hidden by the mask below, as with the pointer loads' zeros)."""
    dk, dv = tl.arange(0, DKP), tl.arange(0, DVP)
    i = i0 + tl.arange(0, BK)
    kmask = i < i_end
    if TMA:
        k = kb.load([bkv[0], i0, bkv[1], 0]).reshape(BK, DKP)
        v = vb.load([bkv[0], i0, bkv[1], 0]).reshape(BK, DVP)
    else:
        k = tl.load(kb + i[:, None] * sks + dk[None, :], mask=kmask[:, None] & (dk[None, :] < DK), other=0.0)
        v = tl.load(vb + i[:, None] * svs + dv[None, :], mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASK:
        s = tl.where(_visible(t, i * KSTRIDE + KOFF, kmask, WIN), s, float("-inf"))
    if DOC:
        s = tl.where((i * KSTRIDE)[None, :] >= ds[:, None], s, float("-inf"))
    return k, v, s


@triton.jit
def _fwd_tile(q, kb, vb, sks, svs, i0, i_end, t, ds, bkv, m_i, l_i, acc, qk_scale, KSTRIDE: tl.constexpr,
              KOFF: tl.constexpr, WIN: tl.constexpr, BK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              DKP: tl.constexpr, DVP: tl.constexpr, DOC: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr):
    """One key tile of the online softmax."""
    k, v, s = _scores(q, kb, vb, sks, svs, i0, i_end, t, ds, bkv, qk_scale, KSTRIDE, KOFF, WIN, BK, DK, DV, DKP,
                      DVP, DOC, MASK, TMA)
    return online_softmax(s, v, m_i, l_i, acc)


@triton.jit
def online_softmax(s, v, m_i, l_i, acc):
    """Fold one tile into the running softmax: scores s in log2 units (-inf where hidden) and their values v;
    (m_i, l_i, acc) = running max, sum of exponentials, unnormalised output. Also the selected forward's step."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def finish_softmax(O, LSE, acc, m_i, l_i, o_rows, lse_rows, row_ok, DV: tl.constexpr, DVP: tl.constexpr):
    """The forwards' epilogue: O = acc / l (0 where a row saw no key), LSE = m + log2(l) (+inf there); o_rows and
    lse_rows are each row's offsets into O and LSE. -> O's tile as stored (rounded to O's dtype), in fp32."""
    dv = tl.arange(0, DVP)
    ok = l_i > 0
    o = tl.where(ok[:, None], acc / tl.where(ok, l_i, 1.0)[:, None], 0.0)
    tl.store(O + o_rows[:, None] + dv[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(LSE + lse_rows, tl.where(ok, m_i + tl.log2(tl.where(ok, l_i, 1.0)), float("inf")), mask=row_ok)
    return o.to(O.dtype.element_ty).to(tl.float32)


@triton.jit
def _band_fwd(Q, K, V, O, LSE, DS, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sob, sot, soh,
              T, TQ, S, HKV, qk_scale, G: tl.constexpr,
              KSTRIDE: tl.constexpr, KOFF: tl.constexpr, WIN: tl.constexpr, ROWS: tl.constexpr,
              BK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              DKP: tl.constexpr, DVP: tl.constexpr, DOC: tl.constexpr, SPLIT: tl.constexpr,
              TMA: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    t, h, row_ok = _rows(pid_m * ROWS, kv, TQ * G, G, ROWS)
    dk = tl.arange(0, DKP)
    q = tl.load(Q + b * sqb + t[:, None] * sqt + h[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    ds, i_start, i_end, m1, m2 = _tile_keys(DS, pid_m, b, t, row_ok, T, TQ, S, G, ROWS, KSTRIDE, KOFF, WIN, BK, DOC,
                                            SPLIT)
    m_i = tl.full([ROWS], -1e30, tl.float32)  # finite start: no inf - inf on fully masked tiles
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DVP], tl.float32)
    if TMA:  # descriptors of the whole [B, S, HKV, D] tensors (see _scores)
        kb, vb = K, V
    else:
        kb, vb = K + b * skb + kv * skh, V + b * svb + kv * svh
    bkv = (pid_bh // HKV, kv)
    for i0 in range(i_start, m1, BK):
        m_i, l_i, acc = _fwd_tile(q, kb, vb, sks, svs, i0, i_end, t, ds, bkv, m_i, l_i, acc, qk_scale, KSTRIDE, KOFF,
                                  WIN, BK, DK, DV, DKP, DVP, DOC, True, TMA)
    for i0 in range(m1, m2, BK):
        m_i, l_i, acc = _fwd_tile(q, kb, vb, sks, svs, i0, i_end, t, ds, bkv, m_i, l_i, acc, qk_scale, KSTRIDE, KOFF,
                                  WIN, BK, DK, DV, DKP, DVP, DOC, False, TMA)
    for i0 in range(m2, i_end, BK):
        m_i, l_i, acc = _fwd_tile(q, kb, vb, sks, svs, i0, i_end, t, ds, bkv, m_i, l_i, acc, qk_scale, KSTRIDE, KOFF,
                                  WIN, BK, DK, DV, DKP, DVP, DOC, True, TMA)
    finish_softmax(O, LSE, acc, m_i, l_i, b * sob + t * sot + h * soh, (b * T + t) * (HKV * G) + h, row_ok, DV, DVP)


def launch_cfg(kernel: str, gp: int, dmax: int, windowed: bool, cuda: bool) -> dict:
    if not cuda:  # interpreter: fewer, larger programs (it pays per op, not per element)
        return dict(rows=64, BK=32 if dmax > 128 else 64, num_warps=4, num_stages=1)
    big = dmax > 128
    cfg = dict(rows=64 if big else 128, BK=32 if big else 64, num_warps=4 if big else 8, num_stages=3)
    if kernel == "band_dkdv" and dmax >= 128:
        # q, dO tiles + k, v + two accumulators: a 128-row query tile with 3 stages overflows the 227 KB
        # of shared memory at head dim 128 (seen on H200).
        cfg.update(rows=64, num_warps=4, num_stages=2)
    cfg.update(TUNED.get((kernel, gp, dmax, windowed), {}))
    return cfg


def many_keys_shape(c: dict, n_keys: int) -> dict | None:
    """The launch shape a table entry ``c`` names for a walk over ``n_keys`` keys: its ``many_keys`` shape from
    ``many_keys["from_keys"]`` keys on, else None (the entry itself). band_fwd reads it for its keys, band_dq2 for
    its second branch's."""
    many = c.get("many_keys")
    if many is None or n_keys < many["from_keys"]:
        return None
    return {k: v for k, v in many.items() if k != "from_keys"}


def _launch(kernel: str, G: int, dmax: int, windowed: bool, x: torch.Tensor, cfg: dict | None):
    """-> (ROWS, BK, triton launch kwargs, tma). An explicit cfg (a sweep) overrides everything; its ``split``
    (default True) turns the mask-free interior tiles on or off (off: every tile masked, for A/B runs), its
    ``tma`` (default: on a GPU) the key/value tiles' loads through tensor descriptors (tma.py), its ``i32_rows``
    (band_dkdv only, default on; pointer loads, where fits_i32) the query tiles' row arithmetic in 32 bits (attempt 95).
    The table is keyed by next_pow2(G); rows stay a power of two (a tl.arange length), at least 16 (the
    smallest MMA tile)."""
    c = dict(launch_cfg(kernel, pow2(G), dmax, windowed, x.device.type == "cuda"), **(cfg or {}))
    kw = dict(num_warps=c["num_warps"], num_stages=c["num_stages"], SPLIT=bool(c.get("split", True)))
    if kernel == "band_dkdv":  # its query tiles' row arithmetic in 32 bits (band_bwd; the caller checks the sizes)
        kw["I32"] = bool(c.get("i32_rows", True))
    return max(pow2(c["rows"]), 16), c["BK"], kw, bool(c.get("tma", x.device.type == "cuda"))


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def band_fwd(q, k, v, kstride: int, koff: int, window: int, cfg: dict | None = None, doc_start=None,
             n_queries: int | None = None, out: tuple | None = None):
    """q [B,T,HQ,Dk], k [B,S,HKV,Dk], v [B,S,HKV,Dv] -> (o [B,T,HQ,Dv], lse [B,T,HQ] fp32 base-2).
    ``doc_start`` [B,T] int32 contiguous or None (see the module doc). ``n_queries``: only the first n query
    tokens (the rest of o and lse is left as it was); ``out``: (o, lse) to write into instead of new tensors
    (lse contiguous)."""
    B, T, HQ, DK = q.shape
    S, HKV, DV = k.shape[1], k.shape[2], v.shape[-1]
    G = HQ // HKV
    tq = T if n_queries is None else n_queries
    o, lse = out if out is not None else (q.new_empty(B, T, HQ, DV),
                                          torch.empty(B, T, HQ, device=q.device, dtype=torch.float32))
    if not cfg:  # a long key walk (the compressed branch from ~48k tokens) may want its own tiles: tuned.py
        cfg = many_keys_shape(launch_cfg("band_fwd", pow2(G), max(DK, DV), window > 0, q.is_cuda), S)
    rows, bk, kw, tma = _launch("band_fwd", G, max(DK, DV), window > 0, q, cfg)
    args = (q, k, v, o, lse, lse if doc_start is None else doc_start, *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *o.stride()[:3], T, tq, S, HKV, DK**-0.5 * LOG2E)
    const = dict(G=G, KSTRIDE=kstride, KOFF=koff, WIN=window, ROWS=rows, BK=bk, DK=DK, DV=DV, DKP=pow2(max(DK, 16)),
                 DVP=pow2(max(DV, 16)), DOC=doc_start is not None, **kw)
    launch_tma(_band_fwd, (triton.cdiv(tq * G, rows), B * HKV), args, kv_specs(k, v, bk), tma, const)
    return o, lse


