"""Fused Triton kernels for NSA decoding: the attention of one new token per row over a layer's KV cache.

Why: a decode step of a small model is bound by launches and latency, not bytes. The torch path of
``models/nsa/decode.py`` (the spec: it restates reference.py's rules for the newest query) issues ~48 aten ops per
layer. Here two launches do all of it (flash-decoding: the long scans are split over programs, a second kernel
merges them):

``_split_kernel``, grid (B x HKV, compressed splits + window tiles):
  - a compressed split runs online softmax over its share of the visible compressed tokens and stores its
    partial (max, denominator, unnormalised output) and its raw scores (for the block importance);
  - a window tile does the same over up to BW slots of the window ring. The tile that holds the new token's
    ring slot also stores the new token's K/V into the window ring, the selection cache and the compression
    ring (the cache writes of the torch path's ``append``, minus the compression itself), and attends to the
    new key from registers, so no other program races its store.
``_finish_kernel``, grid (B x HKV):
  1. merges the compressed and the window partials (max / denominator rescaling);
  2. group-summed compressed probabilities from the stored scores and the merged statistics, then the block
     importance of every past block by gathers (eq. 9, ``block_importance``), forced blocks (0, cur - 1) at +inf;
  3. the top min(n - 1, cur) blocks by repeated argmax (ties to the lower index, as the stable sort of the
     torch path), then the selected blocks plus the current block's tokens <= t, SB blocks per online step;
  4. the gate mix, written as [B, HKV, G, Dv].

Contract: as ``NSALayerCache.attend``; the caller compresses a completed block (torch) before the launch.
Head dims and slc_block must be powers of 2 >= 16 (``supported``; otherwise the cache uses the torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.launch import run

__all__ = ["DecodeWorkspace", "nsa_decode_attend", "supported"]


def supported(head_dim: int, v_head_dim: int, slc_block: int) -> bool:
    """Shapes the kernels take: tl.arange needs powers of 2 and tl.dot dimensions of at least 16."""
    pow2 = lambda x: x >= 16 and x & (x - 1) == 0  # noqa: E731
    return pow2(head_dim) and pow2(v_head_dim) and pow2(slc_block)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class DecodeWorkspace:
    """Tile choices and fp32 scratch of one layer's fused decode, made once with the cache.

    Tiles: compressed tiles of BC tokens (at least 8 tiles over the capacity, at most 128 tokens), window tiles
    of BW slots (about 4 per window), selected steps of SB blocks (<= 128 keys, <= n / 2 blocks: with few
    selected blocks a wide step would hold mostly masked keys). Compressed splits: enough programs to fill the
    GPU (``max_programs``, 4 per SM on CUDA) but never more than the tiles.
    """

    def __init__(self, batch: int, hkv: int, g: int, dv: int, capacity: int, p, device,
                 max_programs: int | None = None):
        device = torch.device(device)
        if max_programs is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
            max_programs = 4 * sms
        tc = max(1, p.num_cmp_tokens(capacity))
        rows = batch * hkv
        self.gp = max(16, triton.next_power_of_2(g))
        self.bc = min(128, max(16, triton.next_power_of_2(_cdiv(tc, 8))))
        self.bw = min(128, max(16, triton.next_power_of_2(_cdiv(p.window, 4))))
        self.sb = max(1, min(128 // p.slc_block, p.slc_top_n // 2))
        self.max_cmp_splits = max(1, min(_cdiv(tc, self.bc), _cdiv(max_programs, rows)))
        self.nsp = self.max_cmp_splits + _cdiv(p.window, self.bw)  # partial slots per (row, KV head)
        self.nselp = triton.next_power_of_2(max(1, p.slc_top_n))
        self.nbp = triton.next_power_of_2(max(1, _cdiv(capacity, p.slc_block)))
        self.pb = min(512, triton.next_power_of_2(tc))
        self.finish_warps = 8  # measured on H100 (m7c): 8 warps 39-45 us vs 4 warps 46-48 us at 64k batch 1
        f32 = dict(device=device, dtype=torch.float32)
        self.scores = torch.empty(rows, g, tc, **f32)
        self.part_m = torch.empty(rows, self.nsp, self.gp, **f32)
        self.part_l = torch.empty(rows, self.nsp, self.gp, **f32)
        self.part_acc = torch.empty(rows, self.nsp, self.gp, dv, **f32)
        self.psum = torch.empty(rows, tc, **f32)

    def cmp_splits(self, nc: int) -> tuple[int, int]:
        """(programs, tiles per program) for nc visible compressed tokens."""
        if nc == 0:
            return 0, 1
        tiles = _cdiv(nc, self.bc)
        per = _cdiv(tiles, min(tiles, self.max_cmp_splits))
        return _cdiv(tiles, per), per


@triton.jit
def _online(s, v, m, l, acc, PREC: tl.constexpr):
    """One online-softmax step: scores s [GP, N] (masked = -inf, at least one finite per row) and values v."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    pr = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(pr, 1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=PREC)
    return m_new, l, acc


@triton.jit
def _store_partial(PM, PL, PACC, slot, m, l, acc, GP: tl.constexpr, DV: tl.constexpr):
    g = tl.arange(0, GP)
    tl.store(PM + slot * GP + g, m)
    tl.store(PL + slot * GP + g, l)
    tl.store(PACC + (slot * GP + g[:, None]) * DV + tl.arange(0, DV)[None, :], acc)


@triton.jit
def _merge(PM, PL, PACC, lo, hi, GP: tl.constexpr, DV: tl.constexpr, NSPP: tl.constexpr, SPB: tl.constexpr):
    """Partials lo .. hi-1 of one (row, KV head) -> (normalised output [GP, DV], max, denominator); 0 if none."""
    g = tl.arange(0, GP)
    s = tl.arange(0, NSPP)
    sm = ((s >= lo) & (s < hi))[:, None]
    m = tl.load(PM + s[:, None] * GP + g[None, :], mask=sm, other=float("-inf"))
    lp = tl.load(PL + s[:, None] * GP + g[None, :], mask=sm, other=0.0)
    m_all = tl.max(m, 0)
    l_all = tl.sum(tl.where(sm, tl.exp(m - m_all[None, :]), 0.0) * lp, 0)
    out = tl.zeros([GP, DV], tl.float32)
    c = tl.arange(0, SPB)
    for s1 in range(lo, hi, SPB):  # the weights need every partial's max first; the outputs come in chunks
        cm = (s1 + c < hi)[:, None]
        m1 = tl.load(PM + (s1 + c)[:, None] * GP + g[None, :], mask=cm, other=float("-inf"))
        w = tl.where(cm, tl.exp(m1 - m_all[None, :]) / l_all[None, :], 0.0)
        a = tl.load(PACC + ((s1 + c)[:, None, None] * GP + g[None, :, None]) * DV + tl.arange(0, DV)[None, None, :],
                    mask=cm[:, :, None], other=0.0)
        out += tl.sum(w[:, :, None] * a, 0)
    return out, m_all, l_all


# Positions change every step: left unspecialised, one compiled kernel serves them all.
@triton.jit(do_not_specialize=["t", "nc", "m_win", "ncs", "tps", "slot_w", "slot_r"])
def _split_kernel(Q, KC, VC, KW, VW, KS, VS, KR, VR, KNW, VNW, KNS, VNS, KNR, VNR, SC, PM, PL, PACC,
                  t, nc, m_win, ncs, tps, slot_w, slot_r, scale,
                  s_kc0, s_kc1, s_vc0, s_vc1, s_kw0, s_kw1, s_vw0, s_vw1, s_ks0, s_ks1, s_vs0, s_vs1,
                  s_kr0, s_kr1, s_vr0, s_vr1, n_kw0, n_kw1, n_vw0, n_vw1, n_ks0, n_ks1, n_vs0, n_vs1,
                  n_kr0, n_kr1, n_vr0, n_vr1, s_sc,
                  HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                  BC: tl.constexpr, BW: tl.constexpr, NSP: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)  # = b * HKV + h; caches [B, HKV, S, D]: one (row, head) stride s_*0, D contiguous
    split = tl.program_id(1)
    b, h = pid // HKV, pid % HKV
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    gm = g < G
    q = tl.load(Q + (pid * G + g[:, None]) * D + d[None, :], mask=gm[:, None], other=0.0).to(KW.dtype.element_ty)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DV], tl.float32)
    pbase = pid * NSP
    if split < ncs:  # compressed tokens [lo, hi) of this split
        lo = split * tps * BC
        hi = tl.minimum(lo + tps * BC, nc)
        for start in range(lo, hi, BC):
            cols = start + tl.arange(0, BC)
            cm = cols < hi
            k = tl.load(KC + pid * s_kc0 + cols[:, None] * s_kc1 + d[None, :], mask=cm[:, None], other=0.0)
            v = tl.load(VC + pid * s_vc0 + cols[:, None] * s_vc1 + dv[None, :], mask=cm[:, None], other=0.0)
            s = tl.where(cm[None, :], tl.dot(q, tl.trans(k), input_precision=PREC) * scale, float("-inf"))
            tl.store(SC + (pid * G + g[:, None]) * s_sc + cols[None, :], s, mask=gm[:, None] & cm[None, :])
            m, l, acc = _online(s, v, m, l, acc, PREC)
        _store_partial(PM, PL, PACC, pbase + split, m, l, acc, GP, DV)
    else:  # window ring slots of tile split - ncs; the ring's first m_win slots are the last m_win positions
        wt = split - ncs
        cols = wt * BW + tl.arange(0, BW)
        cm = cols < m_win
        kw = tl.load(KW + pid * s_kw0 + cols[:, None] * s_kw1 + d[None, :], mask=cm[:, None], other=0.0)
        vw = tl.load(VW + pid * s_vw0 + cols[:, None] * s_vw1 + dv[None, :], mask=cm[:, None], other=0.0)
        if slot_w // BW == wt:  # this tile holds the new token's slot: store it everywhere, attend from registers
            kn = tl.load(KNW + b * n_kw0 + h * n_kw1 + d).to(KW.dtype.element_ty)
            vn = tl.load(VNW + b * n_vw0 + h * n_vw1 + dv).to(VW.dtype.element_ty)
            new = (cols == slot_w)[:, None]
            kw = tl.where(new, kn[None, :], kw)
            vw = tl.where(new, vn[None, :], vw)
            tl.store(KW + pid * s_kw0 + slot_w * s_kw1 + d, kn)
            tl.store(VW + pid * s_vw0 + slot_w * s_vw1 + dv, vn)
            tl.store(KS + pid * s_ks0 + t * s_ks1 + d, tl.load(KNS + b * n_ks0 + h * n_ks1 + d))
            tl.store(VS + pid * s_vs0 + t * s_vs1 + dv, tl.load(VNS + b * n_vs0 + h * n_vs1 + dv))
            tl.store(KR + pid * s_kr0 + slot_r * s_kr1 + d, tl.load(KNR + b * n_kr0 + h * n_kr1 + d))
            tl.store(VR + pid * s_vr0 + slot_r * s_vr1 + dv, tl.load(VNR + b * n_vr0 + h * n_vr1 + dv))
        s_w = tl.where(cm[None, :], tl.dot(q, tl.trans(kw), input_precision=PREC) * scale, float("-inf"))
        m, l, acc = _online(s_w, vw, m, l, acc, PREC)
        _store_partial(PM, PL, PACC, pbase + split, m, l, acc, GP, DV)


@triton.jit(do_not_specialize=["t", "nc", "cur", "k_sel", "ncs", "nws"])
def _finish_kernel(Q, KS, VS, GATES, OUT, SC, PM, PL, PACC, PSUM, t, nc, cur, k_sel, ncs, nws, scale,
                   s_ks0, s_ks1, s_vs0, s_vs1, s_sc, s_ps,
                   G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, NSP: tl.constexpr,
                   NSPP: tl.constexpr, LP: tl.constexpr, SB: tl.constexpr, NSELP: tl.constexpr, NBP: tl.constexpr,
                   SUBS: tl.constexpr, TAPS: tl.constexpr, PB: tl.constexpr, SPB: tl.constexpr,
                   PREC: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    gm = g < G
    rows = pid * G + g  # query head h * G + g of row b, in q [B, HQ, D] / gates [B, HQ, 3] / out [B*HKV, G, DV]
    pm, pl, pacc = PM + pid * NSP * GP, PL + pid * NSP * GP, PACC + pid * NSP * GP * DV

    # 1. merge the splits (compressed: 0 when nc == 0, as in the torch path)
    o_cmp, m_c, l_c = _merge(pm, pl, pacc, 0, ncs, GP, DV, NSPP, SPB)
    o_win, _, _ = _merge(pm, pl, pacc, ncs, ncs + nws, GP, DV, NSPP, SPB)

    # 2. group-summed probabilities, then the importance of blocks 0 .. cur-1: sub-block u sums p[u - r] (r < TAPS),
    # block j its SUBS sub-blocks
    for c0 in range(0, nc, PB):
        cols = c0 + tl.arange(0, PB)
        cm = cols < nc
        s = tl.load(SC + rows[:, None] * s_sc + cols[None, :], mask=gm[:, None] & cm[None, :], other=float("-inf"))
        pr = tl.where(gm[:, None], tl.exp(s - m_c[:, None]) / l_c[:, None], 0.0)
        tl.store(PSUM + pid * s_ps + cols, tl.sum(pr, 0), mask=cm)
    tl.debug_barrier()  # the row is read back below by other threads of this program
    jj = tl.arange(0, NBP)
    imp = tl.zeros([NBP], tl.float32)
    for sub in tl.static_range(SUBS):
        for r in tl.static_range(TAPS):
            i = jj * SUBS + sub - r
            imp += tl.load(PSUM + pid * s_ps + i, mask=(i >= 0) & (i < nc) & (jj < cur), other=0.0)
    imp = tl.where(jj < cur, imp, float("-inf"))
    imp = tl.where(((jj == 0) | (jj == cur - 1)) & (jj < cur), float("inf"), imp)

    # 3. selection: entries 0 .. k_sel-1 the top blocks, entry k_sel (and the padding) the current block; the
    # keys of SB entries per step come from the register vector by tl.gather (no dependent memory load)
    ii = tl.arange(0, NSELP)
    sel = tl.zeros([NSELP], tl.int32) + cur
    for i in range(k_sel):
        j = tl.argmax(imp, 0, tie_break_left=True)
        imp = tl.where(jj == j, float("-inf"), imp)
        sel = tl.where(ii == i, j, sel)
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=gm[:, None], other=0.0).to(KS.dtype.element_ty)
    kk = tl.arange(0, SB * LP)
    m_s = tl.full([GP], float("-inf"), tl.float32)
    l_s = tl.zeros([GP], tl.float32)
    acc_s = tl.zeros([GP, DV], tl.float32)
    for e0 in range(0, k_sel + 1, SB):
        ent = e0 + kk // LP
        em = ent <= k_sel
        blk = tl.gather(sel, tl.minimum(ent, NSELP - 1), 0)
        keys = blk * LP + kk % LP
        km = em & (keys <= t)
        k = tl.load(KS + pid * s_ks0 + keys[:, None] * s_ks1 + d[None, :], mask=km[:, None], other=0.0)
        v = tl.load(VS + pid * s_vs0 + keys[:, None] * s_vs1 + dv[None, :], mask=km[:, None], other=0.0)
        s_sel = tl.where(km[None, :], tl.dot(q, tl.trans(k), input_precision=PREC) * scale, float("-inf"))
        m_s, l_s, acc_s = _online(s_sel, v, m_s, l_s, acc_s, PREC)

    # 4. gate mix
    g0 = tl.load(GATES + rows * 3 + 0, mask=gm, other=0.0).to(tl.float32)
    g1 = tl.load(GATES + rows * 3 + 1, mask=gm, other=0.0).to(tl.float32)
    g2 = tl.load(GATES + rows * 3 + 2, mask=gm, other=0.0).to(tl.float32)
    out = g0[:, None] * o_cmp + g1[:, None] * (acc_s / l_s[:, None]) + g2[:, None] * o_win
    tl.store(OUT + rows[:, None] * DV + dv[None, :], out.to(OUT.dtype.element_ty), mask=gm[:, None])


def nsa_decode_attend(q, new, caches, gates, ws: DecodeWorkspace, t: int, p) -> torch.Tensor:
    """Attention of the token at position t, storing its K/V into the caches first.

    q [B, 1, HQ, D]; ``new`` = ((k, v) compression-raw, (k, v) selection, (k, v) window) of position t, each
    [B, 1, HKV, D] with D contiguous (views are fine); ``caches`` = (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, k_raw,
    v_raw), each [B, HKV, S, D], the compressed ones already holding block (t + 1 - l) / d when it completes at t;
    gates [B, 1, HQ, 3]. Returns [B, HKV, G, Dv] in the cache dtype. ``t`` and NSAParams ``p`` are host values
    (grids and shapes follow them: no host sync)."""
    b, _, hq, dk = q.shape
    k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, k_raw, v_raw = caches
    hkv, dv = k_slc.shape[1], v_slc.shape[-1]
    g = hq // hkv
    nc, cur = p.num_cmp_tokens(t + 1), t // p.slc_block
    k_sel, m_win = min(p.slc_top_n - 1, cur), min(p.window, t + 1)
    ncs, tps = ws.cmp_splits(nc)
    nws = _cdiv(m_win, ws.bw)
    for c in caches:  # one (row, head) stride: [B, HKV] must be mergeable, D contiguous
        assert c.stride(-1) == 1 and c.stride(0) == hkv * c.stride(1), "cache layout [B, HKV, S, D] expected"
    (k_r, v_r), (k_s, v_s), (k_w, v_w) = new
    for x in (k_r, v_r, k_s, v_s, k_w, v_w):
        assert x.stride(-1) == 1, "new K/V must have a contiguous head dim"
    q, gates = q.contiguous(), gates.contiguous()
    out = torch.empty(b, hkv, g, dv, device=q.device, dtype=k_slc.dtype)
    scale = dk**-0.5
    # fp32 caches: full-precision dots, as torch's fp32 matmuls (tf32 scores flip near-tied block choices)
    prec = "ieee" if k_slc.dtype == torch.float32 else "tf32"
    run(_split_kernel, (b * hkv, ncs + nws),
        q, k_cmp, v_cmp, k_win, v_win, k_slc, v_slc, k_raw, v_raw, k_w, v_w, k_s, v_s, k_r, v_r,
        ws.scores, ws.part_m, ws.part_l, ws.part_acc, t, nc, m_win, ncs, tps, t % p.window, t % p.cmp_block, scale,
        *[x for c in (k_cmp, v_cmp, k_win, v_win, k_slc, v_slc, k_raw, v_raw) for x in (c.stride(1), c.stride(2))],
        *[x for n in (k_w, v_w, k_s, v_s, k_r, v_r) for x in (n.stride(0), n.stride(2))], ws.scores.stride(1),
        HKV=hkv, G=g, GP=ws.gp, D=dk, DV=dv, BC=ws.bc, BW=ws.bw, NSP=ws.nsp, PREC=prec, num_warps=4)
    run(_finish_kernel, (b * hkv,),
        q, k_slc, v_slc, gates, out, ws.scores, ws.part_m, ws.part_l, ws.part_acc, ws.psum,
        t, nc, cur, k_sel, ncs, nws, scale, k_slc.stride(1), k_slc.stride(2), v_slc.stride(1), v_slc.stride(2),
        ws.scores.stride(1), ws.psum.stride(0),
        G=g, GP=ws.gp, D=dk, DV=dv, NSP=ws.nsp, NSPP=triton.next_power_of_2(ws.nsp), LP=p.slc_block, SB=ws.sb,
        NSELP=ws.nselp, NBP=ws.nbp, SUBS=p.slc_block // p.cmp_stride, TAPS=p.cmp_block // p.cmp_stride, PB=ws.pb,
        SPB=8, PREC=prec, num_warps=ws.finish_warps)
    return out
