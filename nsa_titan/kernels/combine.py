"""Memory-bound epilogues, one pass each over [rows = B*T*HQ, Dv]:

- gate combination o = g_cmp*o_cmp + g_slc*o_slc + g_win*o_win (fp32 math, one rounding) and its backward
  (dg_i = sum_d dOut * o_i, and what each branch's backward needs to run on dOut itself: its delta and its LSE
  lowered by log2(g_i), in one read of dOut and the three branch outputs); in eager torch this was ~9 separate
  elementwise passes (about 25 GB at 64k paper size, fwd+bwd), and the three deltas were three more passes;
- delta = rowsum(dO * O) in fp32, the softmax-backward term each branch needs, without materialising fp32
  copies of dO and O (torch's do.float() * o.float() moved ~10 GB per branch at that size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.launch import run


def pow2(x: int) -> int:
    return 1 << max(0, (max(1, x) - 1).bit_length())


def fits_i32(q: torch.Tensor, per_batch: int) -> bool:
    """Whether one batch of ``q`` (through its strides) and ``per_batch`` elements (one batch of the other buffers a
    kernel indexes per row) both stay below 2^31: the kernels' launch option i32_rows (attempt 95) may then do the
    row arithmetic in 32 bits from each batch's bases."""
    q_span = 1 + sum((n - 1) * st for n, st in zip(q.shape[1:], q.stride()[1:]))
    return max(q_span, per_batch) < 2**31


@triton.jit
def _rowdot(A, B, OUT, N, D: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    d = tl.arange(0, DP)
    m = (r[:, None] < N) & (d[None, :] < D)
    a = tl.load(A + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.load(B + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + r, tl.sum(a * b, 1), mask=r < N)


@triton.jit
def mix_rows(OC, o_s, OW, G, OUT, r, rm, D: tl.constexpr, DP: tl.constexpr):
    """out = g_cmp*o_cmp + g_slc*o_slc + g_win*o_win for the flat rows r (of [B*T*HQ], rm: real rows), o_slc given
    as an fp32 [rows, DP] tile of values in the output dtype: _combine_fwd loads it, the selected multi-token
    forward and the block forward's merge (their MIX) have it in registers. One code for all, so they give the same
    bits."""
    d = tl.arange(0, DP)
    m = rm[:, None] & (d[None, :] < D)
    off = r[:, None] * D + d[None, :]
    g0 = tl.load(G + r * 3, mask=rm, other=0.0).to(tl.float32)
    g1 = tl.load(G + r * 3 + 1, mask=rm, other=0.0).to(tl.float32)
    g2 = tl.load(G + r * 3 + 2, mask=rm, other=0.0).to(tl.float32)
    o = g0[:, None] * tl.load(OC + off, mask=m, other=0.0).to(tl.float32)
    o += g1[:, None] * o_s
    o += g2[:, None] * tl.load(OW + off, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + off, o.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _combine_fwd(OC, OS, OW, G, OUT, N, D: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    d = tl.arange(0, DP)
    rm = r < N
    o_s = tl.load(OS + r[:, None] * D + d[None, :], mask=rm[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    mix_rows(OC, o_s, OW, G, OUT, r, rm, D, DP)


@triton.jit
def _combine_bwd_branch(DOUT_ROWS, O, LSE, G, DG, DELTA, LSEG, r, rm, off, m, i: tl.constexpr, N):
    """Branch i of _combine_bwd: dg_i = sum_d dOut * o_i, delta_i = dg_i, lse'_i = lse_i - log2(g_i)."""
    dg = tl.sum(DOUT_ROWS * tl.load(O + off, mask=m, other=0.0).to(tl.float32), 1)
    g = tl.load(G + r * 3 + i, mask=rm, other=0.0).to(tl.float32)
    tl.store(DG + r * 3 + i, dg, mask=rm)
    tl.store(DELTA + i * N + r, dg, mask=rm)
    # log2(0) = -inf (a gate that underflowed): lse' = +inf, so the branch's p' and dS are 0 for that row.
    tl.store(LSEG + i * N + r, tl.load(LSE + r, mask=rm, other=0.0) - tl.log2(g), mask=rm)


@triton.jit
def _combine_bwd(DOUT, OC, OS, OW, G, LSE_C, LSE_S, LSE_W, DG, DELTA, LSEG, N, D: tl.constexpr, DP: tl.constexpr,
                 BR: tl.constexpr):
    """One read of dOut and the three branch outputs: every branch's dg_i, delta_i and lowered LSE (combine_bwd)."""
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    d = tl.arange(0, DP)
    rm = r < N
    m = rm[:, None] & (d[None, :] < D)
    off = r[:, None] * D + d[None, :]
    dout = tl.load(DOUT + off, mask=m, other=0.0).to(tl.float32)
    _combine_bwd_branch(dout, OC, LSE_C, G, DG, DELTA, LSEG, r, rm, off, m, 0, N)
    _combine_bwd_branch(dout, OS, LSE_S, G, DG, DELTA, LSEG, r, rm, off, m, 1, N)
    _combine_bwd_branch(dout, OW, LSE_W, G, DG, DELTA, LSEG, r, rm, off, m, 2, N)


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
    run(_rowdot, (triton.cdiv(n, br),), a, b, out, n, D=d, DP=pow2(max(d, 16)), BR=br)
    return out


def mix_operands(mix: tuple | None, placeholder: torch.Tensor, before_mix=None) -> tuple:
    """The (o_cmp, o_win, gates, out) a MIX launch reads: ``placeholder`` four times when ``mix`` is None (MIX off:
    never read), else ``mix``, after ``before_mix()`` when given (ops joins the window's side stream there)."""
    if mix is None:
        return (placeholder,) * 4
    if before_mix is not None:
        before_mix()
    return mix


def combine_fwd(o_c, o_s, o_w, gates, out=None):
    """-> g_cmp*o_c + g_slc*o_s + g_win*o_w (gates [..., 3]), written into ``out`` (contiguous) when given."""
    o_c, o_s, o_w, gates = (x.contiguous() for x in (o_c, o_s, o_w, gates))
    d = o_c.shape[-1]
    n = o_c.numel() // d
    out = torch.empty_like(o_c) if out is None else out
    br = _rows_per_program(o_c, d)
    run(_combine_fwd, (triton.cdiv(n, br),), o_c, o_s, o_w, gates, out, n, D=d, DP=pow2(max(d, 16)), BR=br)
    return out


def combine_bwd(dout, o_c, o_s, o_w, gates, lses):
    """The gate combination's backward -> (dgates, delta [3, *o.shape[:-1]] fp32, lse' [3, *o.shape[:-1]] fp32), for
    ``lses`` the three branches' forward LSEs (base 2).

    No branch's dO_i = g_i * dOut is formed: each branch backward runs on dOut itself with lse'_i = lse_i - log2(g_i)
    and delta_i = dg_i = rowsum(dOut * o_i). Then p' = exp2(s - lse'_i) = g_i p, so P^T dO_i = p'^T dOut, and
    dS = p (g_i dOut V^T - rowsum(dO_i * o_i)) = p' (dOut V^T - dg_i): the branch kernels run unchanged, and three
    [B, T, HQ, Dv] tensors are neither written nor read back."""
    dout, o_c, o_s, o_w, gates = (x.contiguous() for x in (dout, o_c, o_s, o_w, gates))
    d = o_c.shape[-1]
    n = o_c.numel() // d
    dg = torch.empty(gates.shape, device=gates.device, dtype=torch.float32)
    delta = torch.empty((3, *o_c.shape[:-1]), device=o_c.device, dtype=torch.float32)
    lse_g = torch.empty_like(delta)
    br = _rows_per_program(o_c, d)
    run(_combine_bwd, (triton.cdiv(n, br),), dout, o_c, o_s, o_w, gates, *(x.contiguous() for x in lses), dg, delta,
        lse_g, n, D=d, DP=pow2(max(d, 16)), BR=br)
    return dg.to(gates.dtype), delta, lse_g


@triton.jit
def balanced_splits(tile, TQ, BK: tl.constexpr, KSTRIDE, KOFF, G, CHUNK):
    """How many splits of CHUNK packed rows band_bwd's balanced dK/dV gives key tile ``tile`` (scalar or vector):
    the rows of the queries from the tile's first key's position on, at least one (band_bwd._split_plan's counts;
    both its dK/dV kernel and _add_splits read them from here)."""
    return tl.maximum(tl.cdiv(tl.maximum(TQ - (tile * BK * KSTRIDE + KOFF), 0) * G, CHUNK), 1)


@triton.jit
def _add_splits(P, X, N, S, T, HKV, NSPLIT, CHUNK, TQ, KSTRIDE, KOFF, G, D: tl.constexpr, DP: tl.constexpr,
                BR: tl.constexpr, ACC: tl.constexpr, BK: tl.constexpr):
    """X[b, i, kv] (the first S token rows of a [B, T, HKV, D] tensor) += the sum of the NSPLIT fp32 partials
    P[:, b, i, kv] ([NSPLIT, B, S, HKV, D]), in fp32 in split order, rounded once: one kernel for what took
    five torch ops per tensor (sum, two casts, add, slice copy). ACC False: X = the sum (X not read).
    CHUNK > 0 (band_bwd's balanced splits, _split_plan): key i's tile i // BK has only
    max(1, cdiv(max(TQ - (tile BK KSTRIDE + KOFF), 0) G, CHUNK)) splits; its other slots are never written, not read."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)  # (b * S + i) * HKV + kv
    d = tl.arange(0, DP)
    m = (r < N)[:, None] & (d[None, :] < D)
    b = r // (S * HKV)
    x_ptr = X + ((b * T * HKV + r - b * (S * HKV)).to(tl.int64) * D)[:, None] + d[None, :]
    if ACC:
        acc = tl.load(x_ptr, mask=m, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BR, DP], tl.float32)
    used = r * 0 + NSPLIT
    if CHUNK > 0:
        used = balanced_splits(((r // HKV) % S) // BK, TQ, BK, KSTRIDE, KOFF, G, CHUNK)  # the row's key tile's
    # Four slots per step, unrolled (their loads do not wait on acc) and added in split order: the same sums as one
    # slot per step, with a quarter of the dependent load latencies (the compressed keys' S is small, so these programs
    # are few and each walks up to ~64 slots: at the 1b's 32k one at a time was estimated at ~0.1 ms, NOTES_kernels.md
    # attempt 110).
    for sp in range(0, NSPLIT, 4):
        for j in tl.static_range(4):
            acc += tl.load(P + (((sp + j) * N + r).to(tl.int64) * D)[:, None] + d[None, :],
                           mask=m & (sp + j < used)[:, None], other=0.0)
    tl.store(x_ptr, acc.to(X.dtype.element_ty), mask=m)


def add_splits(part, x, acc: bool = True, balanced: tuple | None = None) -> None:
    """x [B, T, H, D] (contiguous): its first S token rows += part.sum(0) for fp32 partials part [NSPLIT, B, S, H, D],
    summed in fp32 and rounded once (band_bwd.band_bwd's dkv_acc); ``acc`` False: x = the sum. ``balanced``: the
    partials of band_bwd's balanced splits, (chunk, n_queries, BK, kstride, koff, G), where a key tile fills only
    the first of its slots (band_bwd._split_plan); the rest are skipped."""
    nsplit, B, S, H, D = part.shape
    if not (x.is_contiguous() and x.shape[0] == B and x.shape[1] >= S and x.shape[2:] == (H, D)):
        raise ValueError(f"add_splits: need a contiguous [{B}, >= {S}, {H}, {D}] tensor, got {tuple(x.shape)} "
                         f"(contiguous={x.is_contiguous()})")
    chunk, tq, bk, kstride, koff, g = balanced or (0, 0, 1, 0, 0, 0)
    n = B * S * H
    if n:
        run(_add_splits, (triton.cdiv(n, 16),), part, x, n, S, x.shape[1], H, nsplit, chunk, tq, kstride, koff, g, D=D,
            DP=pow2(max(D, 16)), BR=16, ACC=acc, BK=bk, num_warps=4)  # 16 rows: 4x the programs of 64
