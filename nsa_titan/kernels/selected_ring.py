"""Selected-block attention forward, block-centric, with the merge of its partials inside the same kernel.

The block-centric loop order (Flash Sparse Attention, arXiv 2508.18224; see selected_blocks.py) gives each program
one K/V block and a chunk of the (token, slot) pairs that selected it. Each pair's attention over its one block is
a complete softmax piece, written as a partial (normalised output and log-sum-exp) and merged per token
afterwards. At m7c 8k batch 2 those partials are 0.4 GB: written by one kernel and read back by a second, whose
0.154 ms ran at the HBM floor (H100), after the writes had already left L2.

Here the partials stay in L2. Items run in token-chunk order: all pairs whose token lies in chunk c (TC
consecutive tokens) of every block, then the merge of chunk c - 1, then chunk c + 1's pairs, and so on.
Chunk c's partials go to slot c % RING of a ring of RING chunks, so the live partials (a few MB per chunk) are
written and read while they are in L2, and the same addresses are overwritten instead of written back
(m7c 8k batch 2: the buffer shrinks from 0.4 GB to ~75 MB, at 64k from 1.6 GB to ~0.3 GB).

Order between items without host syncs or a second launch: every program takes a ticket (an atomic counter per
(batch, KV head)), and the ticket, not the program id, picks its item, through a table built like
selected_blocks.block_pairs' (static sizes; spare tickets exit). A merge item waits until its chunk's pair items
have all finished; a pair item waits until the merge of the chunk that last held its ring slot has finished. An
item only ever waits for items with smaller tickets, which are already running, so the waits end. Each finished
item adds one to its chunk's counter after its stores are visible GPU-wide (a fence per thread, a barrier, a
release add); the waiting side spins with acquire loads and reads the ring past L1. The merge adds the slots of
a row in a fixed order: the result is deterministic, whichever program merges.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.combine import pow2
from nsa_titan.kernels.selected_blocks import _lower_bound, _pair_prog, _slot_tokens, load_kv_rows, sorted_pair_keys

RING = 3  # chunk slots: a pair item of chunk c waits for the merge of chunk c - RING, two chunks back in the order


@triton.jit
def _fence(GPU: tl.constexpr):
    """fence.acq_rel.gpu in every thread (the interpreter runs programs one after another and needs none)."""
    if GPU:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _arrive(ptr, GPU: tl.constexpr):
    """One finished item at counter ptr, once every thread's stores are visible to the whole GPU."""
    tl.debug_barrier()
    _fence(GPU)
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release")


@triton.jit
def _wait_for(ptr, need, GPU: tl.constexpr):
    """Spin until counter ptr reaches need (only items with smaller tickets add to it: they are running)."""
    done = tl.atomic_add(ptr, 0, sem="acquire")
    while done < need:
        done = tl.atomic_add(ptr, 0, sem="acquire")
    _fence(GPU)
    tl.debug_barrier()


@triton.jit
def _sel_chunk_items(KEYS, LO, HI, ITEMS, TN, T, NB, NSEL, TC, NC, NS, CH, MI, LOGK: tl.constexpr,
                     BB: tl.constexpr):
    """Grid (cdiv(NS + 1, BB), B * HKV). Segment s = c * (NB + 1) + j: for j < NB the pairs of block j whose
    token lies in chunk c (their range [LO, HI) of the sorted keys, block * T*n + t*n + slot), in items of CH
    pairs; for j = NB the merge of chunk c - 1 (MI items; none for c = 0). ITEMS[1 + s] = items of segment s,
    ITEMS[0] = 0, so that its cumulative sum gives every segment's first item."""
    pb, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i = pb * BB + tl.arange(0, BB)
    s = i - 1
    zero = tl.arange(0, BB) * 0
    c = s // (NB + 1)
    j = s - c * (NB + 1)
    pairs = (s >= 0) & (j < NB) & (c < NC)
    base = j.to(tl.int64) * TN
    lo = _lower_bound(KEYS + row * TN, base + (tl.minimum(c * TC, T) * NSEL).to(tl.int64), zero, TN, LOGK)
    hi = _lower_bound(KEYS + row * TN, base + (tl.minimum(c * TC + TC, T) * NSEL).to(tl.int64), zero, TN, LOGK)
    items = tl.where(pairs, (hi - lo + CH - 1) // CH, tl.where((s >= 0) & (j == NB) & (c >= 1), MI, 0))
    seg_ok = (s >= 0) & (s < NS)
    tl.store(LO + row * NS + s, lo, mask=seg_ok)
    tl.store(HI + row * NS + s, hi, mask=seg_ok)
    tl.store(ITEMS + row * (NS + 1) + i, items, mask=i <= NS)


@triton.jit
def _pair_item(Q, K, V, KEYS, LO, HI, DONE, RO, RL, DS, seg, item, row, c, blk, sqb, sqt, sqh, skb, sks, skh,
               svb, svs, svh, T, G: tl.constexpr, HKV, NS, NC, TC, RS, MI, qk_scale, LP: tl.constexpr,
               BS: tl.constexpr, NSEL: tl.constexpr, BT: tl.constexpr, ROWS: tl.constexpr, DK: tl.constexpr,
               DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, DOC: tl.constexpr, GPU: tl.constexpr):
    """BT pairs of block blk with tokens in chunk c, packed exactly as ROWS >= BT * G rows (row r: pair r // G,
    head r % G); their partials go to ring slot c % RS."""
    row64 = row.to(tl.int64)
    b, kv = row64 // HKV, row % HKV
    if c >= RS:  # the slot last held chunk c - RS: its merge must have read it
        _wait_for(DONE + (row64 * 2 + 1) * NC + c - RS, MI, GPU)
    r = tl.arange(0, ROWS)
    e = tl.load(LO + row64 * NS + seg) + item * BT + r // G
    g = r % G
    row_ok = (e < tl.load(HI + row64 * NS + seg)) & (r < BT * G)
    key = tl.load(KEYS + row64 * (T * NSEL) + e, mask=row_ok, other=0)
    tq = key // NSEL  # blk * T + t; no 64-bit modulo by a runtime T (slow on the GPU)
    slot = key - tq * NSEL
    t = tl.where(row_ok, tq - blk * T, 0)
    h = kv * G + g
    dk, dv, sj = tl.arange(0, DKP), tl.arange(0, DVP), tl.arange(0, BS)
    q = tl.load(Q + b * sqb + t[:, None] * sqt + h[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    s_pos = blk * LP + sj
    kmask = (sj < LP) & (s_pos < T)
    k, v = load_kv_rows(K, V, b, kv, s_pos, kmask, skb, sks, skh, svb, svs, svh, DK, DV, DKP, DVP)
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
    # Ring layout [B * HKV, RS, TC, n, G(, Dv)]: the merge reads one token's slots contiguously.
    prow = (((row64 * RS + c % RS) * TC + (t - c * TC)) * NSEL + slot) * G + g
    tl.store(RO + prow[:, None] * DV + dv[None, :], o.to(RO.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(RL + prow, lse, mask=row_ok)
    _arrive(DONE + row64 * 2 * NC + c, GPU)


@triton.jit
def _merge_item(IDX, COFF, DONE, RO, RL, O, LSE, item, row, m, T, G, HKV, NS, NB, NC, TC, RS,
                NSEL: tl.constexpr, NP: tl.constexpr, MT: tl.constexpr, MTI: tl.constexpr, GP: tl.constexpr,
                DV: tl.constexpr, DVP: tl.constexpr, GPU: tl.constexpr):
    """MTI * MT tokens of chunk m: o = sum over used slots of exp2(lse_s - lse) * o_s, lse = log2 sum exp2(lse_s),
    a fixed reduction tree over the slots (deterministic); rows without a used slot get o = 0, lse = +inf."""
    row64 = row.to(tl.int64)
    b, kv = row64 // HKV, row % HKV
    tab = COFF + row64 * (NS + 1) + m * (NB + 1)
    _wait_for(DONE + row64 * 2 * NC + m, tl.load(tab + NB) - tl.load(tab), GPU)  # chunk m's pair items
    r, sl, dv = tl.arange(0, MT * GP), tl.arange(0, NP), tl.arange(0, DVP)
    g = r % GP
    t_end = tl.minimum(m * TC + TC, T)
    for i in range(MTI):
        t = m * TC + (item * MTI + i) * MT + r // GP
        row_ok = (t < t_end) & (g < G)
        ok2 = row_ok[:, None] & (sl[None, :] < NSEL)
        used = (tl.load(IDX + (row64 * T + t)[:, None] * NSEL + sl[None, :], mask=ok2, other=-1) >= 0) & ok2
        prow = (((row64 * RS + m % RS) * TC + (t - m * TC))[:, None] * NSEL + sl[None, :]) * G + g[:, None]
        lse_s = tl.load(RL + prow, mask=used, other=float("-inf"), cache_modifier=".cg")  # [rows, NP]
        o_s = tl.load(RO + prow[:, :, None] * DV + dv[None, None, :], cache_modifier=".cg",
                      mask=used[:, :, None] & (dv[None, None, :] < DV), other=0.0).to(tl.float32)
        mx = tl.maximum(tl.max(lse_s, 1), -1e30)  # a row without a used slot keeps mx finite: w = 0, l = 0
        w = tl.exp2(lse_s - mx[:, None])
        l_i = tl.sum(w, 1)
        acc = tl.sum(w[:, :, None] * o_s, 1)
        ok = l_i > 0
        o = tl.where(ok[:, None], acc / tl.where(ok, l_i, 1.0)[:, None], 0.0)
        h = kv * G + g
        tl.store(O + ((b * T + t) * (HKV * G) + h)[:, None] * DV + dv[None, :], o.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < DV))
        tl.store(LSE + (b * T + t) * (HKV * G) + h, tl.where(ok, mx + tl.log2(tl.where(ok, l_i, 1.0)),
                                                             float("inf")), mask=row_ok)
    _arrive(DONE + (row64 * 2 + 1) * NC + m, GPU)


@triton.jit
def _sel_fwd_ring(Q, K, V, KEYS, IDX, LO, HI, COFF, PROG, TICKET, DONE, RO, RL, O, LSE, DS, sqb, sqt, sqh, skb,
                  sks, skh, svb, svs, svh, T, NB, G: tl.constexpr, HKV, NI, NS, NC, TC, RS, MI, qk_scale,
                  LP: tl.constexpr, BS: tl.constexpr, NSEL: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
                  ROWS: tl.constexpr, MT: tl.constexpr, MTI: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr,
                  DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, DOC: tl.constexpr, GPU: tl.constexpr):
    """Grid (NI, B * HKV): every program runs the item its ticket names (a pair item or a merge item)."""
    row = tl.program_id(1)
    row64 = row.to(tl.int64)
    ticket = tl.atomic_add(TICKET + row64, 1)
    seg = tl.load(PROG + row64 * NI + ticket)
    if seg < NS:  # else a spare ticket
        c = seg // (NB + 1)
        j = seg - c * (NB + 1)
        item = ticket - tl.load(COFF + row64 * (NS + 1) + seg)
        if j < NB:
            _pair_item(Q, K, V, KEYS, LO, HI, DONE, RO, RL, DS, seg, item, row, c, j, sqb, sqt, sqh, skb, sks, skh,
                       svb, svs, svh, T, G, HKV, NS, NC, TC, RS, MI, qk_scale, LP, BS, NSEL, BT, ROWS, DK, DV, DKP,
                       DVP, DOC, GPU)
        else:
            _merge_item(IDX, COFF, DONE, RO, RL, O, LSE, item, row, c - 1, T, G, HKV, NS, NB, NC, TC, RS, NSEL, NP,
                        MT, MTI, GP, DV, DVP, GPU)


def chunk_tokens(T: int, nb: int, n: int, bt: int) -> int:
    """Tokens per chunk: a power of two with ~3 items' worth of pairs per (block, chunk) segment on average
    (T * n / nb pairs per block, cut into T / TC segments; fewer pairs per segment leave more items part-empty),
    and at least 256. m7c (128-row items of 21 pairs): 512 at 8k (~6 MB of partials per chunk and KV head), 2048
    at 32k."""
    return min(pow2(max(256, 3 * bt * nb // n)), pow2(T))


def sel_fwd_blocks(q, k, v, block_idx, slc_block: int, consts: dict, lc: dict, doc_start=None):
    """-> (o, lse, sorted pair keys); o and lse as selected.sel_fwd's; ``consts``/``lc`` from selected._consts/_cfg
    (rows, warps, stages; optional chunk_tokens and merge_tokens, the tokens of one merge item)."""
    B, T, HQ, _ = q.shape
    HKV, DV = k.shape[2], v.shape[-1]
    G, n = HQ // HKV, block_idx.shape[-1]
    rows = max(lc["rows"], pow2(G))
    bt = rows // G  # pairs per item: their G heads each are packed rows, the last rows - bt * G unused
    nb = -(-T // slc_block)
    tc = lc.get("chunk_tokens") or chunk_tokens(T, nb, n, bt)
    nc, rs = -(-T // tc), min(-(-T // tc), RING)
    gp = pow2(G)
    mt = _slot_tokens(gp, n, DV)
    mti = max(1, lc.get("merge_tokens", 16) // mt)
    mi = -(-tc // (mt * mti))
    ns = (nc + 1) * (nb + 1)
    ni = -(-T * n // bt) + nc * nb + nc * mi  # every pair segment but one item full, plus the merges
    R, dev, i32 = B * HKV, q.device, torch.int32
    keys = sorted_pair_keys(block_idx, nb)
    lo, hi = (torch.empty(R, ns, device=dev, dtype=i32) for _ in range(2))
    items = torch.empty(R, ns + 1, device=dev, dtype=i32)
    bb = 256 if dev.type == "cuda" else 64
    _sel_chunk_items[(triton.cdiv(ns + 1, bb), R)](keys, lo, hi, items, T * n, T, nb, n, tc, nc, ns, bt, mi,
                                                   LOGK=(T * n).bit_length(), BB=bb, num_warps=4)
    coff = torch.cumsum(items, -1, dtype=i32)
    prog = torch.empty(R, ni, device=dev, dtype=i32)
    _pair_prog[(triton.cdiv(ni, bb), R)](coff, prog, ns, ni, LOGB=ns.bit_length(), BB=bb, num_warps=4)
    counters = torch.zeros(R * (1 + 2 * nc), device=dev, dtype=i32)  # tickets, then pair / merge items done
    ring_o = q.new_empty(R, rs, tc, n, G, DV)
    ring_l = torch.empty(R, rs, tc, n, G, device=dev, dtype=torch.float32)
    o = q.new_empty(B, T, HQ, DV)
    lse = torch.empty(B, T, HQ, device=dev, dtype=torch.float32)
    _sel_fwd_ring[(ni, R)](
        q, k, v, keys, block_idx, lo, hi, coff, prog, counters, counters[R:], ring_o, ring_l, o, lse,
        lse if doc_start is None else doc_start, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], T, nb, G, HKV,
        ni, ns, nc, tc, rs, mi, q.shape[-1] ** -0.5 * 1.4426950408889634, BT=bt, ROWS=rows, MT=mt, MTI=mti, GP=gp,
        NP=pow2(n), **consts, DOC=doc_start is not None, GPU=dev.type == "cuda",
        num_warps=lc["num_warps"], num_stages=lc["num_stages"])
    return o, lse, keys
