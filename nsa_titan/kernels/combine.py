"""Memory-bound epilogues, one pass each over [rows = B*T*HQ, Dv]:

- gate combination o = g_cmp*o_cmp + g_slc*o_slc + g_win*o_win (fp32 math, one rounding) and its backward
  (dO_i = g_i * dOut, dg_i = sum_d dOut * o_i and each branch's delta_i = sum_d dO_i * o_i in one read of
  dOut and the three branch outputs); in eager torch this was ~9 separate elementwise passes (about 25 GB at
  64k paper size, fwd+bwd), and the three deltas were three more passes;
- delta = rowsum(dO * O) in fp32, the softmax-backward term each branch needs, without materialising fp32
  copies of dO and O (torch's do.float() * o.float() moved ~10 GB per branch at that size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def pow2(x: int) -> int:
    return 1 << max(0, (max(1, x) - 1).bit_length())



@triton.jit
def _rowdot(A, B, OUT, N, D: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    d = tl.arange(0, DP)
    m = (r[:, None] < N) & (d[None, :] < D)
    a = tl.load(A + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.load(B + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + r, tl.sum(a * b, 1), mask=r < N)


@triton.jit
def _combine_fwd(OC, OS, OW, G, OUT, N, D: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    d = tl.arange(0, DP)
    rm = r < N
    m = rm[:, None] & (d[None, :] < D)
    off = r[:, None] * D + d[None, :]
    g0 = tl.load(G + r * 3, mask=rm, other=0.0).to(tl.float32)
    g1 = tl.load(G + r * 3 + 1, mask=rm, other=0.0).to(tl.float32)
    g2 = tl.load(G + r * 3 + 2, mask=rm, other=0.0).to(tl.float32)
    o = g0[:, None] * tl.load(OC + off, mask=m, other=0.0).to(tl.float32)
    o += g1[:, None] * tl.load(OS + off, mask=m, other=0.0).to(tl.float32)
    o += g2[:, None] * tl.load(OW + off, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + off, o.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _combine_bwd(DOUT, OC, OS, OW, G, LSE_C, LSE_S, LSE_W, DOC, DOS, DOW, DG, DELTA, LSEG, N, D: tl.constexpr,
                 DP: tl.constexpr, BR: tl.constexpr, STORE_DO: tl.constexpr):
    """dg_i = sum_d dOut * o_i, and per branch either (STORE_DO) dO_i = g_i * dOut (rounded to the branch dtype) with
    its softmax term delta_i = sum_d dO_i * o_i from the rounded dO_i, exactly what rowdot(dO_i, o_i) would give; or
    (not STORE_DO) nothing [B, T, HQ, Dv]-sized: the branch backward then runs on dOut itself with delta_i = dg_i and
    its LSE lowered by log2(g_i) (LSEG), see combine_bwd."""
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    d = tl.arange(0, DP)
    rm = r < N
    m = rm[:, None] & (d[None, :] < D)
    off = r[:, None] * D + d[None, :]
    dout = tl.load(DOUT + off, mask=m, other=0.0).to(tl.float32)
    g0 = tl.load(G + r * 3, mask=rm, other=0.0).to(tl.float32)
    g1 = tl.load(G + r * 3 + 1, mask=rm, other=0.0).to(tl.float32)
    g2 = tl.load(G + r * 3 + 2, mask=rm, other=0.0).to(tl.float32)
    oc = tl.load(OC + off, mask=m, other=0.0).to(tl.float32)
    os_ = tl.load(OS + off, mask=m, other=0.0).to(tl.float32)
    ow = tl.load(OW + off, mask=m, other=0.0).to(tl.float32)
    dg0, dg1, dg2 = tl.sum(dout * oc, 1), tl.sum(dout * os_, 1), tl.sum(dout * ow, 1)
    tl.store(DG + r * 3, dg0, mask=rm)
    tl.store(DG + r * 3 + 1, dg1, mask=rm)
    tl.store(DG + r * 3 + 2, dg2, mask=rm)
    if STORE_DO:
        doc = (g0[:, None] * dout).to(DOC.dtype.element_ty)
        dos = (g1[:, None] * dout).to(DOS.dtype.element_ty)
        dow = (g2[:, None] * dout).to(DOW.dtype.element_ty)
        tl.store(DOC + off, doc, mask=m)
        tl.store(DOS + off, dos, mask=m)
        tl.store(DOW + off, dow, mask=m)
        tl.store(DELTA + r, tl.sum(doc.to(tl.float32) * oc, 1), mask=rm)
        tl.store(DELTA + N + r, tl.sum(dos.to(tl.float32) * os_, 1), mask=rm)
        tl.store(DELTA + 2 * N + r, tl.sum(dow.to(tl.float32) * ow, 1), mask=rm)
    else:
        tl.store(DELTA + r, dg0, mask=rm)
        tl.store(DELTA + N + r, dg1, mask=rm)
        tl.store(DELTA + 2 * N + r, dg2, mask=rm)
        # log2(0) = -inf (a gate that underflowed): LSE' = +inf, so the branch's p' and dS are 0 for that row.
        tl.store(LSEG + r, tl.load(LSE_C + r, mask=rm, other=0.0) - tl.log2(g0), mask=rm)
        tl.store(LSEG + N + r, tl.load(LSE_S + r, mask=rm, other=0.0) - tl.log2(g1), mask=rm)
        tl.store(LSEG + 2 * N + r, tl.load(LSE_W + r, mask=rm, other=0.0) - tl.log2(g2), mask=rm)


def _rows_per_program(x: torch.Tensor, d: int) -> int:
    if x.device.type != "cuda":
        return 64
    return max(1, min(64, 8192 // pow2(d)))  # ~8k elements per tensor per program: 16 B loads, no spills


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., D] x [..., D] (contiguous) -> [...] fp32 sum over D of a*b."""
    a, b = a.contiguous(), b.contiguous()
    d = a.shape[-1]
    n = a.numel() // max(d, 1)
    out = torch.empty(a.shape[:-1], device=a.device, dtype=torch.float32)
    br = _rows_per_program(a, d)
    _rowdot[(triton.cdiv(n, br),)](a, b, out, n, D=d, DP=pow2(max(d, 16)), BR=br)
    return out


def combine_fwd(o_c, o_s, o_w, gates):
    o_c, o_s, o_w, gates = (x.contiguous() for x in (o_c, o_s, o_w, gates))
    d = o_c.shape[-1]
    n = o_c.numel() // d
    out = torch.empty_like(o_c)
    br = _rows_per_program(o_c, d)
    _combine_fwd[(triton.cdiv(n, br),)](o_c, o_s, o_w, gates, out, n, D=d, DP=pow2(max(d, 16)), BR=br)
    return out


def combine_bwd(dout, o_c, o_s, o_w, gates, lses=None):
    """-> (dO_cmp, dO_slc, dO_win, dgates, delta [3, *o.shape[:-1]] fp32: rowsum(dO_i * o_i) per branch).

    ``lses`` (the three branches' forward LSEs, base 2) instead: -> (dgates, delta, lse') with no dO_i stored. Each
    branch's backward then runs on dOut itself: with p' = exp2(s - lse'_i) = g_i p for lse'_i = lse_i - log2(g_i),
    P^T dO_i = p'^T dOut, and dS = p (g_i dOut V^T - delta_i) = p' (dOut V^T - dg_i) since delta_i = g_i dg_i. So the
    branch kernels run unchanged on (dOut, lse'_i, delta'_i = dg_i): three [B, T, HQ, Dv] tensors fewer to write and
    read back, and no extra work per score."""
    dout, o_c, o_s, o_w, gates = (x.contiguous() for x in (dout, o_c, o_s, o_w, gates))
    d = o_c.shape[-1]
    n = o_c.numel() // d
    dg = torch.empty(gates.shape, device=gates.device, dtype=torch.float32)
    delta = torch.empty((3, *o_c.shape[:-1]), device=o_c.device, dtype=torch.float32)
    br = _rows_per_program(o_c, d)
    if lses is None:
        doc, dos, dow = torch.empty_like(o_c), torch.empty_like(o_s), torch.empty_like(o_w)
        lse_c = lse_s = lse_w = lse_g = delta  # never read or written
    else:
        doc = dos = dow = dout  # never written
        lse_c, lse_s, lse_w = (x.contiguous() for x in lses)
        lse_g = torch.empty_like(delta)
    _combine_bwd[(triton.cdiv(n, br),)](dout, o_c, o_s, o_w, gates, lse_c, lse_s, lse_w, doc, dos, dow, dg, delta,
                                        lse_g, n, D=d, DP=pow2(max(d, 16)), BR=br, STORE_DO=lses is None)
    if lses is None:
        return doc, dos, dow, dg.to(gates.dtype), delta
    return dg.to(gates.dtype), delta, lse_g


@triton.jit
def _add_splits(P, X, N, S, T, HKV, NSPLIT, D: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr):
    """X[b, i, kv] (the first S token rows of a [B, T, HKV, D] tensor) += the sum of the NSPLIT fp32 partials
    P[:, b, i, kv] ([NSPLIT, B, S, HKV, D]), in fp32 in split order, rounded once: one kernel for what took
    five torch ops per tensor (sum, two casts, add, slice copy)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)  # (b * S + i) * HKV + kv
    d = tl.arange(0, DP)
    m = (r < N)[:, None] & (d[None, :] < D)
    b = r // (S * HKV)
    x_ptr = X + ((b * T * HKV + r - b * (S * HKV)).to(tl.int64) * D)[:, None] + d[None, :]
    acc = tl.load(x_ptr, mask=m, other=0.0).to(tl.float32)
    for sp in range(0, NSPLIT):
        acc += tl.load(P + ((sp * N + r).to(tl.int64) * D)[:, None] + d[None, :], mask=m, other=0.0)
    tl.store(x_ptr, acc.to(X.dtype.element_ty), mask=m)


def add_splits(part, x) -> None:
    """x [B, T, H, D] (contiguous): its first S token rows += part.sum(0) for fp32 partials part [NSPLIT, B, S, H, D],
    summed in fp32 and rounded once (band.band_bwd's dkv_acc)."""
    nsplit, B, S, H, D = part.shape
    if not (x.is_contiguous() and x.shape[0] == B and x.shape[1] >= S and x.shape[2:] == (H, D)):
        raise ValueError(f"add_splits: need a contiguous [{B}, >= {S}, {H}, {D}] tensor, got {tuple(x.shape)} "
                         f"(contiguous={x.is_contiguous()})")
    n = B * S * H
    if n:
        _add_splits[(triton.cdiv(n, 64),)](part, x, n, S, x.shape[1], H, nsplit, D=D, DP=pow2(max(D, 16)), BR=64,
                                           num_warps=4)
