"""Selected-block attention in Triton, group-centric (the paper's kernel shape): the forward, and the launch
configuration of every selected kernel (``_cfg``); the backward is in selected_bwd.py.

Forward: one program per (token, batch, KV head) holds all G query heads of the group as the rows of one tile
(padded to >= 16 for the MMA) and walks that token's n selected blocks; each K/V block is loaded once for the
whole group. Keys s > t are masked, which only bites in the token's own block. Document masking (DOC, DS =
doc_start [B, T] int32): keys before the token's document are masked.

For small groups (G <= 8) the forward runs block-centric instead (selected_blocks.py). For G 16 at head dim 128
(tuned.py: the 1b, the paper config) it takes four neighbouring tokens per program over the union of their blocks
(_sel_fwd_tokens): a block several chose is loaded once, and the four tokens' 64 rows fill one warpgroup's MMA
(notes attempts 74 and 79; neighbours' selections overlap, a trained model's more than random ones).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_titan.kernels.band import LOG2E, finish_softmax, online_softmax
from nsa_titan.kernels.combine import combine_fwd, mix_operands, mix_rows, pow2
from nsa_titan.kernels.selected_blocks import block_tile, load_kv_rows, sel_fwd_blocks
from nsa_titan.kernels.tma import kv_specs, launch_tma
from nsa_titan.kernels.tuned import TUNED


@triton.jit
def token_slot_kv(K, V, idx_base, n0, c, t, s_min, b, kv, skb, sks, skh, svb, svs, svh, LP: tl.constexpr,
                  BS: tl.constexpr, NSEL: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
                  DVP: tl.constexpr):
    """One step of the token-centric walks (forward, dQ recompute) over token t's selected slots from n0: key c
    is position c % BS of slot n0 + c // BS. -> which keys t sees (inside the block, s <= t, s >= s_min, the
    document's start; unused slots, block -1, fall below 0) and their K/V rows."""
    slot = n0 + c // BS
    blk = tl.load(idx_base + slot, mask=slot < NSEL, other=-1)
    s_pos = blk * LP + c % BS
    kmask = (c % BS < LP) & (s_pos <= t) & (s_pos >= s_min)
    k, v = load_kv_rows(K, V, b, kv, s_pos, kmask, skb, sks, skh, svb, svs, svh, DK, DV, DKP, DVP)
    return kmask, k, v


@triton.jit
def token_block_kv(K, V, idx_base, slot, t, s_min, b, kv, LP: tl.constexpr, BS: tl.constexpr, NSEL: tl.constexpr,
                   DKP: tl.constexpr, DVP: tl.constexpr):
    """token_slot_kv's step in the descriptor form (TMA: K, V are [B, S, HKV, D] descriptors with [1, BS, 1, D]
    boxes): one selected block of token t, its keys as BS rows from the block's first. An unused slot (block -1)
    reads zeros at negative rows; keys past the block (BS > l'), past t or before s_min are masked as above."""
    blk = tl.load(idx_base + slot, mask=slot < NSEL, other=-1).to(tl.int32)  # int32: a descriptor coordinate
    r = tl.arange(0, BS)
    s_pos = blk * LP + r
    kmask = (r < LP) & (s_pos <= t) & (s_pos >= s_min)
    k = K.load([b, blk * LP, kv, 0]).reshape(BS, DKP)
    v = V.load([b, blk * LP, kv, 0]).reshape(BS, DVP)
    return kmask, k, v


@triton.jit
def _softmax_step(q, k, v, kmask, m_i, l_i, acc, qk_scale):
    """One tile of keys of the online softmax (hidden keys -inf)."""
    s = tl.dot(q, tl.trans(k)) * qk_scale
    return online_softmax(tl.where(kmask[None, :], s, float("-inf")), v, m_i, l_i, acc)


@triton.jit
def token_heads(G, HKV, GR: tl.constexpr, BH0=0):
    """The one-token programs' (token_group's walks, selected_dq._sel_bwd_dq_ds) rows: token t = program 0 of one
    (batch, KV head) (BH0 + program 1: a launch over some of them), its G query heads as GR rows. -> (t, b, kv, g,
    row_ok: g < G, h: the query heads)."""
    t, pid_bh = tl.program_id(0), tl.program_id(1) + BH0
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    g = tl.arange(0, GR)
    return t, b, kv, g, g < G, kv * G + g


@triton.jit
def token_group(Q, IDX, DS, sqb, sqt, sqh, T, G, HKV, LP: tl.constexpr, NSEL: tl.constexpr, GR: tl.constexpr,
                DK: tl.constexpr, DKP: tl.constexpr, DOC: tl.constexpr):
    """The token-centric walks' (forward, dQ recompute) program: token t of one (batch, KV head), its G query
    heads as rows (padded to GR). -> (t, b, kv, h, row_ok, q rows, token t's block indices, s_min: the first key
    t may see: its document's start, else 0; unused slots, block -1, fall below it; n_used: the slots to walk).

    n_used: token t has only t // l' - s_min // l' + 1 candidate blocks, and the selection lists its blocks
    first and the unused slots (-1) last (select.py sorts every row by descending key), so slots past that count
    are unused: the walk stops there instead of running masked MMAs on them (the first n l' tokens of a sequence
    and of every document)."""
    t, b, kv, g, row_ok, h = token_heads(G, HKV, GR)
    dk = tl.arange(0, DKP)
    q = tl.load(Q + b * sqb + t * sqt + h[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    idx_base = IDX + ((b * HKV + kv) * T + t) * NSEL
    s_min = 0
    if DOC:
        s_min = tl.load(DS + b * T + t)
    n_used = tl.minimum(t // LP - s_min // LP + 1, NSEL)
    return t, b, kv, h, row_ok, q, idx_base, s_min, n_used


@triton.jit
def _sel_fwd(Q, K, V, IDX, O, LSE, DS, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sob, sot, soh,
             T, G, HKV, qk_scale, LP: tl.constexpr, BS: tl.constexpr, NSEL: tl.constexpr, NPI: tl.constexpr,
             GR: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr,
             DOC: tl.constexpr, TMA: tl.constexpr):
    t, b, kv, h, row_ok, q, idx_base, s_min, n_used = token_group(Q, IDX, DS, sqb, sqt, sqh, T, G, HKV, LP, NSEL,
                                                                  GR, DK, DKP, DOC)
    m_i = tl.full([GR], -1e30, tl.float32)
    l_i = tl.zeros([GR], tl.float32)
    acc = tl.zeros([GR, DVP], tl.float32)
    c = tl.arange(0, NPI * BS)  # NPI selected blocks per step: key c is position c % BS of slot c // BS
    for n0 in range(0, n_used, NPI):
        if TMA:  # one block per tile: no [NPI * BS, D] address tensors (they spill at head dim 128, NPI 2)
            for j in tl.static_range(NPI):
                kmask, k, v = token_block_kv(K, V, idx_base, n0 + j, t, s_min, b.to(tl.int32), kv, LP, BS, NSEL,
                                             DKP, DVP)
                m_i, l_i, acc = _softmax_step(q, k, v, kmask, m_i, l_i, acc, qk_scale)
        else:
            kmask, k, v = token_slot_kv(K, V, idx_base, n0, c, t, s_min, b, kv, skb, sks, skh, svb, svs, svh, LP,
                                        BS, NSEL, DK, DV, DKP, DVP)
            m_i, l_i, acc = _softmax_step(q, k, v, kmask, m_i, l_i, acc, qk_scale)
    finish_softmax(O, LSE, acc, m_i, l_i, b * sob + t * sot + h * soh, (b * T + t) * (HKV * G) + h, row_ok, DV, DVP)


@triton.jit
def _union_block(q, K, V, blk, tok, s_min, live, b, kv, skb, sks, skh, svb, svs, svh, m_i, l_i, acc, qk_scale, T,
                 LP: tl.constexpr, BS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
                 DVP: tl.constexpr, TMA: tl.constexpr):
    """One selected block (blk >= 0) against a token group's rows (_sel_fwd_tokens): row i sees key s when
    s <= tok[i], s >= s_min[i] and live[i] (its token selected the block). Keys past T are loaded as zeros (a hidden
    key's V still meets P = 0 in the MMA, and 0 * NaN would poison the row)."""
    r = tl.arange(0, BS)
    s_pos = blk * LP + r
    k = block_tile(K, b, kv, blk, T, skb, sks, skh, LP, BS, DK, DKP, TMA)
    v = block_tile(V, b, kv, blk, T, svb, svs, svh, LP, BS, DV, DVP, TMA)
    vis = ((r < LP)[None, :] & (s_pos[None, :] <= tok[:, None]) & (s_pos[None, :] >= s_min[:, None])
           & live[:, None])
    s = tl.dot(q, tl.trans(k)) * qk_scale
    return online_softmax(tl.where(vis, s, float("-inf")), v, m_i, l_i, acc)


@triton.jit
def token_rows(T, G, HKV, NT: tl.constexpr, GR: tl.constexpr, BH0=0):
    """The multi-token kernels' program (forward, dQ): NT neighbouring tokens t0 = NT * program .. of one (batch,
    KV head) (BH0 + program 1), each token's G heads as GR rows of one [NT GR, D] tile. -> (b, kv, t0, u: each row's
    token in the group, tok: its position, g: its head in the group, row_ok: a real head of a token before T)."""
    pid, pid_bh = tl.program_id(0), tl.program_id(1) + BH0
    b, kv = (pid_bh // HKV).to(tl.int64), pid_bh % HKV
    t0 = NT * pid
    rr = tl.arange(0, NT * GR)
    u = rr // GR
    tok = t0 + u
    g = rr % GR
    return b, kv, t0, u, tok, g, (g < G) & (tok < T)


@triton.jit
def union_walk(IDX, b, kv, t0, T, HKV, NSEL: tl.constexpr, NP: tl.constexpr, NT: tl.constexpr):
    """The union of NT neighbouring tokens' blocks (t0 .. t0 + NT - 1), listed once per program for the
    multi-token kernels (_sel_fwd_tokens, selected_dq): entry e = token e // NP's slot e % NP is walked when no
    earlier token of the group chose its block, token by token in slot order. -> (n_walk, rank, packed): step w of
    the walk is the entry with rank == w, its packed value block * 2^NT + the bits of the tokens that chose the block
    (rank -1, packed 0 elsewhere). Branch-free: the entries compared pairwise ([NT n, NT n]) up to NT 4, beyond
    that with each token's list in turn ([NT n, n] at a time). Offline sm_90: the pairwise form keeps the 1b's NT 4
    forward at 182 registers (255 the other way), the other keeps m7c's NT 8 at 160 (254)."""
    e = tl.arange(0, NT * NP)
    eu, ej = e // NP, e % NP
    base = ((b * HKV + kv) * T + t0) * NSEL
    blk = tl.load(IDX + base + eu * NSEL + ej, mask=(ej < NSEL) & (t0 + eu < T), other=-1).to(tl.int32)
    first = blk >= 0  # -1: unused, or a token past T
    if NT <= 4:
        same = (blk[:, None] == blk[None, :]) & first[:, None]  # a list has no repeats
        first = first & (tl.sum((same & (eu[None, :] < eu[:, None])).to(tl.int32), 1) == 0)
        bits = tl.sum(tl.where(same, (eu * 0 + 1)[None, :] << eu[None, :], 0), 1)  # which tokens chose its block
    else:
        j = tl.arange(0, NP)
        bits = eu * 0
        for w in tl.static_range(NT):
            lw = tl.load(IDX + base + w * NSEL + j, mask=(j < NSEL) & (j * 0 + t0 + w < T), other=-1).to(tl.int32)
            chose = (tl.sum((blk[:, None] == lw[None, :]).to(tl.int32), 1) > 0) & (blk >= 0)  # token w chose it
            first = first & ~(chose & (eu > w))
            bits = bits | tl.where(chose, 1 << w, 0)
    rank = tl.where(first, tl.cumsum(first.to(tl.int32), 0) - 1, -1)
    return tl.sum(first.to(tl.int32), 0), rank, tl.where(first, blk * (1 << NT) + bits, 0)


@triton.jit
def union_step(rank, packed, w, u, row_ok, NT: tl.constexpr):
    """Step w of union_walk's walk: -> (its block, live: the rows whose token chose that block)."""
    pk = tl.sum(tl.where(rank == w, packed, 0), 0)
    return (pk >> NT).to(tl.int32), row_ok & ((((pk % (1 << NT)) >> u) & 1) == 1)


@triton.jit
def _sel_fwd_tokens(Q, K, V, IDX, O, LSE, DS, OC, OW, GATES, OUT, sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sob,
                    sot, soh, T, G, HKV, qk_scale, LP: tl.constexpr, BS: tl.constexpr, NSEL: tl.constexpr,
                    NP: tl.constexpr, NT: tl.constexpr, GR: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    DKP: tl.constexpr, DVP: tl.constexpr, DOC: tl.constexpr, TMA: tl.constexpr, MIX: tl.constexpr):
    """The token forward for NT neighbouring tokens at once (attempts 74 and 79; NT 2 was a kernel of its own until
    the nineteenth session): tokens t0 = NT * program .. t0 + NT - 1, their G heads as NT row groups of one
    [NT GR, D] tile (NT GR = 64 at G 16 and NT 4: one warpgroup's MMA rows), walking the union of their blocks so
    that a block is loaded once however many of them chose it. The union is listed once per program: entry (u, j) =
    token u's slot j is walked when no earlier token of the group chose its block, token by token in slot order (t0's
    blocks in _sel_fwd's order), with the rows of every token that chose it; the walk reads each entry's block and
    its tokens' bits from one packed vector, so the loop has no branch.
    MIX: also the gate mix of the three branches' outputs into OUT (combine.mix_rows, contiguous [B, T, HQ, Dv]
    OC / OW / OUT and [B, T, HQ, 3] GATES) from the tile just stored: no pass of its own reading O back (attempt 84)."""
    b, kv, t0, u, tok, g, row_ok = token_rows(T, G, HKV, NT, GR)
    h = kv * G + g
    dk = tl.arange(0, DKP)
    q = tl.load(Q + b * sqb + tok[:, None] * sqt + h[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    s_min = tok * 0
    if DOC:
        s_min = tl.load(DS + b * T + tok, mask=row_ok, other=0)
    n_walk, rank, packed = union_walk(IDX, b, kv, t0, T, HKV, NSEL, NP, NT)
    m_i = tl.full([NT * GR], -1e30, tl.float32)
    l_i = tl.zeros([NT * GR], tl.float32)
    acc = tl.zeros([NT * GR, DVP], tl.float32)
    for w in range(0, n_walk):
        blk, live = union_step(rank, packed, w, u, row_ok, NT)
        m_i, l_i, acc = _union_block(q, K, V, blk, tok, s_min, live, b, kv, skb, sks, skh, svb, svs, svh, m_i, l_i, acc,
                                     qk_scale, T, LP, BS, DK, DV, DKP, DVP, TMA)
    rows = (b * T + tok) * (HKV * G) + h
    o = finish_softmax(O, LSE, acc, m_i, l_i, b * sob + tok * sot + h * soh, rows, row_ok, DV, DVP)
    if MIX:
        mix_rows(OC, o, OW, GATES, OUT, rows, row_ok, DV, DVP)


# dQ from stored dS needs a transient [B, HKV, T, n, G, l'] buffer during the backward (n * l' values per query
# head and token: 8x dQ's size at l' = 64, n = 16, head dim 128); the dQ partials of small groups the same size at
# head dim 64. Above this size dQ recomputes instead (paper config at 64k: 8 GiB of dS). 2 GiB since the sixteenth
# session (1 GiB before): the 1b at 64k (exactly 2 GiB) and m7c at 64k (1.6 GiB of partials) stop recomputing.
# Profiled on one H200 (ab_profile_ds_budget2g_s16_H200.md): attention 1b 64k 1.047x, m7c 64k 1.330x; whole model
# 1b 64k with full AC on an H100: 2.15x dense against 2.13x, and the same 48.0 GiB peak (it is in the loss's
# backward, not here: memory_peak_1b_seq65536_acfull_nsa_vs_dense.md). The default of the model's dq_buffer_gib, which
# reaches _cfg as its ``budget``.
DS_BUDGET = 2 << 30
# B * T from which groups of <= 8 heads run the forward block-centric (_cfg). With 4 tiles per program it wins at
# every size measured, the whole attention fwd+bwd on an H100 (blocks_threshold_H100.json): m7c batch 1 at 2k
# 1.03x, 4k 1.24x, 8k 1.27x; qwen7b batch 1 at 4k 1.17x, 8k 1.18x (16384 before attempt 51). 2048 is the smallest
# measured; below T = n * l' every token runs as the causal prefix anyway (causal_prefix).
BLOCKS_MIN_TOKENS = 2048


ALGOS = {"sel_fwd": ("token", "tokens", "blocks"), "sel_dq": ("ds", "recompute", "partials")}  # _cfg's algorithms


def _cfg(kernel: str, q, v, G: int, n: int, lp: int, cfg: dict | None, budget: int | None = None) -> dict:
    """Launch shape: NPI (selected blocks per loop step), rows (dK/dV query rows per tile), warps, stages, and
    the algorithm: for the forward 'token' (one program per token, this file), 'tokens' (NT neighbouring tokens
    per program over their blocks' union, this file) or 'blocks' (selected_blocks.py);
    for dQ 'partials' (the dK/dV walk stores each pair's dQ over its block, in the inputs' dtype or with
    partial_bits=32 in fp32, and a sum kernel adds them per token in fp32: for small groups whose head dim is at
    most l', when that buffer fits DS_BUDGET), 'ds' (the dK/dV walk stores dS, dQ = dS K: when one (batch, KV
    head) pair's dS fits DS_BUDGET; ``ds_chunk`` pairs at a time, all of them where the whole buffer fits) or
    'recompute' (dQ recomputes QK^T and dO V^T per token). ``budget``: those buffers' limit in bytes instead of
    DS_BUDGET (the model's dq_buffer_gib). ``i32_rows`` (on unless a cfg or TUNED turns it off):
    the block forward and the dK/dV walk do their row arithmetic in 32 bits from each batch's bases where one batch
    of every buffer has < 2^31 elements (attempt 95; benchmarks/loop_instructions.py counts what it saves).

    The interpreter pays per Triton op, not per element: all n blocks in one step there. On the GPU two
    64-key blocks per step give 128-key tiles (fewer, larger MMAs) while K and V still fit shared memory
    for head dims <= 128 (measured 13% faster than one block per step, paper config at 64k, H200)."""
    dmax = max(q.shape[-1], v.shape[-1])
    if q.device.type != "cuda":
        c = dict(NPI=pow2(n), rows=64, num_warps=4, num_stages=1)
    else:
        # dK/dV: 128 query rows with 8 warps (H100, benchmarks/results/sweep_selected_*: 1b 8k 2.67 vs 3.29 ms
        # for the whole backward with 64 rows / 4 warps); past head dim 128 only 64 rows fit shared memory.
        rows = 64 if dmax > 128 else 128
        c = dict(NPI=2 if pow2(lp) <= 64 and dmax <= 128 else 1, rows=rows,
                 num_warps=8 if (kernel == "sel_dkdv" and rows >= 128) else 4, num_stages=2)
        if kernel == "sel_fwd" and pow2(G) <= 8 and dmax <= 128 and q.shape[0] * q.shape[1] >= BLOCKS_MIN_TOKENS:
            # Block-centric forward for small groups (selected_blocks.py). H100, bf16 (sweep_selected_blocks_*):
            # m7c 8k B=2 1.25 -> 1.07 ms, m7c 32k 2.45 -> 2.01, qwen7b (G=7) 8k 2.14 -> 1.88, 32k 8.74 -> 7.22; it
            # loses at G=16 (1b 8k 0.54 -> 0.94); BLOCKS_MIN_TOKENS for small B * T. Four tiles per program (one
            # K/V load; 4 programs per SM at 64 rows instead of 2), the forward with sort and merge against one
            # 128-row tile (tiles_sweep_H100.json): m7c 8k B=2 0.741 -> 0.593 ms with 64-row tiles and one stage,
            # 2k B=8 0.644 -> 0.510, 32k 1.490 -> 1.188; qwen7b (head dim 128) 8k 1.313 -> 1.181 with 128 rows.
            c.update(algo="blocks", rows=128 if dmax > 64 else 64, tiles=4, num_stages=2 if dmax > 64 else 1)
    if kernel == "sel_dkdv":
        # Rows per pair: exactly G (no padded heads) where it costs no spills. sm_90 offline compile
        # (kernel_resources.py): m7c (head dim 64) 254 registers, no spills either way; qwen7b (G 7, head dim
        # 128) 65/69 spilled loads/stores with stride 7 against 11/15 with stride 8, and on an H100 the exact
        # stride made its whole attention 3.8 % slower (ab_attention_sel_packing_*).
        c.update(exact_rows=dmax <= 64)
    if kernel == "sel_dq":
        budget = DS_BUDGET if budget is None else budget
        per_value = q.shape[0] * q.shape[1] * q.shape[2] * n  # (token, head, slot) triples
        bh = q.shape[0] * v.shape[2]  # (batch, KV head) pairs
        per_bh = per_value // bh * lp * q.element_size()  # one pair's dS bytes
        if per_bh <= budget:
            # dS in chunks of whole (batch, KV head) pairs where all of it does not fit (attempt 111): the walk and
            # dQ run per chunk over one reused buffer. H100, the paper config's attention at 64k (4 KV heads, 8 GiB
            # of dS): 116-118 ms recomputing, 111-112 with all of the dS stored; qwen7b at 64k 70-72 -> 63 ms.
            c.update(algo="ds", ds_chunk=min(bh, budget // per_bh))
        partials_bytes = per_value * q.shape[-1] * q.element_size()
        if q.device.type == "cuda" and pow2(G) <= 8 and q.shape[-1] <= lp and partials_bytes <= budget:
            # dQ partials in the inputs' dtype: dS's bytes at head dim = l' (m7c); no K re-read through L2. H100,
            # whole NSA attention (ab_attention_pairs_dqpartials_*, ab_attention_bf16_partials_*): m7c 8k B=2
            # 4.11 -> 3.38 ms with fp32 partials, -> 3.07 in bf16 (the op's peak 0.65 -> 1.02 -> 0.65 GiB), 2k B=8
            # 4.47 -> 3.20 -> 2.53; at 32k bf16 partials fit the budget: 9.35 -> 8.21. The float64 check's m7c case
            # 3.23e-3 (fp32) vs 3.30e-3 (bf16). partial_bits=32 keeps them in fp32. Unmeasured for G = 7 at head
            # dim 128.
            c.update(algo="partials", partial_bits=8 * q.element_size())
    # Descriptor loads (tma.py) in the token-centric forward and dQ recompute: one block per tile instead of NPI
    # address tensors; on where TUNED says so (measured there). sm_90 offline (Triton 3.6), 1b shape, NPI 2: the
    # pointer form takes 255 registers and spills 1280 B (forward) / 6192 B (dQ recompute), the descriptor form
    # does not.
    c["tma"] = False
    # Row arithmetic in 32 bits from each batch's bases in the block forward and the dK/dV walk (attempt 95; each
    # launch checks fits_i32 and falls back to 64 bits). Bitwise the same results; H100, m7c 8k batch 2, profiled
    # against 64 bits (ab_profile_i32_m7c_s26_*): walk 0.557 -> 0.521 ms, block forward 0.310 -> 0.291.
    c["i32_rows"] = True
    tuned = TUNED.get((kernel, pow2(G), dmax, False), {})
    if kernel == "sel_dq" and {**c, **(cfg or {})}.get("algo") == "ds":  # dQ from stored dS: its own kernel, shape
        ds_entry = dict(TUNED.get(("sel_dq_ds", pow2(G), dmax, False), {}))
        chunked = ds_entry.pop("chunked", {})  # its shape where the dS is stored a chunk of pairs at a time
        tuned = {**tuned, **ds_entry, **(chunked if c.get("ds_chunk", bh) < bh else {})}
    if q.device.type != "cuda":  # the interpreter keeps all n blocks per step, pointer loads (tests ask for tma)
        tuned = {k: v for k, v in tuned.items() if k not in ("NPI", "tma")}
    c.update(tuned)
    c.update(cfg or {})
    if c.get("algo") is not None and c["algo"] not in ALGOS.get(kernel, ()):
        hint = " (the forward's 'pairs' is algo='tokens' with NT=2 since attempt 79)" if kernel == "sel_fwd" else ""
        raise ValueError(f"{kernel} cfg algo={c['algo']!r}: not one of {ALGOS.get(kernel, ())}{hint}")
    if kernel == "sel_dkdv" and c.get("order", "blocks") not in ("blocks", "tokens"):
        raise ValueError(f"sel_dkdv cfg order={c['order']!r}: use 'blocks' (chunks in block order) or 'tokens' (by "
                         "each chunk's first token, pair_sort.chunk_token_order)")
    if kernel == "sel_dq" and not (isinstance(c.get("ds_chunk", 1), int) and c.get("ds_chunk", 1) >= 1):
        raise ValueError(f"sel_dq cfg ds_chunk={c['ds_chunk']!r}: the (batch, KV head) pairs per stored-dS chunk "
                         "must be an int >= 1 (leave it out for the budget's choice)")
    if kernel == "sel_dq" and c.get("pairs"):
        raise ValueError("sel_dq cfg pairs=True: the pair dQ kernels (attempts 77/78) were removed after attempt 80; "
                         "use NT=2 or NT=4 (the multi-token kernels selected_dq._sel_bwd_dq_tokens / "
                         "_sel_bwd_dq_ds_tokens, NT neighbouring tokens per program over their blocks' union)")
    return c


def _token_rows(G: int, nt: int) -> int:
    """The multi-token kernels' rows per token: its G heads, padded to a power of 2 and so that the tile of nt
    tokens has >= 16 rows (the MMA's minimum)."""
    return max(pow2(G), 16 // nt)


def _consts(q, k, v, lp, n):
    G = q.shape[2] // k.shape[2]
    DK, DV = q.shape[-1], v.shape[-1]
    return G, dict(LP=lp, BS=pow2(max(lp, 16)), NSEL=n, DK=DK, DV=DV, DKP=pow2(max(DK, 16)),
                   DVP=pow2(max(DV, 16)))


def sel_fwd(q, k, v, block_idx, slc_block: int, cfg: dict | None = None, doc_start=None, with_pairs: bool = False,
            mix: tuple | None = None, before_mix=None):
    """block_idx [B,HKV,T,n] (int64, -1 unused) -> (o [B,T,HQ,Dv], lse [B,T,HQ] fp32 base-2);
    ``doc_start`` [B,T] int32 or None: keys before the token's document are masked. ``with_pairs``: also return
    the sorted (block, token, slot) keys when the block-centric forward ran (else None), for sel_bwd to reuse.
    ``mix`` (o_cmp, o_win, gates, out): also write the gate combination of the three branches into ``out``
    (combine.combine_fwd's result, the same bits): in the token forward's or the block forward's merge epilogue
    where they run, else by combine_fwd after the one-token forward. ``before_mix``: called
    right before the first launch that reads ``mix``'s inputs (ops joins its side stream, the window's, there)."""
    B, T, HQ, DK = q.shape
    HKV = k.shape[2]
    G, c = _consts(q, k, v, slc_block, block_idx.shape[-1])
    lc = _cfg("sel_fwd", q, v, G, block_idx.shape[-1], slc_block, cfg)
    if mix is not None and not all(x.is_contiguous() and x.shape[:3] == q.shape[:3] for x in mix):
        raise ValueError("sel_fwd mix: o_cmp, o_win, gates and out must be contiguous [B, T, HQ, ...] tensors")
    if lc.get("algo") == "blocks":  # the mix in the merge's epilogue
        o, lse, keys = sel_fwd_blocks(q, k, v, block_idx, slc_block, c, lc, doc_start, mix=mix, before_mix=before_mix)
        return (o, lse, keys) if with_pairs else (o, lse)
    o = q.new_empty(B, T, HQ, v.shape[-1])
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    if lc.get("algo") == "tokens":  # NT neighbouring tokens per program over their blocks' union (_sel_fwd_tokens)
        nt = lc.get("NT", 4)
        oc, ow, gates, out = mix_operands(mix, o, before_mix)
        launch_tma(_sel_fwd_tokens, (triton.cdiv(T, nt), B * HKV),
                   (q, k, v, block_idx, o, lse, lse if doc_start is None else doc_start, oc, ow, gates, out,
                    *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], T, G, HKV, DK**-0.5 * LOG2E),
                   kv_specs(k, v, c["BS"]), lc["tma"],
                   dict(GR=_token_rows(G, nt), NP=pow2(c["NSEL"]), NT=nt, **c, DOC=doc_start is not None,
                        MIX=mix is not None, num_warps=lc["num_warps"], num_stages=lc["num_stages"]))
        return (o, lse, None) if with_pairs else (o, lse)
    launch_tma(_sel_fwd, (T, B * HKV), (q, k, v, block_idx, o, lse, lse if doc_start is None else doc_start,
                                        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], T, G,
                                        HKV, DK**-0.5 * LOG2E),
               kv_specs(k, v, c["BS"]), lc["tma"], dict(GR=max(16, pow2(G)), NPI=lc["NPI"], **c,
                                                        DOC=doc_start is not None, num_warps=lc["num_warps"],
                                                        num_stages=lc["num_stages"]))
    if mix is not None:
        oc, ow, gates, out = mix_operands(mix, o, before_mix)
        combine_fwd(oc, o, ow, gates, out=out)
    return (o, lse, None) if with_pairs else (o, lse)


def forward_sorts_pairs(q, v, G: int, n: int, slc_block: int) -> bool:
    """Whether sel_fwd (default launch config) runs block-centric and so has sorted pair keys to hand on."""
    return _cfg("sel_fwd", q, v, G, n, slc_block, None).get("algo") == "blocks"


def causal_prefix(q, v, G: int, n: int, slc_block: int, requested: int = -1) -> int:
    """How many leading tokens run the selected branch as plain causal attention (band.py) instead of the sparse
    kernels. A token t < n * l' has at most n candidate blocks (0 .. t // l', fewer inside a document), so the
    selection takes every one of them and its selected attention is exactly causal attention over [0, t] (within
    its document): the dense band kernel computes it with full MMA tiles and no pair sort, merge or partials.

    ``requested`` -1 (automatic), H100 GPU time of the whole attention in benchmarks/results/causal_prefix_H100.md:
    - all T tokens when T <= n * l': no sparse kernel runs at all (m7c at 1k batch 16: 1.76 -> 1.14 ms);
    - the whole prefix n * l' when the forward runs block-centric and the prefix holds at least half of the tokens:
      the prefix's pairs cost their share of every sparse kernel (m7c at 2k batch 8: 1.95 -> 1.90 ms);
    - else 0: a short prefix's band work outweighs the pairs it saves (m7c at 8k batch 2, a 1/8 prefix: 2.39 ->
      2.42 ms); the token-centric kernels already skip a prefix token's unused slots (token_group's n_used).
    Any other value is taken as asked (tests, A/B runs), at most n * l'."""
    T, limit = q.shape[1], n * slc_block
    if requested > limit:
        raise ValueError(f"causal_prefix={requested}: at most n * l' = {limit} tokens select every candidate "
                         "block; use -1 (automatic) or a smaller value")
    if requested >= 0:
        return min(requested, T)
    if T <= limit:
        return T
    return limit if T <= 2 * limit and forward_sorts_pairs(q, v, G, n, slc_block) else 0
