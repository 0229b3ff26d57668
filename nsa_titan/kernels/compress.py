"""The compression MLP phi of the compressed branch's keys and values in Triton (attempt 89), forward and backward.

phi maps each block of l raw positions (stride d) of one KV head to one token: c_i = W2 silu(sum_p (x[i*d + p] +
pos[p]) W1[p]), with W1[p] the block position p's [D, D] slice of fc1 (models/nsa/attention.py's Compressor, whose
``compress_pair`` is the spec). The torch path materialises the unfolded blocks, [B * Tc * H, l * D] per MLP (2x the
raw keys at d = l / 2), and runs skinny GEMMs on it; here one program takes BM compressed tokens of one (batch, KV
head) and walks the l block positions, reading the raw rows where they are, so neither the blocks nor their gradient
exist in memory. Keys and values run in one launch (grid axis 2: their weights are stacked; their inputs are two
strided views). H100, m7c at 8k batch 2: the torch path's phi was ~0.11 ms of GPU time per block (three GEMMs, the
unfold, its backward scatter, the position-embedding sums; benchmarks/results/profile_block_s23_*).

Backward: ``_compress_rows`` recomputes the pre-activation, writes dpre = d(pre) and each program's fp32 partial of
dW2; ``_compress_dw1`` sums dW1[p] = sum_i (x[i*d + p] + pos[p])^T dpre[i] over one split of the rows per program
(fp32 partials, added by torch in a fixed order: deterministic); ``_compress_dx`` gives each raw row its l / d
contributions, dx[j*d + r] = sum_m dpre[j - m] W1[r + m*d]^T, one program per BM rows j of one phase r. Needs d | l
(every phase sees the same number of blocks); the model keeps the torch path otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import custom_op

BM = 32  # compressed tokens (or raw rows of one phase) per program: m7c at 8k batch 2 gives 128 programs per MLP
# sm_90 offline (Triton 3.6, l 32, d 16, bf16): head dim 64 takes 56-112 registers, 128 up to 242, no spills.
LAUNCH = dict(num_warps=4, num_stages=2)


@triton.jit
def _inputs(XK, XV, skb, skt, skh, svb, svt, svh, which):
    """The raw rows of the keys (which 0) or of the values (1): base pointer and strides."""
    if which == 0:
        x, sb, st, sh = XK, skb, skt, skh
    else:
        x, sb, st, sh = XV, svb, svt, svh
    return x, sb, st, sh


@triton.jit
def _block_row(x, pos, b, h, i, ok, p, sb, st, sh, STRIDE: tl.constexpr, L: tl.constexpr, D: tl.constexpr):
    """(x[i*d + p] + pos[p]) for the compressed tokens i: [BM, D] in x's dtype (the torch path adds in that dtype)."""
    e = tl.arange(0, D)
    a = tl.load(x + b * sb + h * sh + (i * STRIDE + p)[:, None] * st + e[None, :], mask=ok[:, None], other=0.0)
    return (a + tl.load(pos + p * D + e)[None, :]).to(a.dtype)


@triton.jit
def _pre(x, W1, pos, b, h, i, ok, sb, st, sh, STRIDE: tl.constexpr, L: tl.constexpr, D: tl.constexpr,
         BMC: tl.constexpr, PREC: tl.constexpr):
    """fc1 over each block: sum_p (x[i*d + p] + pos[p]) @ W1[p]^T-slice -> [BM, D] fp32. W1: fc1's weight [D, l * D]."""
    e = tl.arange(0, D)
    acc = tl.zeros([BMC, D], tl.float32)
    for p in range(L):
        a = _block_row(x, pos, b, h, i, ok, p, sb, st, sh, STRIDE, L, D)
        w = tl.load(W1 + e[None, :] * (L * D) + p * D + e[:, None])  # [in, out] = fc1.weight[out, p*D + in]
        acc = tl.dot(a, w, acc, input_precision=PREC)
    return acc


@triton.jit
def _compress_fwd(XK, XV, POS, W1, W2, OUT, skb, skt, skh, svb, svt, svh, TC, H, STRIDE: tl.constexpr,
                  L: tl.constexpr, D: tl.constexpr, BMC: tl.constexpr, PREC: tl.constexpr):
    """OUT [2, B, TC, H, D] = fc2(silu(fc1(block))) with the torch path's roundings: fc1's and silu's outputs in the
    inputs' dtype."""
    pid_m, pid_bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = (pid_bh // H).to(tl.int64), pid_bh % H
    x, sb, st, sh = _inputs(XK, XV, skb, skt, skh, svb, svt, svh, which)
    i = pid_m * BMC + tl.arange(0, BMC)
    ok = i < TC
    e = tl.arange(0, D)
    pre = _pre(x, W1 + which * (D * L * D), POS + which * (L * D), b, h, i, ok, sb, st, sh, STRIDE, L, D, BMC,
               PREC).to(OUT.dtype.element_ty).to(tl.float32)
    act = (pre * tl.sigmoid(pre)).to(OUT.dtype.element_ty)
    w2 = tl.load(W2 + which * (D * D) + e[None, :] * D + e[:, None])  # [in, out] = fc2.weight[out, in]
    c = tl.dot(act, w2, input_precision=PREC)
    nb = tl.num_programs(1) // H
    tl.store(OUT + (((which * nb + b) * TC + i) * H + h)[:, None] * D + e[None, :], c.to(OUT.dtype.element_ty),
             mask=ok[:, None])


@triton.jit
def _compress_rows(XK, XV, POS, W1, W2, DOUT, DPRE, DW2P, skb, skt, skh, svb, svt, svh, TC, H,
                   STRIDE: tl.constexpr, L: tl.constexpr, D: tl.constexpr, BMC: tl.constexpr, PREC: tl.constexpr):
    """Per compressed token: dpre = (dOut @ fc2.weight) * silu'(pre) into DPRE [2, B, TC, H, D] (the inputs' dtype,
    as the torch path's), and this program's fp32 partial of fc2's weight gradient dOut^T act into
    DW2P [2, B * H * cdiv(TC, BM), D, D]."""
    pid_m, pid_bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = (pid_bh // H).to(tl.int64), pid_bh % H
    x, sb, st, sh = _inputs(XK, XV, skb, skt, skh, svb, svt, svh, which)
    i = pid_m * BMC + tl.arange(0, BMC)
    ok = i < TC
    e = tl.arange(0, D)
    dt = DPRE.dtype.element_ty
    pre = _pre(x, W1 + which * (D * L * D), POS + which * (L * D), b, h, i, ok, sb, st, sh, STRIDE, L, D, BMC,
               PREC).to(dt).to(tl.float32)
    sig = tl.sigmoid(pre)
    act = (pre * sig).to(dt)
    nb = tl.num_programs(1) // H
    row = (((which * nb + b) * TC + i) * H + h)[:, None] * D + e[None, :]
    dout = tl.load(DOUT + row, mask=ok[:, None], other=0.0)
    w2 = tl.load(W2 + which * (D * D) + e[:, None] * D + e[None, :])  # [out, in]
    dact = tl.dot(dout, w2, input_precision=PREC).to(dt).to(tl.float32)
    tl.store(DPRE + row, (dact * sig * (1.0 + pre * (1.0 - sig))).to(dt), mask=ok[:, None])
    part = tl.dot(tl.trans(dout), act, input_precision=PREC)  # [out, in]
    slot = (which * tl.num_programs(1) + pid_bh) * tl.num_programs(0) + pid_m
    tl.store(DW2P + slot.to(tl.int64) * (D * D) + e[:, None] * D + e[None, :], part)


@triton.jit
def _compress_dw1(XK, XV, POS, DPRE, DW1P, skb, skt, skh, svb, svt, svh, TC, H, ROWS, CHUNK, STRIDE: tl.constexpr,
                  L: tl.constexpr, D: tl.constexpr, BMC: tl.constexpr, PREC: tl.constexpr):
    """fc1's weight gradient for block position p over rows [split * CHUNK, ...) of the flattened [B, TC, H]:
    sum dpre^T (x[i*d + p] + pos[p]) -> DW1P [2, NSPLIT, L, D, D] (fp32, [out, in])."""
    p, split, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x, sb, st, sh = _inputs(XK, XV, skb, skt, skh, svb, svt, svh, which)
    e = tl.arange(0, D)
    acc = tl.zeros([D, D], tl.float32)
    lo = split * CHUNK
    for r0 in range(lo, tl.minimum(lo + CHUNK, ROWS), BMC):
        r = r0 + tl.arange(0, BMC)
        ok = r < tl.minimum(lo + CHUNK, ROWS)
        b, i, h = (r // (TC * H)).to(tl.int64), (r // H) % TC, r % H
        a = tl.load(x + b[:, None] * sb + h[:, None] * sh + (i * STRIDE + p)[:, None] * st + e[None, :],
                    mask=ok[:, None], other=0.0)
        a = (a + tl.load(POS + which * (L * D) + p * D + e)[None, :]).to(a.dtype)
        dp = tl.load(DPRE + (which * ROWS + r.to(tl.int64))[:, None] * D + e[None, :], mask=ok[:, None], other=0.0)
        acc = tl.dot(tl.trans(dp), a, acc, input_precision=PREC)
    slot = (which * tl.num_programs(1) + split) * L + p
    tl.store(DW1P + slot.to(tl.int64) * (D * D) + e[:, None] * D + e[None, :], acc)


@triton.jit
def _compress_dx(W1, DPRE, DX, T, TC, H, STRIDE: tl.constexpr, L: tl.constexpr, D: tl.constexpr,
                 BMC: tl.constexpr, PREC: tl.constexpr):
    """Raw rows t = j*d + r of phase r = program_id(2) % d: dx[t] = sum_m dpre[j - m] @ fc1-slice[r + m*d] over the
    l / d blocks that hold t -> DX [2, B, T, H, D] (rows no block holds get 0)."""
    pid_j, pid_bh, pid_w = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    which, r = pid_w // STRIDE, pid_w % STRIDE
    b, h = (pid_bh // H).to(tl.int64), pid_bh % H
    nb = tl.num_programs(1) // H
    j = pid_j * BMC + tl.arange(0, BMC)
    e = tl.arange(0, D)
    acc = tl.zeros([BMC, D], tl.float32)
    for m in range(L // STRIDE):
        i = j - m
        ok = (i >= 0) & (i < TC)
        dp = tl.load(DPRE + (((which * nb + b) * TC + i) * H + h)[:, None] * D + e[None, :], mask=ok[:, None],
                     other=0.0)
        w = tl.load(W1 + which * (D * L * D) + e[:, None] * (L * D) + (r + m * STRIDE) * D + e[None, :])  # [out, in]
        acc = tl.dot(dp, w, acc, input_precision=PREC)
    t = j * STRIDE + r
    tl.store(DX + (((which * nb + b) * T + t) * H + h)[:, None] * D + e[None, :], acc.to(DX.dtype.element_ty),
             mask=(t < T)[:, None])


def _geometry(xk: Tensor, block: int, stride: int):
    B, T, H, D = xk.shape
    tc = (T - block) // stride + 1
    prec = "ieee" if xk.dtype == torch.float32 else "tf32"
    return B, T, H, D, tc, dict(STRIDE=stride, L=block, D=D, BMC=BM, PREC=prec)


def _strides(xk: Tensor, xv: Tensor) -> tuple:
    return (*xk.stride()[:3], *xv.stride()[:3])


@custom_op("nsa_titan::compress_fwd", mutates_args=())
def compress_fwd(xk: Tensor, xv: Tensor, pos: Tensor, w1: Tensor, w2: Tensor, block: int, stride: int) -> Tensor:
    """[2, B, Tc, H, D]: phi of the raw keys xk and values xv ([B, T, H, D], last stride 1) with stacked parameters
    pos [2, l, D], w1 [2, D, l * D], w2 [2, D, D] (the two Compressors', in the inputs' dtype)."""
    B, T, H, D, tc, c = _geometry(xk, block, stride)
    out = torch.empty(2, B, tc, H, D, device=xk.device, dtype=xk.dtype)
    grid = (triton.cdiv(tc, BM), B * H, 2)
    _compress_fwd[grid](xk, xv, pos, w1, w2, out, *_strides(xk, xv), tc, H, **c, **LAUNCH)
    return out


@compress_fwd.register_fake
def _(xk, xv, pos, w1, w2, block, stride):
    B, T, H, D = xk.shape
    return xk.new_empty(2, B, (T - block) // stride + 1, H, D)


@custom_op("nsa_titan::compress_bwd", mutates_args=())
def compress_bwd(dout: Tensor, xk: Tensor, xv: Tensor, pos: Tensor, w1: Tensor, w2: Tensor, block: int,
                 stride: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of compress_fwd: (dx [2, B, T, H, D], dpos, dw1, dw2) in the inputs' dtype."""
    B, T, H, D, tc, c = _geometry(xk, block, stride)
    dout = dout.contiguous()
    dpre = torch.empty_like(dout)
    mprog = triton.cdiv(tc, BM)
    dw2p = torch.empty(2, B * H * mprog, D, D, device=xk.device, dtype=torch.float32)
    grid = (mprog, B * H, 2)
    _compress_rows[grid](xk, xv, pos, w1, w2, dout, dpre, dw2p, *_strides(xk, xv), tc, H, **c, **LAUNCH)
    rows = B * tc * H
    nsplit = max(1, min(8, triton.cdiv(rows, 4 * BM)))
    chunk = triton.cdiv(triton.cdiv(rows, nsplit), BM) * BM
    dw1p = torch.empty(2, nsplit, block, D, D, device=xk.device, dtype=torch.float32)
    grid = (block, nsplit, 2)
    _compress_dw1[grid](xk, xv, pos, dpre, dw1p, *_strides(xk, xv), tc, H, rows, chunk, **c, **LAUNCH)
    dx = torch.empty(2, B, T, H, D, device=xk.device, dtype=xk.dtype)
    grid = (triton.cdiv(triton.cdiv(T, stride), BM), B * H, 2 * stride)
    _compress_dx[grid](w1, dpre, dx, T, tc, H, **c, **LAUNCH)
    # Fixed-order sums of the fp32 partials (deterministic), one rounding to the parameters' dtype each.
    dw1 = dw1p.sum(1).permute(0, 2, 1, 3).reshape(2, D, block * D)  # [2, L, out, in] -> fc1's [out, L * in]
    dw2 = dw2p.sum(1)
    # pos[p] enters every block's row p: its gradient is (sum_i dpre[i]) @ the fc1 slice of p.
    dpos = torch.einsum("wo,wopi->wpi", dpre.float().sum((1, 2, 3)), w1.float().view(2, D, block, D))
    return dx, dpos.to(pos.dtype), dw1.to(w1.dtype), dw2.to(w2.dtype)


@compress_bwd.register_fake
def _(dout, xk, xv, pos, w1, w2, block, stride):
    B, T, H, D = xk.shape
    return xk.new_empty(2, B, T, H, D), pos.new_empty(pos.shape), w1.new_empty(w1.shape), w2.new_empty(w2.shape)


def _setup(ctx, inputs, output):
    xk, xv, pos, w1, w2, block, stride = inputs
    ctx.save_for_backward(xk, xv, pos, w1, w2)
    ctx.geo = (block, stride)


def _backward(ctx, dout):
    xk, xv, pos, w1, w2 = ctx.saved_tensors
    dx, dpos, dw1, dw2 = compress_bwd(dout, xk, xv, pos, w1, w2, *ctx.geo)
    return dx[0], dx[1], dpos, dw1, dw2, None, None


compress_fwd.register_autograd(_backward, setup_context=_setup)


def supported(xk: Tensor, xv: Tensor, block: int, stride: int) -> bool:
    """Whether compress_mlp_pair takes these shapes: equal key and value widths (a power of two >= 16, the MMA's
    minimum), d | l, and at least one block."""
    D = xk.shape[-1]
    return (xv.shape == xk.shape and D >= 16 and D & (D - 1) == 0 and block % stride == 0
            and xk.shape[1] >= block)


def compress_mlp_pair(xk: Tensor, xv: Tensor, pos_k: Tensor, pos_v: Tensor, w1_k: Tensor, w1_v: Tensor,
                      w2_k: Tensor, w2_v: Tensor, block: int, stride: int) -> tuple[Tensor, Tensor]:
    """(phi_k(xk), phi_v(xv)), each [B, Tc, H, D], as attention.compress_pair computes them (its spec) with the two
    Compressors' parameters (pos_emb [l, D], fc1.weight [D, l * D], fc2.weight [D, D]) cast to the inputs' dtype,
    as autocast casts them for the torch path's matmuls. ``supported`` must hold."""
    dt = xk.dtype
    c = lambda x: x if x.stride(-1) == 1 else x.contiguous()  # noqa: E731 - rows must be contiguous
    pos, w1, w2 = (torch.stack((a, b)).to(dt) for a, b in ((pos_k, pos_v), (w1_k, w1_v), (w2_k, w2_v)))
    out = compress_fwd(c(xk), c(xv), pos, w1, w2, block, stride)
    return out[0], out[1]
