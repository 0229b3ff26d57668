"""The selected branch's dK/dV walk (selected_bwd.py's ``_sel_bwd_dkdv`` with dQ partials) in Gluon for Hopper.

Why: each step of the walk gathers the Q and dO rows of BT (token, slot) pairs whose tokens come from the pair
keys, so its loads form a chain (keys -> token -> rows). Triton 3.6 turns that chain into cp.async copies that it
waits for at once (``async_wait num = 0``) and waits for every wgmma as soon as it is issued: every step pays the
L2 latency of the keys and of the rows, then five matmuls one after the other. m7c at 8k batch 2: ~2.8 us per
64-row step for ~0.35 us of tensor-core work. Here the next step's rows are copied into a second shared-memory
buffer while the current step computes, S^T and dP^T are issued together, the exponentials overlap dP^T and the
dS arithmetic overlaps dV.

Same contract as ``_sel_bwd_dkdv`` with STORE_DQ (``selected_bwd.sel_bwd``'s "partials" dQ): the chunk tables of
``selected_blocks.block_pairs``, dK/dV rows or fp32 chunk partials, unscaled bf16 dQ partials per (token, slot).
Keys are the MMA rows here (S^T = K Q^T), so dK and dV accumulate without transposes; dQ = dS K reads dS^T back
from shared memory through a transposed view. Supported: 4 warps, l' = 64, head dim 64 (DK = DV), groups packed
exactly (GS = G), no document masking, bf16; everything else keeps the Triton kernel.
"""

from __future__ import annotations

try:
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
    def _pair_keys(key_base, e0, hi, BT: gl.constexpr, G: gl.constexpr, r):
        """Pair key of every row of the step whose first pair is e0 (row r: pair e0 + r // G), -1 on rows past the
        chunk or past BT pairs."""
        e = e0 + r // G
        ok = (e < hi) & (r < BT * G)
        return gl.where(ok, gl.load(key_base + e, mask=ok, other=0), -1)

    @gluon.jit
    def _copy_rows(Q, DO, q_dst, do_dst, key, r, dd, b, kv, blk, T, HKV, sqb, sqt, sqh, NSEL: gl.constexpr,
                   G: gl.constexpr, D: gl.constexpr):
        """cp.async of the rows' Q and dO into shared memory (zeros on rows without a pair), one commit group."""
        ok = key >= 0
        t = gl.where(ok, (key // NSEL - blk * T).to(gl.int32), 0)
        h = kv * G + r % G
        ok2 = gl.expand_dims(ok, 1)
        async_copy.async_copy_global_to_shared(
            q_dst, Q + b * sqb + gl.expand_dims(t * sqt + h * sqh, 1) + gl.expand_dims(dd, 0), mask=ok2)
        async_copy.async_copy_global_to_shared(
            do_dst, DO + gl.expand_dims(((b * T + t) * (HKV * G) + h) * D, 1) + gl.expand_dims(dd, 0), mask=ok2)
        async_copy.commit_group()

    @gluon.jit
    def _row_terms(LSE, DELTA, key, r, b, kv, blk, T, HKV, NSEL: gl.constexpr, G: gl.constexpr):
        """LSE and delta of the rows (+inf and 0 on rows without a pair: their probabilities are 0)."""
        ok = key >= 0
        t = gl.where(ok, (key // NSEL - blk * T).to(gl.int32), 0)
        row = (b * T + t) * (HKV * G) + kv * G + r % G
        return (gl.load(LSE + row, mask=ok, other=float("inf")), gl.load(DELTA + row, mask=ok, other=0.0))

    @gluon.jit
    def _sel_dkdv_wg(Q, K, V, DO, LSE, DELTA, KEYS, OFF, COFF, PROG, POFF, DK_, DV_, PK, PV, DQP,
                     sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, T, NB, HKV, NCH, NPS, CH, qk_scale, sm_scale,
                     G: gl.constexpr, LP: gl.constexpr, NSEL: gl.constexpr, BT: gl.constexpr, ROWS: gl.constexpr,
                     D: gl.constexpr, TPR: gl.constexpr, NW: gl.constexpr):
        # NW // 4 warpgroups split every matmul's N (query rows of S^T, head dim of dK / dV / dQ): fewer registers per
        # thread. P^T and dS^T go through shared memory, where every warpgroup reads the whole K dimension.
        WN: gl.constexpr = NW // 4
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPR, TPR], [NW, 1], [1, 0])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN],
                                                      instr_shape=[16, ROWS // WN, 16])
        a_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN],
                                                      instr_shape=[16, D // WN, 16])
        sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        row_ld: gl.constexpr = gl.SliceLayout(1, ld)
        col_s: gl.constexpr = gl.SliceLayout(0, s_l)
        row_a: gl.constexpr = gl.SliceLayout(1, a_l)

        pid, pid_bh = gl.program_id(0), gl.program_id(1)
        b = (pid_bh // HKV).to(gl.int64)
        kv = pid_bh % HKV
        blk = gl.load(PROG + pid_bh.to(gl.int64) * NCH + pid)
        live = (blk < NB).to(gl.int32)  # spare programs (past the last chunk): no pairs, no stores
        blk = gl.minimum(blk, NB - 1)
        tab = pid_bh.to(gl.int64) * (NB + 1) + blk
        c0 = gl.load(COFF + tab)
        nch = gl.load(COFF + tab + 1) - c0
        lo = gl.load(OFF + tab) + (pid - c0) * CH
        hi = gl.minimum(lo + CH, gl.load(OFF + tab + 1))
        hi = lo + (hi - lo) * live

        dd = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        sj = gl.arange(0, LP, layout=row_ld)
        s_pos = blk * LP + sj
        kmask = gl.expand_dims(s_pos < T, 1)
        k = gl.load(K + b * skb + gl.expand_dims(s_pos, 1) * sks + kv * skh + gl.expand_dims(dd, 0), mask=kmask,
                    other=0.0)
        v = gl.load(V + b * svb + gl.expand_dims(s_pos, 1) * svs + kv * svh + gl.expand_dims(dd, 0), mask=kmask,
                    other=0.0)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [LP, D], sh, k)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [LP, D], sh, v)
        q_buf = gl.allocate_shared_memory(gl.bfloat16, [2, ROWS, D], sh)
        do_buf = gl.allocate_shared_memory(gl.bfloat16, [2, ROWS, D], sh)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [LP, ROWS], sh)
        ds_smem = gl.allocate_shared_memory(gl.bfloat16, [LP, ROWS], sh)
        key_base = KEYS + pid_bh.to(gl.int64) * (T * NSEL)

        dk = gl.zeros([LP, D], gl.float32, a_l)
        dv = gl.zeros([LP, D], gl.float32, a_l)
        sj_s = gl.expand_dims(gl.arange(0, LP, layout=gl.SliceLayout(1, s_l)), 1)
        dd_a = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, a_l)), 0)
        n_steps = gl.cdiv(gl.maximum(hi - lo, 0), BT)

        # Software pipeline: step j's Q and dO rows are copied during step j - 1, its pair keys loaded during step
        # j - 2 and its LSE / delta during step j - 1, so no step waits on a dependent chain of global loads.
        r_ld = gl.arange(0, ROWS, layout=row_ld)
        keys_c = _pair_keys(key_base, lo, hi, BT, G, r_ld)
        keys_n = _pair_keys(key_base, lo + BT, hi, BT, G, r_ld)
        _copy_rows(Q, DO, q_buf.index(0), do_buf.index(0), keys_c, r_ld, dd, b, kv, blk, T, HKV, sqb, sqt, sqh,
                   NSEL, G, D)
        lse_c, delta_c = _row_terms(LSE, DELTA, gl.convert_layout(keys_c, col_s), gl.arange(0, ROWS, layout=col_s),
                                    b, kv, blk, T, HKV, NSEL, G)

        for j in range(0, n_steps):
            e0 = lo + j * BT
            cur = j % 2
            # Step j + 1's rows (masked off past the last step: one copy group per step either way), step j + 2's
            # keys and step j + 1's softmax terms: all in flight while step j computes.
            _copy_rows(Q, DO, q_buf.index(1 - cur), do_buf.index(1 - cur), keys_n, r_ld, dd, b, kv, blk, T, HKV,
                       sqb, sqt, sqh, NSEL, G, D)
            keys_nn = _pair_keys(key_base, e0 + 2 * BT, hi, BT, G, r_ld)
            r_c = gl.arange(0, ROWS, layout=col_s)
            lse_n, delta_n = _row_terms(LSE, DELTA, gl.convert_layout(keys_n, col_s), r_c, b, kv, blk, T, HKV, NSEL,
                                        G)
            key_s = gl.convert_layout(keys_c, col_s)
            tc = gl.where(key_s >= 0, (key_s // NSEL - blk * T).to(gl.int32), 0)

            async_copy.wait_group(1)
            fence_async_shared()
            gl.thread_barrier()
            qb = q_buf.index(cur)
            dob = do_buf.index(cur)
            zero_s = gl.zeros([LP, ROWS], gl.float32, s_l)  # not read (use_acc=False): made here, not kept live
            s_t = warpgroup_mma(k_smem, qb.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_smem, dob.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
            # A row sees the block's keys up to its token (lse = +inf on invalid rows: p = 0 without a mask).
            vis = sj_s <= gl.expand_dims(gl.minimum(tc - blk * LP, LP - 1), 0)
            p_t = gl.exp2(gl.where(vis, s_t * qk_scale - gl.expand_dims(lse_c, 0), float("-inf")))
            p_smem.store(p_t.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            dv = warpgroup_mma(p_smem, dob, dv, is_async=True)
            dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))
            ds_t = (p_t * (dp_t - gl.expand_dims(delta_c, 0))).to(gl.bfloat16)
            ds_smem.store(ds_t)
            fence_async_shared()
            gl.thread_barrier()
            dk = warpgroup_mma(ds_smem, qb, dk, is_async=True)
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, gl.zeros([ROWS, D], gl.float32, a_l), use_acc=False,
                               is_async=True)
            dk, dv, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, dq))
            key_a = gl.convert_layout(keys_c, row_a)
            ra = gl.arange(0, ROWS, layout=row_a)
            tq = (key_a // NSEL - blk * T).to(gl.int32)
            sq = (key_a - (key_a // NSEL) * NSEL).to(gl.int32)
            q_row = (((b * T + tq) * HKV + kv) * NSEL + sq) * G + ra % G
            gl.store(DQP + gl.expand_dims(q_row, 1) * D + dd_a, dq.to(gl.bfloat16), mask=gl.expand_dims(key_a >= 0, 1))
            gl.thread_barrier()  # every warp is done with this step's buffers before they are refilled
            keys_c = keys_n
            keys_n = keys_nn
            lse_c = lse_n
            delta_c = delta_n
        async_copy.wait_group(0)

        ai = gl.arange(0, LP, layout=row_a)
        s_pos_a = blk * LP + ai
        alive = live > 0
        whole = alive & (nch == 1)
        out_row = gl.expand_dims((b * T + s_pos_a) * HKV + kv, 1)
        smask = gl.expand_dims(s_pos_a < T, 1) & whole
        gl.store(DK_ + out_row * D + dd_a, (dk * sm_scale).to(gl.bfloat16), mask=smask)
        gl.store(DV_ + out_row * D + dd_a, dv.to(gl.bfloat16), mask=smask)
        p_row = gl.expand_dims((pid_bh.to(gl.int64) * NPS + gl.load(POFF + tab) + pid - c0) * LP + ai, 1)
        pmask = gl.expand_dims(ai < LP, 1) & alive & (nch != 1)
        gl.store(PK + p_row * D + dd_a, dk * sm_scale, mask=pmask)
        gl.store(PV + p_row * D + dd_a, dv, mask=pmask)


def supported(q, k, v, doc_start, lp: int, bs: int, gs: int, G: int, rows: int, num_warps: int, algo: str) -> bool:
    """Whether ``_sel_dkdv_wg`` serves this call (see the module doc)."""
    if not (HAVE_GLUON and q.is_cuda and doc_start is None and algo == "partials"):
        return False
    import torch  # noqa: PLC0415

    d = q.shape[-1]
    aligned = all(s % 16 == 0 for s in q.stride()[:3]) and q.data_ptr() % 16 == 0  # 16-byte cp.async rows
    return (aligned and torch.cuda.get_device_capability(q.device)[0] == 9 and q.dtype == torch.bfloat16
            and d == 64 and k.shape[-1] == d and v.shape[-1] == d and lp == 64 and bs == 64 and gs == G
            and rows == 64)


def launch(grid, q, k, v, do, lse, delta, keys, off, coff, prog, poff, dk, dv, pk, pv, dqp, T, nb, G, HKV, nch, nps,
           ch, qk_scale, sm_scale, lp, n, bt, rows, num_warps=8, maxnreg=None):
    d = q.shape[-1]
    _sel_dkdv_wg[grid](q, k, v, do, lse, delta, keys, off, coff, prog, poff, dk, dv, pk, pv, dqp, *q.stride()[:3],
                       *k.stride()[:3], *v.stride()[:3], T, nb, HKV, nch, nps, ch, qk_scale, sm_scale, G=G, LP=lp,
                       NSEL=n, BT=bt, ROWS=rows, D=d, TPR=min(32, d // 8), NW=num_warps,
                       num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
