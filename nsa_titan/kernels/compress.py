"""The compression phi of the keys and values (the MLP form of ``attention.compress_pair``) as Triton kernels.

phi(window) = fc2(silu(fc1(window + pos))) over each window of l positions (stride d) of one head, the keys' and the
values' in one launch. In torch this is an unfold + position-embedding kernel, two batched matmuls and their
backward: ~14 small kernels per layer, ~0.12 ms of an m7c block at 8k batch 2 on an H100, where fc1 ran as cutlass
sm80 kernels on 32 tiles (``benchmarks/results/block_overhead_s10_H100.md``). Here:

- forward, one kernel: a program owns BM windows of one (batch, head, K or V), reads each window's l rows straight
  from the raw keys (no unfolded copy), accumulates fc1 over the l positions and applies silu and fc2 in registers;
- backward, two kernels: per window tile, fc1 recomputed, dpre = d(fc1's output) stored, and each position's dX
  written into the raw layout, one buffer per window a token can lie in (R = ceil(l / d), summed after); per
  (position, K or V), fc1's weight gradient reduced over every window in one fixed order (deterministic, no
  atomics), with the position embedding's gradient, and one more program per K / V for fc2's.

Weights come in as the parameters (fp32 masters, or bf16 under FSDP's mixed precision) and are rounded to the
activations' dtype in registers, as autocast would; accumulation is fp32. The spec is ``compress_pair``; tests hold
these kernels to it (tests/_kernel_checks.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import custom_op

_BM = 64  # windows per program: 64 programs for m7c at 8k batch 2 (511 windows x 2 heads x 2 rows x K and V)
_BR = 64  # windows per step of the weight-gradient reduction


@triton.jit
def _w_tile(W, row_len, col0, D: tl.constexpr):
    """[D, D] tile of a row-major weight W[:, col0:col0 + D] (row_len columns): rows are nn.Linear's outputs."""
    d = tl.arange(0, D)
    return tl.load(W + d[:, None] * row_len + col0 + d[None, :])


@triton.jit
def _phi_fwd(K, V, PK, PV, W1K, W1V, W2K, W2V, CK, CV, PRE, skb, skt, skh, svb, svt, svh, TC, H, M, STRIDE, L,
             D: tl.constexpr, DT: tl.constexpr, BM: tl.constexpr):
    """Windows c of (b, h) for the keys (which 0) or values (1): out = silu(pre) W2^T with pre = sum over positions
    j of (x_j + pos_j) W1[:, jD:(j+1)D]^T, accumulated in fp32; PRE [2, B*TC*H, D] fp32 keeps pre for the backward.
    Weights are the parameters in nn.Linear's layout, rounded to DT in registers."""
    pid, bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    if which == 0:
        X, P, W1, W2, OUT = K, PK, W1K, W2K, CK
    else:
        X, P, W1, W2, OUT = V, PV, W1V, W2V, CV
    sb = skb + (svb - skb) * which
    st = skt + (svt - skt) * which
    sh = skh + (svh - skh) * which
    c = pid * BM + tl.arange(0, BM)
    cm = c < TC
    d = tl.arange(0, D)
    rows = X + b.to(tl.int64) * sb + h.to(tl.int64) * sh + (c * STRIDE).to(tl.int64)[:, None] * st + d[None, :]
    pre = tl.zeros([BM, D], dtype=tl.float32)
    for j in range(L):
        x = tl.load(rows + j * st, mask=cm[:, None], other=0.0).to(tl.float32) + tl.load(P + j * D + d)[None, :]
        pre = tl.dot(x.to(DT), tl.trans(_w_tile(W1, L * D, j * D, D).to(DT)), pre)
    a = pre * tl.sigmoid(pre)
    out = tl.dot(a.to(DT), tl.trans(_w_tile(W2, D, 0, D).to(DT)))
    row = (b.to(tl.int64) * TC + c) * H + h
    tl.store(OUT + row[:, None] * D + d[None, :], out.to(OUT.dtype.element_ty), mask=cm[:, None])
    tl.store(PRE + (which * M + row)[:, None] * D + d[None, :], pre, mask=cm[:, None])


@triton.jit
def _dpre(DC, PRE, W2, row, ok, which, M, D: tl.constexpr, DT: tl.constexpr):
    """d(fc1's output) of the windows ``row`` (``ok`` masks): (dout W2) * silu'(pre), fp32."""
    d = tl.arange(0, D)
    dc = tl.load(DC + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    pre = tl.load(PRE + (which * M + row)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    s = tl.sigmoid(pre)
    return tl.dot(dc.to(DT), _w_tile(W2, D, 0, D).to(DT)) * s * (1.0 + pre * (1.0 - s))


@triton.jit
def _phi_bwd_x(DCK, DCV, PRE, W1K, W1V, W2K, W2V, DK, DV, DPRE, T, TC, H, M, STRIDE, L, R,
               D: tl.constexpr, DT: tl.constexpr, BM: tl.constexpr):
    """The raw keys' (values') gradient, written once per token: token c*STRIDE + i gets
    sum over r < R of dpre[window c - r] W1[:, (r*STRIDE + i)D : +D] (the windows that hold it), for every token
    group c < ceil(T / STRIDE); tokens in no window get 0. Also stores dpre [2, M, D] fp32 for the weights."""
    pid, bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    if which == 0:
        DC, W1, W2, DX = DCK, W1K, W2K, DK
    else:
        DC, W1, W2, DX = DCV, W1V, W2V, DV
    c = pid * BM + tl.arange(0, BM)
    d = tl.arange(0, D)
    own = c < TC
    row = (b.to(tl.int64) * TC + c) * H + h
    dp0 = _dpre(DC, PRE, W2, row, own, which, M, D, DT)
    tl.store(DPRE + (which * M + row)[:, None] * D + d[None, :], dp0, mask=own[:, None])
    dp0 = dp0.to(DT)
    for i in range(STRIDE):
        tok = c * STRIDE + i
        acc = tl.zeros([BM, D], dtype=tl.float32)
        if i < L:
            acc = tl.dot(dp0, _w_tile(W1, L * D, i * D, D).to(DT), acc)
        for r in range(1, R):
            if r * STRIDE + i < L:
                ok = (c >= r) & (c - r < TC)
                dpr = _dpre(DC, PRE, W2, row - r * H, ok, which, M, D, DT).to(DT)
                acc = tl.dot(dpr, _w_tile(W1, L * D, (r * STRIDE + i) * D, D).to(DT), acc)
        dst = ((b.to(tl.int64) * T + tok) * H + h)[:, None] * D + d[None, :]
        tl.store(DX + dst, acc.to(DX.dtype.element_ty), mask=(tok < T)[:, None])


@triton.jit
def _phi_bwd_w(K, V, PK, PV, W1K, W1V, PRE, DPRE, DCK, DCV, DW1K, DW1V, DW2K, DW2V, DPK, DPV,
               skb, skt, skh, svb, svt, svh, TC, H, M, STRIDE, L, D: tl.constexpr, DT: tl.constexpr,
               BR: tl.constexpr):
    """Program (j, which), windows in one fixed order (deterministic, no atomics), fp32 sums: j < L: fc1's weight
    gradient for position j, dW1[:, jD:(j+1)D] = sum of dpre^T (x_j + pos_j); j == L: fc2's, dW2 = sum of
    dout^T silu(pre), and the position embedding's, dpos_j = (sum of dpre) W1[:, jD:(j+1)D] for every j."""
    j, which = tl.program_id(0), tl.program_id(1)
    if which == 0:
        X, P, W1, DC, DW1, DW2, DPOS = K, PK, W1K, DCK, DW1K, DW2K, DPK
    else:
        X, P, W1, DC, DW1, DW2, DPOS = V, PV, W1V, DCV, DW1V, DW2V, DPV
    sb = skb + (svb - skb) * which
    st = skt + (svt - skt) * which
    sh = skh + (svh - skh) * which
    d = tl.arange(0, D)
    w_off = d[:, None] * (L * D) + d[None, :]
    acc = tl.zeros([D, D], dtype=tl.float32)
    if j < L:
        pos = tl.load(P + j * D + d).to(tl.float32)
        for m0 in range(0, M, BR):
            m = m0 + tl.arange(0, BR)
            mm = m < M
            h = m % H
            c = (m // H) % TC
            b = m // (H * TC)
            xo = b.to(tl.int64) * sb + (c * STRIDE + j).to(tl.int64) * st + h.to(tl.int64) * sh
            x = tl.load(X + xo[:, None] + d[None, :], mask=mm[:, None], other=0.0).to(tl.float32) + pos[None, :]
            dp = tl.load(DPRE + (which * M + m.to(tl.int64))[:, None] * D + d[None, :], mask=mm[:, None], other=0.0)
            acc = tl.dot(tl.trans(dp.to(DT)), x.to(DT), acc)  # [out n, in i]; padded rows have dp = 0
        tl.store(DW1 + j * D + w_off, acc.to(DW1.dtype.element_ty))
    else:
        colsum = tl.zeros([D], dtype=tl.float32)
        for m0 in range(0, M, BR):
            m = m0 + tl.arange(0, BR)
            mm = m < M
            o = (which * M + m.to(tl.int64))[:, None] * D + d[None, :]
            pre = tl.load(PRE + o, mask=mm[:, None], other=0.0)
            dc = tl.load(DC + m.to(tl.int64)[:, None] * D + d[None, :], mask=mm[:, None], other=0.0)
            acc = tl.dot(tl.trans(dc.to(DT)), (pre * tl.sigmoid(pre)).to(DT), acc)  # [out o, in i]
            colsum += tl.sum(tl.load(DPRE + o, mask=mm[:, None], other=0.0), 0)
        tl.store(DW2 + d[:, None] * D + d[None, :], acc.to(DW2.dtype.element_ty))
        for jj in range(L):
            w = tl.load(W1 + jj * D + w_off).to(tl.float32)  # [out n, in i]
            tl.store(DPOS + jj * D + d, tl.sum(colsum[:, None] * w, 0).to(DPOS.dtype.element_ty))


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


_WARPS = 8  # offline sm_90 (Triton 3.6): with 4, the dX kernel takes 255 registers at head dim 64 and spills at 128


def _x_rows(d: int) -> int:
    """Windows per program of the dX kernel: 64 (wgmma tiles) up to head dim 64; 32 at 128, where 64 spills."""
    return 64 if d <= 64 else 32


def _strides(k: Tensor, v: Tensor) -> tuple[int, ...]:
    return (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))


def _c(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def windows(t: int, block: int, stride: int) -> int:
    """Windows of ``block`` positions at ``stride`` in t tokens (Tensor.unfold's count)."""
    return (t - block) // stride + 1 if t >= block else 0


@custom_op("nsa_titan::phi_fwd", mutates_args=())
def phi_fwd(k: Tensor, v: Tensor, pos_k: Tensor, pos_v: Tensor, w1_k: Tensor, w1_v: Tensor, w2_k: Tensor,
            w2_v: Tensor, block: int, stride: int) -> tuple[Tensor, Tensor, Tensor]:
    """(phi_K(k), phi_V(v), pre): k, v [B, T, H, D] -> [B, TC, H, D] each, TC = windows(T, block, stride) >= 1;
    pre [2, B*TC*H, D] fp32: fc1's outputs, for the backward. Parameters contiguous, in nn.Linear's layout."""
    k, v = _c(k), _c(v)
    b, t, h, d = k.shape
    tc = windows(t, block, stride)
    ck, cv = (k.new_empty(b, tc, h, d) for _ in range(2))
    pre = torch.empty(2, b * tc * h, d, device=k.device, dtype=torch.float32)
    _phi_fwd[(triton.cdiv(tc, _BM), b * h, 2)](k, v, pos_k, pos_v, w1_k, w1_v, w2_k, w2_v, ck, cv, pre,
                                                *_strides(k, v), tc, h, b * tc * h, stride, block, D=d,
                                                DT=_TL[k.dtype], BM=_BM,
                                                num_warps=_WARPS)
    return ck, cv, pre


@phi_fwd.register_fake
def _(k, v, pos_k, pos_v, w1_k, w1_v, w2_k, w2_v, block, stride):
    b, t, h, d = k.shape
    tc = windows(t, block, stride)
    return k.new_empty(b, tc, h, d), k.new_empty(b, tc, h, d), k.new_empty(2, b * tc * h, d, dtype=torch.float32)


@custom_op("nsa_titan::phi_bwd", mutates_args=())
def phi_bwd(dck: Tensor, dcv: Tensor, k: Tensor, v: Tensor, pre: Tensor, pos_k: Tensor, pos_v: Tensor,
            w1_k: Tensor, w1_v: Tensor, w2_k: Tensor, w2_v: Tensor, block: int, stride: int) -> tuple[
                Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (k, v, pos_k, pos_v, w1_k, w1_v, w2_k, w2_v), contiguous, each in its input's dtype."""
    k, v, dck, dcv = _c(k), _c(v), dck.contiguous(), dcv.contiguous()
    b, t, h, d = k.shape
    tc = windows(t, block, stride)
    m = b * tc * h
    dt, nw = _TL[k.dtype], _WARPS
    dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)
    dpre = torch.empty_like(pre)
    groups = triton.cdiv(t, stride)  # token groups of STRIDE tokens: every token is written
    bm = _x_rows(d)
    _phi_bwd_x[(triton.cdiv(groups, bm), b * h, 2)](dck, dcv, pre, w1_k, w1_v, w2_k, w2_v, dk, dv, dpre, t, tc, h, m,
                                                     stride, block, -(-block // stride), D=d, DT=dt, BM=bm,
                                                     num_warps=nw)
    grads = [x.new_empty(x.shape) for x in (w1_k, w1_v, w2_k, w2_v, pos_k, pos_v)]
    _phi_bwd_w[(block + 1, 2)](k, v, pos_k, pos_v, w1_k, w1_v, pre, dpre, dck, dcv, *grads, *_strides(k, v), tc, h,
                               m, stride, block, D=d, DT=dt, BR=_BR, num_warps=nw)
    dw1_k, dw1_v, dw2_k, dw2_v, dpos_k, dpos_v = grads
    return dk, dv, dpos_k, dpos_v, dw1_k, dw1_v, dw2_k, dw2_v


@phi_bwd.register_fake
def _(dck, dcv, k, v, pre, pos_k, pos_v, w1_k, w1_v, w2_k, w2_v, block, stride):
    return tuple(x.new_empty(x.shape) for x in (k, v, pos_k, pos_v, w1_k, w1_v, w2_k, w2_v))  # all contiguous


def _phi_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8], output[2])
    ctx.args = inputs[8:]
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)


def _phi_backward(ctx, dck, dcv, _dpre):
    k, v, *params, pre = ctx.saved_tensors
    if dck is None or dcv is None:  # one of the two was not used: its gradient is zero
        ref = dcv if dck is None else dck
        if ref is None:
            return (None,) * 10
        shape = ref.shape
        dck = torch.zeros(shape, device=ref.device, dtype=ref.dtype) if dck is None else dck
        dcv = torch.zeros(shape, device=ref.device, dtype=ref.dtype) if dcv is None else dcv
    grads = phi_bwd(dck, dcv, k, v, pre, *params, *ctx.args)
    return (*grads, None, None)


phi_fwd.register_autograd(_phi_backward, setup_context=_phi_setup)


def phi_pair(ck, cv, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``attention.compress_pair`` for two MLP compressors of one width (duck-typed: kind, block, stride, pos_emb,
    fc1, fc2), k and v [B, T, H, D] with T >= block; the caller checks ``supports``."""
    params = (ck.pos_emb, cv.pos_emb, ck.fc1.weight, cv.fc1.weight, ck.fc2.weight, cv.fc2.weight)
    out_k, out_v, _ = phi_fwd(k, v, *(p.contiguous() for p in params), ck.block, ck.stride)
    return out_k, out_v


def supports(ck, cv, k: Tensor, v: Tensor) -> bool:
    """What ``phi_pair`` runs: both compressors MLPs of one block and stride, keys and values of one head dim that
    is a power of 2 from 16 to 128 (the kernels hold [D, D] tiles), at least one window."""
    d = k.shape[-1]
    return (ck.kind == "mlp" and cv.kind == "mlp" and ck.block == cv.block and ck.stride == cv.stride
            and k.shape == v.shape and d in (16, 32, 64, 128) and k.shape[1] >= ck.block and k.dtype in _TL)
