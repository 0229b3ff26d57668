"""Launch-shape sweep of the selected-attention forward and dQ kernels, per config and sequence length.

    python benchmarks/sweep_selected.py --configs paper,1b,m7c,qwen7b --ts 8192,32768 [--batch 1] [--out DIR]
        [--q-corr 0.9]   # queries correlated along T: the 1b's selections then overlap like a model's after 60
                         # steps (|union| / n 1.14 / 1.43 / 1.84 for 2 / 4 / 8 tokens against 1.15 / 1.43 / 1.77;
                         # random queries 1.46 / 2.17 / 2.97: q_corr_overlap_1b_seq8192_cpu.json)

For each (config, T): random bf16 inputs, block indices from the real selection kernel, then every variant of
``VARIANTS`` timed (median of triton.testing.do_bench) for sel_fwd, the whole backward with each dQ variant
(sel_dq) and with each dK/dV variant (sel_dkdv), outputs checked against the first variant (bf16 rounding
only). Also prints |union| / n of tiles of BT consecutive tokens (see selection_overlap.py). Writes
sweep_selected_<device>.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_checks import (  # noqa: E402
    float64_selection,
    make_inputs,
    picked_variants,
    run_sweep,
    same_rows,
    sweep_parser,
    time_variants,
)
from profile_block import ATTN_CONFIGS, PAPER_P  # noqa: E402
from selection_overlap import TILES, union_ratio  # noqa: E402

from nsa_titan.kernels import band, select, selected, selected_bwd  # noqa: E402


def _v(NPI=2, w=4, st=2):
    return dict(algo="token", NPI=NPI, num_warps=w, num_stages=st)


VARIANTS = {  # first = the token-centric pointer form (G 16 at head dim 128: tma, NPI 1, 2 warps by default, tuned.py)
    "sel_fwd": [_v(), _v(1, st=3), _v(2, st=3), _v(2, w=8), _v(1, w=2, st=3),
                # K/V through tensor descriptors (selected.py TMA): ~100 registers and no spills at head dim 128
                dict(_v(), tma=True), dict(_v(1), tma=True), dict(_v(2, st=3), tma=True), dict(_v(4), tma=True),
                dict(_v(2, w=8), tma=True), dict(_v(1, st=3), tma=True), dict(_v(1, w=2), tma=True),
                dict(_v(1, w=2, st=3), tma=True), dict(_v(1, w=8), tma=True),
                # block-centric (selected_blocks.py): rows = tokens per chunk * next_pow2(G)
                dict(algo="blocks", rows=64, num_warps=4, num_stages=1),
                dict(algo="blocks", rows=64, num_warps=4, num_stages=2),
                dict(algo="blocks", rows=128, num_warps=8, num_stages=1),
                dict(algo="blocks", rows=128, num_warps=4, num_stages=2),
                dict(algo="blocks", rows=32, num_warps=4, num_stages=1),
                # two neighbouring tokens per program over their blocks' union (attempt 74: ~0.73x the K/V bytes of
                # one token per program on random selections, 1.46x the MMA rows). Until the nineteenth session the
                # kernel selected._sel_fwd_pair (offline sm_90, 1b shape, descriptors: 246 / 193 / 147 registers at 2
                # / 4 / 8 warps), since then _sel_fwd_tokens with NT 2 (4-5 % faster, its branch-free walk)
                dict(algo="tokens", NT=2, tma=True, num_warps=2, num_stages=2),
                dict(algo="tokens", NT=2, tma=True, num_warps=2, num_stages=3),
                dict(algo="tokens", NT=2, tma=True, num_warps=4, num_stages=2),
                dict(algo="tokens", NT=2, tma=True, num_warps=4, num_stages=3),
                dict(algo="tokens", NT=2, tma=True, num_warps=8, num_stages=2),
                # NT neighbouring tokens per program over their blocks' union (selected._sel_fwd_tokens, attempt 79):
                # at G 16 and NT 4 the tile is 64 rows, one warpgroup's wgmma. Offline sm_90, 1b shape, descriptors:
                # NT 4 182 registers at 4 warps / 2 or 3 stages, 225 with 1 stage, 170 at 8 warps; NT 8 at 8 warps
                # 255 and 16 B of stack; NT 2 (the pair kernel's tile, branch-free walk) 225 at 2 warps
                dict(algo="tokens", NT=4, tma=True, num_warps=4, num_stages=2),
                dict(algo="tokens", NT=4, tma=True, num_warps=4, num_stages=3),
                dict(algo="tokens", NT=4, tma=True, num_warps=8, num_stages=2),
                dict(algo="tokens", NT=4, tma=True, num_warps=4, num_stages=1),
                dict(algo="tokens", NT=8, tma=True, num_warps=8, num_stages=2),
                dict(algo="tokens", NT=2, tma=True, num_warps=2, num_stages=2),  # = 19 (the pair kernel's row then)
                # small groups (m7c's G 6, qwen7b's G 7: 8 rows a token): NT 8 fills 64 rows; against 14, the
                # block-centric default there. Offline sm_90, m7c shape: NT 8 160 / 163 registers at 2 / 3 stages
                # (selected.union_walk's per-token listing; 254 pairwise), NT 4 167
                dict(algo="tokens", NT=8, tma=True, num_warps=4, num_stages=2),
                dict(algo="tokens", NT=8, tma=True, num_warps=4, num_stages=3),
                dict(algo="tokens", NT=4, tma=True, num_warps=4, num_stages=3)],
    # dQ = dS K from the dS the dK/dV walk stores ('ds', the default when its buffer fits selected.DS_BUDGET),
    # or recomputed per token; each timed as the whole selected backward
    # (2 warps with pointer loads, ds and recompute, lost at 1b and paper 8k / 32k: sweep_selected_dq_w2_s16_*.)
    "sel_dq": [dict(_v(), algo="ds", tma=False), dict(_v(1, st=3), algo="ds", tma=False),
               dict(_v(2, w=8), algo="ds", tma=False), dict(_v(4), algo="ds", tma=False),
               dict(_v(), algo="recompute", tma=False), dict(_v(1, st=3), algo="recompute", tma=False),
               dict(_v(), algo="recompute", tma=True), dict(_v(1), algo="recompute", tma=True),
               dict(_v(2, st=3), algo="recompute", tma=True),
               # dQ from stored dS with K and dS through descriptors (G 16 at l' 64: one [G, l'] box per slot):
               # 72-128 registers offline against 126-255 (and spills at 2 warps) with pointer loads
               dict(_v(), algo="ds", tma=True), dict(_v(1), algo="ds", tma=True),
               dict(_v(1, st=3), algo="ds", tma=True),
               dict(_v(1, w=2), algo="ds", tma=True), dict(_v(1, w=2, st=3), algo="ds", tma=True),
               dict(_v(2, w=2), algo="ds", tma=True),
               # Two neighbouring tokens over their blocks' union: until attempt 80 the pair kernels (attempt 77 from
               # the stored dS, 15-17; attempt 78 recomputed, 18-20, against 7; offline sm_90, 1b shape, descriptors:
               # ds 196 / 128 registers at 2 / 4 warps, recompute 236 / 145 at 4 / 8), removed after attempt 80. These
               # six are now NT 2 of the four-token kernels below, in the pair variants' warps and stages
               # (indices unchanged).
               dict(algo="ds", NT=2, tma=True, num_warps=2, num_stages=2),
               dict(algo="ds", NT=2, tma=True, num_warps=2, num_stages=3),
               dict(algo="ds", NT=2, tma=True, num_warps=4, num_stages=2),
               dict(algo="recompute", NT=2, tma=True, num_warps=4, num_stages=2),
               dict(algo="recompute", NT=2, tma=True, num_warps=4, num_stages=3),
               dict(algo="recompute", NT=2, tma=True, num_warps=8, num_stages=2),
               # four neighbouring tokens as one 64-row tile over their blocks' union (selected_dq, attempt 80): from
               # the stored dS (dS by pointers, K by descriptor) and recomputed. Offline sm_90, 1b shape: ds 128 / 80
               # registers at 4 / 8 warps; recompute 207 (2 stages) / 227 (3) at 4 warps, 145 at 8; no spills
               dict(algo="ds", NT=4, tma=True, num_warps=4, num_stages=2),
               dict(algo="ds", NT=4, tma=True, num_warps=4, num_stages=3),
               dict(algo="ds", NT=4, tma=True, num_warps=8, num_stages=2),
               dict(algo="recompute", NT=4, tma=True, num_warps=4, num_stages=2),
               dict(algo="recompute", NT=4, tma=True, num_warps=4, num_stages=3),
               dict(algo="recompute", NT=4, tma=True, num_warps=8, num_stages=2),
               # groups of <= 8 heads (qwen7b's G 7, 8 rows a token): eight tokens fill the 64 MMA rows
               dict(algo="ds", NT=8, tma=True, num_warps=4, num_stages=2),
               dict(algo="ds", NT=8, tma=True, num_warps=4, num_stages=3),
               dict(algo="ds", NT=8, tma=True, num_warps=8, num_stages=2),
               dict(algo="recompute", NT=8, tma=True, num_warps=4, num_stages=2),
               dict(algo="recompute", NT=8, tma=True, num_warps=8, num_stages=2),
               dict(algo="recompute", NT=8, tma=True, num_warps=8, num_stages=3)],
    # dK/dV: chunk_tiles = query tiles per chunk of a block's pair list (default: ~4 chunks per SM, >= 64)
    "sel_dkdv": [dict(rows=128, num_warps=8, num_stages=2), dict(rows=64, num_warps=4, num_stages=2),
                 dict(rows=128, num_warps=8, num_stages=2, chunk_tiles=8),
                 dict(rows=128, num_warps=8, num_stages=2, chunk_tiles=16),
                 dict(rows=128, num_warps=8, num_stages=2, chunk_tiles=64),
                 dict(rows=128, num_warps=8, num_stages=2, chunk_tiles=256),
                 dict(rows=128, num_warps=8, num_stages=2, chunk_tiles=1 << 20),  # one chunk per block
                 # small groups at head dim 64 (m7c; the walk also stores the dQ partials there)
                 dict(rows=64, num_warps=8, num_stages=2), dict(rows=64, num_warps=4, num_stages=3),
                 dict(rows=32, num_warps=4, num_stages=2), dict(rows=128, num_warps=4, num_stages=2),
                 dict(rows=64, num_warps=4, num_stages=2, chunk_tiles=16),
                 dict(rows=64, num_warps=4, num_stages=2, chunk_tiles=32),
                 dict(rows=64, num_warps=4, num_stages=2, chunk_tiles=256),
                 # one stage (the block-centric forward's gathers ran fastest with one, attempt 51)
                 dict(rows=64, num_warps=4, num_stages=1), dict(rows=32, num_warps=4, num_stages=1),
                 dict(rows=128, num_warps=8, num_stages=1),
                 # G 16 (the 1b, the paper config): the tuned pointer walk and one pair per step. (Each pair's Q / dO
                 # and dS through descriptors, one 16-row pair per MMA, attempt 69, lost: 1b 8k 2.20-3.55 ms
                 # against 1.56, sweep_selected_walk_tma_s17_*; the code is in 42761be.)
                 # (The walk with the keys as MMA rows, band_bwd's KT, attempt 73, lost at every shape and config:
                 # sweep_selected_walk_kt*_s17_*; not kept.)
                 dict(rows=64, num_warps=4, num_stages=3, mask_split=True),
                 dict(rows=16, num_warps=4, num_stages=2, mask_split=True),
                 # TUNED's shape as is, then its chunks in token order (attempt 114) of 8 to 64 query tiles
                 dict(), dict(order="tokens", chunk_tiles=8), dict(order="tokens", chunk_tiles=16),
                 dict(order="tokens", chunk_tiles=32), dict(order="tokens", chunk_tiles=64)],
    # block importance + top-n (select.py): rows = tokens per program * next_pow2(G), CI = compressed tokens
    # per chunk; the first is the heuristic default (tuned.py picks 256 rows / 8 warps for m7c). Each is held to
    # the float64 selection (float64_selection).
    "select": [dict(rows=128, CI=64, num_warps=4, num_stages=3), dict(rows=64, CI=64, num_warps=4, num_stages=3),
               dict(rows=256, CI=64, num_warps=8, num_stages=3), dict(rows=128, CI=32, num_warps=4, num_stages=3),
               dict(rows=128, CI=128, num_warps=4, num_stages=3), dict(rows=128, CI=64, num_warps=8, num_stages=3),
               dict(rows=128, CI=64, num_warps=4, num_stages=1), dict(rows=64, CI=128, num_warps=4, num_stages=2),
               # the chunk's keys sorted, then one bitonic merge with the sorted running top (select.py merge)
               dict(rows=128, CI=64, num_warps=4, num_stages=1, merge="sorted"),
               dict(rows=128, CI=64, num_warps=4, num_stages=3, merge="sorted"),
               dict(rows=128, CI=128, num_warps=4, num_stages=1, merge="sorted"),
               dict(rows=64, CI=64, num_warps=4, num_stages=3, merge="sorted"),
               dict(rows=128, CI=64, num_warps=4, num_stages=3, merge="topk"),
               # K_cmp's chunks through a descriptor (select.py TMA; offline sm_90: m7c at 256 rows / 8 warps 197 ->
               # 128 registers, the 1b at 128 / 4 168 -> 162)
               dict(rows=128, CI=64, num_warps=4, num_stages=3, tma=True),
               dict(rows=256, CI=64, num_warps=8, num_stages=3, tma=True),
               dict(rows=256, CI=64, num_warps=8, num_stages=2, tma=True),
               dict(rows=128, CI=64, num_warps=8, num_stages=3, tma=True),
               # A token's heads on the tile's register rows (select.py HL, the default since 2026-11-27 where
               # heads_on_register_rows applies); perm=False is the plain row order. Offline sm_90 at 128 / 4: m7c
               # 332 -> 156 SHFL and 186 -> 128 registers, the 1b 167 -> 103 SHFL
               dict(rows=128, CI=64, num_warps=4, num_stages=3, tma=True, perm=False),
               dict(rows=128, CI=64, num_warps=4, num_stages=2, tma=True),
               dict(rows=128, CI=32, num_warps=4, num_stages=3, tma=True),
               dict(rows=128, CI=64, num_warps=8, num_stages=3, tma=True, perm=False)],
}


def case(name: str, T: int, B: int, kernels: list[str], pick: list[int] | None = None, q_corr: float = 0.0) -> dict:

    HQ, HKV, DK, DV = ATTN_CONFIGS[name]
    p = PAPER_P
    q, kc, vc, ks, vs, _, _, _ = make_inputs(B, T, HQ, HKV, DK, DV, p, q_corr=q_corr)
    _, lse_c = band.band_fwd(q, kc, vc, p.cmp_stride, p.cmp_block - 1, 0)
    idx = select.select_blocks(q, kc, lse_c, p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n)
    o, lse = selected.sel_fwd(q, ks, vs, idx, p.slc_block)
    do = torch.randn_like(o)
    G = HQ // HKV
    jobs = {
        "sel_fwd": lambda c: selected.sel_fwd(q, ks, vs, idx, p.slc_block, cfg=c)[:1],
        # (a variant without NT means one token per program, whatever tuned.py's default)
        "sel_dq": lambda c: selected_bwd.sel_bwd(do, q, ks, vs, o, lse, idx, p.slc_block,
                                                 cfg_dq={"NT": 1, **c})[:1],
        "sel_dkdv": lambda c: selected_bwd.sel_bwd(do, q, ks, vs, o, lse, idx, p.slc_block, cfg_dkdv=c)[1:],
        "select": lambda c: (torch.sort(select.select_blocks(q, kc, lse_c, p.cmp_block, p.cmp_stride, p.slc_block,
                                                             p.slc_top_n, cfg=c), -1).values,),
    }
    # The selection against float64, not against its own default: a launch shape that rounds differently
    # (a tf32 map, 2026-11-26) must not make the others look wrong.
    refs = {"select": lambda: (torch.sort(float64_selection(q, kc, p), -1).values,)}
    out = dict(config=name, T=T, B=B, G=G, q_corr=q_corr)
    for bt in TILES:
        out[f"union_over_n_bt{bt}"] = round(union_ratio(idx, bt), 3)
    for kname, fn in ((k, jobs[k]) for k in kernels):
        variants = [VARIANTS[kname][i] for i in pick] if pick else VARIANTS[kname]
        ref = refs[kname]() if kname in refs else fn(variants[0])
        res, best = time_variants(fn, variants, ref, same_fn=same_rows if kname in refs else None)
        out[kname] = res
        print(f"{name} T={T} B={B} {kname}: default {res[0].get('ms')} ms, best {best and best['ms']} ms "
              f"{best and best['cfg']}; all "
              + ", ".join(f"{r['cfg'].get('algo', 'token')[0]}{'t' if r['cfg'].get('tma') else ''}"
                          f"{r['cfg'].get('rows', '-')}/{r['cfg'].get('NPI', r['cfg'].get('NT', '-'))}/"
                          f"{r['cfg'].get('chunk_tiles', '-')}{'tok' if r['cfg'].get('order') == 'tokens' else ''}/"
                          f"{r['cfg'].get('num_warps', '-')}/{r['cfg'].get('num_stages', '-')}="
                          f"{r.get('ms', 'ERR')}{'' if r.get('same', True) else '!'}"
                          for r in res), flush=True)
    print(json.dumps({k: v for k, v in out.items() if k.startswith("union")}), flush=True)
    return out


def main():
    ap = sweep_parser("paper,1b,m7c,qwen7b")
    ap.add_argument("--kernels", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--q-corr", type=float, default=0.0,
                    help="lag-1 correlation of the queries along T (attention_checks.correlated_along_t): selections "
                         "whose neighbours overlap like a model's (union_over_n_bt* in the output says how much)")
    a = ap.parse_args()
    if not 0.0 <= a.q_corr < 1.0:
        ap.error(f"--q-corr {a.q_corr}: use 0 <= q-corr < 1")
    pick = picked_variants(ap, a, VARIANTS, a.kernels.split(","))
    run_sweep("sweep_selected", a, lambda name, T: case(name, T, a.batch, a.kernels.split(","), pick, a.q_corr))


if __name__ == "__main__":
    main()
