"""The band forward (band.py's ``_band_fwd``) in Gluon for Hopper, with the tensor cores and the softmax overlapped.

Why a second version of one kernel: Triton 3.6 waits for every ``tl.dot`` as soon as it issues it, so a forward
step runs S = Q K^T, then the softmax (exp2 and row sums on the ALUs), then O += P V, one after the other, and the
tensor cores idle while the exponentials run (about as long as the two matmuls at head dim 128). Here each step
issues the next tile's S = Q K_j^T and the previous tile's O += P_{j-1} V_{j-1} together as asynchronous wgmma,
waits for S only, and runs the softmax of tile j while O's matmul is still in the tensor cores: FA3's intra-
warpgroup pipelining. Key and value tiles arrive by TMA into a ring of NBUF stages (mbarriers), issued NBUF - 2
steps ahead.

Same contract and arithmetic as ``_band_fwd`` (band.py's module doc: packed (token, head) rows, KSTRIDE / KOFF /
WIN, base-2 LSE, +inf and zeros for rows that see no key, the mask-free interior tiles): the same tiles in the same
order, the same scale, mask and online-softmax updates, so the outputs agree with it up to the matmuls' rounding.
Supported: head dim 64 or 128 with DK == DV, bf16 / fp16, 16 rows per warp (64 rows on 4 warps, 128 on 8), no
document masking; ``band.band_fwd`` keeps the Triton kernel for everything else and wherever Gluon for Hopper is
missing (the CPU interpreter included: Gluon has no interpreter).
"""

from __future__ import annotations

import torch
import triton

try:  # Gluon ships with Triton >= 3.5; its Hopper ops are what this file needs (written against Triton 3.6)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - older Triton
    HAVE_GLUON = False


if HAVE_GLUON:

    @gluon.jit
    def _issue_tile(k_desc, v_desc, k_bufs, v_bufs, ready, j, n, i_start, b, kv, NBUF: gl.constexpr,
                    BK: gl.constexpr):
        """Key / value tile j of the walk into ring stage j % NBUF (nothing past the last tile)."""
        s = j % NBUF
        go = j < n
        bar = ready.index(s)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=go)
        tma.async_copy_global_to_shared(k_desc, [b, i_start + j * BK, kv, 0], bar, k_bufs.index(s), pred=go)
        tma.async_copy_global_to_shared(v_desc, [b, i_start + j * BK, kv, 0], bar, v_bufs.index(s), pred=go)

    @gluon.jit
    def _softmax_step(s, m_i, l_i, i0, t_s, kk, i_end, masked, qk_scale, KSTRIDE: gl.constexpr,
                      KOFF: gl.constexpr, WIN: gl.constexpr):
        """band.py's _scores mask and online_softmax update on one tile's raw scores -> (m, l, p, alpha)."""
        s = s * qk_scale
        if masked:
            i = i0 + kk
            pos = gl.expand_dims(i * KSTRIDE + KOFF, 0)
            t2 = gl.expand_dims(t_s, 1)
            vis = (pos <= t2) & gl.expand_dims(i < i_end, 0)
            if WIN > 0:
                vis = vis & (pos > t2 - WIN)
            s = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        return m_new, l_i, p, alpha

    @gluon.jit
    def _band_fwd_wg(Q, k_desc, v_desc, O, LSE, sqb, sqt, sqh, sob, sot, soh, T, TQ, S, HKV, qk_scale,
                     G: gl.constexpr, KSTRIDE: gl.constexpr, KOFF: gl.constexpr, WIN: gl.constexpr,
                     ROWS: gl.constexpr, BK: gl.constexpr, D: gl.constexpr, NBUF: gl.constexpr,
                     SPLIT: gl.constexpr, num_warps: gl.constexpr):
        # Layouts: ld for Q's load and O's store (8 elements = 16 bytes per thread); s_l the wgmma accumulator of
        # S [ROWS, BK], o_l that of O [ROWS, D] (16 rows per warp, a warpgroup per 64); p_l P as wgmma A operand.
        TPR: gl.constexpr = 16 if D >= 128 else D // 8
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPR, TPR], [num_warps, 1], [1, 0])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BK, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, D, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        q_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_l)

        pid_m, pid_bh = gl.program_id(0), gl.program_id(1)
        b = pid_bh // HKV
        kv = pid_bh % HKV

        # The query tile, resident in shared memory for the whole walk.
        r_ld = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
        d_ld = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        t_ld = r_ld // G
        h_ld = kv * G + r_ld % G
        ok_ld = gl.expand_dims(r_ld < TQ * G, 1)
        q = gl.load(Q + b.to(gl.int64) * sqb + gl.expand_dims(t_ld * sqt + h_ld * sqh, 1) + gl.expand_dims(d_ld, 0),
                    mask=ok_ld, other=0.0)
        q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [ROWS, D], q_sl, q)

        # The keys the tile walks, [i_start, i_end), and its whole tiles [m1, m2) that every row sees (band.py's
        # _key_range / _unmasked_keys, written with max() where those use where(): the same integers).
        t_lo = (pid_m * ROWS) // G
        t_hi = gl.minimum((pid_m * ROWS + ROWS - 1) // G, TQ - 1)
        i_end = gl.minimum(gl.maximum(t_hi - KOFF + KSTRIDE, 0) // KSTRIDE, S)
        i_start = 0
        if WIN > 0:
            i_start = (gl.maximum(t_lo - WIN + 1 - KOFF, 0) + KSTRIDE - 1) // KSTRIDE
        m1 = i_end
        m2 = i_end
        if SPLIT:
            c1 = gl.minimum(gl.maximum(t_lo - KOFF + KSTRIDE, 0) // KSTRIDE, i_end)
            a = i_start
            if WIN > 0:
                a = (gl.maximum(t_hi - WIN + 1 - KOFF, 0) + KSTRIDE - 1) // KSTRIDE
            m1 = gl.minimum(i_start + gl.cdiv(gl.maximum(a - i_start, 0), BK) * BK, i_end)
            m2 = m1 + (gl.maximum(c1 - m1, 0) // BK) * BK
        # At least one tile: a tile with no visible key (all masked) leaves l = 0, so O = 0 and LSE = +inf.
        n = gl.maximum(gl.cdiv(gl.maximum(i_end - i_start, 0), BK), 1)

        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NBUF] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NBUF] + v_desc.block_type.shape, v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NBUF):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()  # Q's tile and the barriers' init, before the async proxy (TMA, wgmma) reads them
        for i in gl.static_range(NBUF - 1):
            _issue_tile(k_desc, v_desc, k_bufs, v_bufs, ready, i, n, i_start, b, kv, NBUF, BK)

        r_s = pid_m * ROWS + gl.arange(0, ROWS, layout=row_s)
        t_s = r_s // G
        kk = gl.arange(0, BK, layout=gl.SliceLayout(0, s_l))
        zero_s = gl.zeros([ROWS, BK], gl.float32, s_l)
        acc = gl.zeros([ROWS, D], gl.float32, o_l)
        m_i = gl.full([ROWS], -1e30, gl.float32, row_s)  # finite start: no inf - inf on fully masked tiles
        l_i = gl.zeros([ROWS], gl.float32, row_s)

        # Tile 0: its scores, then its softmax (O is still zero: nothing to rescale).
        mbarrier.wait(ready.index(0), 0)
        s0 = warpgroup_mma(q_smem, k_bufs.index(0).reshape([BK, D]).permute((1, 0)), zero_s, use_acc=False)
        m_i, l_i, p, alpha = _softmax_step(s0, m_i, l_i, i_start, t_s, kk, i_end, (i_start < m1) | (i_start >= m2),
                                           qk_scale, KSTRIDE, KOFF, WIN)
        p_op = gl.convert_layout(p.to(Q.dtype.element_ty), p_l)
        for j in range(1, n):
            # Tile j - 2's stage is free once every warp has waited for its O matmul (the step before): refill it
            # with tile j + NBUF - 2.
            gl.thread_barrier()
            _issue_tile(k_desc, v_desc, k_bufs, v_bufs, ready, j + NBUF - 2, n, i_start, b, kv, NBUF, BK)
            cur = j % NBUF
            mbarrier.wait(ready.index(cur), (j // NBUF) & 1)
            prev = (j - 1) % NBUF
            s_tok = warpgroup_mma(q_smem, k_bufs.index(cur).reshape([BK, D]).permute((1, 0)), zero_s, use_acc=False,
                                  is_async=True)
            o_tok = warpgroup_mma(p_op, v_bufs.index(prev).reshape([BK, D]), acc, is_async=True)
            s_j = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            i0 = i_start + j * BK
            m_i, l_i, p, alpha = _softmax_step(s_j, m_i, l_i, i0, t_s, kk, i_end, (i0 < m1) | (i0 >= m2), qk_scale,
                                               KSTRIDE, KOFF, WIN)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_l)), 1)
            p_op = gl.convert_layout(p.to(Q.dtype.element_ty), p_l)
        acc = warpgroup_mma(p_op, v_bufs.index((n - 1) % NBUF).reshape([BK, D]), acc)
        for i in gl.static_range(NBUF):
            mbarrier.invalidate(ready.index(i))

        # band.py's finish_softmax: O = acc / l (0 where a row saw no key), LSE = m + log2(l) (+inf there).
        ok = l_i > 0
        lse = gl.where(ok, m_i + gl.log2(gl.where(ok, l_i, 1.0)), float("inf"))
        h_s = kv * G + r_s % G
        gl.store(LSE + (b.to(gl.int64) * T + t_s) * (HKV * G) + h_s, lse, mask=r_s < TQ * G)
        l_o = gl.convert_layout(gl.where(ok, l_i, 1.0), gl.SliceLayout(1, o_l))
        ok_o = gl.convert_layout(ok, gl.SliceLayout(1, o_l))
        o = gl.where(gl.expand_dims(ok_o, 1), acc / gl.expand_dims(l_o, 1), 0.0)
        o = gl.convert_layout(o.to(O.dtype.element_ty), ld)
        gl.store(O + b.to(gl.int64) * sob + gl.expand_dims(t_ld * sot + h_ld * soh, 1) + gl.expand_dims(d_ld, 0), o,
                 mask=ok_ld)


def supported(q, k, v, doc_start, rows: int, bk: int) -> bool:
    """Whether ``_band_fwd_wg`` serves this call (see the module doc)."""
    if not (HAVE_GLUON and q.is_cuda and doc_start is None):
        return False
    d = q.shape[-1]
    if not (torch.cuda.get_device_capability(q.device)[0] == 9 and q.dtype in (torch.bfloat16, torch.float16)
            and k.dtype == q.dtype and v.dtype == q.dtype and d in (64, 128) and k.shape[-1] == d
            and v.shape[-1] == d and rows in (64, 128) and bk in (64, 128) and k.shape[1] > 0):
        return False
    # Descriptors: 16-byte aligned bases and strides, a contiguous head dim.
    return all(x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0
                                                                      for s in x.stride()[:-1]) for x in (k, v))


def _descriptor(x, bk: int):
    """x [B, S, HKV, D] as a descriptor of [1, bk, 1, D] boxes: one tile of bk keys of one (batch, KV head)."""
    box = [1, bk, 1, x.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16)
    return GluonDescriptor(x, list(x.shape), list(x.stride()), box, layout)


def launch(q, k, v, o, lse, kstride: int, koff: int, window: int, tq: int, rows: int, bk: int, nbuf: int,
           split: bool, qk_scale: float):
    """One ``_band_fwd_wg`` launch writing o and lse (band.band_fwd's arguments, already checked by supported)."""
    B, T, HQ, D = q.shape
    S, HKV = k.shape[1], k.shape[2]
    G = HQ // HKV
    _band_fwd_wg[(triton.cdiv(tq * G, rows), B * HKV)](
        q, _descriptor(k, bk), _descriptor(v, bk), o, lse, *q.stride()[:3], *o.stride()[:3], T, tq, S, HKV,
        qk_scale, G=G, KSTRIDE=kstride, KOFF=koff, WIN=window, ROWS=rows, BK=bk, D=D, NBUF=nbuf, SPLIT=split,
        num_warps=rows // 16)
