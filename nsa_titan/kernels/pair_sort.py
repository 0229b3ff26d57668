"""The selected branch's (block, token, slot) pair keys sorted by block: a counting sort (attempt 86).

The dK/dV walk and the block-centric forward visit each KV block's list of the (token, slot) pairs that chose it,
in token order: the keys block * T*n + t*n + slot of every row of block_idx, sorted (selected_blocks.pair_keys is
the spec). torch.sort is a radix sort over all the key's bits (4 passes over int32 keys plus its histogram and
scan kernels: ~0.055 ms for the 1b's 262k keys at 8k batch 2 on an H100), although only the block is out of
order: the pairs arrive in (t, slot) order already. A stable counting sort by block gives the same keys:

1. ``_pair_count``: each program counts one chunk of CH pairs of one (b, kv) row per bucket (the block, NB for an
   unused slot), stored bucket-major: counts[row, bucket, chunk].
2. one torch.cumsum over all rows' counts in that order, as one 1-D tensor (cub's device-wide scan: a per-row scan
   of the 2-D counts ran torch's inner-dim scan kernel, 0.36 ms at the 1b's 32k for 2 rows of 262k counts). Each
   row's counts sum to T*n, so the chunk's first pair of the bucket goes to the inclusive sum - its own count -
   row * T*n (every pair of a lower bucket first, then the earlier chunks' pairs of this one).
3. ``_pair_scatter``: each program sorts its chunk by (bucket, position), ranks every pair among the chunk's
   earlier pairs of its bucket (a segmented count over the sorted chunk) and writes its key to its place.

All of it is exact integer work in a fixed order: the same keys, bit for bit, as torch.sort (tests/_kernel_checks
``pair_sort``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.combine import pow2

CHUNK = 1024  # pairs per program: counts has NB + 1 entries per chunk, so fewer chunks keep its scan small
# selected_blocks.sorted_pair_keys' default since the twenty-second session's H100 A/B (NOTES_kernels.md, attempt 86:
# the whole m7c at 8k +3 %, the 1b +0.5 %); "radix" (torch.sort) stays for comparisons and the check.
METHOD = "counting"
# The most histogram bins (NB + 2, to a power of 2) the count kernel takes by default: sm_90 offline (Triton 3.6), 2048
# bins use 127 registers, 4096 spill 288 bytes, 8192 6.5 KB. Past it selected_blocks.sorted_pair_keys sorts by radix
# (the 1b beyond 128k tokens; the chunked block forward's virtual blocks, attempt 92).
MAX_BINS = 2048


@triton.jit
def _chunk_buckets(IDX, row, pid, TN, NB, CH: tl.constexpr):
    """This program's CH pairs of one row: (local position r, bucket: the block, NB if unused, NB + 1 past T*n)."""
    r = tl.arange(0, CH)
    i = pid * CH + r
    blk = tl.load(IDX + row * TN + i, mask=i < TN, other=-2)
    bucket = tl.where(blk >= 0, blk, tl.where(blk == -1, blk * 0 + NB, blk * 0 + NB + 1))
    return r, bucket.to(tl.int32)


@triton.jit
def _pair_count(IDX, COUNTS, TN, NB, NCHUNK, CH: tl.constexpr, NBP: tl.constexpr):
    """counts[row, j, chunk] = this chunk's pairs in bucket j, 0 <= j <= NB (NBP >= NB + 2: a bin for the lanes
    past T*n)."""
    pid, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    _, bucket = _chunk_buckets(IDX, row, pid, TN, NB, CH)
    j = tl.arange(0, NBP)
    tl.store(COUNTS + (row * (NB + 1) + j) * NCHUNK + pid, tl.histogram(bucket, NBP), mask=j <= NB)


@triton.jit
def _same_bucket_count(b_left, n_left, b_right, n_right):
    """Segmented sum over a sorted sequence: the right run's count continues the left's within one bucket."""
    return b_right, n_right + tl.where(b_left == b_right, n_left, 0)


@triton.jit
def _pair_scatter(IDX, COUNTS, CSUM, KEYS, TN, NB, NCHUNK, CH: tl.constexpr):
    """keys[row, start + rank] = bucket * T*n + i (NB * T*n for an unused slot): start = csum - counts - row * T*n
    at [row, bucket, chunk] (the exclusive prefix within the row), rank = the number of this chunk's earlier pairs
    in the same bucket."""
    pid, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    r, bucket = _chunk_buckets(IDX, row, pid, TN, NB, CH)
    order = tl.sort(bucket * CH + r)  # by bucket, then position: stable
    b = order // CH
    i = pid * CH + order % CH
    _, seen = tl.associative_scan((b, tl.full([CH], 1, tl.int32)), 0, _same_bucket_count)
    ok = b <= NB
    at = (row * (NB + 1) + b) * NCHUNK + pid
    start = tl.load(CSUM + at, mask=ok, other=0) - tl.load(COUNTS + at, mask=ok, other=0) - row * TN
    key = b.to(tl.int64) * TN + tl.where(b < NB, i, 0)
    tl.store(KEYS + row * TN + start + seen - 1, key.to(KEYS.dtype.element_ty), mask=ok)


def counting_sort_pair_keys(block_idx: torch.Tensor, nb: int, dtype: torch.dtype) -> torch.Tensor:
    """block_idx [B, HKV, T, n] (int64, -1 unused) -> the sorted pair keys [B*HKV, T*n] in ``dtype``
    (selected_blocks.pair_keys' keys)."""
    B, HKV, T, n = block_idx.shape
    tn, rows = T * n, B * HKV
    idx = block_idx.contiguous()
    ch = min(CHUNK, max(16, pow2(tn)))
    nchunk = triton.cdiv(tn, ch)
    counts = torch.empty(rows, nb + 1, nchunk, device=idx.device, dtype=torch.int32)
    _pair_count[(nchunk, rows)](idx, counts, tn, nb, nchunk, CH=ch, NBP=pow2(nb + 2), num_warps=4)
    # inclusive, over every row in (row, bucket, chunk) order; its last entry is rows * T*n
    csum = torch.cumsum(counts.view(-1), 0, dtype=torch.int32 if rows * tn < 2**31 else torch.int64)
    keys = torch.empty(rows, tn, device=idx.device, dtype=dtype)
    _pair_scatter[(nchunk, rows)](idx, counts, csum, keys, tn, nb, nchunk, CH=ch, num_warps=4)
    return keys
