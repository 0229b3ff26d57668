"""Measured launch shapes of the Triton kernels, one table for band.py, select.py and selected.py.

Keyed by (kernel, next_pow2(G), max head dim, windowed); a kernel's heuristic default applies to any key that
is absent, and an explicit cfg (a sweep) overrides both. ``benchmarks/bench_attention.py --sweep`` installs
its winners here for the rest of its process.
"""

from __future__ import annotations

# Values: rows (MMA rows per tile: band.py and the selected block forward pack (token, head) pairs exactly, the
# selected dK/dV too at head dim <= 64 (selected._cfg exact_rows); select.py pads each token's group to
# next_pow2(G)), BK (keys per tile), num_warps, num_stages.
# ``split`` False: every tile masked (the mask-free interior lost there). H100 figures below are the whole band
# backward, 8k / 32k, batch 1, before -> after (benchmarks/results/sweep_band_*.json).
TUNED: dict[tuple, dict] = {
    # H200, paper config at T=65536: 12.05 -> 11.92 ms (compressed), 3.73 -> 3.27 ms (window).
    # From 3,072 compressed keys (~48k tokens at d = 16) 128 rows with 2 stages (H100, paper config at 64k, 4,095
    # keys: 9.75 / 9.45 ms for the entry's shape, 8.96 with this one, sweep_band_paper64k_s37_*; the 1b at 32k,
    # 2,047 keys, was even: 1.213 / 1.211, sweep_band_fwddq_s15_*).
    ("band_fwd", 16, 128, False): dict(rows=64, BK=64, num_warps=4, num_stages=3,
                                       many_keys=dict(from_keys=3072, rows=128, BK=64, num_warps=4, num_stages=2)),
    ("band_fwd", 16, 128, True): dict(rows=64, BK=64, num_warps=4, num_stages=3),
    # Compressed dK/dV at head dim 128: the interior split is slower here (1b 0.38 -> 0.32 / 3.32 -> 2.77 ms
    # without it; qwen7b 0.59 -> 0.52 / 5.85 -> 5.18). Window dK/dV: 128 rows / 8 warps fit with 2 stages
    # (1b 0.53 -> 0.44 / 1.68 -> 1.64; qwen7b 0.90 -> 0.82 / 3.62 -> 3.18); for G 16, 64 rows / 4 warps / 3 stages
    # since the twelfth session (sweep_band_1b8k_b2_s12_*: window backward 0.844 -> 0.759 ms at 1b 8k batch 2;
    # profiled, ab_profile_bandwin_1b_*_H100.md: both band dK/dV 0.787 -> 0.700 ms at 8k batch 2, 2.816 -> 2.630
    # at 32k batch 1). Not for qwen7b (the G 8 key): 64 rows there were slower (ab_profile_bandwin_qwen7b_*: 0.715
    # -> 0.789 ms at 8k, 5.01 -> 5.26 at 32k).
    # Compressed dK/dV for G 16 with 3 stages since the fifteenth session (loads through descriptors since attempt
    # 61; sweep_band_dkdv_s15_*): 1b batch 2, 8k 0.544 -> 0.527 ms, 32k 5.34 -> 5.19.
    # Both G 16 dK/dV with the keys as the MMA rows (band_bwd KT, attempt 72) over 128-key tiles, a warpgroup per 64
    # keys, since the seventeenth session. H100, whole band backward, batch 2 (sweep_band_kt_s17_*), compressed /
    # window: 1b 8k 0.532 -> 0.530 / 0.730 -> 0.682 ms, 32k 5.17 -> 4.56 / 2.83 -> 2.67; paper 8k 1.95 -> 1.86 /
    # 2.91 -> 2.73, 32k 20.5 -> 19.1 / 11.8 -> 11.6. Not for qwen7b (G 8 key) or m7c: slower at every shape there.
    # Profiled against the parent (ab_profile_band_kt_s17_*, 2 rounds): both band dK/dV 5.05 -> 4.30 ms at 1b 32k
    # batch 2 (attention 1.031x), 2.59 -> 2.22 at batch 1 (1.030x), paper 8k 1.38 -> 1.30 (1.014x), 32k 10.37 -> 9.77
    # (1.019x); but 0.377 -> 0.523 at 1b 8k batch 1, whose window has 64 key tiles of 128 for 132 SMs: there
    # (band_bwd._dkdv_launch's few_tiles, fewer programs than half the SMs) the shape before.
    # The compressed dK/dV's balanced splits (attempt 109, band_bwd._split_plan: only where each split walks >= 1024
    # queries, i.e. from ~32k-64k on) for the three measured keys; H100, the kernel with its partial sums
    # (ab_band_dkdv_s35b_*): 1b 64k 5.27 -> 4.42 ms, m7c 32k 0.797 -> 0.690, qwen7b 32k 3.81 -> 3.09, paper 32k 5.91 ->
    # 5.71; the m7c 32k step replayed from its graph 103.32 -> 102.81 ms (+0.5 %). With the grid capped at 4 programs
    # per SM (balanced_cap, attempt 110, ab_band_dkdv_s35c_*): 1b 64k 4.37, m7c 32k 0.635, paper 32k 5.38; not for
    # qwen7b (3.71 with it).
    ("band_dkdv", 16, 128, False): dict(rows=64, BK=128, num_warps=8, num_stages=3, split=False, keys_rows=True,
                                        balanced=True, balanced_cap=True,
                                        few_tiles=dict(rows=64, BK=64, num_warps=4, num_stages=3, keys_rows=False)),
    ("band_dkdv", 8, 128, False): dict(rows=64, BK=64, num_warps=4, num_stages=2, split=False, balanced=True),
    ("band_dkdv", 16, 128, True): dict(rows=64, BK=128, num_warps=8, num_stages=3, keys_rows=True,
                                       few_tiles=dict(rows=64, BK=64, num_warps=4, num_stages=3, keys_rows=False)),
    ("band_dkdv", 8, 128, True): dict(rows=128, BK=64, num_warps=8, num_stages=2),
    # qwen7b (G 7, head dim 128), both band forwards at 64 rows / 4 warps / 3 stages as for G 16 (fifteenth session,
    # sweep_band_fwddq_s15_*, batch 2; 128 rows / 8 warps before): compressed 8k 0.276 -> 0.231 ms, 32k 2.33 -> 2.19;
    # window 8k 0.428 -> 0.365, 32k 1.68 -> 1.54. (The 1b's identical default and explicit 64/64/4/3 launches in the
    # same sweep differed by up to 7 % at 32k: the spread between runs of one shape.) Profiled against the parent
    # (ab_profile_qwen_bandfwd_s15_*, 2 interleaved rounds): both band forwards 0.698 -> 0.617 ms at 8k batch 2,
    # 4.13 -> 3.72 at 32k; the attention totals, 0.978x and 0.987x, moved with kernels this change does not touch
    # (the selected dQ and dK/dV, +4 %, one new round faster than both old ones): noise of +-3 % per round.
    ("band_fwd", 8, 128, False): dict(rows=64, BK=64, num_warps=4, num_stages=3),
    ("band_fwd", 8, 128, True): dict(rows=64, BK=64, num_warps=4, num_stages=3),
    # m7c (G 6, head dim 64): 64 rows / 4 warps but for the window forward; from the 32k runs (at 8k the band
    # backward takes ~0.2-0.3 ms and varied up to 1.7x between identical launches: host-bound). Compressed
    # forward 0.51 -> 0.42 ms; band backward with this dQ: compressed 1.66 -> 1.53, window 0.97 -> 0.89; with
    # this dK/dV: compressed 1.67 -> 1.48, window 0.97 -> 0.82.
    ("band_fwd", 8, 64, False): dict(rows=64, BK=64, num_warps=4, num_stages=3),
    # Window forward at m7c, 8k batch 2 (sweep_band_m7c8k_b2_s12_*): 0.147 ms with the default 128 rows / 8 warps,
    # 0.115 with 64 / 4. Profiled against the default in one call (ab_profile_tuned_*_H100.md, which also carried a
    # dK/dV chunk change that was dropped): both band forwards 0.217 -> 0.185 ms at 8k batch 2, 0.235 -> 0.209 at
    # 2k batch 8, 0.597 -> 0.546 at 32k batch 1 (an older batch-1 sweep had 128 rows 5 % faster at 32k).
    ("band_fwd", 8, 64, True): dict(rows=64, BK=64, num_warps=4, num_stages=3),
    ("band_dq", 8, 64, False): dict(rows=64, BK=64, num_warps=4, num_stages=3),
    ("band_dq", 8, 64, True): dict(rows=64, BK=64, num_warps=4, num_stages=3),
    ("band_dkdv", 8, 64, False): dict(rows=64, BK=64, num_warps=4, num_stages=3, balanced=True,  # attempts 109-110
                                      balanced_cap=True),
    ("band_dkdv", 8, 64, True): dict(rows=64, BK=64, num_warps=4, num_stages=3),
    # Selected dK/dV (selected_bwd.py) for groups of <= 8 heads: 64 rows / 4 warps, H100 whole selected backward
    # at 8k / 32k: m7c 1.12 -> 1.06 / 3.84 -> 3.50 ms, qwen7b 2.76 -> 2.56 / 14.68 -> 14.13. m7c with 3 stages since
    # its row arithmetic is 32-bit (attempt 95; sweep_selected_walk_m7c_i32_s26_*: 0.766 -> 0.740 ms, batch 2),
    # profiled against 2 stages (ab_profile_walk_st3_m7c_s26_*, 2 rounds): walk 0.527 -> 0.503 ms at 8k batch 2,
    # 2.213 -> 2.092 at 32k.
    ("sel_dkdv", 8, 64, False): dict(rows=64, num_warps=4, num_stages=3),
    # Selection (select.py): the default 128 rows / 4 warps / 3 stages is fastest for the 1b, qwen7b and the paper
    # config since its overlap map is an fp32 FMA dot (H100, 8k batch 2, select_precision_H100.md: the 1b 0.156 ms
    # with 64 rows, 0.138 with 128; it had its own 64-row entry while the map ran as a tf32 dot). m7c (G 6, head
    # dim 64) at 32k: 256 rows / 8 warps 0.923 ms against 0.99-1.04 for the default in the same sweep; at 8k all
    # within noise, 0.1945 vs 0.1939-0.1966 (sweep_selected_select_32k_*, sweep_selected_float64ref_*).
    # Since attempt 70 (seventeenth session) K_cmp's chunks come through a descriptor, and the default shape with it
    # is best for both (sweep_selected_select_tma_s17_*, batch 2): m7c 8k 0.1929 (256 rows / 8 warps, pointers) ->
    # 0.1815 ms, 32k 1.750 -> 1.733 (256 / 8 / 2 stages with descriptors 1.710, but 0.195 at 8k); the 1b 8k 0.1676
    # -> 0.168, 32k 1.612 -> 1.579. Profiled against the parent (ab_profile_select_tma_s17_*, 2 rounds):
    # `_select_kernel` m7c 0.148 -> 0.139 ms at 8k batch 2, 0.091 -> 0.075 at batch 1, 1.633 -> 1.603 at 32k batch
    # 2, 0.872 -> 0.842 at batch 1; the 1b 0.849 -> 0.832 at 32k batch 1 (attention totals within +-3 %: noise).
    # The paper config (same G 16 key) unmeasured.
    # Since attempt 76 (eighteenth session) a token's heads sit on the 128-row tile's register rows (select.py HL),
    # and the group sum shuffles less: sweep_selected_heads_regs_s18_*, batch 2, descriptors, plain row order ->
    # heads on registers at 3 stages -> at 2 stages, 8k / 32k: m7c 0.182 -> 0.150 -> 0.179 / 1.75 -> 1.27 -> 1.26;
    # the 1b 0.169 -> 0.152 -> 0.137 / 1.60 -> 1.38 -> 1.19; paper 0.561 -> 0.501 -> 0.437 / 6.29 -> 5.39 -> 4.60;
    # qwen7b (no entry before: pointer loads, 3 stages) 0.388 -> 0.325 -> 0.291 / 4.14 -> 3.20 -> 2.77.
    ("select", 8, 64, False): dict(rows=128, CI=64, num_warps=4, num_stages=3, tma=True),
    ("select", 8, 128, False): dict(rows=128, CI=64, num_warps=4, num_stages=2, tma=True),
    ("select", 16, 128, False): dict(rows=128, CI=64, num_warps=4, num_stages=2, tma=True),
    # qwen7b's walk with 3 stages since its row arithmetic is 32-bit (attempt 95): whole selected backward at 8k batch 2
    # 3.867 -> 3.789 ms (sweep_selected_walk_qwen_i32_s26_*).
    ("sel_dkdv", 8, 128, False): dict(rows=64, num_warps=4, num_stages=3),
    # 1b (G 16, head dim 128), H100 whole selected backward at 8k batch 2: 128 rows / 8 warps / 2 stages 2.108 ->
    # 1.931 ms (sweep_selected_prefetch_*). mask_split (the walk's steps past a block's own tokens without the causal
    # mask), profiled against the parent (ab_profile_masksplit_*): the walk 1.001 -> 0.920 ms at 1b 8k batch 2, 2.090
    # -> 1.984 at 32k. Not for m7c (0.549 -> 0.588, ab_profile_maskfree_walk_8k) nor qwen7b (1.111 -> 1.089 at 8k but
    # 2.784 -> 2.882 at 32k). Its row arithmetic stays 64-bit: with i32_rows (attempt 95, on by default) the G 16 walk
    # ran slower, 1b 8k batch 2 0.931 -> 0.972 ms, paper 8k 1.984 -> 2.059 (ab_profile_i32_1b_qwen_paper_s26_*), where
    # m7c's walk gained 0.557 -> 0.521 and qwen7b's 2.200 -> 1.990.
    # many_pairs (attempt 114, selected_bwd.walk_shape): from 2^20 pairs per launch the walk's chunks of 64 tiles (256
    # pairs) in token order (pair_sort.chunk_token_order). H100, the whole selected backward's kernels (profiled, 2
    # rounds, against this entry's block order): paper 8k 3.00 -> 2.94 ms, 16k 6.34 -> 6.12, 32k 12.81 -> 12.37, 64k
    # 26.80 -> 26.14 (walk 17.36 -> 15.88, reduce 0.21 -> 0.90); 1b 32k 3.30 -> 3.27, 64k 6.73 -> 6.61; it loses at
    # the 1b's 8k / 16k (0.755 -> 0.815, 1.63 -> 1.66: the order's sort and the partials). The whole attention's eager
    # fwd+bwd, paired (ab_walk_order_s39_*): paper 64k 1.008x (IQR 0.979-1.024), 32k 1.016x (1.005-1.022), 1b 64k
    # 1.001x, paper 8k 0.991x (4 x 131k pairs: below the threshold). Not for m7c / qwen7b (32k: 1.54 -> 1.58, 7.79 ->
    # 7.88 ms).
    ("sel_dkdv", 16, 128, False): dict(rows=64, num_warps=4, num_stages=3, mask_split=True, i32_rows=False,
                                       many_pairs=dict(from_pairs=1 << 20, order="tokens", chunk_tiles=64)),
    # Token-centric forward and dQ recompute with K/V through tensor descriptors (selected.py, attempt 62), H100
    # batch 2 (sweep_selected_tma_s15_*), forward 8k / 32k: 1b 1.025 -> 0.967 / 4.335 -> 4.162 ms (one block per
    # step; two: 0.970 / 4.170), paper config 4.05 -> 3.65 / 17.41 -> 16.35. The whole selected backward with dQ
    # recomputed (the default where dS does not fit DS_BUDGET: the 1b above 64k tokens per step, above 32k before
    # the sixteenth session): 1b 2.12 -> 1.86 / 8.64 -> 7.73, paper 8.23 -> 7.17 / 34.96 -> 31.86; dQ from stored dS,
    # the default below that, is unchanged (1.72 / 6.85). qwen7b (G 7 in 16 rows, the same kernel shape) at 32k
    # batch 1, where dQ recomputed until the sixteenth session: 13.63 -> 11.76 ms
    # (sweep_selected_qwen_dq_s15_*); its forward runs block-centric. The forward with 2 warps (one 16-row tile per
    # program needs no more; sweep_selected_tma2_s15_*): 1b 8k 0.970 -> 0.865 ms, 32k 4.16 -> 3.88; paper 8k 3.62 ->
    # 3.48, 32k 16.30 -> 15.95. Profiled against 4 warps (ab_profile_sel_fwd_w2_s15_*): attention 1b 8k batch 2
    # 1.045x (`_sel_fwd` 1.010 -> 0.879 ms), 32k 1.016x; paper 8k 1.003x, 32k 1.006x.
    # Since attempt 74 (eighteenth session): two neighbouring tokens per program over their blocks' union
    # (selected._sel_fwd_pair, since the nineteenth session NT 2 of _sel_fwd_tokens). On random selections it loses
    # (sweep_selected_pairs_s18_*: the 1b 8k 0.877 -> 0.917 ms, paper 8k 3.53 -> 3.61), but a model's selections overlap
    # more: for two tokens |union| / n is 1.46 on random inputs, 1.39 at initialisation and 1.15-1.20 after 60-200 steps
    # (selection_overlap_1b_seq8192.json). Whole 1b model, 8k batch 2, CUDA graphs, rounds interleaved
    # (train_pairs_ab_{token,pairs}_r{1,2}_s18): 65,058 / 64,760 tokens/s with one token per program, 65,439 / 65,331
    # with pairs, at steps 25-30 of a run from initialisation; the float64 check green with it
    # (attention_check_pairs_s18_H100.md).
    # Since attempt 79 (nineteenth session): four neighbouring tokens per program (selected._sel_fwd_tokens), the
    # 64-row tile one warpgroup's wgmma. Forward alone, batch 2, against the pair kernel (sweep_selected_tokens_*_s19):
    # queries correlated at 0.9, 1b 8k 0.739 -> 0.507 ms, 32k 3.12 -> 2.23, paper 8k 2.89 -> 1.96, 32k 12.63 -> 8.98;
    # random queries 1b 8k 0.918 -> 0.742, 32k 4.11 -> 3.69, paper 8k 3.59 -> 2.94, 32k 16.45 -> 15.47 (2 stages:
    # 10-15 % slower). Attention, random inputs (ab_profile_tokens_st3_s19_*): 1b 8k batch 2 1.048x, paper 8k 1.020x.
    # Whole 1b model, 8k batch 2, against NT 2 (train_nt4_ab_*_s20, two interleaved rounds): +1.3 % / +1.5 %. Not for
    # m7c's G 6 (NT 8 x 8 rows, attempt 81): the whole m7c model lost 1.2 % at 8k and 5.5 % at 32k (train_m7tok_*_s20).
    ("sel_fwd", 16, 128, False): dict(algo="tokens", NT=4, tma=True, num_warps=4, num_stages=3),
    # dQ recomputed (where dS does not fit: the paper config from 16k at batch 1) for two neighbouring tokens over
    # their blocks' union (selected_dq._sel_bwd_dq_pair, attempt 78; removed after attempt 80). H100, whole
    # selected backward, batch 2, queries correlated along T at 0.9 (the 1b's trained overlap;
    # sweep_selected_rpairs_qc09_s19_*), against one token per program: paper 8k 8.61 -> 8.07 ms, 32k 35.93 ->
    # 33.43; 1b 8k 2.31 -> 2.10, 32k 9.07 -> 8.34.
    # Since attempt 80 (twentieth session): four tokens per program as one 64-row tile (selected_dq._sel_bwd_dq_tokens).
    # Whole selected backward, batch 2, against the pairs: correlated queries (sweep_selected_dqtok_rc_qc09_s20b_*)
    # 1b 8k 2.10 -> 1.83 ms, 32k 8.30 -> 7.45, paper 8k 8.05 -> 6.80, 32k 33.3 -> 29.5; random queries
    # (sweep_selected_dqtok_rc_s20b_*) 1b 8k 1.92 -> 1.74, 32k 7.86 -> 8.21, paper 8k 7.35 -> 6.56, 32k 32.2 -> 33.0.
    ("sel_dq", 16, 128, False): dict(tma=True, NT=4, num_warps=4, num_stages=2),
    # qwen7b (G 7) recomputes dQ where dS does not fit (from ~37k tokens per step) for eight neighbouring tokens per
    # program (64 MMA rows of 8-row groups) since the twenty-sixth session. H100, whole selected backward at 32k batch 1
    # (sweep_selected_dqrc_qwen32k*_s26_*): 11.51 -> 10.93 ms on random queries, 12.72 -> 8.30 on queries correlated
    # at 0.9 (a trained model's overlap); four tokens 13.22 / 10.60, eight at 8 warps 22.3 / 14.3.
    ("sel_dq", 8, 128, False): dict(tma=True, NT=8, num_warps=4, num_stages=2),
    # The window's and the compressed branch's dQ in one launch (band_dq2.band_dq2, attempt 82) since the twenty-
    # first session. H100, batch 2, two band_bwd calls -> one (sweep_band_dq2_*_s21): 1b 8k 0.524 -> 0.416 ms,
    # 16k 1.133 -> 0.970, 32k 2.747 -> 2.544 (many_keys); paper 8k 1.972 -> 1.578, 16k 4.366 -> 4.005, 32k 11.58 ->
    # 10.15 (many_keys); 1b 64k batch 1 3.867 -> 3.833 (many_keys); m7c 8k 0.321 -> 0.169, 32k 1.030 -> 1.024.
    # 64-row tiles over 32 keys win while the compressed walk is short; from 32k (>= 1536 compressed keys) 128
    # rows over 64 keys (at 16k the 1b still prefers 64 rows: 0.970 against 1.011; the paper 128: 3.874 / 4.005).
    # Whole 1b model at 8k batch 2 against two calls (dq2_ab_*_s21): 66,057 / 65,809 -> 66,234 / 66,403 tokens/s.
    ("band_dq2", 16, 128, False): dict(rows=64, BK=32, num_warps=4, num_stages=3,
                                       many_keys=dict(from_keys=1536, rows=128, BK=64, num_warps=8, num_stages=4)),
    ("band_dq2", 8, 64, False): dict(rows=64, BK=32, num_warps=4, num_stages=3),
    # qwen7b (G 7, head dim 128) since the twenty-sixth session (it ran two band_bwd dQ calls before). H100, batch 2,
    # two calls -> one (sweep_band_dq2_qwen_s26_*): 8k 0.940 -> 0.727 ms (64/32/4/3), 32k 5.12 -> 4.58 (128/64/8/4; 5.03
    # with 64/32/4/3). Profiled against two calls at 64/32/4/3 (ab_profile_qwen_dq2_s26_*, 2 rounds): 0.922 -> 0.697
    # ms at 8k (attention 1.036x), 5.42 -> 4.97 at 32k.
    ("band_dq2", 8, 128, False): dict(rows=64, BK=32, num_warps=4, num_stages=3,
                                      many_keys=dict(from_keys=1536, rows=128, BK=64, num_warps=8, num_stages=4)),
    # dQ from the stored dS (where it fits selected.DS_BUDGET, 2 GiB: the 1b up to 64k tokens per step, the paper
    # config up to 16k, qwen7b up to ~37k) with K and each slot's [G, l'] dS through descriptors (attempt 67), one
    # block per MMA, 2 warps, 3 stages. H100, whole selected backward, batch 2 (sweep_selected_dsdq_tma_s16_*):
    # 1b 8k 1.733 -> 1.564 ms, 32k 6.85 -> 6.41; paper 8k 6.96 -> 6.18, 32k 28.6 -> 26.6. The pointer form with 2
    # warps was slower (sweep_selected_dq_w2_s16_*). Profiled against the parent (ab_profile_dsdq_tma_s16_*, 2
    # rounds): `_sel_bwd_dq_ds` 0.618 -> 0.436 ms at 1b 8k batch 2 (attention 1.042x), 1.289 -> 1.026 at 32k batch 1
    # (1.020x), paper 8k 1.286 -> 0.852 (1.057x).
    # Since attempt 77 (nineteenth session): two neighbouring tokens per program over their blocks' union
    # (selected_dq._sel_bwd_dq_ds_pair, removed after attempt 80), the same 2 warps / 3 stages. Whole selected
    # backward, batch 2: queries correlated at 0.9 (sweep_selected_pairs_qc09_s19_*) 1b 8k 1.842 -> 1.745 ms, 32k
    # 7.53 -> 6.95, paper 8k 6.89 -> 6.47, 32k 29.45 -> 27.80; random queries (sweep_selected_pairs_s19_*) 1b 8k
    # 1.563 -> 1.545, 32k 6.41 -> 6.45, paper 8k 6.18 -> 6.10, 32k 26.95 -> 27.03.
    # Since attempt 80 (twentieth session): four tokens per program as one 64-row tile
    # (selected_dq._sel_bwd_dq_ds_tokens). Against the pairs: correlated queries (sweep_selected_dqtok_qc09_s20b_*)
    # 1b 8k 1.826 -> 1.716 ms, 32k 7.21 -> 6.82, paper 8k 6.85 -> 6.40, 32k 28.6 -> 26.8; random queries
    # (sweep_selected_dqtok_s20b_*) 1b 8k 1.604 -> 1.573, 32k 6.60 -> 6.61, paper 8k 6.46 -> 6.28, 32k 27.95 -> 27.91.
    # ``chunked``: the shape where dS is stored in chunks of (batch, KV head) pairs (attempt 111: the paper config from
    # 32k on). H100, paper 64k, whole selected backward (sweep_selected_paper64k_sel_s37_*): 27.71 ms with the
    # entry's shape, 26.59 with two tokens per program at 2 warps / 3 stages.
    ("sel_dq_ds", 16, 128, False): dict(tma=True, NT=4, num_warps=4, num_stages=3,
                                        chunked=dict(NT=2, num_warps=2, num_stages=3)),
    # qwen7b (G 7: 16-row boxes that also read the next slots' rows, never stored), 8k: whole selected backward
    # batch 1 2.417 -> 2.128 ms, batch 2 4.688 -> 4.139 (sweep_selected_dsdq_tma_qwen_b{1,2}_s16_*); profiled with 2
    # blocks per step and 4 warps (ab_profile_dsdq_tma_qwen_s16_*): `_sel_bwd_dq_ds` 1.181 -> 0.902 ms at batch 1
    # (attention 1.060x), 2.306 -> 1.786 at batch 2 (1.054x); this shape was 1-2 % faster again in the sweeps.
    # Since the twenty-sixth session eight neighbouring tokens per program (64 MMA rows of 8-row groups) over their
    # blocks' union (selected_dq._sel_bwd_dq_ds_tokens). H100, whole selected backward
    # (sweep_selected_dqds_qwen*_s26_*): 8k batch 2 3.87 -> 3.38 ms on random queries, 4.09 -> 3.24 on queries
    # correlated at 0.9; 32k batch 1 8.44 -> 7.92.
    ("sel_dq_ds", 8, 128, False): dict(tma=True, NT=8, num_warps=4, num_stages=3),
}
