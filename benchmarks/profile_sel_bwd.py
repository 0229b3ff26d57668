"""The selected branch's backward kernel by kernel (torch.profiler), for several walk launch options in one process.

    python benchmarks/profile_sel_bwd.py --cases paper:65536,1b:65536 \
        --variants '{}' '{"order": "tokens", "chunk_tiles": 64}' [--rounds 2] [--tag _x] [--out DIR]

Each variant is selected_bwd.sel_bwd's ``cfg_dkdv`` (``{}``: tuned.py's choice), run on the same random inputs
(the selection from the compressed forward, as sweep_selected.py makes them); each round profiles three calls per
variant and reports the GPU time per call of every kernel. Rounds repeat the variants in the same order. Writes
profile_sel_bwd<tag>_<device>.json and .md (the total and the five largest kernels per row).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def kernel_times(fn, calls: int = 3) -> dict[str, float]:
    """GPU ms per call of every kernel ``fn`` launches, summed by kernel name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out[e.name] = out.get(e.name, 0.0) + e.device_time / calls / 1000.0
    return out


def case_rows(name: str, T: int, variants: list[dict], rounds: int) -> list[dict]:
    import torch
    from attention_checks import make_inputs
    from profile_block import ATTN_CONFIGS, PAPER_P

    from nsa_titan.kernels import band, select, selected, selected_bwd

    HQ, HKV, DK, DV = ATTN_CONFIGS[name]
    p = PAPER_P
    q, kc, vc, ks, vs, _, _, _ = make_inputs(1, T, HQ, HKV, DK, DV, p)
    _, lse_c = band.band_fwd(q, kc, vc, p.cmp_stride, p.cmp_block - 1, 0)
    idx = select.select_blocks(q, kc, lse_c, p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n)
    o, lse = selected.sel_fwd(q, ks, vs, idx, p.slc_block)
    do = torch.randn_like(o)
    rows = []
    for rnd in range(rounds):
        for cfg in variants:
            k = kernel_times(lambda c=cfg: selected_bwd.sel_bwd(do, q, ks, vs, o, lse, idx, p.slc_block, cfg_dkdv=c))
            rows.append(dict(config=name, T=T, round=rnd, cfg=cfg, total_ms=sum(k.values()), kernels_ms=k))
            top = sorted(k.items(), key=lambda x: -x[1])[:5]
            print(f"{name} {T} r{rnd} {cfg}: total {rows[-1]['total_ms']:.2f} ms; "
                  + "; ".join(f"{n[:24]} {v:.2f}" for n, v in top), flush=True)
    return rows


def to_markdown(payload: dict) -> str:
    lines = [f"# Selected backward by kernel: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}; "
             "`benchmarks/profile_sel_bwd.py`: GPU ms per call (torch.profiler, 3 calls), batch 1, random inputs; "
             "cfg = selected_bwd.sel_bwd's cfg_dkdv ({} = tuned.py's choice).", "",
             "| case | round | cfg | total ms | walk | dQ | reduce |", "|---|---|---|---|---|---|---|"]
    for r in payload["cases"]:
        k = r["kernels_ms"]
        dq = sum(v for n, v in k.items() if n.startswith(("_sel_bwd_dq", "_sel_dq_sum")))
        lines.append(f"| {r['config']} {r['T']} | {r['round']} | `{json.dumps(r['cfg'])}` | {r['total_ms']:.2f} | "
                     f"{k.get('_sel_bwd_dkdv', 0.0):.2f} | {dq:.2f} | {k.get('_sel_bwd_reduce', 0.0):.2f} |")
    return "\n".join(lines) + "\n"


def main():
    from ab_eager_fork import ab_parser, parse_cases, run_cases
    from profile_block import ATTN_CONFIGS

    ap = ab_parser(__doc__, "paper:65536,paper:32768,1b:65536")  # CONFIG:T here: batch 1
    ap.add_argument("--variants", nargs="+", default=["{}", '{"order": "tokens", "chunk_tiles": 64}'])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    variants = [json.loads(v) for v in a.variants]
    if not all(isinstance(v, dict) for v in variants):
        ap.error("--variants: give each as a JSON object, e.g. '{}' or '{\"order\": \"tokens\"}'")
    if bad := [c for c in a.cases.split(",") if c.count(":") != 1]:
        ap.error(f"--cases {bad}: give CONFIG:T (batch 1), e.g. paper:65536")
    cases = parse_cases(",".join(c + ":1" for c in a.cases.split(",")), ATTN_CONFIGS)
    run_cases(a, "profile_sel_bwd", cases, lambda name, T, B: case_rows(name, T, variants, a.rounds), to_markdown)


if __name__ == "__main__":
    main()
