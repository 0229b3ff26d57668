"""The selected branch's (block, token, slot) pair keys sorted by block, and the tables that give every program of the
block-centric kernels its block and chunk (selected_blocks' forward, selected_bwd's dK/dV walk).

Scheduling without host syncs: each block's pairs are cut into ceil(count / BT) chunks; a prefix sum gives every
program its (block, chunk) through a static-size table of ceil(T * n / BT) + NB programs, the spare ones exit at
once. Two Triton kernels per table (``_pair_table``, ``_pair_prog``) do the searches and prefix sums that took ~20
small torch ops (H100, m7c at 8k: 123 -> 46 launches per forward+backward, host time 3.7 -> 2.9 ms). The spec of
the tables is ``block_pairs_reference`` (torch).

The sort: a counting sort (attempt 86).

The dK/dV walk and the block-centric forward visit each KV block's list of the (token, slot) pairs that chose it,
in token order: the keys block * T*n + t*n + slot of every row of block_idx, sorted (pair_keys is
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
from nsa_titan.kernels.launch import run

CHUNK = 1024  # pairs per program: counts has NB + 1 entries per chunk, so fewer chunks keep its scan small
# sorted_pair_keys' default since the twenty-second session's H100 A/B (NOTES_kernels.md, attempt 86:
# the whole m7c at 8k +3 %, the 1b +0.5 %); "radix" (torch.sort) stays for comparisons and the check.
METHOD = "counting"
# The most histogram bins (NB + 2, to a power of 2) the count kernel takes by default: sm_90 offline (Triton 3.6), 2048
# bins use 127 registers, 4096 spill 288 bytes, 8192 6.5 KB. Past it sorted_pair_keys sorts by radix
# (more than 2046 selection blocks: past ~128k tokens with blocks of 64).
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
    (pair_keys' keys)."""
    B, HKV, T, n = block_idx.shape
    tn, rows = T * n, B * HKV
    idx = block_idx.contiguous()
    ch = min(CHUNK, max(16, pow2(tn)))
    nchunk = triton.cdiv(tn, ch)
    counts = torch.empty(rows, nb + 1, nchunk, device=idx.device, dtype=torch.int32)
    run(_pair_count, (nchunk, rows), idx, counts, tn, nb, nchunk, CH=ch, NBP=pow2(nb + 2), num_warps=4)
    # inclusive, over every row in (row, bucket, chunk) order; its last entry is rows * T*n
    csum = torch.cumsum(counts.view(-1), 0, dtype=torch.int32 if rows * tn < 2**31 else torch.int64)
    keys = torch.empty(rows, tn, device=idx.device, dtype=dtype)
    run(_pair_scatter, (nchunk, rows), idx, counts, csum, keys, tn, nb, nchunk, CH=ch, num_warps=4)
    return keys


@triton.jit
def _pair_keys_kernel(IDX, KEYS, TN, NB, BLOCK: tl.constexpr):
    """keys[row, i] = block * T*n + i for pair i = t*n + slot of block_idx row (b, kv); unused slots NB * T*n."""
    pid, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    m = i < TN
    blk = tl.load(IDX + row * TN + i, mask=m, other=-1).to(tl.int64)
    key = tl.where(blk >= 0, blk, blk * 0 + NB) * TN + tl.where(blk >= 0, i, 0)
    tl.store(KEYS + row * TN + i, key.to(KEYS.dtype.element_ty), mask=m)


@triton.jit
def _lower_bound(keys, target, zero, n, STEPS: tl.constexpr):
    """Per lane: the first index i in [0, n) of the ascending keys with keys[i] >= target (n if none)."""
    lo = zero
    hi = zero + n
    for _ in range(STEPS):
        act = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(keys + mid, mask=act, other=0)
        go = act & (v < target)
        lo = tl.where(go, mid + 1, lo)
        hi = tl.where(act & (v >= target), mid, hi)
    return lo


@triton.jit
def _pair_table(KEYS, OFF, COFF, POFF, TN, NB, CH, LOGK: tl.constexpr, BB: tl.constexpr):
    """One program per (b, kv) row of the sorted keys: off (each block's first pair: a lower-bound binary search
    for block * T*n), coff (each block's first chunk of CH pairs, a running prefix sum) and poff (the same over the
    blocks cut into several chunks: their partial slots); _pair_prog then gives every program its block. The two
    replace ~20 small torch ops per table."""
    row = tl.program_id(0).to(tl.int64)
    keys = KEYS + row * TN
    tab = row * (NB + 1)
    zero = tl.arange(0, BB) * 0
    carry_c = tl.sum(zero, 0)
    carry_p = tl.sum(zero, 0)
    for j0 in range(0, NB + 1, BB):
        j = j0 + tl.arange(0, BB)
        lo_j = _lower_bound(keys, j.to(tl.int64) * TN, zero, TN, LOGK)
        lo_next = _lower_bound(keys, (j + 1).to(tl.int64) * TN, zero, TN, LOGK)
        tl.store(OFF + tab + j, lo_j, mask=j <= NB)
        chunks = tl.where(j < NB, (lo_next - lo_j + CH - 1) // CH, 0)
        parts = tl.where(chunks > 1, chunks, 0)
        tl.store(COFF + tab + 1 + j, carry_c + tl.cumsum(chunks, 0), mask=j < NB)
        tl.store(POFF + tab + 1 + j, carry_p + tl.cumsum(parts, 0), mask=j < NB)
        carry_c += tl.sum(chunks, 0)
        carry_p += tl.sum(parts, 0)
    first = tl.arange(0, BB) == 0
    tl.store(COFF + tab + zero, zero, mask=first)
    tl.store(POFF + tab + zero, zero, mask=first)


@triton.jit
def _pair_prog(COFF, PROG, NB, NCH, LOGB: tl.constexpr, BB: tl.constexpr):
    """prog for BB program ids of one (b, kv) row: the block of each (NB for spare programs), a binary search in
    coff. Its own grid: in _pair_table's one program per row these searches ran ~NCH/BB steps in series (m7c at
    32k batch 1: two programs, ~0.06 ms per table on an H100)."""
    pb, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    p = pb * BB + tl.arange(0, BB)
    zero = tl.arange(0, BB) * 0
    # prog = the number of blocks whose chunks all start at or before p: coff[1 + i] > p first fails there
    lo = _lower_bound(COFF + row * (NB + 1) + 1, p + 1, zero, NB, LOGB)
    tl.store(PROG + row * NCH + p, lo, mask=p < NCH)


def chunk_token_order(keys: torch.Tensor, off: torch.Tensor, coff: torch.Tensor, prog: torch.Tensor, nb: int,
                      ch: int, n: int) -> torch.Tensor:
    """The walk's programs in token order (attempt 114): [B*HKV, NCH] int32, the chunk ids of every row sorted
    by each chunk's first token (stable, so ties keep block order; spare programs last). Run in that order, the
    chunks on the GPU at one time hold pairs of nearby tokens, whose Q / dO rows L2 then serves to all of them:
    every block's list is sorted by token, and at a token t every block before it is chosen with the same
    probability, so chunks that start together advance through the tokens together. In block order (chunk id
    order) the running chunks spread over the whole sequence and each pair's rows come from DRAM (ncu at the
    paper's 64k: ~34 GB of Q / dO rows per call). Static shapes, no host sync."""
    rows, nch = prog.shape
    tn = keys.shape[1]
    T = tn // n
    blk = prog.long()
    live = blk < nb
    b = blk.clamp(max=nb - 1)
    chunk = torch.arange(nch, device=prog.device).expand(rows, nch)
    lo = off.long().gather(1, b) + (chunk - coff.long().gather(1, b)) * ch
    t = keys.gather(1, lo.clamp(max=tn - 1)).long() // n - b * T  # the chunk's first pair: key = blk*T*n + t*n + slot
    return torch.argsort(torch.where(live, t, T), dim=1, stable=True).to(torch.int32)


def pair_key_dtype(nb: int, tn: int) -> torch.dtype:
    """int32 keys while (nb + 1) * T*n fits (T below ~92.7k at l' = 64, n = 16): the radix sort then makes 4
    passes instead of 8 (16 of the m7c layer's kernel launches at 8k were int64 sort passes, 0.24 ms)."""
    return torch.int32 if (nb + 1) * tn < 2**31 else torch.int64


def pair_keys(block_idx: torch.Tensor, nb: int):
    """The spec of the pair tables, in torch (tests hold the Triton path to it): block_idx [B, HKV, T, n] ->
    keys [B*HKV, T*n]: block * T*n + t*n + slot sorted (unused slots last, as nb * T*n), and off [B*HKV, NB+1]
    int64: each block's range in keys."""
    B, HKV, T, n = block_idx.shape
    dev = block_idx.device
    tn = T * n
    kdt = pair_key_dtype(nb, tn)
    pos = torch.arange(tn, device=dev).view(1, 1, T, n)  # t * n + slot
    keys = torch.where(block_idx >= 0, block_idx * tn + pos, nb * tn).view(B * HKV, tn).to(kdt)
    keys = torch.sort(keys, dim=-1).values
    bounds = (torch.arange(nb + 1, device=dev, dtype=kdt) * tn).expand(B * HKV, nb + 1).contiguous()
    return keys, torch.searchsorted(keys, bounds)


def block_pairs_reference(block_idx: torch.Tensor, nb: int, bt: int):
    """``pair_keys`` and the chunk tables in torch: off, coff [B*HKV, NB+1] (each block's first chunk of bt
    pairs), poff [B*HKV, NB+1] (each block's first partial slot, counting only blocks of several chunks) and
    prog [B*HKV, NCH] (the block of every program; NB for spare ones), all int32."""
    B, HKV, T, n = block_idx.shape
    tn = T * n
    keys, off = pair_keys(block_idx, nb)
    chunks = (off[:, 1:] - off[:, :-1] + bt - 1) // bt
    coff = torch.nn.functional.pad(torch.cumsum(chunks, -1), (1, 0))
    poff = torch.nn.functional.pad(torch.cumsum(torch.where(chunks > 1, chunks, 0), -1), (1, 0))
    nch = num_chunk_programs(tn, nb, bt)
    progs = torch.arange(nch, device=block_idx.device).expand(B * HKV, nch).contiguous()
    prog = torch.searchsorted(coff[:, 1:].contiguous(), progs, right=True)  # nb once past the last chunk
    return keys, *(x.to(torch.int32) for x in (off, coff, poff, prog))


def num_chunk_programs(tn: int, nb: int, bt: int) -> int:
    """Every chunk but one per block is full: an upper bound on the chunks of bt pairs."""
    return -(-tn // bt) + nb


def sorted_pair_keys(block_idx: torch.Tensor, nb: int, method: str | None = None) -> torch.Tensor:
    """``pair_keys``'s sorted keys, by ``method`` (default METHOD, or "radix" past MAX_BINS buckets): "radix" (one
    Triton kernel builds them, torch.sort orders them) or "counting" (counting_sort_pair_keys: the same keys)."""
    B, HKV, T, n = block_idx.shape
    tn = T * n
    if method is None:
        method = METHOD if pow2(nb + 2) <= MAX_BINS else "radix"
    if method == "counting":
        return counting_sort_pair_keys(block_idx, nb, pair_key_dtype(nb, tn))
    if method != "radix":
        raise ValueError(f"sorted_pair_keys method={method!r}: use 'radix' or 'counting'")
    keys = torch.empty(B * HKV, tn, device=block_idx.device, dtype=pair_key_dtype(nb, tn))
    blk = 1024
    run(_pair_keys_kernel, (triton.cdiv(tn, blk), B * HKV), block_idx, keys, tn, nb, BLOCK=blk, num_warps=4)
    return torch.sort(keys, dim=-1).values


def block_pairs(block_idx: torch.Tensor, nb: int, bt: int, keys: torch.Tensor | None = None):
    """``block_pairs_reference``'s (keys, off, coff, poff, prog) with one Triton kernel for the tables; ``keys``:
    the sorted keys when a caller already has them (the backward reuses the block-centric forward's)."""
    B, HKV, T, n = block_idx.shape
    tn = T * n
    if keys is None:
        keys = sorted_pair_keys(block_idx, nb)
    nch = num_chunk_programs(tn, nb, bt)
    dev = block_idx.device
    off, coff, poff = (torch.empty(B * HKV, nb + 1, device=dev, dtype=torch.int32) for _ in range(3))
    prog = torch.empty(B * HKV, nch, device=dev, dtype=torch.int32)
    bb = 256 if dev.type == "cuda" else 64
    run(_pair_table, (B * HKV,), keys, off, coff, poff, tn, nb, bt, LOGK=tn.bit_length(), BB=bb, num_warps=4)
    run(_pair_prog, (triton.cdiv(nch, bb), B * HKV), coff, prog, nb, nch, LOGB=nb.bit_length(), BB=bb, num_warps=4)
    return keys, off, coff, poff, prog
