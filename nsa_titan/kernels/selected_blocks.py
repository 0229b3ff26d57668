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

Scheduling without host syncs: the (block, token, slot) triples are sorted by block (one int64 sort with
static shapes); each block's pairs are cut into ceil(count / BT) chunks; a prefix sum gives every program its
(block, chunk) through a static-size table of ceil(T * n / BT) + NB programs, the spare ones exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.combine import pow2


@triton.jit
def _sel_fwd_blocks(Q, K, V, KEYS, OFF, COFF, PROG, OP, LP_, DS, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh,
                    T, NB, G, HKV, NCH, qk_scale, LP: tl.constexpr, BS: tl.constexpr, NSEL: tl.constexpr,
                    BT: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    DKP: tl.constexpr, DVP: tl.constexpr, DOC: tl.constexpr):
    pid, pid_bh = tl.program_id(0), tl.program_id(1)
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    r = tl.arange(0, BT * GP)
    blk = tl.load(PROG + pid_bh.to(tl.int64) * NCH + pid)
    live = (blk < NB).to(tl.int32)  # spare programs (past the last chunk) have blk == NB: no pairs
    blk = tl.minimum(blk, NB - 1)
    seg = OFF + pid_bh.to(tl.int64) * (NB + 1) + blk
    lo = tl.load(seg)
    hi = lo + (tl.load(seg + 1) - lo) * live  # integer scalars only (the interpreter mis-types bool scalars)
    e = lo + (pid - tl.load(COFF + pid_bh.to(tl.int64) * (NB + 1) + blk)) * BT + r // GP
    g = r % GP
    pair_ok = e < hi
    row_ok = pair_ok & (g < G)
    key = tl.load(KEYS + pid_bh.to(tl.int64) * (T * NSEL) + e, mask=pair_ok, other=0)
    tq = key // NSEL  # blk * T + t; no 64-bit modulo by a runtime T (slow on the GPU)
    slot = key - tq * NSEL
    t = tl.where(pair_ok, tq - blk * T, 0)
    h = kv * G + g
    dk, dv, sj = tl.arange(0, DKP), tl.arange(0, DVP), tl.arange(0, BS)
    q = tl.load(Q + b * sqb + t[:, None] * sqt + h[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    s_pos = blk * LP + sj
    kmask = (sj < LP) & (s_pos < T)
    k = tl.load(K + b * skb + s_pos[:, None] * sks + kv * skh + dk[None, :],
                mask=kmask[:, None] & (dk[None, :] < DK), other=0.0)
    v = tl.load(V + b * svb + s_pos[:, None] * svs + kv * svh + dv[None, :],
                mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    vis = (s_pos[None, :] <= t[:, None]) & kmask[None, :] & row_ok[:, None]
    if DOC:  # keys before the token's document are masked
        vis = vis & (s_pos[None, :] >= tl.load(DS + b * T + t, mask=row_ok, other=0)[:, None])
    s = tl.where(vis, s, float("-inf"))
    m = tl.maximum(tl.max(s, 1), -1e30)  # a row with no visible key keeps m finite: p = 0, l = 0
    p = tl.exp2(s - m[:, None])
    l = tl.sum(p, 1)
    ok = l > 0
    o = tl.dot(p.to(v.dtype), v) / tl.where(ok, l, 1.0)[:, None]
    lse = tl.where(ok, m + tl.log2(tl.where(ok, l, 1.0)), float("-inf"))
    # Partial slot layout [B, T, HKV, n, G(, Dv)]: the merge reads one (token, KV head) contiguously.
    prow = (((b * T + t) * HKV + kv) * NSEL + slot) * G + g
    tl.store(OP + prow[:, None] * DV + dv[None, :], o.to(OP.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(LP_ + prow, lse, mask=row_ok)


@triton.jit
def _sel_merge(OP, LP_, IDX, O, LSE, T, G, HKV, NSEL: tl.constexpr, BT: tl.constexpr, GP: tl.constexpr,
               DV: tl.constexpr, DVP: tl.constexpr):
    """o = sum over used slots of exp2(lse_s - lse) * o_s, lse = log2 sum exp2(lse_s); slots in order."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    r = tl.arange(0, BT * GP)
    t = pid_m * BT + r // GP
    g = r % GP
    row_ok = (t < T) & (g < G)
    dv = tl.arange(0, DVP)
    m_i = tl.full([BT * GP], -1e30, tl.float32)
    l_i = tl.zeros([BT * GP], tl.float32)
    acc = tl.zeros([BT * GP, DVP], tl.float32)
    for s in range(NSEL):
        used = tl.load(IDX + ((b * HKV + kv) * T + t) * NSEL + s, mask=row_ok, other=-1) >= 0
        prow = (((b * T + t) * HKV + kv) * NSEL + s) * G + g
        lse_s = tl.load(LP_ + prow, mask=row_ok & used, other=float("-inf"))
        o_s = tl.load(OP + prow[:, None] * DV + dv[None, :], mask=(row_ok & used)[:, None] & (dv[None, :] < DV),
                      other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, lse_s)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse_s - m_new)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o_s
        m_i = m_new
    ok = l_i > 0
    o = tl.where(ok[:, None], acc / tl.where(ok, l_i, 1.0)[:, None], 0.0)
    h = kv * G + g
    tl.store(O + ((b * T + t) * (HKV * G) + h)[:, None] * DV + dv[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < DV))
    lse = tl.where(ok, m_i + tl.log2(tl.where(ok, l_i, 1.0)), float("inf"))
    tl.store(LSE + (b * T + t) * (HKV * G) + h, lse, mask=row_ok)


def pair_keys(block_idx: torch.Tensor, nb: int):
    """block_idx [B, HKV, T, n] -> keys [B*HKV, T*n]: block * T*n + t*n + slot sorted (unused slots last, as
    nb * T*n), and off [B*HKV, NB+1] int64: each block's range in keys. Static shapes, no host sync.
    The keys are int32 while (nb + 1) * T*n fits (T below ~92.7k at l' = 64, n = 16): the radix sort then makes
    4 passes instead of 8 (16 of the m7c layer's kernel launches at 8k were int64 sort passes, 0.24 ms)."""
    B, HKV, T, n = block_idx.shape
    dev = block_idx.device
    tn = T * n
    kdt = torch.int32 if (nb + 1) * tn < 2**31 else torch.int64
    pos = torch.arange(tn, device=dev).view(1, 1, T, n)  # t * n + slot
    keys = torch.where(block_idx >= 0, block_idx * tn + pos, nb * tn).view(B * HKV, tn).to(kdt)
    keys = torch.sort(keys, dim=-1).values
    bounds = (torch.arange(nb + 1, device=dev, dtype=kdt) * tn).expand(B * HKV, nb + 1).contiguous()
    return keys, torch.searchsorted(keys, bounds)


def block_pairs(block_idx: torch.Tensor, nb: int, bt: int):
    """``pair_keys`` and the chunk table: coff [B*HKV, NB+1] (each block's first chunk of bt pairs) and
    prog [B*HKV, NCH] (the block of every program; NB for spare ones)."""
    B, HKV, T, n = block_idx.shape
    dev = block_idx.device
    tn = T * n
    keys, off = pair_keys(block_idx, nb)
    chunks = (off[:, 1:] - off[:, :-1] + bt - 1) // bt
    coff = torch.nn.functional.pad(torch.cumsum(chunks, -1), (1, 0))
    nch = -(-tn // bt) + nb  # every chunk but one per block is full: an upper bound on the chunks
    progs = torch.arange(nch, device=dev).expand(B * HKV, nch).contiguous()
    prog = torch.searchsorted(coff[:, 1:].contiguous(), progs, right=True)  # nb once past the last chunk
    return keys, off.to(torch.int32), coff.to(torch.int32), prog.to(torch.int32)


def sel_fwd_blocks(q, k, v, block_idx, slc_block: int, consts: dict, lc: dict, doc_start=None):
    """Same contract as selected.sel_fwd; ``consts``/``lc`` from selected._consts/_cfg (rows, warps, stages)."""
    B, T, HQ, _ = q.shape
    HKV, DV = k.shape[2], v.shape[-1]
    G, n = HQ // HKV, block_idx.shape[-1]
    gp = pow2(G)
    bt = max(1, lc["rows"] // gp)
    nb = -(-T // slc_block)
    keys, off, coff, prog = block_pairs(block_idx, nb, bt)
    op = q.new_empty(B, T, HKV, n, G, DV)  # every used slot is written; unused ones are masked in the merge
    lp = torch.empty(B, T, HKV, n, G, device=q.device, dtype=torch.float32)
    _sel_fwd_blocks[(prog.shape[1], B * HKV)](
        q, k, v, keys, off, coff, prog, op, lp, lp if doc_start is None else doc_start, *q.stride()[:3],
        *k.stride()[:3], *v.stride()[:3], T, nb, G, HKV, prog.shape[1], q.shape[-1] ** -0.5 * 1.4426950408889634,
        BT=bt, GP=gp, **consts, DOC=doc_start is not None, num_warps=lc["num_warps"], num_stages=lc["num_stages"])
    o = q.new_empty(B, T, HQ, DV)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    mt = max(1, 64 // gp)
    _sel_merge[(triton.cdiv(T, mt), B * HKV)](op, lp, block_idx, o, lse, T, G, HKV, NSEL=n, BT=mt, GP=gp, DV=DV,
                                              DVP=consts["DVP"], num_warps=4)
    return o, lse

