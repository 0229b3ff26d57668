"""The band dK/dV kernel (band.py's ``_band_bwd_dkdv``) written in Gluon for Hopper: asynchronous wgmma.

Why a second version of one kernel: Triton 3.6 waits for every ``tl.dot`` as soon as it is issued, so the four
matmuls of a dK/dV step (S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q) and the softmax arithmetic between
them run one after the other, and the tensor cores idle during the exponentials (ncu: tensor pipe 20-38 %, "wait"
the top stall). Here S^T and dP^T are issued together, the exponentials run while dP^T is still in the tensor
cores, the dS arithmetic while dV accumulates, and the next query tile's Q and dO rows are copied into shared
memory (cp.async, double-buffered) while the current tile computes.

Same contract as ``_band_bwd_dkdv``: one program per (key tile, batch x KV head, query split), packed (token, head)
rows, fp32 partials [NSPLIT, B, S, HKV, D], the same geometry (KSTRIDE, KOFF, WIN). Supported: one warpgroup
(4 warps), BK = 64 keys, head dim 64 or 128 with DK == DV, no document masking; ``band.band_bwd`` keeps the
Triton kernel for everything else and on machines without Hopper Gluon (the CPU interpreter included).
"""

from __future__ import annotations

import triton

try:  # Gluon ships with Triton >= 3.5; its Hopper ops are what this file needs
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - older Triton
    HAVE_GLUON = False


if HAVE_GLUON:

    @gluon.jit
    def _band_dkdv_wg(Q, K, V, DO, LSE, DELTA, DKP_, DVP_, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh,
                      T, TQ, S, HKV, B, qk_scale, sm_scale, NSPLIT, G: gl.constexpr, KSTRIDE: gl.constexpr,
                      KOFF: gl.constexpr, WIN: gl.constexpr, ROWS: gl.constexpr, BK: gl.constexpr,
                      D: gl.constexpr, TPR: gl.constexpr):
        # Layouts: ld for global loads (8 bf16 = 16 bytes per thread, TPR threads per row); s_l the wgmma
        # accumulator of S^T / dP^T [BK, ROWS]; a_l that of dK / dV [BK, D]; op_l P^T / dS^T as wgmma A operand.
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPR, TPR], [4, 1], [1, 0])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
        a_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_l, k_width=2)
        sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        pid_n, pid_bh, pid_s = gl.program_id(0), gl.program_id(1), gl.program_id(2)
        b = (pid_bh // HKV).to(gl.int64)
        kv = pid_bh % HKV

        # The program's key tile, resident in shared memory for the whole walk.
        ki = pid_n * BK + gl.arange(0, BK, layout=gl.SliceLayout(1, ld))
        dd = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        kmask = gl.expand_dims(ki < S, 1)
        k = gl.load(K + b * skb + gl.expand_dims(ki, 1) * sks + kv * skh + gl.expand_dims(dd, 0), mask=kmask, other=0.0)
        v = gl.load(V + b * svb + gl.expand_dims(ki, 1) * svs + kv * svh + gl.expand_dims(dd, 0), mask=kmask, other=0.0)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [BK, D], sh, k)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [BK, D], sh, v)
        q_buf = gl.allocate_shared_memory(gl.bfloat16, [2, ROWS, D], sh)
        do_buf = gl.allocate_shared_memory(gl.bfloat16, [2, ROWS, D], sh)

        # Packed rows [lo, hi) of this split (band._band_bwd_dkdv's arithmetic).
        q_lo = pid_n * BK * KSTRIDE + KOFF
        q_hi = TQ
        if WIN > 0:
            q_hi = gl.minimum(TQ, (gl.minimum(pid_n * BK + BK, S) - 1) * KSTRIDE + KOFF + WIN)
        q_lo = q_lo * G
        q_hi = q_hi * G
        chunk = gl.cdiv(gl.cdiv(gl.maximum(q_hi - q_lo, 0), NSPLIT), ROWS) * ROWS
        lo = q_lo + pid_s * chunk
        hi = gl.minimum(lo + chunk, q_hi)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), ROWS)

        # Key positions and masks in the S^T layout (keys are its rows, packed query rows its columns).
        ks = pid_n * BK + gl.arange(0, BK, layout=gl.SliceLayout(1, s_l))
        pos = gl.expand_dims(ks * KSTRIDE + KOFF, 1)
        k_ok = gl.expand_dims(ks < S, 1)
        zero_s = gl.zeros([BK, ROWS], gl.float32, s_l)
        dk = gl.zeros([BK, D], gl.float32, a_l)
        dv = gl.zeros([BK, D], gl.float32, a_l)

        # Prologue: the first tile's Q and dO rows in flight.
        rl = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
        r = lo + rl
        t = r // G
        h = kv * G + r % G
        ok = gl.expand_dims(r < hi, 1)
        async_copy.async_copy_global_to_shared(
            q_buf.index(0), Q + b * sqb + gl.expand_dims(t * sqt + h * sqh, 1) + gl.expand_dims(dd, 0), mask=ok)
        async_copy.async_copy_global_to_shared(
            do_buf.index(0), DO + gl.expand_dims(((b * T + t) * (HKV * G) + h) * D, 1) + gl.expand_dims(dd, 0),
            mask=ok)
        async_copy.commit_group()

        rs_l = gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_l))
        for j in range(0, n_tiles):
            r0 = lo + j * ROWS
            slot = j % 2
            # The next tile's rows (all masked past the last tile: an empty copy keeps one group per step).
            r = r0 + ROWS + rl
            t = r // G
            h = kv * G + r % G
            ok = gl.expand_dims(r < hi, 1)
            async_copy.async_copy_global_to_shared(
                q_buf.index(1 - slot), Q + b * sqb + gl.expand_dims(t * sqt + h * sqh, 1) + gl.expand_dims(dd, 0),
                mask=ok)
            async_copy.async_copy_global_to_shared(
                do_buf.index(1 - slot),
                DO + gl.expand_dims(((b * T + t) * (HKV * G) + h) * D, 1) + gl.expand_dims(dd, 0), mask=ok)
            async_copy.commit_group()

            rs = r0 + rs_l
            ts = rs // G
            hs = kv * G + rs % G
            rows_ok = rs < hi
            lse = gl.load(LSE + (b * T + ts) * (HKV * G) + hs, mask=rows_ok, other=float("inf"))
            delta = gl.load(DELTA + (b * T + ts) * (HKV * G) + hs, mask=rows_ok, other=0.0)

            async_copy.wait_group(1)  # this tile's copies (the next tile's may still run)
            fence_async_shared()
            gl.thread_barrier()
            qb = q_buf.index(slot)
            dob = do_buf.index(slot)
            s_t = warpgroup_mma(k_smem, qb.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_smem, dob.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))

            t2 = gl.expand_dims(ts, 0)
            vis = (pos <= t2) & k_ok & gl.expand_dims(rows_ok, 0)
            if WIN > 0:
                vis = vis & (pos > t2 - WIN)
            p_t = gl.exp2(gl.where(vis, s_t * qk_scale - gl.expand_dims(lse, 0), float("-inf")))
            p_op = gl.convert_layout(p_t.to(gl.bfloat16), op_l)
            dv = warpgroup_mma(p_op, dob, dv, is_async=True)
            dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))
            ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
            ds_op = gl.convert_layout(ds_t.to(gl.bfloat16), op_l)
            dk = warpgroup_mma(ds_op, qb, dk, is_async=True)
            # Both accumulators, and the register operands they read, are settled before the buffers turn over.
            dk, dv, p_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, p_op, ds_op))
            gl.thread_barrier()  # every warp is done with this slot before the next step's copy overwrites it
        async_copy.wait_group(0)

        ai = pid_n * BK + gl.arange(0, BK, layout=gl.SliceLayout(1, a_l))
        ad = gl.arange(0, D, layout=gl.SliceLayout(0, a_l))
        out = gl.expand_dims(((pid_s * B + b) * S + ai) * HKV + kv, 1) * D + gl.expand_dims(ad, 0)
        amask = gl.expand_dims(ai < S, 1)
        gl.store(DKP_ + out, dk * sm_scale, mask=amask)
        gl.store(DVP_ + out, dv, mask=amask)


def supported(q, k, v, doc_start, rows: int, bk: int, num_warps: int) -> bool:
    """Whether ``_band_dkdv_wg`` serves this call (see the module doc)."""
    if not (HAVE_GLUON and q.is_cuda and doc_start is None):
        return False
    import torch  # noqa: PLC0415

    d = q.shape[-1]
    # cp.async moves 16 bytes per thread: every Q row must start 16-byte aligned, and the JIT must see the strides
    # as multiples of 16 elements to emit 16-byte copies (it specializes integer arguments divisible by 16).
    aligned = all(s % 16 == 0 for s in q.stride()[:3]) and q.data_ptr() % 16 == 0
    return (aligned and torch.cuda.get_device_capability(q.device)[0] == 9 and q.dtype == torch.bfloat16
            and d in (64, 128) and k.shape[-1] == d and v.shape[-1] == d and rows in (64, 128) and bk == 64
            and num_warps == 4)


def launch(q, k, v, do, lse, delta, dkp, dvp, T, tq, S, HKV, B, qk_scale, sm_scale, nsplit, G, kstride, koff,
           window, rows, bk):
    d = q.shape[-1]
    _band_dkdv_wg[(triton.cdiv(S, bk), B * HKV, nsplit)](
        q, k, v, do, lse, delta, dkp, dvp, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], T, tq, S, HKV, B,
        qk_scale, sm_scale, nsplit, G=G, KSTRIDE=kstride, KOFF=koff, WIN=window, ROWS=rows, BK=bk, D=d,
        TPR=min(32, d // 8), num_warps=4)
