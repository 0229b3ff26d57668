"""Launch shapes of the per-(token, slot) kernels of the block-centric selected branch: the forward's merge
(``_sel_merge``) and the backward's dQ-partial sum (``_sel_dq_sum``), tokens per program x warps, at m7c's shapes
(G 6, head dim 64, n 16, l' 64) on random partials, with each token using its real number of slots.

    python benchmarks/sweep_slot_kernels.py [--out DIR]

Writes sweep_slot_kernels_<device>.json / .md (median ms of triton.testing.do_bench). The committed launch is
selected_blocks._slot_tokens's tokens with 4 warps.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from nsa_titan.kernels.combine import pow2  # noqa: E402
from nsa_titan.kernels.selected_blocks import _sel_dq_sum, _sel_merge, _slot_tokens  # noqa: E402


def bench(B, T, HKV=2, G=6, n=16, D=64, lp=64) -> list[dict]:
    dev = "cuda"
    nb = -(-T // lp)
    used = torch.clamp(torch.arange(T, device=dev) // lp + 1, max=n)  # token t has min(n, t // l' + 1) slots
    idx = torch.randint(0, nb, (B, HKV, T, n), device=dev)
    idx = torch.where(torch.arange(n, device=dev)[None, None, None, :] < used[None, None, :, None], idx, -1)
    op = torch.randn(B, T, HKV, n, G, D, device=dev, dtype=torch.bfloat16)
    lpp = torch.randn(B, T, HKV, n, G, device=dev)
    o = torch.empty(B, T, HKV * G, D, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(B, T, HKV * G, device=dev)
    dq = torch.empty_like(o)
    gp, rows = pow2(G), []
    for bt in (1, 2, 4, 8):
        for w in (2, 4, 8):
            grid = (triton.cdiv(T, bt), B * HKV)
            merge = lambda: _sel_merge[grid](op, lpp, idx, o, lse, T, G, HKV, NSEL=n, NP=pow2(n), BT=bt,  # noqa: E731
                                             GP=gp, DV=D, DVP=D, num_warps=w)
            dqsum = lambda: _sel_dq_sum[grid](op, idx, dq, T, G, HKV, 0.125, NSEL=n, NP=pow2(n), BT=bt,  # noqa: E731
                                              GP=gp, DK=D, DKP=D, ACC=False, num_warps=w)
            rows.append(dict(B=B, T=T, tokens=bt, warps=w, committed=bt == _slot_tokens(gp, n, D) and w == 4,
                             merge_ms=triton.testing.do_bench(merge, rep=200),
                             dq_sum_ms=triton.testing.do_bench(dqsum, rep=200)))
            print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    from attention_checks import run_header, write_results

    payload = run_header(rows=bench(2, 8192) + bench(8, 2048))
    lines = [f"# Merge and dQ-sum launch shapes: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date'][:10]}; m7c shapes, ms.", "",
             "| B | T | tokens / program | warps | merge ms | dQ sum ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['B']} | {r['T']} | {r['tokens']} | {r['warps']}{' (committed)' if r['committed'] else ''} | "
              f"{r['merge_ms']:.3f} | {r['dq_sum_ms']:.3f} |" for r in payload["rows"]]
    write_results(a.out, "sweep_slot_kernels_" + payload["device"].replace(" ", "_"), payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
