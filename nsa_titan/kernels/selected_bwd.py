"""Selected-block attention backward in Triton (the forward and the launch configuration are in selected.py).

dK/dV without atomics: the (block, token, slot) triples of block_idx are sorted by block
(pair_sort.block_pairs: a counting sort of the keys and two table kernels; static shapes, no host sync;
the block-centric forward's sorted keys are reused when it ran), which gives for every block the
ascending list of tokens that selected it. Every list is cut into chunks of at most CH pairs and one program
takes one chunk (a static-size chunk table; spare programs exit). A block with one chunk writes its dK/dV rows
directly; the chunks of a longer list (block 0 is chosen by every token, early blocks by ~3x the average) write
fp32 partials that a second kernel adds in chunk order. Every dK/dV row is thus a fixed sum: deterministic, and
no single program serialises a popular block's list.

dQ, three ways: recomputed per token (one program per (token, batch, KV head) with the G heads as rows, as the
forward), dS K from the dS the dK/dV walk stores (both in selected_dq.py, each also for NT neighbouring tokens
as one tile over their blocks' union), or (small groups at head dim <= l') the sum of per-(token, slot) partials
dS K that the dK/dV walk computes with the K block it holds (summed by selected_blocks.sel_dq_sum, or in the
model's backward by band_dq2.band_dq2 together with the window's and the compressed branch's dQ: sel_bwd_parts).

Document masking (DOC, DS = doc_start [B, T] int32): keys before the token's document are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.band import LOG2E, sm_count
from nsa_titan.kernels.combine import fits_i32, pow2, rowdot
from nsa_titan.kernels.launch import run
from nsa_titan.kernels.pair_sort import block_pairs, chunk_token_order
from nsa_titan.kernels.selected import _cfg, _consts, _token_rows
from nsa_titan.kernels.selected_blocks import load_kv_rows, sel_dq_sum, slot_row
from nsa_titan.kernels.selected_dq import _sel_bwd_dq, _sel_bwd_dq_ds, _sel_bwd_dq_ds_tokens, _sel_bwd_dq_tokens
from nsa_titan.kernels.tma import kv_specs, launch_tma


@triton.jit
def _walk_math(q, do, lse, delta, k, v, acc_k, acc_v, vis, qk_scale, MASK: tl.constexpr):
    """The walk's arithmetic for one tile of rows against the block's keys: P (vis: the visible keys, broadcast
    against the tile; unread with MASK off, where every key is visible), dV += P^T dO, dS = P (dP - delta),
    dK += dS^T Q. -> (acc_k, acc_v, dS in Q's dtype)."""
    s = tl.dot(q, tl.trans(k))  # unscaled: the scale goes into exp2's argument (one FMA per score)
    if MASK:
        p = tl.exp2(tl.where(vis, s * qk_scale - lse[:, None], float("-inf")))  # masked before exp2: no overflow
    else:
        p = tl.exp2(s * qk_scale - lse[:, None])
    acc_v += tl.dot(tl.trans(p.to(do.dtype)), do)
    dp = tl.dot(do, tl.trans(v))
    ds = (p * (dp - delta[:, None])).to(q.dtype)
    acc_k += tl.dot(tl.trans(ds), q)
    return acc_k, acc_v, ds


@triton.jit
def _walk_step(Q, DO, LSE, DELTA, DSB, DQP, DS, key_base, k, v, acc_k, acc_v, e0, hi, r, b, kv, blk, s_pos, sj, dk,
               dv, sqb, sqt, sqh, T, HKV, qk_scale, G: tl.constexpr, LP: tl.constexpr, NSEL: tl.constexpr,
               BT: tl.constexpr, GS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, STORE_DS: tl.constexpr,
               STORE_DQ: tl.constexpr, DOC: tl.constexpr, MASK: tl.constexpr, I32: tl.constexpr = False):
    """One step of _sel_bwd_dkdv's walk: BT pairs from e0 (those < hi) as rows; MASK False when every row's token
    lies past the block (it sees all of its keys)."""
    g = r % GS
    h = kv * G + g
    e = e0 + r // GS
    row_ok = (e < hi) & (r < BT * GS) & (g < G)
    key = tl.load(key_base + e, mask=row_ok, other=0)  # blk * T*n + t*n + slot
    if I32:  # keys are >= 0: unsigned division (a shift for n a power of 2), not signed division's fix-ups
        kq = (key.to(tl.uint32) // NSEL).to(tl.int32)
        t = kq - blk * T
    else:
        t = (key // NSEL - blk * T).to(tl.int32)  # no 64-bit modulo by a runtime T (slow on the GPU)
    t = tl.where(row_ok, t, 0)
    q = tl.load(Q + b * sqb + t[:, None] * sqt + h[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    row = (b * T + t) * (HKV * G) + h
    do = tl.load(DO + row[:, None] * DV + dv[None, :], mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    # One compare per score: a row's last visible key of the block (t < T, so this also keeps keys inside T and
    # the block); invalid rows have lse = +inf, so their p is 0 without a mask of their own.
    vis = sj[None, :] <= tl.minimum(t - blk * LP, LP - 1)[:, None]
    if MASK and DOC:
        vis = vis & (s_pos[None, :] >= tl.load(DS + b * T + t, mask=row_ok, other=0)[:, None])
    acc_k, acc_v, ds = _walk_math(q, do, lse, delta, k, v, acc_k, acc_v, vis, qk_scale, MASK)
    if I32:
        slot = key - kq * NSEL
    else:
        slot = key - (key // NSEL) * NSEL  # only the stores below read it
    if STORE_DS:
        d_row = (((b * HKV + kv) * T + t) * NSEL + slot) * G + g
        tl.store(DSB + d_row[:, None] * LP + sj[None, :], ds, mask=row_ok[:, None] & (sj[None, :] < LP))
    if STORE_DQ:
        q_row = slot_row(b, t, kv, slot, g, T, HKV, G, NSEL)
        tl.store(DQP + q_row[:, None] * DK + dk[None, :], tl.dot(ds, k).to(DQP.dtype.element_ty),
                 mask=row_ok[:, None] & (dk[None, :] < DK))
    return acc_k, acc_v


@triton.jit
def _sel_bwd_dkdv(Q, K, V, DO, LSE, DELTA, KEYS, OFF, COFF, PROG, ORD, POFF, DK_, DV_, PK, PV, DSB, DQP, DS,
                  sqb, sqt, sqh, skb, sks, skh, svb, svs, svh,
                  T, NB, G: tl.constexpr, HKV, NCH, NPS, CH, qk_scale, sm_scale, LP: tl.constexpr, BS: tl.constexpr,
                  NSEL: tl.constexpr, BT: tl.constexpr, ROWS: tl.constexpr, GS: tl.constexpr,
                  DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, STORE_DS: tl.constexpr,
                  STORE_DQ: tl.constexpr, DOC: tl.constexpr, MASK_SPLIT: tl.constexpr, I32: tl.constexpr = False,
                  CHUNKED: tl.constexpr = False, BH0=0, DSOFF=0, ORDERED: tl.constexpr = False):
    """One program per chunk of <= CH (token, slot) pairs of one block (the chunk table of
    pair_sort.block_pairs). A block with one chunk writes its dK/dV rows; a block cut into several writes
    fp32 partials to slots POFF[block] + chunk, which _sel_bwd_reduce adds in chunk order.
    STORE_DS: also store every pair's dS (bf16, the MMA operand dQ needs) to DSB [B, HKV, T, n, G, LP].
    STORE_DQ: also store every pair's dQ over this block, dS K (unscaled), to DQP [B, T, HKV, n, G, DK], which
    selected_blocks._sel_dq_sum adds up per token: the K block is already in registers here, so dQ needs no
    second pass reading K through L2 (the dS path's dQ kernel).
    Each step takes BT pairs as ROWS >= BT * GS rows (row r: pair r // GS, head r % GS, rows with head >= G
    unused): GS = G packs them exactly, GS = next_pow2(G) pads each group (fewer registers: see _cfg).
    MASK_SPLIT: the steps past the block's own tokens run without the causal mask (a second copy of the loop).
    I32 (launch option i32_rows, when every buffer's part of one batch has < 2^31 elements): the walk's row and
    address arithmetic in 32 bits from batch b's bases, and the pair keys decoded unsigned (sel_bwd_parts).
    ORDERED (launch option order="tokens", attempt 114): program i takes chunk ORD[pair, i] (pair_sort.
    chunk_token_order: the chunks by first token), so that the chunks running together share their tokens' Q / dO
    rows in L2.
    CHUNKED (dS in chunks of (batch, KV head) pairs, sel_bwd_parts' ds_chunk): this launch's programs are the pairs
    BH0 + program_id(1), DSB holds their dS only, from the pair BH0 (its element DSOFF of the whole buffer), and
    PK / PV their partials only (rows program_id(1)), which the launch's _sel_bwd_reduce adds.
    A constexpr, so that the one-launch kernels stay as they were (offline sm_90, the 1b's walk: 600 -> 712 bytes
    of spills with the two offsets always applied)."""
    pid, pid_bh = tl.program_id(0), tl.program_id(1)
    p_bh = pid_bh  # the partial slots' row: PK / PV hold this launch's pairs only
    if CHUNKED:
        pid_bh += BH0
        DSB = DSB - DSOFF  # the whole buffer's addressing below: only this chunk's part is ever written
    if ORDERED:
        pid = tl.load(ORD + pid_bh.to(tl.int64) * NCH + pid)
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    blk = tl.load(PROG + pid_bh.to(tl.int64) * NCH + pid)
    live = (blk < NB).to(tl.int32)  # spare programs (past the last chunk) have blk == NB: no pairs, no stores
    blk = tl.minimum(blk, NB - 1)
    tab = pid_bh.to(tl.int64) * (NB + 1) + blk
    c0 = tl.load(COFF + tab)
    nch = tl.load(COFF + tab + 1) - c0
    lo = tl.load(OFF + tab) + (pid - c0) * CH
    hi = tl.minimum(lo + CH, tl.load(OFF + tab + 1))
    hi = lo + (hi - lo) * live  # integer scalars only (the interpreter mis-types bool scalars)
    dk, dv, sj = tl.arange(0, DKP), tl.arange(0, DVP), tl.arange(0, BS)
    s_pos = blk * LP + sj
    kmask = (sj < LP) & (s_pos < T)
    k, v = load_kv_rows(K, V, b, kv, s_pos, kmask, skb, sks, skh, svb, svs, svh, DK, DV, DKP, DVP)
    r = tl.arange(0, ROWS)
    acc_k = tl.zeros([BS, DKP], tl.float32)
    acc_v = tl.zeros([BS, DVP], tl.float32)
    key_base = KEYS + pid_bh.to(tl.int64) * (T * NSEL)
    # Only a pair whose token lies inside the block (t <= blk*l' + l' - 2) sees part of it. Those tokens come first
    # in the block's list (sorted by token), at most l' - 1 of them, so steps from `mid` on skip the mask.
    mid = hi
    if MASK_SPLIT and LP == BS and not DOC:
        j = lo + tl.arange(0, BS)
        first_whole = (blk.to(tl.int64) * T + blk * LP + LP - 1) * NSEL  # the key of token blk*l' + l' - 1, slot 0
        own = (tl.load(key_base + j, mask=j < hi, other=0).to(tl.int64) < first_whole) & (j < hi)
        mid = tl.minimum(lo + tl.cdiv(tl.sum(own.to(tl.int32), 0), BT) * BT, hi)
    # The walk's tensors; with I32 from batch b's first element, so that the row arithmetic inside needs no b
    # (wb = 0 folds every b term away and leaves int32 math; 64-bit products cost ~3 instructions each, and the
    # walk is issue-bound, attempt 56).
    wb = b
    Qw, DOw, LSEw, DELTAw, DSBw, DQPw, DSw = Q, DO, LSE, DELTA, DSB, DQP, DS
    if I32:
        wb = 0
        Qw = Q + b * sqb
        DOw = DO + b * T * (HKV * G * DV)
        LSEw = LSE + b * T * (HKV * G)
        DELTAw = DELTA + b * T * (HKV * G)
        DSBw = DSB + b * T * (HKV * NSEL * G * LP)
        DQPw = DQP + b * T * (HKV * NSEL * G * DK)
        DSw = DS + b * T
    for e0 in range(lo, mid, BT):
        acc_k, acc_v = _walk_step(Qw, DOw, LSEw, DELTAw, DSBw, DQPw, DSw, key_base, k, v, acc_k, acc_v, e0, hi, r, wb,
                                  kv, blk, s_pos, sj, dk, dv, sqb, sqt, sqh, T, HKV, qk_scale, G, LP, NSEL, BT, GS, DK,
                                  DV, STORE_DS, STORE_DQ, DOC, True, I32)
    if MASK_SPLIT and LP == BS and not DOC:  # off: one loop, the kernel as before the split (registers: 248 vs 254)
        for e0 in range(mid, hi, BT):
            acc_k, acc_v = _walk_step(Qw, DOw, LSEw, DELTAw, DSBw, DQPw, DSw, key_base, k, v, acc_k, acc_v, e0, hi, r,
                                      wb, kv, blk, s_pos, sj, dk, dv, sqb, sqt, sqh, T, HKV, qk_scale, G, LP, NSEL, BT,
                                      GS, DK, DV, STORE_DS, STORE_DQ, DOC, False, I32)
    acc_k = acc_k * sm_scale
    # Masks from vectors only (the interpreter mis-types bool scalar & bool tensor).
    alive = (sj * 0 + live) > 0
    whole = alive & ((sj * 0 + nch) == 1)
    smask = (kmask & whole)[:, None]
    out_row = ((b * T + s_pos[:, None]) * HKV + kv)
    tl.store(DK_ + out_row * DK + dk[None, :], acc_k.to(DK_.dtype.element_ty), mask=smask & (dk[None, :] < DK))
    tl.store(DV_ + out_row * DV + dv[None, :], acc_v.to(DV_.dtype.element_ty), mask=smask & (dv[None, :] < DV))
    pmask = (alive & ~whole)[:, None]
    p_row = (p_bh.to(tl.int64) * NPS + tl.load(POFF + tab) + pid - c0) * BS + sj[:, None]
    tl.store(PK + p_row * DKP + dk[None, :], acc_k, mask=pmask & (dk[None, :] < DK))
    tl.store(PV + p_row * DVP + dv[None, :], acc_v, mask=pmask & (dv[None, :] < DV))


@triton.jit
def _sel_bwd_reduce(PK, PV, COFF, POFF, DK_, DV_, T, NB, HKV, NPS, BH0, LP: tl.constexpr, BS: tl.constexpr,
                    RB: tl.constexpr, NC: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
                    DVP: tl.constexpr):
    """dK/dV of every block not written by _sel_bwd_dkdv: the sum of its chunks' partials in chunk order
    (deterministic), or zeros for a block that no token selected.
    One program per RB of the block's BS rows: block 0 (chosen by every token) has ~T*n/CH chunks, and with one
    program per block its serial sum was the kernel's tail (H100, 1b at 8k: 0.106 ms for 128 programs); NC chunks'
    loads in flight at once for the same reason (attempt 114: with the walk's short token-order chunks, one chunk
    per step took 2.4 ms at the paper's 64k). The (batch, KV head) pairs BH0 + program_id(1), whose partials PK / PV
    hold from row 0 (one launch per chunk of pairs where the walk's dS is chunked)."""
    blk, p_bh, rg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_bh = p_bh + BH0
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    tab = pid_bh.to(tl.int64) * (NB + 1) + blk
    c0 = tl.load(COFF + tab)
    nch = tl.load(COFF + tab + 1) - c0
    p0 = p_bh.to(tl.int64) * NPS + tl.load(POFF + tab)
    dk, dv, sj = tl.arange(0, DKP), tl.arange(0, DVP), rg * RB + tl.arange(0, RB)
    acc_k = tl.zeros([RB, DKP], tl.float32)
    acc_v = tl.zeros([RB, DVP], tl.float32)
    n_add = nch * (nch > 1).to(tl.int32)
    for c in range(0, n_add, NC):
        for i in tl.static_range(NC):  # NC independent loads per step, added in chunk order (masked ones add 0)
            live = (sj * 0 + c + i) < n_add
            p_row = (p0 + c + i) * BS + sj[:, None]
            acc_k += tl.load(PK + p_row * DKP + dk[None, :], mask=live[:, None], other=0.0)
            acc_v += tl.load(PV + p_row * DVP + dv[None, :], mask=live[:, None], other=0.0)
    s_pos = blk * LP + sj
    smask = ((sj < LP) & (s_pos < T) & ((sj * 0 + nch) != 1))[:, None]
    out_row = ((b * T + s_pos[:, None]) * HKV + kv)
    tl.store(DK_ + out_row * DK + dk[None, :], acc_k.to(DK_.dtype.element_ty), mask=smask & (dk[None, :] < DK))
    tl.store(DV_ + out_row * DV + dv[None, :], acc_v.to(DV_.dtype.element_ty), mask=smask & (dv[None, :] < DV))


def sel_bwd(do, q, k, v, o, lse, block_idx, slc_block: int, cfg_dq: dict | None = None,
            cfg_dkdv: dict | None = None, delta=None, dq_acc=None, doc_start=None, keys=None,
            dq_buffer_bytes: int | None = None):
    """-> (dq, dk, dv); ``delta``, ``dq_acc`` and ``doc_start`` as in band_bwd.band_bwd; ``keys``: the forward's
    sorted pair keys (sel_fwd with_pairs), or None to sort here; ``dq_buffer_bytes``: the budget for stored dS /
    dQ partials (None: selected.DS_BUDGET; see selected._cfg)."""
    dq, dk, dv, _ = sel_bwd_parts(do, q, k, v, o, lse, block_idx, slc_block, cfg_dq, cfg_dkdv, delta, dq_acc,
                                  doc_start, keys, dq_buffer_bytes)
    return dq, dk, dv


def sel_bwd_parts(do, q, k, v, o, lse, block_idx, slc_block: int, cfg_dq: dict | None = None,
                  cfg_dkdv: dict | None = None, delta=None, dq_acc=None, doc_start=None, keys=None,
                  dq_buffer_bytes: int | None = None, sum_dq: bool = True):
    """sel_bwd -> (dq, dk, dv, partials). With ``sum_dq`` False and dQ as per-(token, slot) partials (selected._cfg's
    'partials'), the partials are not summed here: ``partials`` is (dqp, block_idx), for band_dq2.band_dq2 to add
    in its pass (attempt 88), and ``dq`` holds nothing of this branch (dq_acc unchanged, or uninitialised). Else
    ``partials`` is None and dq is complete."""
    B, T, HQ, DK = q.shape
    HKV, DV = k.shape[2], v.shape[-1]
    n = block_idx.shape[-1]
    G, c = _consts(q, k, v, slc_block, n)
    do = do.contiguous()
    if delta is None:
        delta = rowdot(do, o)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    dq = torch.empty(B, T, HQ, DK, device=q.device, dtype=q.dtype) if dq_acc is None else dq_acc
    lq = _cfg("sel_dq", q, v, G, n, slc_block, cfg_dq, dq_buffer_bytes)
    ds = delta if doc_start is None else doc_start  # any tensor when there are no documents (never read)
    algo = lq.get("algo", "recompute")
    if algo == "recompute":
        consts = dict(GR=max(16, pow2(G)), **c, ACC=dq_acc is not None, DOC=doc_start is not None,
                      num_warps=lq["num_warps"], num_stages=lq["num_stages"])
        args = (q, k, v, do, lse, delta, block_idx, dq, ds, *strides, T, G, HKV, DK**-0.5 * LOG2E, DK**-0.5)
        if lq.get("NT", 1) > 1:  # NT neighbouring tokens per program as one tile (attempt 80)
            launch_tma(_sel_bwd_dq_tokens, (triton.cdiv(T, lq["NT"]), B * HKV), args, kv_specs(k, v, c["BS"]),
                       lq["tma"], dict(consts, NP=pow2(n), NT=lq["NT"], GR=_token_rows(G, lq["NT"])))
        else:
            launch_tma(_sel_bwd_dq, (T, B * HKV), args, kv_specs(k, v, c["BS"]), lq["tma"],
                       dict(consts, NPI=lq["NPI"]))
    # dK/dV block-centric: the (block, token, slot) triples sorted by block, every block's list cut into chunks
    # of <= ch pairs, one program per chunk (no block walks a long list alone: at 8k block 1 is chosen by ~3x
    # the average, which made the kernel 2x slower per sequence at batch 1 than at batch 4).
    nb = -(-T // slc_block)
    lc = _cfg("sel_dkdv", q, v, G, n, slc_block, cfg_dkdv)
    rows = max(lc["rows"], pow2(G))
    gs = G if lc.get("exact_rows", True) else pow2(G)
    bt = rows // gs  # pairs per step, each one's heads as gs rows
    # dS in chunks of (batch, KV head) pairs where the whole buffer exceeds the budget (selected._cfg's ds_chunk):
    # each chunk's walk, then its dQ, over one buffer of chunk size.
    bh = B * HKV
    per_chunk = min(bh, lq.get("ds_chunk") or bh) if algo == "ds" else bh
    chunked = per_chunk < bh  # the kernels' CHUNKED: their launches cover part of the pairs
    lc = walk_shape(lc, per_chunk * T * n, cfg_dkdv)
    ch = bt * _chunk_tiles(per_chunk * T * n, bt, q.device, lc)  # each launch's programs fill the GPU
    keys, off, coff, poff, prog = block_pairs(block_idx, nb, ch, keys)
    # The walk's programs in token order (attempt 114; launch option order="tokens", TUNED's choice per shape).
    ordered = lc.get("order", "blocks") == "tokens"
    order = chunk_token_order(keys, off, coff, prog, nb, ch, n) if ordered else prog  # prog: never read
    # Partial slots of the blocks cut into several chunks: each such block has count > ch pairs and
    # ceil(count / ch) < 2 * count / ch chunks, so 2 * ceil(T * n / ch) slots always suffice; nor can there be more
    # than the chunks, prog.shape[1] (the smaller bound for short chunks, as token order takes).
    nps = min(2 * -(-T * n // ch), prog.shape[1])
    bs, dkp, dvp = c["BS"], c["DKP"], c["DVP"]
    dk = torch.empty(B, T, HKV, DK, device=q.device, dtype=k.dtype)
    dv = torch.empty(B, T, HKV, DV, device=q.device, dtype=v.dtype)
    # partials of one launch's (batch, KV head) pairs, added by that launch's reduce
    pk = torch.empty(per_chunk, nps, bs, dkp, device=q.device, dtype=torch.float32)
    pv = torch.empty(per_chunk, nps, bs, dvp, device=q.device, dtype=torch.float32)
    dsb = q.new_empty(per_chunk, T, n, G, slc_block) if algo == "ds" else pk  # pk: never written without STORE_DS
    dqp = pk  # never written without STORE_DQ
    if algo == "partials":  # every used (token, slot) is written; unused slots are masked in the sum
        dqp = torch.empty(B, T, HKV, n, G, DK, device=q.device,
                          dtype=torch.float32 if lq.get("partial_bits", 32) == 32 else q.dtype)
    walk = dict(BT=bt, ROWS=rows, GS=gs, **c, STORE_DS=algo == "ds", STORE_DQ=algo == "partials",
                DOC=doc_start is not None, MASK_SPLIT=bool(lc.get("mask_split", False)),
                I32=bool(lc["i32_rows"]) and fits_i32(q, T * HKV * n * G * max(DK, DV, slc_block)),
                num_warps=lc["num_warps"], num_stages=lc["num_stages"], ORDERED=ordered)
    cuda = q.device.type == "cuda"
    rb = min(bs, 16 if cuda else 8)  # the interpreter's cases then have several row groups
    nc = 8 if cuda else 2  # chunks summed per step (the interpreter's: some steps part-masked)
    for bh0 in range(0, bh, per_chunk):  # one pass unless dS is chunked; a static count, no host sync
        nbh, dsoff = min(per_chunk, bh - bh0), bh0 * T * n * G * slc_block  # dsoff: the chunk's first dS element
        run(_sel_bwd_dkdv, (prog.shape[1], nbh),
            q, k, v, do, lse, delta, keys, off, coff, prog, order, poff, dk, dv, pk, pv, dsb, dqp, ds, *strides, T, nb,
            G, HKV, prog.shape[1], nps, ch, DK**-0.5 * LOG2E, DK**-0.5, CHUNKED=chunked, BH0=bh0, DSOFF=dsoff,
            **walk)
        if algo == "ds":
            _dq_from_ds(k, dsb, block_idx, dq, lq, G, n, slc_block, bs, dkp, dq_acc is not None, bh0, nbh, dsoff,
                        chunked)
        run(_sel_bwd_reduce, (nb, nbh, bs // rb), pk, pv, coff, poff, dk, dv, T, nb, HKV, nps, bh0, LP=slc_block,
            BS=bs, RB=rb, NC=nc, DK=DK, DV=DV, DKP=dkp, DVP=dvp, num_warps=4)
    if algo == "partials":
        if not sum_dq:
            return dq, dk, dv, (dqp, block_idx)
        sel_dq_sum(dqp, block_idx, dq, DK**-0.5, acc=dq_acc is not None)
    return dq, dk, dv, None


def _dq_from_ds(k, dsb, block_idx, dq, lq, G, n, slc_block, bs, dkp, acc, bh0, nbh, dsoff, chunked):
    """dQ = dS K for the (batch, KV head) pairs bh0 .. bh0 + nbh - 1, whose dS dsb holds (from element dsoff of
    the whole [B, HKV, T, n, G, l'] buffer)."""
    T, HKV, DK = block_idx.shape[2], k.shape[2], k.shape[-1]
    gr = max(16, pow2(G))
    # Descriptors where a slot's dS rows are l' = BS wide: a [GR, l'] box from the slot's first row. With G < GR
    # its last GR - G rows are the next slots' (or zeros past the buffer): they only reach dQ rows that are
    # never stored. K's box is kv_specs' (V is not read here).
    specs = {0: (k, list(k.shape), list(k.stride()), [1, bs, 1, DK]),
             1: (dsb, [dsb.numel() // slc_block, slc_block], [slc_block, 1], [gr, slc_block])}
    consts = dict(LP=slc_block, BS=bs, NSEL=n, GR=gr, DK=DK, DKP=dkp, ACC=acc, CHUNKED=chunked, BH0=bh0, DSOFF=dsoff,
                  num_warps=lq["num_warps"], num_stages=lq["num_stages"])
    args = (k, dsb, block_idx, dq, *k.stride()[:3], T, G, HKV, DK**-0.5)
    if lq.get("NT", 1) > 1:  # NT neighbouring tokens per program as one tile (attempt 80)
        launch_tma(_sel_bwd_dq_ds_tokens, (triton.cdiv(T, lq["NT"]), nbh), args, {0: specs[0]},
                   lq["tma"] and bs == slc_block, dict(consts, NP=pow2(n), NT=lq["NT"], GR=_token_rows(G, lq["NT"])))
    else:
        launch_tma(_sel_bwd_dq_ds, (T, nbh), args, specs, lq["tma"] and bs == slc_block, dict(consts, NPI=lq["NPI"]))


def walk_shape(lc: dict, pairs: int, cfg: dict | None) -> dict:
    """The walk's launch option ``lc`` (selected._cfg's, with the table entry's ``many_pairs`` shape in it, if any)
    for a launch over ``pairs`` (token, slot) pairs: the ``many_pairs`` shape from ``many_pairs["from_pairs"]`` on,
    unless the caller's cfg names the chunking itself (order or chunk_tiles: a sweep's variant). Attempt 114: the
    paper config's and the 1b's walk in token order with short chunks from 2^20 pairs per launch (the paper config
    from 16k, the 1b at 64k); below that the sort and the partials cost what the shorter walk saves."""
    lc = dict(lc)
    many = lc.pop("many_pairs", None)
    if many and pairs >= many["from_pairs"] and not {"order", "chunk_tiles"} & set(cfg or {}):
        lc.update({k: v for k, v in many.items() if k != "from_pairs"})
    return lc


def _chunk_tiles(pairs: int, bt: int, device: torch.device, lc: dict) -> int:
    """Query tiles per dK/dV chunk: about 4 chunks per SM over all (batch, KV head) pair lists, at least 64 tiles
    (each chunk reloads its K/V block and writes a partial). H100, whole selected backward at 8k, batch 1
    (sweep_selected_*): 1b 1.75 / 1.26 / 1.22 / 1.75 ms at 16 / 32 / 64 / 256 tiles, 5.33 with one chunk per
    block; qwen7b 2.87 / 2.76 / 2.73 / 3.46. The interpreter takes 2, so that its small cases cut blocks into
    several chunks."""
    if "chunk_tiles" in lc:
        return lc["chunk_tiles"]
    if device.type != "cuda":
        return 2
    want = pairs // (bt * 4 * sm_count(device.index or 0))
    return max(64, 1 << max(0, want.bit_length() - 1))
