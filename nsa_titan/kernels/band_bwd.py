"""The band attention's backward (band.py's kernel family: its module doc gives the key geometry, the GQA row
packing, the mask-free interior tiles, the descriptor loads and the document masking).

dQ: one program per tile of packed query rows walks the keys it sees, as the forward does. dK/dV: one program per
key tile walks the query rows that see it (no atomics: deterministic); long query ranges are split into NSPLIT
contiguous parts whose fp32 partial sums are added afterwards in a fixed order (_num_splits).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.band import (
    LOG2E,
    _launch,
    _rows,
    _scores,
    _tile_keys,
    _visible,
    launch_cfg,
    sm_count,
)
from nsa_titan.kernels.combine import add_splits, balanced_splits, fits_i32, pow2, rowdot
from nsa_titan.kernels.tma import kv_specs, launch_tma


@triton.jit
def _unmasked_queries(lo, hi, key_lo, key_last, T, G: tl.constexpr, KSTRIDE: tl.constexpr, KOFF: tl.constexpr,
                      WIN: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr):
    """[m1, m2): the whole ROWS-tiles of a loop over packed rows R from lo (< hi) whose every row sees every key
    of [key_lo, key_last] (row R is token R // G, so token bounds scale by G)."""
    m1 = hi
    m2 = hi
    if SPLIT:
        fa = (key_last * KSTRIDE + KOFF) * G  # rows >= fa: tokens that see the tile's last key
        fb = T * G
        if WIN > 0:
            fb = (key_lo * KSTRIDE + KOFF + WIN) * G  # rows < fb: tokens that still see its first key
        m1 = tl.minimum(lo + tl.cdiv(tl.maximum(fa - lo, 0), ROWS) * ROWS, hi)
        m2 = m1 + (tl.maximum(tl.minimum(fb, hi) - m1, 0) // ROWS) * ROWS
    return m1, m2


@triton.jit
def _dq_tile(q, do, lse, delta, kb, vb, sks, svs, i0, i_end, t, ds, bkv, dq, qk_scale, KSTRIDE: tl.constexpr,
             KOFF: tl.constexpr, WIN: tl.constexpr, BK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
             DKP: tl.constexpr, DVP: tl.constexpr, DOC: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr):
    k, v, s = _scores(q, kb, vb, sks, svs, i0, i_end, t, ds, bkv, qk_scale, KSTRIDE, KOFF, WIN, BK, DK, DV, DKP,
                      DVP, DOC, MASK, TMA)
    p = tl.exp2(s - lse[:, None])  # hidden: -inf - lse = -inf, also for rows that see nothing (lse = +inf)
    dp = tl.dot(do, tl.trans(v))
    dsc = p * (dp - delta[:, None])
    return dq + tl.dot(dsc.to(k.dtype), k)


@triton.jit
def _dkdv_tile(Q, DO, LSE, DELTA, DS, k, v, b, kv, sqb, sqt, sqh, T, HKV, r0, hi, i, pos, kmask,
               acc_k, acc_v, qk_scale, G: tl.constexpr, KSTRIDE: tl.constexpr, WIN: tl.constexpr,
               ROWS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr,
               DOC: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr, KT: tl.constexpr):
    """One query tile (packed rows [r0, r0 + ROWS), those < hi valid) contribution to a key tile's dK/dV. With TMA
    the rows past hi hold other tokens' Q and dO (or zeros past the end): their LSE of +inf zeroes them below. KT:
    the scores as [keys, rows] (no transposes of register tiles before the dV and dK MMAs)."""
    dk, dv = tl.arange(0, DKP), tl.arange(0, DVP)
    t, h, row_ok = _rows(r0, kv, hi, G, ROWS)
    if TMA:
        q = Q.load([b.to(tl.int32), r0, 0]).reshape(ROWS, DKP)
        do = DO.load([b.to(tl.int32), r0, 0]).reshape(ROWS, DVP)
    else:
        q = tl.load(Q + b * sqb + t[:, None] * sqt + h[:, None] * sqh + dk[None, :],
                    mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
        do_off = b * (T * HKV * G * DV) + t[:, None] * (HKV * G * DV) + h[:, None] * DV
        do = tl.load(DO + do_off + dv[None, :], mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + (b * T + t) * (HKV * G) + h, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + (b * T + t) * (HKV * G) + h, mask=row_ok, other=0.0)
    if KT:  # keys as the MMA rows: S^T = K Q^T, so P^T and dS^T are the register operands of dV and dK's MMAs
        st = tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :]
        if MASK:
            st = tl.where(tl.trans(_visible(t, pos, kmask, WIN)) & row_ok[None, :], st, float("-inf"))
        if DOC:
            dst = tl.load(DS + b * T + t, mask=row_ok, other=0)
            st = tl.where((i * KSTRIDE)[:, None] >= dst[None, :], st, float("-inf"))
        pt = tl.exp2(st)
        acc_v += tl.dot(pt.to(do.dtype), do)
        dsc_t = pt * (tl.dot(v, tl.trans(do)) - delta[None, :])
        acc_k += tl.dot(dsc_t.to(q.dtype), q)
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None]
        if MASK:
            s = tl.where(_visible(t, pos, kmask, WIN) & row_ok[:, None], s, float("-inf"))  # before exp2
        if DOC:
            dst = tl.load(DS + b * T + t, mask=row_ok, other=0)
            s = tl.where((i * KSTRIDE)[None, :] >= dst[:, None], s, float("-inf"))
        p = tl.exp2(s)
        acc_v += tl.dot(tl.trans(p.to(do.dtype)), do)
        dp = tl.dot(do, tl.trans(v))
        dsc = p * (dp - delta[:, None])
        acc_k += tl.dot(tl.trans(dsc.to(q.dtype)), q)
    return acc_k, acc_v


@triton.jit
def _dq_branch(q, do, dq, K, V, LSE, DELTA, DS, pid_m, pid_bh, b, kv, t, h, row_ok, skb, sks, skh, svb, svs, svh, T,
               TQ, S, HKV, qk_scale, G: tl.constexpr, KSTRIDE: tl.constexpr, KOFF: tl.constexpr, WIN: tl.constexpr,
               ROWS: tl.constexpr, BK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
               DVP: tl.constexpr, DOC: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr):
    """One branch's keys added to a query tile's dQ accumulator (unscaled): masked edges, the mask-free interior."""
    lse = tl.load(LSE + (b * T + t) * (HKV * G) + h, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + (b * T + t) * (HKV * G) + h, mask=row_ok, other=0.0)
    ds, i_start, i_end, m1, m2 = _tile_keys(DS, pid_m, b, t, row_ok, T, TQ, S, G, ROWS, KSTRIDE, KOFF, WIN, BK, DOC,
                                            SPLIT)
    if TMA:  # descriptors of the whole [B, S, HKV, D] tensors (see _scores)
        kb, vb = K, V
    else:
        kb, vb = K + b * skb + kv * skh, V + b * svb + kv * svh
    bkv = (pid_bh // HKV, kv)
    for i0 in range(i_start, m1, BK):
        dq = _dq_tile(q, do, lse, delta, kb, vb, sks, svs, i0, i_end, t, ds, bkv, dq, qk_scale, KSTRIDE, KOFF, WIN, BK,
                      DK, DV, DKP, DVP, DOC, True, TMA)
    for i0 in range(m1, m2, BK):
        dq = _dq_tile(q, do, lse, delta, kb, vb, sks, svs, i0, i_end, t, ds, bkv, dq, qk_scale, KSTRIDE, KOFF, WIN, BK,
                      DK, DV, DKP, DVP, DOC, False, TMA)
    for i0 in range(m2, i_end, BK):
        dq = _dq_tile(q, do, lse, delta, kb, vb, sks, svs, i0, i_end, t, ds, bkv, dq, qk_scale, KSTRIDE, KOFF, WIN, BK,
                      DK, DV, DKP, DVP, DOC, True, TMA)
    return dq


@triton.jit
def _dq_rows(Q, DO, sqb, sqt, sqh, T, TQ, HKV, G: tl.constexpr, ROWS: tl.constexpr, DK: tl.constexpr,
             DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr):
    """A dQ program's query tile: -> (pid_m, pid_bh, b, kv, t, h, row_ok, q, do, dk)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    t, h, row_ok = _rows(pid_m * ROWS, kv, TQ * G, G, ROWS)
    dk, dv = tl.arange(0, DKP), tl.arange(0, DVP)
    q_off = b * sqb + t[:, None] * sqt + h[:, None] * sqh
    q = tl.load(Q + q_off + dk[None, :], mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    do_off = b * (T * HKV * G * DV) + t[:, None] * (HKV * G * DV) + h[:, None] * DV
    do = tl.load(DO + do_off + dv[None, :], mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
    return pid_m, pid_bh, b, kv, t, h, row_ok, q, do, dk


@triton.jit
def _store_band_dq(DQ, dq, b, t, h, row_ok, dk, T, HKV, G: tl.constexpr, DK: tl.constexpr, ACC: tl.constexpr):
    dq_off = b * (T * HKV * G * DK) + t[:, None] * (HKV * G * DK) + h[:, None] * DK
    if ACC:
        dq += tl.load(DQ + dq_off + dk[None, :], mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float32)
    tl.store(DQ + dq_off + dk[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (dk[None, :] < DK))


@triton.jit
def _band_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, DS, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh,
                 T, TQ, S, HKV, qk_scale, sm_scale, G: tl.constexpr,
                 KSTRIDE: tl.constexpr, KOFF: tl.constexpr, WIN: tl.constexpr, ROWS: tl.constexpr,
                 BK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 DKP: tl.constexpr, DVP: tl.constexpr, ACC: tl.constexpr, DOC: tl.constexpr,
                 SPLIT: tl.constexpr, TMA: tl.constexpr):
    """dQ per query tile; DO and DQ are contiguous [B, T, HQ, D]. ACC: add to the dQ already in DQ (another
    branch's), in fp32, instead of overwriting it (each row is read and written by one program: deterministic)."""
    pid_m, pid_bh, b, kv, t, h, row_ok, q, do, dk = _dq_rows(Q, DO, sqb, sqt, sqh, T, TQ, HKV, G, ROWS, DK, DV, DKP,
                                                             DVP)
    dq = _dq_branch(q, do, tl.zeros([ROWS, DKP], tl.float32), K, V, LSE, DELTA, DS, pid_m, pid_bh, b, kv, t, h,
                    row_ok, skb, sks, skh, svb, svs, svh, T, TQ, S, HKV, qk_scale, G, KSTRIDE, KOFF, WIN, ROWS, BK,
                    DK, DV, DKP, DVP, DOC, SPLIT, TMA)
    _store_band_dq(DQ, dq * sm_scale, b, t, h, row_ok, dk, T, HKV, G, DK, ACC)


@triton.jit
def _band_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DKP_, DVP_, DS, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh,
                   T, TQ, S, HKV, B, qk_scale, sm_scale, NSPLIT, CHUNK, G: tl.constexpr,
                   KSTRIDE: tl.constexpr, KOFF: tl.constexpr, WIN: tl.constexpr, ROWS: tl.constexpr,
                   BK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   DKP: tl.constexpr, DVP: tl.constexpr, DOC: tl.constexpr, SPLIT: tl.constexpr,
                   TMA: tl.constexpr, KT: tl.constexpr, I32: tl.constexpr = False, BAL: tl.constexpr = False,
                   TP: tl.constexpr = 1):
    """dK/dV of one key tile over one split of the queries that see it; partials [NSPLIT, B, S, HKV, D] (fp32, or the
    outputs themselves in their dtype when NSPLIT is 1). With
    TMA, Q and DO are [B, T * HQ, D] descriptors (one KV head: a tile's packed rows are consecutive).
    I32 (launch option i32_rows, pointer loads only): the query tiles' row arithmetic in 32 bits from batch b's
    bases, as the selected walk's (attempt 95).
    BAL (balanced splits, _split_plan): every split walks CHUNK packed rows (the tile's last one what is left), so a
    key tile seen by more queries gets more splits, up to NSPLIT; TP: next_pow2 of the key tiles. A tile's slots past
    its split count stay unwritten (combine.add_splits skips them). Its grid puts the key tile slowest: the GPU
    starts programs in grid order, so the splits of the first (under the causal mask the longest) key tiles start
    before the short last ones: longest first."""
    pid = tl.program_id(0)
    if BAL:
        nn = tl.arange(0, TP)
        ns = tl.where(nn * BK < S, balanced_splits(nn, TQ, BK, KSTRIDE, KOFF, G, CHUNK), 0)  # each key tile's
        cum = tl.cumsum(ns * (B * HKV), 0)  # programs of the tiles up to each, all heads
        pid_n = tl.sum((cum <= pid).to(tl.int32), 0)
        ns_n = tl.sum(tl.where(nn == pid_n, ns, 0), 0)
        r = pid - tl.sum(tl.where(nn == pid_n, cum - ns * (B * HKV), 0), 0)
        pid_s, pid_bh = r % ns_n, r // ns_n
    else:  # uniform splits: the key tile fastest, as the grid (tiles, heads, splits) before attempt 109
        tiles = tl.cdiv(S, BK)
        pid_n, pid_bh, pid_s = pid % tiles, (pid // tiles) % (B * HKV), pid // (tiles * B * HKV)
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    dk, dv = tl.arange(0, DKP), tl.arange(0, DVP)
    i = pid_n * BK + tl.arange(0, BK)
    kmask = i < S
    k = tl.load(K + b * skb + i[:, None] * sks + kv * skh + dk[None, :],
                mask=kmask[:, None] & (dk[None, :] < DK), other=0.0)
    v = tl.load(V + b * svb + i[:, None] * svs + kv * svh + dv[None, :],
                mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
    pos = i * KSTRIDE + KOFF
    q_lo = pid_n * BK * KSTRIDE + KOFF
    q_hi = TQ
    if WIN > 0:
        q_hi = tl.minimum(TQ, (tl.minimum(pid_n * BK + BK, S) - 1) * KSTRIDE + KOFF + WIN)
    q_lo, q_hi = q_lo * G, q_hi * G  # as packed rows
    if BAL:
        chunk = CHUNK
    else:
        chunk = tl.cdiv(tl.cdiv(tl.maximum(q_hi - q_lo, 0), NSPLIT), ROWS) * ROWS
    lo = q_lo + pid_s * chunk
    hi = tl.minimum(lo + chunk, q_hi)
    acc_k = tl.zeros([BK, DKP], tl.float32)
    acc_v = tl.zeros([BK, DVP], tl.float32)
    m1, m2 = _unmasked_queries(lo, hi, pid_n * BK, tl.minimum(pid_n * BK + BK, S) - 1, TQ, G, KSTRIDE, KOFF, WIN,
                               ROWS, SPLIT)
    wb = b  # with I32 the tiles index from batch b's bases (wb = 0 folds the b terms away: int32 row math)
    Qw, DOw, LSEw, DELTAw, DSw = Q, DO, LSE, DELTA, DS
    if I32 and not TMA:
        wb = 0
        Qw = Q + b * sqb
        DOw = DO + b * T * (HKV * G * DV)
        LSEw = LSE + b * T * (HKV * G)
        DELTAw = DELTA + b * T * (HKV * G)
        DSw = DS + b * T
    for r0 in range(lo, m1, ROWS):
        acc_k, acc_v = _dkdv_tile(Qw, DOw, LSEw, DELTAw, DSw, k, v, wb, kv, sqb, sqt, sqh, T, HKV, r0, hi, i, pos,
                                  kmask, acc_k, acc_v, qk_scale, G, KSTRIDE, WIN, ROWS, DK, DV, DKP, DVP, DOC, True,
                                  TMA, KT)
    for r0 in range(m1, m2, ROWS):
        acc_k, acc_v = _dkdv_tile(Qw, DOw, LSEw, DELTAw, DSw, k, v, wb, kv, sqb, sqt, sqh, T, HKV, r0, hi, i, pos,
                                  kmask, acc_k, acc_v, qk_scale, G, KSTRIDE, WIN, ROWS, DK, DV, DKP, DVP, DOC, False,
                                  TMA, KT)
    for r0 in range(m2, hi, ROWS):
        acc_k, acc_v = _dkdv_tile(Qw, DOw, LSEw, DELTAw, DSw, k, v, wb, kv, sqb, sqt, sqh, T, HKV, r0, hi, i, pos,
                                  kmask, acc_k, acc_v, qk_scale, G, KSTRIDE, WIN, ROWS, DK, DV, DKP, DVP, DOC, True,
                                  TMA, KT)
    base = ((pid_s * B + b) * S + i[:, None]) * HKV + kv
    tl.store(DKP_ + base * DK + dk[None, :], (acc_k * sm_scale).to(DKP_.dtype.element_ty),
             mask=kmask[:, None] & (dk[None, :] < DK))
    tl.store(DVP_ + base * DV + dv[None, :], acc_v.to(DVP_.dtype.element_ty), mask=kmask[:, None] & (dv[None, :] < DV))


def _rows_specs(q: torch.Tensor, do: torch.Tensor, rows: int, hkv: int) -> dict:
    """dK/dV's Q and dO (arguments 0 and 3) as [B, T * HQ, D] descriptors with [1, ROWS, D] boxes: with one KV head
    the packed rows R = t * G + h of a tile are consecutive rows of that view (with more, a tile's rows skip the other
    groups' heads, and the loads stay pointer loads). Empty when not one KV head or not that view."""
    if hkv != 1 or any(x.stride(1) != x.shape[2] * x.stride(2) for x in (q, do)):
        return {}
    return {i: (x, [x.shape[0], x.shape[1] * x.shape[2], x.shape[3]], [x.stride(0), x.stride(2), 1],
                [1, rows, x.shape[3]]) for i, x in ((0, q), (3, do))}


def _num_splits(T: int, tiles: int, window: int, device: torch.device) -> int:
    """Query-range splits per key tile for dK/dV. With a window every key tile sees <= w + BK queries: 1.
    Without one (compressed keys: Tc = T/d, so only T/(d*BK) key tiles per head), the first tiles are seen
    by almost all T queries: split so that the grid has ~4 programs per SM (at 8k, 8 key tiles x 4 heads
    were 32 programs for 132 SMs) and no program walks more than T/8 queries; >= 256 queries per split.
    Partial sums are [nsplit, B, Tc, HKV, D] fp32: nsplit <= 32 keeps them linear in T."""
    if window > 0:
        return 1
    if device.type != "cuda":  # interpreter tests: still exercise the partial-sum path
        return 2 if T >= 32 else 1
    want = max(min(8, triton.cdiv(T, 4096)), triton.cdiv(4 * sm_count(device.index or 0), max(tiles, 1)))
    return max(1, min(want, 32, triton.cdiv(T, 256)))


def _split_plan(tq: int, S: int, bk: int, rows: int, G: int, kstride: int, koff: int, window: int, bh: int,
                device: torch.device, balanced: bool, per_sm: int = 4, min_queries: int = 1024,
                cap: bool = False) -> tuple[int, int, int]:
    """-> (nsplit, chunk, programs) of the dK/dV grid. Uniform (``balanced`` off, every windowed branch, and short
    chunks): _num_splits parts per key tile, chunk 0. Balanced (attempt 109): every split walks ``chunk`` packed rows,
    so that a key tile gets splits in proportion to the queries that see it (under the causal mask the first
    compressed tiles are seen by ~all T queries, the last by few: uniform parts leave the first tiles' splits up to 2x
    the average program). The chunk aims at ``per_sm`` programs per SM (the launch config's ``split_per_sm``, default
    4); where that chunk is shorter than ``min_queries`` queries (``balanced_min_queries``, default 1024) the plan
    stays uniform: measured on an H100 (ab_band_dkdv_s35b), balanced lost at chunks of 256-528 queries (the 1b at 8k
    and 32k 0.74-0.80x, m7c 8k batch 2 0.65x) and won from 2048 on (1b 64k 1.19x, m7c 32k 1.16x, qwen7b 32k 1.23x,
    paper 32k 1.03x), and a floor that lengthened short chunks (fewer programs) lost more (1b 32k 0.69x).
    nsplit is the first tile's count, which bounds the fp32 partials at ~2 x programs x BK rows whatever T. The counts
    are combine.balanced_splits' (the kernels compute them again, per program). On the CPU (the interpreter) three
    splits for the first tile, whatever the length."""
    tiles = triton.cdiv(S, bk)
    if window == 0 and balanced:
        target = per_sm * sm_count(device.index or 0) if device.type == "cuda" else 0
        plan = _balanced_plan(tq, tiles, bk, rows, G, kstride, koff, bh, target, min_queries, cap)
        if plan is not None:
            return plan
    nsplit = _num_splits(tq, tiles * bh, window, device)
    return nsplit, 0, nsplit * tiles * bh


@functools.lru_cache(maxsize=256)
def _balanced_plan(tq: int, tiles: int, bk: int, rows: int, G: int, kstride: int, koff: int, bh: int, target: int,
                   min_queries: int, cap: bool) -> tuple[int, int, int] | None:
    """_split_plan's balanced grid for ``target`` programs, or None where its chunk is shorter than min_queries
    queries; target 0 (the interpreter): three splits for the first tile, whatever the length. ``cap``
    (launch option ``balanced_cap``): the chunk grows by row tiles until the programs fit ``target`` (per_sm x SMs).
    Rounding every tile's count up adds up to a program per tile, and where one program runs per SM (the G 16 key's
    128-key tiles) a grid a few programs over whole waves ends with a wave of full-length ones (the 1b at 32k: 535
    programs of one chunk for 4 x 132 slots). Attempt 110, H100 (ab_band_dkdv_s35c): with the cap the kernel gained
    at the 1b's 64k (1.19x -> 1.21x over uniform), paper 32k (1.03x -> 1.10x), m7c 32k (1.16x -> 1.25x, with
    add_splits' change), but qwen7b's 32k fell from 1.23x to 1.02x (its longest program 12 % longer, 576 -> 528
    programs where more than one runs per SM): on in TUNED per key, as measured."""
    seen = [max(tq - (n * bk * kstride + koff), 0) * G for n in range(tiles)]  # packed rows that see each tile
    if target:
        chunk = triton.cdiv(sum(seen) * bh, target)
        if chunk < min_queries * G:
            return None
    else:
        chunk = triton.cdiv(seen[0], 3)
    chunk = triton.cdiv(max(chunk, 1), rows) * rows
    counts = [max(1, triton.cdiv(x, chunk)) for x in seen]
    while cap and target and sum(counts) * bh > target and counts[0] > 1:
        chunk += rows
        counts = [max(1, triton.cdiv(x, chunk)) for x in seen]
    return max(counts), chunk, sum(counts) * bh


def _dkdv_launch(G: int, dmax: int, window: int, q: torch.Tensor, cfg: dict | None, S: int, tq: int, B: int,
                 HKV: int, kstride: int = 1, koff: int = 0) -> tuple:
    """-> (rows, BK, launch kwargs, tma, KT, (nsplit, chunk, programs)) of the dK/dV kernel. KT (the keys as the MMA
    rows) is the launch config's ``keys_rows``, the split plan its ``balanced`` (default off; _split_plan). TUNED may
    name a ``few_tiles`` shape for grids of fewer programs than half the SMs (its G 16 entries: their 128-key tiles
    leave the 1b's 8k window at batch 1 with 64 programs, where 64-key tiles run faster); an explicit cfg (a sweep)
    is taken as it is."""
    cuda = q.device.type == "cuda"
    c = dict(launch_cfg("band_dkdv", pow2(G), dmax, window > 0, cuda), **(cfg or {}))

    def plan(c: dict) -> tuple:
        rows, bk, kw, tma = _launch("band_dkdv", G, dmax, window > 0, q, c)
        splits = _split_plan(tq, S, bk, rows, G, kstride, koff, window, B * HKV, q.device,
                             bool(c.get("balanced", False)), int(c.get("split_per_sm", 4)),
                             int(c.get("balanced_min_queries", 1024)), bool(c.get("balanced_cap", False)))
        return rows, bk, kw, tma, splits

    rows, bk, kw, tma, splits = plan(c)
    if not cfg and "few_tiles" in c and cuda and splits[2] < sm_count(q.device.index or 0) // 2:
        c = {**c, **c["few_tiles"]}
        rows, bk, kw, tma, splits = plan(c)
    return rows, bk, kw, tma, bool(c.get("keys_rows", False)), splits


def band_bwd(do, q, k, v, o, lse, kstride: int, koff: int, window: int, cfg_dq: dict | None = None,
             cfg_dkdv: dict | None = None, delta=None, dq_acc=None, doc_start=None, n_queries: int | None = None,
             dkv_acc: tuple | None = None, parts: str = "all", dkv_out: tuple | None = None):
    """-> (dq, dk, dv). ``delta`` [B,T,HQ] fp32 = rowsum(dO*O) when the caller has it (else computed here);
    ``dq_acc`` (contiguous [B,T,HQ,Dk]): add this branch's dQ into it in place and return it as dq;
    ``doc_start`` as in band_fwd; ``n_queries`` as in band_fwd (dQ rows past it are not written);
    ``dkv_acc``: (dk, dv) of at least S rows: add this call's dK/dV to their first S rows (in fp32, one rounding)
    and return them. ``parts``: "all", "dq" (dk, dv returned as None) or "dkdv" (dq None), so that the two halves
    can run on different streams; ``dkv_out``: (dk, dv) shaped like k, v to write into instead of new tensors
    (allocated by a caller on its own stream)."""
    if parts not in ("all", "dq", "dkdv"):
        raise ValueError(f"band_bwd: parts={parts!r}; use 'all', 'dq' or 'dkdv'")
    B, T, HQ, DK = q.shape
    S, HKV, DV = k.shape[1], k.shape[2], v.shape[-1]
    G = HQ // HKV
    tq = T if n_queries is None else n_queries
    do = do.contiguous()
    if delta is None:
        delta = rowdot(do, o)  # [B, T, HQ] fp32: rowsum(dO * O), the softmax-backward term
    dims = dict(G=G, KSTRIDE=kstride, KOFF=koff, WIN=window, DK=DK, DV=DV, DKP=pow2(max(DK, 16)),
                DVP=pow2(max(DV, 16)), DOC=doc_start is not None)
    ds = delta if doc_start is None else doc_start  # any tensor when there are no documents (never read)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    dq = None
    if parts != "dkdv":
        dq = torch.empty(B, T, HQ, DK, device=q.device, dtype=q.dtype) if dq_acc is None else dq_acc
        rows, bk, kw, tma = _launch("band_dq", G, max(DK, DV), window > 0, q, cfg_dq)
        launch_tma(_band_bwd_dq, (triton.cdiv(tq * G, rows), B * HKV),
                    (q, k, v, do, lse, delta, dq, ds, *strides, T, tq, S, HKV, DK**-0.5 * LOG2E, DK**-0.5),
                    kv_specs(k, v, bk), tma, dict(ROWS=rows, BK=bk, **dims, ACC=dq_acc is not None, **kw))
    if parts == "dq":
        return dq, None, None
    rows, bk, kw, tma, kt, (nsplit, chunk, programs) = _dkdv_launch(G, max(DK, DV), window, q, cfg_dkdv, S, tq, B,
                                                                     HKV, kstride, koff)
    # One split (the window branch): the kernel rounds dK / dV into the outputs itself (contiguous [B, S, HKV, D] is
    # the partials' layout with NSPLIT = 1), not into fp32 partials that a cast copies afterwards.
    direct = dkv_acc is None and nsplit == 1

    def outputs() -> tuple:  # dkv_out where a kernel can write it in place, else new tensors
        if dkv_out is not None and all(x.is_contiguous() for x in dkv_out):
            return dkv_out
        return (torch.empty(B, S, HKV, DK, device=q.device, dtype=k.dtype),
                torch.empty(B, S, HKV, DV, device=q.device, dtype=v.dtype))

    if direct:
        dk, dv = outputs()
        dkp, dvp = dk.unsqueeze(0), dv.unsqueeze(0)
    else:
        dkp = torch.empty(nsplit, B, S, HKV, DK, device=q.device, dtype=torch.float32)
        dvp = torch.empty(nsplit, B, S, HKV, DV, device=q.device, dtype=torch.float32)
    if S > 0:
        launch_tma(_band_bwd_dkdv, (programs,),
                    (q, k, v, do, lse, delta, dkp, dvp, ds, *strides, T, tq, S, HKV, B, DK**-0.5 * LOG2E, DK**-0.5,
                     nsplit, chunk), _rows_specs(q, do, rows, HKV), tma,
                    dict(ROWS=rows, BK=bk, **dims, KT=kt, BAL=chunk > 0, TP=pow2(triton.cdiv(S, bk)),
                         **{**kw, "I32": kw["I32"] and fits_i32(q, do[0].numel())}))
    balanced = (chunk, tq, bk, kstride, koff, G) if chunk else None  # which partial slots hold sums (add_splits)
    if dkv_acc is not None:
        dk, dv = dkv_acc
        add_splits(dkp, dk, balanced=balanced)
        add_splits(dvp, dv, balanced=balanced)
        return dq, dk, dv
    if not direct and balanced:  # one pass over the written slots, rounded into the outputs
        dk, dv = outputs()
        add_splits(dkp, dk, acc=False, balanced=balanced)
        add_splits(dvp, dv, acc=False, balanced=balanced)
    elif not direct:
        dk, dv = dkp.sum(0), dvp.sum(0)
    if dkv_out is None or dk is dkv_out[0]:
        return dq, dk.to(k.dtype), dv.to(v.dtype)  # no copy where they already are
    dkv_out[0].copy_(dk)
    dkv_out[1].copy_(dv)
    return dq, *dkv_out
