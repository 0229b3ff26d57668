"""Selected-block attention forward, block-centric (the loop order of Flash Sparse Attention, arXiv 2508.18224).

The token-centric forward (selected.py) gives each (token, KV head) its own program, which reads its n
selected K/V blocks: at 8k every block is read by ~T*n/NB tokens, so the kernel moves n * l' * (Dk + Dv) * 2
bytes per (token, KV head) through L2 and is bound by L2 bandwidth, and for G < 16 most MMA rows are padding.

Here one program takes one K/V block and a chunk of BT of the (token, slot) pairs that selected it, with the
chunk's G query heads per token as the MMA rows (BT * next_pow2(G) rows, >= 64), so each K/V block is read
once per chunk instead of once per token. Each pair's attention over its one block is a complete softmax
piece: the program writes its normalised output and log-sum-exp to the pair's slot of a partial buffer
[B, T, HKV, n, G, Dv] / [B, T, HKV, n, G], and a merge kernel combines the n slots of every row
(o = sum_s exp2(lse_s - lse) o_s), which is exact up to the partials' rounding.

Scheduling without host syncs: the (block, token, slot) triples are sorted by block and every program finds its
(block, chunk) in a static-size table (pair_sort.block_pairs, which the dK/dV walk uses too).

Also here: ``_sel_dq_sum``, the per-token sum of the dQ partials that the selected dK/dV walk can store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.combine import fits_i32, mix_operands, mix_rows, pow2
from nsa_titan.kernels.launch import run
from nsa_titan.kernels.pair_sort import block_pairs


@triton.jit
def slot_row(b, t, kv, slot, g, T, HKV, G, NSEL: tl.constexpr):
    """Row of (batch, token, KV head, slot, head) in the per-(token, slot) partial buffers [B, T, HKV, n, G, ...]:
    the forward's outputs and LSEs and the backward's dQ partials; writers and readers all index through here,
    so one (token, KV head) is contiguous for the merge and the dQ sum."""
    return (((b * T + t) * HKV + kv) * NSEL + slot) * G + g


@triton.jit
def load_kv_rows(K, V, b, kv, s_pos, kmask, skb, sks, skh, svb, svs, svh, DK: tl.constexpr, DV: tl.constexpr,
                 DKP: tl.constexpr, DVP: tl.constexpr):
    """The K and V rows at positions s_pos of (batch b, KV head kv), zeros where kmask is off: every selected
    kernel's block load."""
    dk, dv = tl.arange(0, DKP), tl.arange(0, DVP)
    k = tl.load(K + b * skb + s_pos[:, None] * sks + kv * skh + dk[None, :],
                mask=kmask[:, None] & (dk[None, :] < DK), other=0.0)
    v = tl.load(V + b * svb + s_pos[:, None] * svs + kv * svh + dv[None, :],
                mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
    return k, v


@triton.jit
def block_tile(X, b, kv, blk, T, sxb, sxs, sxh, LP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
               DP: tl.constexpr, TMA: tl.constexpr):
    """Block blk's K or V rows of (batch b, KV head kv) as one [BS, DP] tile, the multi-token kernels' load: with
    TMA through X's [B, S, HKV, D] descriptor ([1, BS, 1, D] boxes; rows before 0 or past S read as zeros, rows
    past l' are the next block's and must be masked by the caller), else pointer loads with rows past l' or past T
    as zeros."""
    if TMA:
        x = X.load([b.to(tl.int32), blk * LP, kv, 0]).reshape(BS, DP)
    else:
        c, d = tl.arange(0, BS), tl.arange(0, DP)
        s_pos = blk * LP + c
        x = tl.load(X + b * sxb + s_pos[:, None] * sxs + kv * sxh + d[None, :],
                    mask=((c < LP) & (s_pos < T))[:, None] & (d[None, :] < D), other=0.0)
    return x


@triton.jit
def _sel_fwd_blocks(Q, K, V, KEYS, OFF, COFF, PROG, OP, LP_, DS, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh,
                    T, NB, G: tl.constexpr, HKV, NCH, qk_scale, LP: tl.constexpr, BS: tl.constexpr,
                    NSEL: tl.constexpr, BT: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr,
                    DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, DOC: tl.constexpr,
                    I32: tl.constexpr = False):
    """One program: one K/V block and up to TILES tiles of BT of its (token, slot) pairs, each tile packed exactly
    as ROWS >= BT * G matrix rows (row r: pair r // G, head r % G; G a constexpr, so no group is padded to a
    power of two). The K/V block is loaded once for all tiles, and a 64-row tile needs fewer registers than one
    128-row tile (sm_90: 126 against 173), so more programs share an SM and hide each other's gathers.
    I32 (launch option i32_rows): the tiles' row arithmetic in 32 bits from batch b's bases, the keys decoded
    unsigned, as selected_bwd._sel_bwd_dkdv's."""
    pid, pid_bh = tl.program_id(0), tl.program_id(1)
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    r = tl.arange(0, ROWS)
    blk = tl.load(PROG + pid_bh.to(tl.int64) * NCH + pid)
    if blk >= NB:  # a spare program (past the last chunk): no pairs. Exit before the K/V load and the MMAs,
        return  # which it ran on empty rows before (2k batch 8: ~23 % of the grid, more with a causal prefix)
    seg = OFF + pid_bh.to(tl.int64) * (NB + 1) + blk
    lo = tl.load(seg)
    hi = tl.load(seg + 1)
    c0 = lo + (pid - tl.load(COFF + pid_bh.to(tl.int64) * (NB + 1) + blk)) * (BT * TILES)
    dk, dv, sj = tl.arange(0, DKP), tl.arange(0, DVP), tl.arange(0, BS)
    s_pos = blk * LP + sj
    kmask = (sj < LP) & (s_pos < T)
    k, v = load_kv_rows(K, V, b, kv, s_pos, kmask, skb, sks, skh, svb, svs, svh, DK, DV, DKP, DVP)
    g = r % G
    h = kv * G + g
    wb = b  # with I32 the tiles index from batch b's bases (wb = 0 folds the b terms away: int32 row math)
    Qw, OPw, LPw, DSw = Q, OP, LP_, DS
    if I32:
        wb = 0
        Qw = Q + b * sqb
        OPw = OP + b * T * (HKV * NSEL * G * DV)
        LPw = LP_ + b * T * (HKV * NSEL * G)
        DSw = DS + b * T
    for i in range(0, tl.cdiv(tl.minimum(hi - c0, BT * TILES), BT)):
        e = c0 + i * BT + r // G
        row_ok = (e < hi) & (r < BT * G)
        key = tl.load(KEYS + pid_bh.to(tl.int64) * (T * NSEL) + e, mask=row_ok, other=0)
        if I32:  # keys are >= 0: unsigned division (a shift for n a power of 2)
            tq = (key.to(tl.uint32) // NSEL).to(tl.int32)
        else:
            tq = key // NSEL  # blk * T + t; no 64-bit modulo by a runtime T (slow on the GPU)
        slot = key - tq * NSEL
        t = tl.where(row_ok, tq - blk * T, 0)
        q = tl.load(Qw + wb * sqb + t[:, None] * sqt + h[:, None] * sqh + dk[None, :],
                    mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
        _sel_fwd_tile(q, k, v, t, slot, g, row_ok, blk, wb, kv, OPw, LPw, DSw, T, HKV, qk_scale, s_pos, sj, dv, LP,
                      G, NSEL, DV, DOC)


@triton.jit
def _sel_fwd_tile(q, k, v, t, slot, g, row_ok, blk, b, kv, OP, LP_, DS, T, HKV, qk_scale, s_pos, sj, dv,
                  LP: tl.constexpr, G: tl.constexpr, NSEL: tl.constexpr, DV: tl.constexpr, DOC: tl.constexpr):
    """One tile's attention over its block, stored as partials."""
    s = tl.dot(q, tl.trans(k))  # unscaled: the scale goes into exp2's argument (one FMA per score)
    # One compare per score: a row's last visible key of the block (t < T, so this also keeps keys inside T and
    # the block). Invalid rows have q = 0: finite scores, never stored.
    vis = sj[None, :] <= tl.minimum(t - blk * LP, LP - 1)[:, None]
    if DOC:  # keys before the token's document are masked
        vis = vis & (s_pos[None, :] >= tl.load(DS + b * T + t, mask=row_ok, other=0)[:, None])
    s = tl.where(vis, s, float("-inf"))
    m = tl.maximum(tl.max(s, 1), -1e30) * qk_scale  # a row with no visible key keeps m finite: p = 0, l = 0
    p = tl.exp2(s * qk_scale - m[:, None])
    l = tl.sum(p, 1)
    ok = l > 0
    o = tl.dot(p.to(v.dtype), v) / tl.where(ok, l, 1.0)[:, None]
    lse = tl.where(ok, m + tl.log2(tl.where(ok, l, 1.0)), float("-inf"))
    # Partial slot layout [B, T, HKV, n, G(, Dv)]: the merge reads one (token, KV head) contiguously.
    prow = slot_row(b, t, kv, slot, g, T, HKV, G, NSEL)
    tl.store(OP + prow[:, None] * DV + dv[None, :], o.to(OP.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(LP_ + prow, lse, mask=row_ok)


@triton.jit
def _slot_rows(T, G, HKV, BT: tl.constexpr, GP: tl.constexpr):
    """The rows of a program over the per-(token, slot) partials: BT tokens x GP heads of one (batch, KV head);
    grid (token tiles, B * HKV)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BT * GP)
    t = pid_m * BT + r // GP
    g = r % GP
    return (pid_bh // HKV).to(tl.int64), pid_bh % HKV, t, g, (t < T) & (g < G)


@triton.jit
def _slot_tiles(IDX, T, G, HKV, NSEL: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, GP: tl.constexpr):
    """A program's rows (BT tokens x GP heads of one (batch, KV head)) by all NP >= n slots at once: the
    [rows, NP] partial-buffer rows and whether each slot holds a block; loading every slot in one go keeps all
    of a program's loads in flight (a loop over the slots waited for each slot's loads in turn)."""
    b, kv, t, g, row_ok = _slot_rows(T, G, HKV, BT, GP)
    used, prow = used_slots(IDX, b, kv, t, g, row_ok, tl.arange(0, NP), T, HKV, G, NSEL)
    return b, kv, t, g, row_ok, used, prow


@triton.jit
def used_slots(IDX, b, kv, t, g, row_ok, s, T, HKV, G, NSEL: tl.constexpr):
    """For rows (batch b, token t, KV head kv, head g) and slots s: [rows, len(s)] whether the slot holds a block
    (IDX [B, HKV, T, n] >= 0, valid rows and slots < n only) and its row in the per-(token, slot) partial buffers."""
    ok = row_ok[:, None] & (s[None, :] < NSEL)
    used = tl.load(IDX + ((b * HKV + kv) * T + t)[:, None] * NSEL + s[None, :], mask=ok, other=-1) >= 0
    return used & ok, slot_row(b, t[:, None], kv, s[None, :], g[:, None], T, HKV, G, NSEL)


@triton.jit
def _sel_merge(OP, LP_, IDX, O, LSE, OC, OW, GATES, OUT, T, G, HKV, NSEL: tl.constexpr, NP: tl.constexpr,
               BT: tl.constexpr, GP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, MIX: tl.constexpr):
    """o = sum over used slots of exp2(lse_s - lse) * o_s, lse = log2 sum exp2(lse_s); a fixed reduction tree
    over the slots (deterministic). MIX: also the gate mix into OUT from the o just stored (combine.mix_rows, as
    selected._sel_fwd_tokens' MIX; attempt 85)."""
    b, kv, t, g, row_ok, used, prow = _slot_tiles(IDX, T, G, HKV, NSEL, NP, BT, GP)
    dv = tl.arange(0, DVP)
    lse_s = tl.load(LP_ + prow, mask=used, other=float("-inf"))  # [rows, NP]
    o_s = tl.load(OP + prow[:, :, None] * DV + dv[None, None, :],
                  mask=used[:, :, None] & (dv[None, None, :] < DV), other=0.0).to(tl.float32)
    m = tl.maximum(tl.max(lse_s, 1), -1e30)  # a row without a used slot keeps m finite: w = 0, l = 0
    w = tl.exp2(lse_s - m[:, None])
    l_i = tl.sum(w, 1)
    acc = tl.sum(w[:, :, None] * o_s, 1)
    ok = l_i > 0
    o = tl.where(ok[:, None], acc / tl.where(ok, l_i, 1.0)[:, None], 0.0)
    rows = (b * T + t) * (HKV * G) + kv * G + g
    tl.store(O + rows[:, None] * DV + dv[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
    lse = tl.where(ok, m + tl.log2(tl.where(ok, l_i, 1.0)), float("inf"))
    tl.store(LSE + rows, lse, mask=row_ok)
    if MIX:
        mix_rows(OC, o.to(O.dtype.element_ty).to(tl.float32), OW, GATES, OUT, rows, row_ok, DV, DVP)


@triton.jit
def _sel_dq_sum(DQP, IDX, DQ, T, G, HKV, sm_scale, NSEL: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
                GP: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, ACC: tl.constexpr):
    """dQ = sm_scale * the sum over used slots of the per-(token, slot) partials dS K that the dK/dV walk stored
    (selected_bwd._sel_bwd_dkdv, STORE_DQ), in fp32 by a fixed reduction tree: deterministic. ACC: add to what DQ
    holds."""
    b, kv, t, g, row_ok, used, prow = _slot_tiles(IDX, T, G, HKV, NSEL, NP, BT, GP)
    dk = tl.arange(0, DKP)
    part = tl.load(DQP + prow[:, :, None] * DK + dk[None, None, :],  # unused slots (block -1) were never written
                   mask=used[:, :, None] & (dk[None, None, :] < DK), other=0.0).to(tl.float32)
    dq = tl.sum(part, 1) * sm_scale
    ptr = DQ + ((b * T + t) * (HKV * G) + kv * G + g)[:, None] * DK + dk[None, :]
    m = row_ok[:, None] & (dk[None, :] < DK)
    if ACC:
        dq += tl.load(ptr, mask=m, other=0.0).to(tl.float32)
    tl.store(ptr, dq.to(DQ.dtype.element_ty), mask=m)


def _slot_tokens(gp: int, n: int, d: int) -> int:
    """Tokens per program of the merge and the dQ sum: a [tokens * gp, pow2(n), d] fp32 tile of at most 16k
    values (128 per thread with 4 warps)."""
    return max(1, (1 << 14) // (gp * pow2(n) * pow2(max(d, 16))))


def sel_fwd_blocks(q, k, v, block_idx, slc_block: int, consts: dict, lc: dict, doc_start=None, mix=None,
                   before_mix=None):
    """-> (o, lse, sorted pair keys); o and lse as selected.sel_fwd's; ``consts``/``lc`` from
    selected._consts/_cfg (rows, warps, stages; tiles: tiles of pairs per program, default 1); ``mix`` and
    ``before_mix`` as selected.sel_fwd's (checked there): the merge writes the mix."""
    B, T, HQ, _ = q.shape
    HKV, DV = k.shape[2], v.shape[-1]
    G, n = HQ // HKV, block_idx.shape[-1]
    rows = max(lc["rows"], pow2(G))
    bt = rows // G  # pairs per program: their G heads each are packed rows, the last rows - bt * G unused
    nb = -(-T // slc_block)
    tiles = lc.get("tiles", 1)  # tiles of bt pairs per program
    keys, off, coff, _, prog = block_pairs(block_idx, nb, bt * tiles)
    op = q.new_empty(B, T, HKV, n, G, DV)  # every used slot is written; unused ones are masked in the merge
    lp = torch.empty(B, T, HKV, n, G, device=q.device, dtype=torch.float32)
    run(_sel_fwd_blocks, (prog.shape[1], B * HKV),
        q, k, v, keys, off, coff, prog, op, lp, lp if doc_start is None else doc_start, *q.stride()[:3],
        *k.stride()[:3], *v.stride()[:3], T, nb, G, HKV, prog.shape[1], q.shape[-1] ** -0.5 * 1.4426950408889634,
        BT=bt, ROWS=rows, TILES=tiles, **consts, DOC=doc_start is not None,
        I32=bool(lc["i32_rows"]) and fits_i32(q, T * HKV * n * G * DV),
        num_warps=lc["num_warps"], num_stages=lc["num_stages"])
    o = q.new_empty(B, T, HQ, DV)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    gp = pow2(G)
    mt = _slot_tokens(gp, n, DV)
    oc, ow, gates, out = mix_operands(mix, o, before_mix)
    run(_sel_merge, (triton.cdiv(T, mt), B * HKV), op, lp, block_idx, o, lse, oc, ow, gates, out, T, G, HKV, NSEL=n,
        NP=pow2(n), BT=mt, GP=gp, DV=DV, DVP=consts["DVP"], MIX=mix is not None, num_warps=4)
    return o, lse, keys


def sel_dq_sum(dqp: torch.Tensor, block_idx: torch.Tensor, dq: torch.Tensor, sm_scale: float, acc: bool) -> None:
    """dq [B, T, HQ, DK] (=, or += with ``acc``) sm_scale * the sum over each token's used slots of the partials
    dqp [B, T, HKV, n, G, DK] (fp32 or bf16) that selected_bwd._sel_bwd_dkdv stored."""
    B, T, HKV, n, G, DK = dqp.shape
    gp = pow2(G)
    mt = _slot_tokens(gp, n, DK)
    run(_sel_dq_sum, (triton.cdiv(T, mt), B * HKV), dqp, block_idx, dq, T, G, HKV, sm_scale, NSEL=n, NP=pow2(n), BT=mt,
        GP=gp, DK=DK, DKP=pow2(max(DK, 16)), ACC=acc, num_warps=4)
