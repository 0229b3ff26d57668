"""Block importance + top-n selection per (token, KV head), streamed: no [T, Tc] or [T, Nb] tensor exists.

A program owns BT tokens of one (batch, KV head) with its G query heads as rows, each token's group padded to
next_pow2(G) rows (band.py packs them exactly; here the per-token top-n wants a token's rows together). It
walks the selection blocks in chunks of BJ blocks; for each chunk it recomputes, from q, K_cmp and the
compressed branch's LSE, the probabilities of the CI compressed tokens that overlap those blocks
(p = exp2(s - LSE), the compressed softmax exactly), sums them over the group's heads, and maps them to
blocks with the eq. 9 overlap weights |[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / d (closed form, exact in fp32).

The running top-n is merged chunk by chunk with int64 keys that pack (importance bits, ~block index): for
non-negative floats the IEEE bit pattern is monotonic, so one integer comparison orders by importance and
breaks ties towards the lower block index, which is the spec's rule. Forced blocks (0, current, previous)
get +inf, non-candidates (blocks starting after t) key -1, which decodes to the unused index -1. Each chunk's
keys join the running top in one bitonic top-k (tl.topk over 2W keys per row, W = max(pow2(n), pow2(BJ))),
which keeps them sorted by descending key: the same order as torch_impl's stable sort. (An insertion loop of
up to n max-extractions per chunk did the same before, serially.)
With documents (DOC), compressed tokens outside the row's document are masked, blocks that end before it are
no candidates, the forced first block is the document's first, and the chunk loop starts at the tile's
earliest such block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.band import LOG2E
from nsa_titan.kernels.combine import pow2
from nsa_titan.kernels.tma import launch_tma
from nsa_titan.kernels.tuned import TUNED


@triton.jit
def _select_kernel(Q, KC, LSE, IDX, DS, sqb, sqt, sqh, skb, sks, skh,
                   T, TC, NB, G, HKV, qk_scale,
                   CD: tl.constexpr, CL: tl.constexpr, LP: tl.constexpr, R: tl.constexpr, LD: tl.constexpr,
                   NSEL: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, GP: tl.constexpr,
                   CI: tl.constexpr, BJ: tl.constexpr, DK: tl.constexpr,
                   DKP: tl.constexpr, DOC: tl.constexpr, SORTED_MERGE: tl.constexpr, TMA: tl.constexpr,
                   HL: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    r = tl.arange(0, BT * GP)
    if HL >= 0:  # 128 rows, a token's heads on row bits 3 and 6 and the lowest HL bits (heads_on_register_rows)
        t = pid_m * BT + ((r >> 4) & 3) * (8 >> HL) + ((r >> HL) & ((8 >> HL) - 1))
        g = ((r >> 6) & 1) * (2 << HL) + ((r >> 3) & 1) * (1 << HL) + (r & ((1 << HL) - 1))
    else:  # row = token * GP + head
        t = pid_m * BT + r // GP
        g = r % GP
    h = kv * G + g
    row_ok = (t < T) & (g < G)
    dk = tl.arange(0, DKP)
    q = tl.load(Q + b * sqb + t[:, None] * sqt + h[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    lse = tl.load(LSE + (b * T + t) * (HKV * G) + h, mask=row_ok, other=float("inf"))
    tt = pid_m * BT + tl.arange(0, BT)  # the tile's tokens, one per output row
    cur = tt // LP
    first = tt * 0  # each token's forced first block: block 0, or its document's first block
    j_lo = 0
    if DOC:
        ds_row = tl.load(DS + b * T + t, mask=row_ok, other=0)
        ds_tok = tl.load(DS + b * T + tt, mask=tt < T, other=0)
        first = ds_tok // LP
        j_lo = tl.min(tl.where(tt < T, first, NB))  # blocks before every token's document: no candidate
    col = tl.arange(0, W)  # the chunk's block columns (j0 + col), and the running top's columns
    ci = tl.arange(0, CI)
    ci_cd = ci * CD
    # Running top keys, W >= n columns sorted descending; -1 = empty (decodes to the unused index -1).
    best = tl.full([BT, W], -1, tl.int64)
    nb_tile = tl.minimum((tl.minimum(pid_m * BT + BT, T) - 1) // LP + 1, NB)  # later blocks: no candidate
    for j0 in range(j_lo, nb_tile, BJ):
        # Compressed tokens overlapping blocks j0 .. j0+BJ-1: i from j0*R - (LD-1), CI >= BJ*R + LD - 1 of them.
        i = j0 * R - (LD - 1) + ci
        if TMA:  # KC a [B, TC, HKV, D] descriptor with [1, CI, 1, D] boxes: rows before 0 or past TC read zeros
            kc = KC.load([b.to(tl.int32), j0 * R - (LD - 1), kv, 0]).reshape(CI, DKP)
        else:
            imask = (i >= 0) & (i < TC)
            kc = tl.load(KC + b * skb + i[:, None] * sks + kv * skh + dk[None, :],
                         mask=imask[:, None] & (dk[None, :] < DK), other=0.0)
        s = tl.dot(q, tl.trans(kc))  # unscaled: the scale goes into exp2's argument (one FMA per score)
        # One compare per score (the kernel is ALU-bound): token t sees compressed token i iff
        # i*CD + CL - 1 <= t, i.e. ci*CD <= t - CL + 1 - (j0*R - LD + 1)*CD; t < T keeps i < TC as well. Columns
        # before compressed token 0 (first chunk only) get -inf through a column bias, and padding rows have
        # lse = +inf, so their p is 0 without a mask of their own.
        vis = ci_cd[None, :] <= (t - CL + 1 - (j0 * R - (LD - 1)) * CD)[:, None]
        if DOC:
            vis = vis & (i[None, :] * CD >= ds_row[:, None])
        before_first = tl.where(i >= 0, 0.0, float("-inf"))
        p = tl.exp2(tl.where(vis, s * qk_scale - lse[:, None] + before_first[None, :], float("-inf")))
        if HL >= 0:  # eq. 10: sum over the group's heads, the register row bits first, then HL lane bits
            p6 = tl.reshape(p, [2, 4, 2, 8 >> HL, 1 << HL, CI])  # row bits (6, 5-4, 3, token lanes, head lanes)
            pg = tl.reshape(tl.sum(tl.sum(tl.sum(p6, axis=0), axis=1), axis=2), [BT, CI])
        else:
            pg = tl.sum(tl.reshape(p, [BT, GP, CI]), axis=1)  # eq. 10: sum over the group's heads
        j = j0 + col
        lo = tl.maximum(i[:, None] * CD, j[None, :] * LP)
        hi = tl.minimum(i[:, None] * CD + CL, (j[None, :] + 1) * LP)
        w = (tl.maximum(hi - lo, 0) // CD).to(tl.float32)  # [CI, W] eq. 9 overlap in units of d
        # eq. 9 map as an fp32 FMA dot ("ieee"): exact, and the fastest of five ways on an H100 (8k batch 2: m7c
        # 0.152 ms, against 0.182 for the broadcast-multiply-sum this replaced, which Triton turned into a tf32
        # dot from 16 tokens per program on: rel. error ~5e-4, so 0.4 % of m7c's rows chose other blocks than
        # float64; tf32x3 0.271, two fp16 or tf32 halves 0.187-0.191; benchmarks/results/select_precision_H100.md).
        imp = tl.dot(pg, w, input_precision="ieee")  # [BT, W]
        forced = (j[None, :] == first[:, None]) | (j[None, :] == cur[:, None]) | (j[None, :] == cur[:, None] - 1)
        imp = tl.where(forced, float("inf"), imp)
        cand = (j[None, :] * LP <= tt[:, None]) & (col[None, :] < BJ) & (j[None, :] < NB)
        if DOC:
            cand = cand & ((j[None, :] + 1) * LP > ds_tok[:, None])
        bits = imp.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(cand, (bits << 32) | (2147483647 - j[None, :]).to(tl.int64), -1)
        # Merge the chunk into the running top: one bitonic top-W of the 2W keys of each row (keys are unique
        # but for the -1 of non-candidates), skipped when no key of the tile beats its row's n-th best.
        kth = tl.min(tl.where(col[None, :] < NSEL, best, 2**62), 1)
        if tl.max(tl.sum((key > kth[:, None]).to(tl.int32), 1)) > 0:
            if SORTED_MERGE:
                # best is sorted descending already: sort only the chunk's keys ascending; the elementwise max
                # of the two holds exactly the W largest of both and is bitonic, so one bitonic merge sorts it
                # (~240 compare-swaps per row of 32 keys against tl.topk's ~400, which re-sorts best too).
                best = tl.bitonic_merge(tl.maximum(best, tl.sort(key, dim=1)), dim=1, descending=True)
            else:
                best = tl.topk(tl.reshape(tl.join(best, key), [BT, 2 * W]), W)
    idx = tl.where(best >= 0, 2147483647 - (best & 0xFFFFFFFF), -1)
    tl.store(IDX + ((b * HKV + kv) * T + tt[:, None]) * NSEL + col[None, :], idx,
             mask=(tt[:, None] < T) & (col[None, :] < NSEL))


def select_blocks(q, k_cmp, lse, cmp_block: int, cmp_stride: int, slc_block: int, top_n: int,
                  cfg: dict | None = None, doc_start=None):
    """q [B,T,HQ,Dk], k_cmp [B,Tc,HKV,Dk], lse [B,T,HQ] (band_fwd's) -> block_idx [B,HKV,T,n] int64.
    ``doc_start`` [B,T] int32 or None: candidates overlap the token's document, whose first block is forced."""
    B, T, HQ, DK = q.shape
    TC, HKV = k_cmp.shape[1], k_cmp.shape[2]
    G = HQ // HKV
    nb = -(-T // slc_block)
    idx = torch.empty(B, HKV, T, top_n, device=q.device, dtype=torch.int64)
    if TC == 0:  # no compressed token yet: a one-row dummy keeps pointers valid, every score is masked
        k_cmp = k_cmp.new_zeros(B, 1, HKV, DK)
    R, LD = slc_block // cmp_stride, cmp_block // cmp_stride
    gp = pow2(G)
    cuda = q.device.type == "cuda"
    # merge: how a chunk's keys join the running top: "sorted" (sort the chunk's W keys, then one bitonic merge
    # with the already sorted top) or "topk" (tl.topk of both, 2W keys). Sorted does fewer compare-swaps: H100,
    # 8k batch 2, m7c 0.217 -> 0.181 ms, qwen7b 0.418 -> 0.352 (sweep_selected_sorted_merge_*).
    lc = dict(rows=128 if cuda else 64, CI=64 if DK <= 128 else 32, num_warps=4, num_stages=3 if cuda else 1,
              merge="sorted")
    lc.update(TUNED.get(("select", gp, DK, False), {}) if cuda else {})
    lc.update(cfg or {})
    if lc["merge"] not in ("topk", "sorted"):
        raise ValueError(f"select cfg merge={lc['merge']!r}: use 'topk' or 'sorted'")
    bt = max(2, lc["rows"] // gp)  # bt * gp >= 16 rows: tl.dot needs M >= 16
    # perm (default True): a token's heads on the tile's register rows where heads_on_register_rows allows; False
    # keeps the plain row order (the A/B of sweep_selected.py and the interpreter check)
    hl = heads_on_register_rows(bt * gp, gp) if lc.get("perm", True) else -1
    ci = max(lc["CI"], pow2(R + LD - 1))  # a chunk must hold at least one block's compressed tokens
    bj = (ci - LD + 1) // R
    # tma: K_cmp's chunks through a descriptor (tma.py; where TUNED says so: m7c and the 1b, attempt 70).
    launch_tma(_select_kernel, (triton.cdiv(T, bt), B * HKV),
               (q, k_cmp, lse, idx, lse if doc_start is None else doc_start, *q.stride()[:3], *k_cmp.stride()[:3], T,
                TC, nb, G, HKV, DK**-0.5 * LOG2E),
               {1: (k_cmp, list(k_cmp.shape), list(k_cmp.stride()), [1, ci, 1, DK])}, bool(lc.get("tma", False)),
               dict(CD=cmp_stride, CL=cmp_block, LP=slc_block, R=R, LD=LD, NSEL=top_n, W=max(pow2(top_n), pow2(bj)),
                    BT=bt, GP=gp, CI=ci, BJ=bj, DK=DK, DKP=pow2(max(DK, 16)), DOC=doc_start is not None,
                    SORTED_MERGE=lc["merge"] == "sorted", HL=hl, num_warps=lc["num_warps"],
                    num_stages=lc["num_stages"]))
    return idx


def heads_on_register_rows(rows: int, gp: int) -> int:
    """How many of a token's head bits sit on lane row bits when its heads also take row bits 3 and 6 (HL in
    _select_kernel), or -1 for the plain order (row = token * gp + head). The group sum of eq. 10 runs over the
    rows of one token: in the plain order those are lanes (row bits 0-2 of an MMA tile), so it took log2(gp)
    shuffles per score held (1b 4, m7c 3; ncu: the kernel waits on the shared-memory / shuffle pipe, 78 % busy).
    A 128-row wgmma tile over 4 warps keeps rows r, r + 8 and r + 64 in one thread: with two head bits there, the
    sum adds in registers first and shuffles only log2(gp) - 2 times on a quarter of the values. Needs 128 rows of
    4 to 32 heads per token (other shapes and warp counts are still correct, with other costs)."""
    return gp.bit_length() - 3 if rows == 128 and 4 <= gp <= 32 else -1
