"""The selected branch's token-centric dQ kernels (selected_bwd.sel_bwd launches them): one program per (token,
batch, KV head) with the G query heads as rows, as the forward.

- _sel_bwd_dq recomputes QK^T and dO V^T per selected block (where the dS buffer does not fit the budget);
- _sel_bwd_dq_ds multiplies the dS that the dK/dV walk stored by K: one matmul per block, K alone read;
- _sel_bwd_dq_tokens and _sel_bwd_dq_ds_tokens do them for NT neighbouring tokens as one [NT G, D] tile over the
  union of their blocks (attempt 80; at G 16 and NT 4 one warpgroup's 64 MMA rows): a block several of them chose is
  read once. (The pair kernels of attempts 77 and 78, two tokens in separate tiles, were removed after attempt 80;
  NT 2 covers two tokens.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from nsa_titan.kernels.selected import (
    token_block_kv,
    token_group,
    token_heads,
    token_rows,
    token_slot_kv,
    union_step,
    union_walk,
)
from nsa_titan.kernels.selected_blocks import block_tile


@triton.jit
def _store_dq(DQ, dq, b, t, h, row_ok, dk, T, G, HKV, DK: tl.constexpr, ACC: tl.constexpr):
    """One token's dQ rows (fp32, scaled) into DQ [B, T, HQ, Dk]; ACC: added to what another branch stored."""
    _store_dq_rows(DQ, dq, (b * T + t) * (HKV * G) + h, row_ok, dk, DK, ACC)


@triton.jit
def _store_dq_rows(DQ, dq, row, row_ok, dk, DK: tl.constexpr, ACC: tl.constexpr):
    """dQ rows (fp32, scaled) into DQ [B * T * HQ, Dk] at rows ``row``; ACC: added to what another branch stored."""
    dq_ptr = DQ + row[:, None] * DK + dk[None, :]
    if ACC:
        dq += tl.load(dq_ptr, mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float32)
    tl.store(dq_ptr, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (dk[None, :] < DK))


@triton.jit
def _dq_step(q, do, lse, delta, k, v, kmask, dq, qk_scale):
    """One tile of keys of the dQ recompute: dq + dS K with dS = P (dP - delta)."""
    s = tl.dot(q, tl.trans(k)) * qk_scale
    p = tl.exp2(tl.where(kmask[None, :], s - lse[:, None], float("-inf")))
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k)


@triton.jit
def _sel_bwd_dq(Q, K, V, DO, LSE, DELTA, IDX, DQ, DS, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh,
                T, G, HKV, qk_scale, sm_scale, LP: tl.constexpr, BS: tl.constexpr, NSEL: tl.constexpr,
                NPI: tl.constexpr, GR: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
                DVP: tl.constexpr, ACC: tl.constexpr, DOC: tl.constexpr, TMA: tl.constexpr):
    """DO and DQ are contiguous [B, T, HQ, D]; ACC: add to DQ (band.py's _band_bwd_dq has the same flag); TMA: K, V
    are descriptors (selected.token_block_kv)."""
    t, b, kv, h, row_ok, q, idx_base, s_min, n_used = token_group(Q, IDX, DS, sqb, sqt, sqh, T, G, HKV, LP, NSEL,
                                                                  GR, DK, DKP, DOC)
    dk, dv = tl.arange(0, DKP), tl.arange(0, DVP)
    do = tl.load(DO + ((b * T + t) * (HKV * G) + h[:, None]) * DV + dv[None, :],
                 mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + (b * T + t) * (HKV * G) + h, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + (b * T + t) * (HKV * G) + h, mask=row_ok, other=0.0)
    dq = tl.zeros([GR, DKP], tl.float32)
    c = tl.arange(0, NPI * BS)  # NPI selected blocks per step: key c is position c % BS of slot c // BS
    for n0 in range(0, n_used, NPI):
        if TMA:
            for j in tl.static_range(NPI):
                kmask, k, v = token_block_kv(K, V, idx_base, n0 + j, t, s_min, b.to(tl.int32), kv, LP, BS, NSEL,
                                             DKP, DVP)
                dq = _dq_step(q, do, lse, delta, k, v, kmask, dq, qk_scale)
        else:
            kmask, k, v = token_slot_kv(K, V, idx_base, n0, c, t, s_min, b, kv, skb, sks, skh, svb, svs, svh, LP,
                                        BS, NSEL, DK, DV, DKP, DVP)
            dq = _dq_step(q, do, lse, delta, k, v, kmask, dq, qk_scale)
    _store_dq(DQ, dq * sm_scale, b, t, h, row_ok, dk, T, G, HKV, DK, ACC)


@triton.jit
def _sel_bwd_dq_ds(K, DSB, IDX, DQ, skb, sks, skh, T, G, HKV, sm_scale, LP: tl.constexpr, BS: tl.constexpr,
                   NSEL: tl.constexpr, NPI: tl.constexpr, GR: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                   ACC: tl.constexpr, TMA: tl.constexpr, CHUNKED: tl.constexpr = False, BH0=0, DSOFF=0):
    """dQ = sum over the token's selected blocks of dS K, from the dS that _sel_bwd_dkdv stored: one matmul per
    block instead of three (no QK^T, no dO V^T) and K alone read through L2 (not K and V). Same layout and
    ACC flag as _sel_bwd_dq. TMA: K is a [B, S, HKV, D] descriptor with [1, BS, 1, D] boxes and DSB a
    [pairs * G, l'] descriptor with [GR, l'] boxes (BS = l'; rows past G belong to the next slots and only reach dQ
    rows that are not stored); one block per MMA. CHUNKED, BH0, DSOFF: as _sel_bwd_dkdv's (DSB from the pair BH0 on)."""
    bh0, dsoff = 0, 0
    if CHUNKED:
        bh0, dsoff = BH0, DSOFF
    t, b, kv, g, row_ok, h = token_heads(G, HKV, GR, bh0)
    dk = tl.arange(0, DKP)
    dq = tl.zeros([GR, DKP], tl.float32)
    pair0 = ((b * HKV + kv) * T + t) * NSEL
    c = tl.arange(0, NPI * BS)  # NPI selected blocks per step: key c is position c % BS of slot c // BS
    # Token t has at most t // l' + 1 candidate blocks, listed first (selected.token_group's n_used; documents
    # only lower the count, and their slots past it are unused too).
    for n0 in range(0, tl.minimum(t // LP + 1, NSEL), NPI):
        if TMA:
            for j in tl.static_range(NPI):
                # An unused slot (block -1, or a slot past NSEL) reads K at negative rows (zeros) and dS it never
                # wrote: zeroed here. Keys past t (or T) have dS = 0 as written by the walk.
                blk = tl.load(IDX + pair0 + n0 + j, mask=n0 + j < NSEL, other=-1).to(tl.int32)
                k = K.load([b.to(tl.int32), blk * LP, kv, 0]).reshape(BS, DKP)
                ds = DSB.load([((pair0 + n0 + j) * G - dsoff // LP).to(tl.int32), 0])
                dq += tl.dot(tl.where(blk >= 0, ds, 0.0).to(k.dtype), k)
        else:
            slot = n0 + c // BS
            blk = tl.load(IDX + pair0 + slot, mask=slot < NSEL, other=-1)
            s_pos = blk * LP + c % BS
            # Unused slots (block -1) were never written; keys past t or before the document have dS = 0.
            kmask = (c % BS < LP) & (blk >= 0) & (s_pos <= t)
            k = tl.load(K + b * skb + s_pos[:, None] * sks + kv * skh + dk[None, :],
                        mask=kmask[:, None] & (dk[None, :] < DK), other=0.0)
            ds = tl.load(DSB - dsoff + ((pair0 + slot[None, :]) * G + g[:, None]) * LP + (c % BS)[None, :],
                         mask=row_ok[:, None] & kmask[None, :], other=0.0)
            dq += tl.dot(ds, k)
    _store_dq(DQ, dq * sm_scale, b, t, h, row_ok, dk, T, G, HKV, DK, ACC)


@triton.jit
def _sel_bwd_dq_ds_tokens(K, DSB, IDX, DQ, skb, sks, skh, T, G, HKV, sm_scale, LP: tl.constexpr, BS: tl.constexpr,
                          NSEL: tl.constexpr, NP: tl.constexpr, NT: tl.constexpr, GR: tl.constexpr,
                          DK: tl.constexpr, DKP: tl.constexpr, ACC: tl.constexpr, TMA: tl.constexpr,
                          CHUNKED: tl.constexpr = False, BH0=0, DSOFF=0):
    """_sel_bwd_dq_ds for NT neighbouring tokens t0 = NT * program .. t0 + NT - 1 as the row groups of one
    [NT GR, D] dQ tile (attempt 80; at G 16 and NT 4 one warpgroup's 64 MMA rows), over the union of their blocks
    (selected.union_walk, the forward's order): each union block's K tile is loaded once and multiplied by the
    [NT GR, l'] dS of the tokens that chose it (each row from its token's own slot of that block; zeros for the
    others) in one MMA. Rounding differs from _sel_bwd_dq_ds only in the order of a token's blocks. CHUNKED, BH0,
    DSOFF: as _sel_bwd_dkdv's."""
    bh0 = 0
    if CHUNKED:
        bh0 = BH0
        DSB = DSB - DSOFF
    b, kv, t0, u, tok, g, row_ok = token_rows(T, G, HKV, NT, GR, bh0)
    dk, c, j = tl.arange(0, DKP), tl.arange(0, BS), tl.arange(0, NP)
    pair0 = ((b * HKV + kv) * T + t0) * NSEL  # token u's slot s is the (token, slot) pair pair0 + u * NSEL + s
    # every row's token's block list [NT GR, NP] (-1: unused, or a token past T), to find a block's slot per row
    lists = tl.load(IDX + pair0 + u[:, None] * NSEL + j[None, :], mask=(j[None, :] < NSEL) & (tok < T)[:, None],
                    other=-1).to(tl.int32)
    n_walk, rank, packed = union_walk(IDX, b, kv, t0, T, HKV, NSEL, NP, NT)
    dq = tl.zeros([NT * GR, DKP], tl.float32)
    for w in range(0, n_walk):
        blk = (tl.sum(tl.where(rank == w, packed, 0), 0) >> NT).to(tl.int32)
        k = block_tile(K, b, kv, blk, T, skb, sks, skh, LP, BS, DK, DKP, TMA)
        hit = lists == blk
        live = row_ok & (tl.sum(hit.to(tl.int32), 1) > 0)  # the row's token chose the block
        slot = tl.sum(tl.where(hit, j[None, :], 0), 1)
        ds = tl.load(DSB + ((pair0 + u * NSEL + slot) * G + g)[:, None] * LP + c[None, :],
                     mask=live[:, None] & (c < LP)[None, :], other=0.0)
        dq += tl.dot(ds.to(k.dtype), k)
    _store_dq_rows(DQ, dq * sm_scale, (b * T + tok) * (HKV * G) + kv * G + g, row_ok, dk, DK, ACC)


@triton.jit
def _sel_bwd_dq_tokens(Q, K, V, DO, LSE, DELTA, IDX, DQ, DS, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh,
                       T, G, HKV, qk_scale, sm_scale, LP: tl.constexpr, BS: tl.constexpr, NSEL: tl.constexpr,
                       NP: tl.constexpr, NT: tl.constexpr, GR: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       DKP: tl.constexpr, DVP: tl.constexpr, ACC: tl.constexpr, DOC: tl.constexpr,
                       TMA: tl.constexpr):
    """_sel_bwd_dq (dQ recomputed) for NT neighbouring tokens as the row groups of one [NT GR, D] tile (attempt 80),
    over the union of their blocks (selected.union_walk): each union block's K and V are loaded once and its three
    MMAs run on all NT GR rows, the rows of tokens that did not choose it masked (P = 0)."""
    b, kv, t0, u, tok, g, row_ok = token_rows(T, G, HKV, NT, GR)
    dk, dv, c = tl.arange(0, DKP), tl.arange(0, DVP), tl.arange(0, BS)
    q = tl.load(Q + b * sqb + tok[:, None] * sqt + (kv * G + g)[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    row = (b * T + tok) * (HKV * G) + kv * G + g
    do = tl.load(DO + row[:, None] * DV + dv[None, :], mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    s_min = tok * 0
    if DOC:
        s_min = tl.load(DS + b * T + tok, mask=row_ok, other=0)
    n_walk, rank, packed = union_walk(IDX, b, kv, t0, T, HKV, NSEL, NP, NT)
    dq = tl.zeros([NT * GR, DKP], tl.float32)
    for w in range(0, n_walk):
        blk, live = union_step(rank, packed, w, u, row_ok, NT)
        k = block_tile(K, b, kv, blk, T, skb, sks, skh, LP, BS, DK, DKP, TMA)
        v = block_tile(V, b, kv, blk, T, svb, svs, svh, LP, BS, DV, DVP, TMA)
        s_pos = blk * LP + c
        vis = (c < LP)[None, :] & (s_pos[None, :] <= tok[:, None]) & (s_pos[None, :] >= s_min[:, None]) & live[:, None]
        s = tl.dot(q, tl.trans(k)) * qk_scale
        p = tl.exp2(tl.where(vis, s - lse[:, None], float("-inf")))
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    _store_dq_rows(DQ, dq * sm_scale, row, row_ok, dk, DK, ACC)
