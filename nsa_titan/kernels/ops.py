"""Torch operators around the Triton kernels (custom ops: opaque to torch.compile, with fake shapes and
autograd), and ``nsa_attention`` composed from them.

The gate combination is its own operator (one fused pass forward, one backward that also yields the gate
gradients): eager torch spent ~9 elementwise passes on it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from nsa_titan.kernels import band, combine, select, selected


def _c(x: Tensor) -> Tensor:
    """Kernels index the last dimension with stride 1; every other stride is passed explicitly."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _like(x: Tensor, shape=None, dtype=None) -> Tensor:
    return torch.empty(x.shape if shape is None else shape, dtype=dtype or x.dtype, device=x.device)


# --- band attention: compressed (kstride=d, koff=l-1, window=0) and sliding window (1, 0, w) ---
@custom_op("nsa_titan::band_attn", mutates_args=())
def band_attn(q: Tensor, k: Tensor, v: Tensor, kstride: int, koff: int, window: int) -> tuple[Tensor, Tensor]:
    return band.band_fwd(_c(q), _c(k), _c(v), kstride, koff, window)


@band_attn.register_fake
def _(q, k, v, kstride, koff, window):
    b, t, hq, _ = q.shape
    return _like(q, (b, t, hq, v.shape[-1])), _like(q, (b, t, hq), torch.float32)


@custom_op("nsa_titan::band_attn_bwd", mutates_args=())
def band_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, kstride: int,
                  koff: int, window: int) -> tuple[Tensor, Tensor, Tensor]:
    return band.band_bwd(do, _c(q), _c(k), _c(v), o, lse, kstride, koff, window)


@band_attn_bwd.register_fake
def _(do, q, k, v, o, lse, kstride, koff, window):
    return _like(q), _like(k), _like(v)


def _band_setup(ctx, inputs, output):
    q, k, v, kstride, koff, window = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.args = (kstride, koff, window)
    ctx.mark_non_differentiable(lse)


def _band_backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = band_attn_bwd(do, q, k, v, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None


band_attn.register_autograd(_band_backward, setup_context=_band_setup)


# --- block selection (no gradient: the choice is discrete) ---
@custom_op("nsa_titan::select_blocks", mutates_args=())
def select_blocks(q: Tensor, k_cmp: Tensor, lse: Tensor, cmp_block: int, cmp_stride: int, slc_block: int,
                  top_n: int) -> Tensor:
    return select.select_blocks(_c(q), _c(k_cmp), lse, cmp_block, cmp_stride, slc_block, top_n)


@select_blocks.register_fake
def _(q, k_cmp, lse, cmp_block, cmp_stride, slc_block, top_n):
    b, t = q.shape[:2]
    return _like(q, (b, k_cmp.shape[2], t, top_n), torch.int64)


# --- selected-block attention ---
@custom_op("nsa_titan::sel_attn", mutates_args=())
def sel_attn(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, slc_block: int) -> tuple[Tensor, Tensor]:
    return selected.sel_fwd(_c(q), _c(k), _c(v), block_idx.contiguous(), slc_block)


@sel_attn.register_fake
def _(q, k, v, block_idx, slc_block):
    b, t, hq, _ = q.shape
    return _like(q, (b, t, hq, v.shape[-1])), _like(q, (b, t, hq), torch.float32)


@custom_op("nsa_titan::sel_attn_bwd", mutates_args=())
def sel_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, block_idx: Tensor,
                 slc_block: int) -> tuple[Tensor, Tensor, Tensor]:
    return selected.sel_bwd(do, _c(q), _c(k), _c(v), o, lse, block_idx.contiguous(), slc_block)


@sel_attn_bwd.register_fake
def _(do, q, k, v, o, lse, block_idx, slc_block):
    return _like(q), _like(k), _like(v)


def _sel_setup(ctx, inputs, output):
    q, k, v, block_idx, slc_block = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, block_idx)
    ctx.slc_block = slc_block
    ctx.mark_non_differentiable(lse)


def _sel_backward(ctx, do, _dlse):
    q, k, v, o, lse, block_idx = ctx.saved_tensors
    dq, dk, dv = sel_attn_bwd(do, q, k, v, o, lse, block_idx, ctx.slc_block)
    return dq, dk, dv, None, None


sel_attn.register_autograd(_sel_backward, setup_context=_sel_setup)

# --- gated combination of the three branches ---
@custom_op("nsa_titan::gate_combine", mutates_args=())
def gate_combine(o_cmp: Tensor, o_slc: Tensor, o_win: Tensor, gates: Tensor) -> Tensor:
    return combine.combine_fwd(o_cmp, o_slc, o_win, gates)


@gate_combine.register_fake
def _(o_cmp, o_slc, o_win, gates):
    return _like(o_cmp)


@custom_op("nsa_titan::gate_combine_bwd", mutates_args=())
def gate_combine_bwd(dout: Tensor, o_cmp: Tensor, o_slc: Tensor, o_win: Tensor,
                     gates: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return combine.combine_bwd(dout, o_cmp, o_slc, o_win, gates)


@gate_combine_bwd.register_fake
def _(dout, o_cmp, o_slc, o_win, gates):
    return _like(o_cmp), _like(o_slc), _like(o_win), _like(gates)


def _combine_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _combine_backward(ctx, dout):
    return gate_combine_bwd(dout, *ctx.saved_tensors)


gate_combine.register_autograd(_combine_backward, setup_context=_combine_setup)

OPS = {"band_attn": band_attn, "band_attn_bwd": band_attn_bwd, "select_blocks": select_blocks,
       "sel_attn": sel_attn, "sel_attn_bwd": sel_attn_bwd, "gate_combine": gate_combine,
       "gate_combine_bwd": gate_combine_bwd}


def nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, p):
    """Same contract as torch_impl.nsa_attention: (o [B,T,HQ,Dv], block_idx [B,HKV,T,n] int64, -1 unused).

    ``p`` is duck-typed: cmp_block (l), cmp_stride (d), slc_block (l'), slc_top_n (n), window (w).
    """
    b, t, hq, _ = q.shape
    if k_cmp.shape[1] == 0:  # static shape: shorter than one compression block, nothing is visible
        o_cmp = q.new_zeros(b, t, hq, v_cmp.shape[-1])
        lse = torch.full((b, t, hq), float("inf"), device=q.device, dtype=torch.float32)
    else:
        o_cmp, lse = band_attn(q, k_cmp, v_cmp, p.cmp_stride, p.cmp_block - 1, 0)
    block_idx = select_blocks(q.detach(), k_cmp.detach(), lse, p.cmp_block, p.cmp_stride, p.slc_block,
                              p.slc_top_n)
    o_slc, _ = sel_attn(q, k_slc, v_slc, block_idx, p.slc_block)
    o_win, _ = band_attn(q, k_win, v_win, 1, 0, p.window)
    return gate_combine(o_cmp, o_slc, o_win, gates), block_idx
