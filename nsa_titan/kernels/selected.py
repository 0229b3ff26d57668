"""Selected-block attention in Triton, group-centric (the paper's kernel shape).

Forward and dQ: one program per (token, batch, KV head) holds all G query heads of the group as the rows of
one tile (padded to >= 16 for the MMA) and walks that token's n selected blocks; each K/V block is loaded
once for the whole group. Keys s > t are masked, which only bites in the token's own block.

dK/dV without atomics: the (block, token, slot) triples of block_idx are sorted by block
(selected_blocks.pair_keys: one torch.sort, static shapes, no host sync), which gives for every block the
ascending list of tokens that selected it and its segment offsets (searchsorted). One program per block then
walks its list, so each dK/dV row is written by exactly one program in a fixed order: deterministic. Block 0 is
forced for every token, so its list is all of 0..T-1 (with documents: the tokens whose document overlaps it);
it is cut into P0 fixed segments whose fp32 partial sums are added afterwards, which keeps that one block from
serialising T tokens in a single program.

Document masking (DOC, DS = doc_start [B, T] int32): keys before the token's document are masked.

For small groups (G <= 8) the forward runs block-centric instead (selected_blocks.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.band import LOG2E, TUNED
from nsa_titan.kernels.combine import pow2, rowdot
from nsa_titan.kernels.selected_blocks import pair_keys, sel_fwd_blocks


@triton.jit
def _sel_fwd(Q, K, V, IDX, O, LSE, DS, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sob, sot, soh,
             T, G, HKV, qk_scale, LP: tl.constexpr, BS: tl.constexpr, NSEL: tl.constexpr, NPI: tl.constexpr,
             GR: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr,
             DOC: tl.constexpr):
    t, pid_bh = tl.program_id(0), tl.program_id(1)
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    g = tl.arange(0, GR)
    row_ok = g < G
    h = kv * G + g
    dk, dv = tl.arange(0, DKP), tl.arange(0, DVP)
    q = tl.load(Q + b * sqb + t * sqt + h[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    m_i = tl.full([GR], -1e30, tl.float32)
    l_i = tl.zeros([GR], tl.float32)
    acc = tl.zeros([GR, DVP], tl.float32)
    idx_base = IDX + ((b * HKV + kv) * T + t) * NSEL
    s_min = 0  # keys before the token's document are masked (unused slots, block -1, are below 0)
    if DOC:
        s_min = tl.load(DS + b * T + t)
    c = tl.arange(0, NPI * BS)  # NPI selected blocks per step: key c is position c % BS of slot c // BS
    for n0 in range(0, NSEL, NPI):
        slot = n0 + c // BS
        blk = tl.load(idx_base + slot, mask=slot < NSEL, other=-1)
        s_pos = blk * LP + c % BS
        kmask = (c % BS < LP) & (s_pos <= t) & (s_pos >= s_min)
        k = tl.load(K + b * skb + s_pos[:, None] * sks + kv * skh + dk[None, :],
                    mask=kmask[:, None] & (dk[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + s_pos[:, None] * svs + kv * svh + dv[None, :],
                    mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    ok = l_i > 0
    o = tl.where(ok[:, None], acc / tl.where(ok, l_i, 1.0)[:, None], 0.0)
    tl.store(O + b * sob + t * sot + h[:, None] * soh + dv[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < DV))
    lse = tl.where(ok, m_i + tl.log2(tl.where(ok, l_i, 1.0)), float("inf"))
    tl.store(LSE + (b * T + t) * (HKV * G) + h, lse, mask=row_ok)


@triton.jit
def _sel_bwd_dq(Q, K, V, DO, LSE, DELTA, IDX, DQ, DS, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh,
                T, G, HKV, qk_scale, sm_scale, LP: tl.constexpr, BS: tl.constexpr, NSEL: tl.constexpr,
                NPI: tl.constexpr, GR: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
                DVP: tl.constexpr, ACC: tl.constexpr, DOC: tl.constexpr):
    """DO and DQ are contiguous [B, T, HQ, D]; ACC: add to DQ (band.py's _band_bwd_dq has the same flag)."""
    t, pid_bh = tl.program_id(0), tl.program_id(1)
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    g = tl.arange(0, GR)
    row_ok = g < G
    h = kv * G + g
    dk, dv = tl.arange(0, DKP), tl.arange(0, DVP)
    q = tl.load(Q + b * sqb + t * sqt + h[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    do = tl.load(DO + ((b * T + t) * (HKV * G) + h[:, None]) * DV + dv[None, :],
                 mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + (b * T + t) * (HKV * G) + h, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + (b * T + t) * (HKV * G) + h, mask=row_ok, other=0.0)
    dq = tl.zeros([GR, DKP], tl.float32)
    idx_base = IDX + ((b * HKV + kv) * T + t) * NSEL
    s_min = 0  # keys before the token's document are masked (unused slots, block -1, are below 0)
    if DOC:
        s_min = tl.load(DS + b * T + t)
    c = tl.arange(0, NPI * BS)  # NPI selected blocks per step: key c is position c % BS of slot c // BS
    for n0 in range(0, NSEL, NPI):
        slot = n0 + c // BS
        blk = tl.load(idx_base + slot, mask=slot < NSEL, other=-1)
        s_pos = blk * LP + c % BS
        kmask = (c % BS < LP) & (s_pos <= t) & (s_pos >= s_min)
        k = tl.load(K + b * skb + s_pos[:, None] * sks + kv * skh + dk[None, :],
                    mask=kmask[:, None] & (dk[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + s_pos[:, None] * svs + kv * svh + dv[None, :],
                    mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        p = tl.exp2(tl.where(kmask[None, :], s - lse[:, None], float("-inf")))
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    dq_ptr = DQ + ((b * T + t) * (HKV * G) + h[:, None]) * DK + dk[None, :]
    dq = dq * sm_scale
    if ACC:
        dq += tl.load(dq_ptr, mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float32)
    tl.store(dq_ptr, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (dk[None, :] < DK))


@triton.jit
def _sel_bwd_dkdv(Q, K, V, DO, LSE, DELTA, KEYS, OFF, DK_, DV_, PK, PV, DS,
                  sqb, sqt, sqh, skb, sks, skh, svb, svs, svh,
                  T, NB, G, HKV, P0, CH0, qk_scale, sm_scale, LP: tl.constexpr, BS: tl.constexpr,
                  NSEL: tl.constexpr, BT: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr,
                  DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, DOC: tl.constexpr):
    """Program pid < P0: segment pid of block 0 -> fp32 partial PK/PV[bh, pid]; else block pid - P0 + 1 -> DK_/DV_."""
    pid, pid_bh = tl.program_id(0), tl.program_id(1)
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    is_b0 = pid < P0
    blk = tl.where(is_b0, 0, pid - P0 + 1)
    off_base = OFF + pid_bh.to(tl.int64) * (NB + 1)
    two = tl.arange(0, 2)
    seg = tl.load(off_base + blk + two)  # [start, end) of this block's token list
    seg_end = tl.sum(tl.where(two == 1, seg, 0))
    lo = tl.where(is_b0, pid * CH0, tl.sum(tl.where(two == 0, seg, 0)))
    # Block 0's list is all T tokens, except with documents (only those whose document overlaps block 0).
    hi = tl.where(is_b0, tl.minimum(pid * CH0 + CH0, seg_end), seg_end)
    dk, dv, sj = tl.arange(0, DKP), tl.arange(0, DVP), tl.arange(0, BS)
    s_pos = blk * LP + sj
    kmask = (sj < LP) & (s_pos < T)
    k = tl.load(K + b * skb + s_pos[:, None] * sks + kv * skh + dk[None, :],
                mask=kmask[:, None] & (dk[None, :] < DK), other=0.0)
    v = tl.load(V + b * svb + s_pos[:, None] * svs + kv * svh + dv[None, :],
                mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
    r = tl.arange(0, BT * GP)
    g = r % GP
    h = kv * G + g
    acc_k = tl.zeros([BS, DKP], tl.float32)
    acc_v = tl.zeros([BS, DVP], tl.float32)
    key_base = KEYS + pid_bh.to(tl.int64) * (T * NSEL)
    for e0 in range(lo, hi, BT):
        e = e0 + r // GP
        row_ok = (e < hi) & (g < G)
        key = tl.load(key_base + e, mask=e < hi, other=0)  # blk * T*n + t*n + slot
        t = (key // NSEL - blk * T).to(tl.int32)  # no 64-bit modulo by a runtime T (slow on the GPU)
        t = tl.where(e < hi, t, 0)
        q = tl.load(Q + b * sqb + t[:, None] * sqt + h[:, None] * sqh + dk[None, :],
                    mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
        row = (b * T + t) * (HKV * G) + h
        do = tl.load(DO + row[:, None] * DV + dv[None, :], mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
        lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        vis = (s_pos[None, :] <= t[:, None]) & kmask[None, :] & row_ok[:, None]
        if DOC:
            vis = vis & (s_pos[None, :] >= tl.load(DS + b * T + t, mask=row_ok, other=0)[:, None])
        p = tl.exp2(tl.where(vis, s - lse[:, None], float("-inf")))  # masked before exp2: no overflow
        acc_v += tl.dot(tl.trans(p.to(do.dtype)), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        acc_k += tl.dot(tl.trans(ds.to(q.dtype)), q)
    acc_k = acc_k * sm_scale
    # Masks from vectors only (the interpreter mis-types bool scalar & bool tensor).
    own = (sj[:, None] * 0 + pid) >= P0
    smask = kmask[:, None] & own
    out_row = ((b * T + s_pos[:, None]) * HKV + kv)
    tl.store(DK_ + out_row * DK + dk[None, :], acc_k.to(DK_.dtype.element_ty),
             mask=smask & (dk[None, :] < DK))
    tl.store(DV_ + out_row * DV + dv[None, :], acc_v.to(DV_.dtype.element_ty),
             mask=smask & (dv[None, :] < DV))
    p_row = (pid_bh.to(tl.int64) * P0 + pid) * BS + sj[:, None]
    tl.store(PK + p_row * DK + dk[None, :], acc_k, mask=(dk[None, :] < DK) & ~own)
    tl.store(PV + p_row * DV + dv[None, :], acc_v, mask=(dv[None, :] < DV) & ~own)


def _cfg(kernel: str, q, v, G: int, n: int, lp: int, cfg: dict | None) -> dict:
    """Launch shape: NPI (selected blocks per loop step), rows (dK/dV query rows per tile), warps, stages, and
    for the forward the algorithm: 'token' (one program per token, this file) or 'blocks' (selected_blocks.py).

    The interpreter pays per Triton op, not per element: all n blocks in one step there. On the GPU two
    64-key blocks per step give 128-key tiles (fewer, larger MMAs) while K and V still fit shared memory
    for head dims <= 128 (measured 13% faster than one block per step, paper config at 64k, H200)."""
    dmax = max(q.shape[-1], v.shape[-1])
    if q.device.type != "cuda":
        c = dict(NPI=pow2(n), rows=64, num_warps=4, num_stages=1)
    else:
        # dK/dV: 128 query rows with 8 warps (H100, benchmarks/results/sweep_selected_*: 1b 8k 2.67 vs 3.29 ms
        # for the whole backward with 64 rows / 4 warps); past head dim 128 only 64 rows fit shared memory.
        rows = 64 if dmax > 128 else 128
        c = dict(NPI=2 if pow2(lp) <= 64 and dmax <= 128 else 1, rows=rows,
                 num_warps=8 if (kernel == "sel_dkdv" and rows >= 128) else 4, num_stages=2)
        if kernel == "sel_fwd" and pow2(G) <= 8 and dmax <= 128 and q.shape[0] * q.shape[1] >= 16384:
            # Block-centric forward for small groups (selected_blocks.py), 128-row chunks. H100, bf16
            # (sweep_selected_blocks_*): m7c 8k B=2 1.25 -> 1.07 ms, m7c 32k 2.45 -> 2.01, qwen7b (G=7) 8k
            # 2.14 -> 1.88, 32k 8.74 -> 7.22; it loses at G=16 (1b 8k 0.54 -> 0.94) and at m7c 8k B=1.
            c.update(algo="blocks", rows=128)
    c.update(TUNED.get((kernel, pow2(G), dmax, False), {}))
    c.update(cfg or {})
    return c


def _consts(q, k, v, lp, n):
    G = q.shape[2] // k.shape[2]
    DK, DV = q.shape[-1], v.shape[-1]
    return G, dict(LP=lp, BS=pow2(max(lp, 16)), NSEL=n, DK=DK, DV=DV, DKP=pow2(max(DK, 16)),
                   DVP=pow2(max(DV, 16)))


def sel_fwd(q, k, v, block_idx, slc_block: int, cfg: dict | None = None, doc_start=None):
    """block_idx [B,HKV,T,n] (int64, -1 unused) -> (o [B,T,HQ,Dv], lse [B,T,HQ] fp32 base-2);
    ``doc_start`` [B,T] int32 or None: keys before the token's document are masked."""
    B, T, HQ, DK = q.shape
    HKV = k.shape[2]
    G, c = _consts(q, k, v, slc_block, block_idx.shape[-1])
    o = q.new_empty(B, T, HQ, v.shape[-1])
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    lc = _cfg("sel_fwd", q, v, G, block_idx.shape[-1], slc_block, cfg)
    if lc.get("algo") == "blocks":
        return sel_fwd_blocks(q, k, v, block_idx, slc_block, c, lc, doc_start)
    _sel_fwd[(T, B * HKV)](q, k, v, block_idx, o, lse, lse if doc_start is None else doc_start, *q.stride()[:3],
                           *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], T, G, HKV, DK**-0.5 * LOG2E,
                           GR=max(16, pow2(G)), NPI=lc["NPI"], **c, DOC=doc_start is not None,
                           num_warps=lc["num_warps"], num_stages=lc["num_stages"])
    return o, lse


def sel_bwd(do, q, k, v, o, lse, block_idx, slc_block: int, cfg_dq: dict | None = None,
            cfg_dkdv: dict | None = None, delta=None, dq_acc=None, doc_start=None):
    """-> (dq, dk, dv); ``delta``, ``dq_acc`` and ``doc_start`` as in band.band_bwd."""
    B, T, HQ, DK = q.shape
    HKV, DV = k.shape[2], v.shape[-1]
    n = block_idx.shape[-1]
    G, c = _consts(q, k, v, slc_block, n)
    do = do.contiguous()
    if delta is None:
        delta = rowdot(do, o)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    dq = torch.empty(B, T, HQ, DK, device=q.device, dtype=q.dtype) if dq_acc is None else dq_acc
    lc = _cfg("sel_dq", q, v, G, n, slc_block, cfg_dq)
    ds = delta if doc_start is None else doc_start  # any tensor when there are no documents (never read)
    _sel_bwd_dq[(T, B * HKV)](q, k, v, do, lse, delta, block_idx, dq, ds, *strides, T, G, HKV,
                              DK**-0.5 * LOG2E, DK**-0.5, GR=max(16, pow2(G)), NPI=lc["NPI"], **c,
                              ACC=dq_acc is not None, DOC=doc_start is not None, num_warps=lc["num_warps"],
                              num_stages=lc["num_stages"])
    # Inverse index: the (block, token, slot) triples sorted by block, each block's range in them.
    nb = -(-T // slc_block)
    keys, off = pair_keys(block_idx, nb)
    off = off.to(torch.int32)
    ch0 = 1024
    p0 = triton.cdiv(T, ch0)
    bs = c["BS"]
    # Every block >= 1 has its program (writing zeros when nobody chose it); block 0 comes from the partials.
    dk = torch.empty(B, T, HKV, DK, device=q.device, dtype=k.dtype)
    dv = torch.empty(B, T, HKV, DV, device=q.device, dtype=v.dtype)
    pk = torch.empty(B * HKV, p0, bs, DK, device=q.device, dtype=torch.float32)
    pv = torch.empty(B * HKV, p0, bs, DV, device=q.device, dtype=torch.float32)
    gp = pow2(G)
    lc = _cfg("sel_dkdv", q, v, G, n, slc_block, cfg_dkdv)
    bt = max(1, lc["rows"] // gp)
    _sel_bwd_dkdv[(p0 + nb - 1, B * HKV)](
        q, k, v, do, lse, delta, keys, off, dk, dv, pk, pv, ds, *strides, T, nb, G, HKV, p0, ch0,
        DK**-0.5 * LOG2E, DK**-0.5, BT=bt, GP=gp, **c, DOC=doc_start is not None, num_warps=lc["num_warps"],
        num_stages=lc["num_stages"])
    l0 = min(slc_block, T)
    dk[:, :l0] = pk.sum(1)[:, :l0].view(B, HKV, l0, DK).transpose(1, 2).to(dk.dtype)
    dv[:, :l0] = pv.sum(1)[:, :l0].view(B, HKV, l0, DV).transpose(1, 2).to(dv.dtype)
    return dq, dk, dv
