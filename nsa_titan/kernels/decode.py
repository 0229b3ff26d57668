"""One fused Triton kernel for NSA decoding: the attention of one new token per row over a layer's KV cache.

Why: a decode step of a small model is bound by kernel launches, not bytes. The torch path of
``models/nsa/decode.py`` (the spec: it restates reference.py's rules for the newest query) issues ~48 aten ops
per layer for the three branches, the block importance, the top-n sort, the gathers and the gate mix; with
CUDA graphs each still costs a few microseconds of GPU time, and at m7c sizes that is most of the step.
Here one program per (row, KV head) does all of it:

1. compressed branch, two passes over the visible compressed tokens (softmax max/denominator, then the
   probabilities, which give both the output and the group-summed probabilities stored to a scratch row);
2. block importance of every past block from that scratch row (eq. 9, the gathers of ``block_importance``),
   forced blocks (0 and cur - 1) at +inf;
3. the top min(n - 1, cur) blocks by repeated argmax (ties to the lower index, as the stable sort of the
   torch path), each attended as soon as it is chosen (online softmax), then the current block's tokens <= t;
4. the sliding window over the ring's valid slots (key order does not matter to attention);
5. the gate mix, written as [B, HKV, G, Dv].

Contract: as ``NSALayerCache.attend`` after the new token is stored (no documents: decode refuses them).
Head dims must be powers of 2 (``supported`` says so; the cache then uses the torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["nsa_decode_attend", "supported"]


def supported(head_dim: int, v_head_dim: int, slc_block: int) -> bool:
    """Shapes the kernel takes: tl.arange needs powers of 2 and tl.dot dimensions of at least 16."""
    pow2 = lambda x: x >= 16 and x & (x - 1) == 0  # noqa: E731
    return pow2(head_dim) and pow2(v_head_dim) and pow2(slc_block)


@triton.jit
def _online(s, v, m, l, acc):
    """One online-softmax step: scores s [GP, N] (masked = -inf, at least one finite per row) and values v."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    pr = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(pr, 1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
    return m_new, l, acc


# The positions change every step: left unspecialised, one compiled kernel serves them all (Triton would otherwise
# compile a variant per value class of each: equal to 1, divisible by 16, other).
@triton.jit(do_not_specialize=["t", "nc", "cur", "k_sel", "m_win"])
def _decode_kernel(Q, KC, VC, KS, VS, KW, VW, GATES, OUT, PSUM, t, nc, cur, k_sel, m_win, scale,
                   s_kc0, s_kc1, s_vc0, s_vc1, s_ks0, s_ks1, s_vs0, s_vs1, s_kw0, s_kw1, s_vw0, s_vw1, s_ps,
                   HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                   BC: tl.constexpr, LP: tl.constexpr, BW: tl.constexpr, NBP: tl.constexpr, SUBS: tl.constexpr,
                   TAPS: tl.constexpr):
    pid = tl.program_id(0)  # = b * HKV + h; caches are [B, HKV, S, D] with S stride s_* and D contiguous
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    gm = g < G
    rows = pid * G + g  # query head h * G + g of row b, in q [B, HQ, D] / gates [B, HQ, 3] / out [B*HKV, G, DV]
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=gm[:, None], other=0.0).to(KS.dtype.element_ty)
    neg = tl.full([GP], float("-inf"), tl.float32)

    # 1. compressed branch (nc may be 0: no compressed token yet; its output is then 0, as in the torch path)
    m_c, l_c = neg, tl.zeros([GP], tl.float32)
    for start in range(0, nc, BC):
        cols = start + tl.arange(0, BC)
        k = tl.load(KC + pid * s_kc0 + cols[:, None] * s_kc1 + d[None, :], mask=(cols < nc)[:, None], other=0.0)
        s = tl.where((cols < nc)[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m_c, tl.max(s, 1))
        l_c = l_c * tl.exp(m_c - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m_c = m_new
    acc_c = tl.zeros([GP, DV], tl.float32)
    for start in range(0, nc, BC):
        cols = start + tl.arange(0, BC)
        cm = cols < nc
        k = tl.load(KC + pid * s_kc0 + cols[:, None] * s_kc1 + d[None, :], mask=cm[:, None], other=0.0)
        v = tl.load(VC + pid * s_vc0 + cols[:, None] * s_vc1 + dv[None, :], mask=cm[:, None], other=0.0)
        s = tl.where(cm[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        pr = tl.exp(s - m_c[:, None]) / l_c[:, None]
        acc_c += tl.dot(pr.to(v.dtype), v)
        tl.store(PSUM + pid * s_ps + cols, tl.sum(tl.where(gm[:, None], pr, 0.0), 0), mask=cm)
    tl.debug_barrier()  # the scratch row is read back below by other threads of this program

    # 2. importance of blocks 0 .. cur-1: sub-block u sums p[u - r] (r < TAPS), block j sums its SUBS sub-blocks
    jj = tl.arange(0, NBP)
    imp = tl.zeros([NBP], tl.float32)
    for sub in tl.static_range(SUBS):
        for r in tl.static_range(TAPS):
            i = jj * SUBS + sub - r
            imp += tl.load(PSUM + pid * s_ps + i, mask=(i >= 0) & (i < nc) & (jj < cur), other=0.0)
    imp = tl.where(jj < cur, imp, float("-inf"))
    imp = tl.where(((jj == 0) | (jj == cur - 1)) & (jj < cur), float("inf"), imp)

    # 3. selected branch: the chosen past blocks (whole), then the current block's tokens <= t
    lp = tl.arange(0, LP)
    m_s, l_s, acc_s = neg, tl.zeros([GP], tl.float32), tl.zeros([GP, DV], tl.float32)
    for _ in range(k_sel):
        j = tl.argmax(imp, 0, tie_break_left=True)
        imp = tl.where(jj == j, float("-inf"), imp)
        keys = j * LP + lp
        k = tl.load(KS + pid * s_ks0 + keys[:, None] * s_ks1 + d[None, :])
        v = tl.load(VS + pid * s_vs0 + keys[:, None] * s_vs1 + dv[None, :])
        m_s, l_s, acc_s = _online(tl.dot(q, tl.trans(k)) * scale, v, m_s, l_s, acc_s)
    keys = cur * LP + lp
    km = keys <= t
    k_cur = tl.load(KS + pid * s_ks0 + keys[:, None] * s_ks1 + d[None, :], mask=km[:, None], other=0.0)
    v_cur = tl.load(VS + pid * s_vs0 + keys[:, None] * s_vs1 + dv[None, :], mask=km[:, None], other=0.0)
    s_cur = tl.where(km[None, :], tl.dot(q, tl.trans(k_cur)) * scale, float("-inf"))
    m_s, l_s, acc_s = _online(s_cur, v_cur, m_s, l_s, acc_s)

    # 4. window: the ring's first m_win slots hold the last m_win positions (names differ from the sections above:
    # a name assigned before a loop is loop-carried, and its shape may not change inside it)
    m_w, l_w, acc_w = neg, tl.zeros([GP], tl.float32), tl.zeros([GP, DV], tl.float32)
    for start in range(0, m_win, BW):
        cols = start + tl.arange(0, BW)
        cm = cols < m_win
        kw = tl.load(KW + pid * s_kw0 + cols[:, None] * s_kw1 + d[None, :], mask=cm[:, None], other=0.0)
        vw = tl.load(VW + pid * s_vw0 + cols[:, None] * s_vw1 + dv[None, :], mask=cm[:, None], other=0.0)
        s_w = tl.where(cm[None, :], tl.dot(q, tl.trans(kw)) * scale, float("-inf"))
        m_w, l_w, acc_w = _online(s_w, vw, m_w, l_w, acc_w)

    # 5. gate mix
    g0 = tl.load(GATES + rows * 3 + 0, mask=gm, other=0.0).to(tl.float32)
    g1 = tl.load(GATES + rows * 3 + 1, mask=gm, other=0.0).to(tl.float32)
    g2 = tl.load(GATES + rows * 3 + 2, mask=gm, other=0.0).to(tl.float32)
    out = g0[:, None] * acc_c + g1[:, None] * (acc_s / l_s[:, None]) + g2[:, None] * (acc_w / l_w[:, None])
    tl.store(OUT + rows[:, None] * DV + dv[None, :], out.to(OUT.dtype.element_ty), mask=gm[:, None])


def nsa_decode_attend(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, psum, t: int, p) -> torch.Tensor:
    """q [B, 1, HQ, D] (position t, already stored in the cache); caches [B, HKV, S, D] (D contiguous); gates
    [B, 1, HQ, 3]; psum fp32 [B, HKV, >= compressed capacity] scratch. Returns [B, HKV, G, Dv] in the cache dtype.
    ``t`` and the NSAParams ``p`` are host values (shapes follow them: no host sync)."""
    b, _, hq, dk = q.shape
    hkv, dv = k_slc.shape[1], v_slc.shape[-1]
    g = hq // hkv
    nc, cur = p.num_cmp_tokens(t + 1), t // p.slc_block
    k_sel, m_win = min(p.slc_top_n - 1, cur), min(p.window, t + 1)
    out = torch.empty(b, hkv, g, dv, device=q.device, dtype=k_slc.dtype)
    caches = (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win)
    for c in caches:  # one (row, head) stride: [B, HKV] must be mergeable, D contiguous
        assert c.stride(-1) == 1 and c.stride(0) == hkv * c.stride(1), "cache layout [B, HKV, S, D] expected"
    nbp = triton.next_power_of_2(max(1, k_slc.shape[2] // p.slc_block))
    _decode_kernel[(b * hkv,)](
        q.contiguous(), *caches, gates.contiguous(), out, psum, t, nc, cur, k_sel, m_win, dk**-0.5,
        *[x for c in caches for x in (c.stride(1), c.stride(2))], psum.stride(1),
        HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), D=dk, DV=dv, BC=128, LP=p.slc_block,
        BW=max(16, min(128, triton.next_power_of_2(p.window))), NBP=nbp, SUBS=p.slc_block // p.cmp_stride,
        TAPS=p.cmp_block // p.cmp_stride, num_warps=4)
    return out
