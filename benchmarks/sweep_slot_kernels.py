"""Launch shapes of the per-(token, slot) kernels of the block-centric selected branch: the forward's merge
(``_sel_merge``) and the backward's dQ-partial sum (``_sel_dq_sum``), tokens per program x warps, at m7c's shapes
(G 6, head dim 64, n 16, l' 64) on random partials, with each token using its real number of slots.

    python benchmarks/sweep_slot_kernels.py [--out DIR]
    python benchmarks/sweep_slot_kernels.py --dq2 [--out DIR]

Writes sweep_slot_kernels_<device>.json / .md (median ms of triton.testing.do_bench). The committed launch is
selected_blocks._slot_tokens's tokens with 4 warps. ``--dq2`` instead times the backward's last dQ step both ways
(attempt 88): the dQ sum followed by band_dq2 adding into its dQ, against band_dq2 adding the partials itself, for
each number of slots per load (``psum_slots``); writes sweep_dq2_partials_<device>.json / .md.
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

from nsa_titan.kernels import band, band_dq2  # noqa: E402
from nsa_titan.kernels.combine import pow2, rowdot  # noqa: E402
from nsa_titan.kernels.selected_blocks import _sel_dq_sum, _sel_merge, _slot_tokens, sel_dq_sum  # noqa: E402


def random_slots(B, T, HKV, n, lp, dev):
    """block_idx with token t using min(n, t // l' + 1) slots (the rest -1), random blocks."""
    used = torch.clamp(torch.arange(T, device=dev) // lp + 1, max=n)
    idx = torch.randint(0, -(-T // lp), (B, HKV, T, n), device=dev)
    return torch.where(torch.arange(n, device=dev)[None, None, None, :] < used[None, None, :, None], idx, -1)


def bench(B, T, HKV=2, G=6, n=16, D=64, lp=64) -> list[dict]:
    dev = "cuda"
    idx = random_slots(B, T, HKV, n, lp, dev)  # token t has min(n, t // l' + 1) slots
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


def bench_dq2(B, T, HKV=2, G=6, n=16, D=64, lp=64, cmp=(32, 16), win=512) -> list[dict]:
    """The window's and the compressed branch's dQ plus the selected branch's partials, m7c's shapes: separately
    (sel_dq_sum, then band_dq2 adding) and in one band_dq2 launch at 1, 2, 4 and 8 slots per load."""
    dev, dt = "cuda", torch.bfloat16
    q, do = (torch.randn(B, T, HKV * G, D, device=dev, dtype=dt) for _ in range(2))
    tc = (T - cmp[0]) // cmp[1] + 1
    kw, vw = (torch.randn(B, T, HKV, D, device=dev, dtype=dt) for _ in range(2))
    kc, vc = (torch.randn(B, tc, HKV, D, device=dev, dtype=dt) for _ in range(2))
    branches = []
    for k, v, geo in ((kw, vw, (1, 0, win)), (kc, vc, (cmp[1], cmp[0] - 1, 0))):
        o, lse = band.band_fwd(q, k, v, *geo)
        branches.append((k, v, lse, rowdot(do, o), *geo))
    parts = (torch.randn(B, T, HKV, n, G, D, device=dev, dtype=dt), random_slots(B, T, HKV, n, lp, dev))
    dq = torch.empty_like(q)

    def separate():
        sel_dq_sum(*parts, dq, D**-0.5, acc=False)
        band_dq2.band_dq2(do, q, *branches, dq)

    rows = [dict(B=B, T=T, variant="sum, then band_dq2", ms=triton.testing.do_bench(separate, rep=200))]
    entry = band.launch_cfg("band_dq2", pow2(G), D, False, True)
    for sg in (1, 2, 4, 8):
        fused = lambda: band_dq2.band_dq2(do, q, *branches, dq, cfg=dict(entry, psum_slots=sg),  # noqa: E731
                                          dq_partials=parts, acc=False)
        rows.append(dict(B=B, T=T, variant=f"band_dq2 with partials, {sg} slots per load",
                         ms=triton.testing.do_bench(fused, rep=200)))
    rows.append(dict(B=B, T=T, variant="band_dq2 alone (no partials)",
                     ms=triton.testing.do_bench(lambda: band_dq2.band_dq2(do, q, *branches, dq), rep=200)))
    for r in rows:
        print(r, flush=True)
    return rows


def main_dq2(out: str) -> None:
    from attention_checks import run_header, write_table

    payload = run_header(rows=bench_dq2(2, 8192) + bench_dq2(8, 2048) + bench_dq2(1, 32768))
    write_table(out, "sweep_dq2_partials", payload, "The selected dQ partials inside band_dq2 (attempt 88)",
                "m7c shapes (G 6, head dim 64, n 16, window 512, compressed l 32 / d 16), median ms of "
                "triton.testing.do_bench.", ["B", "T", "variant", "ms"],
                [[str(r["B"]), str(r["T"]), r["variant"], f"{r['ms']:.4f}"] for r in payload["rows"]])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--dq2", action="store_true", help="time the dQ sum inside band_dq2 (attempt 88) instead")
    a = ap.parse_args()
    if a.dq2:
        return main_dq2(a.out)
    from attention_checks import run_header, write_table

    payload = run_header(rows=bench(2, 8192) + bench(8, 2048))
    write_table(a.out, "sweep_slot_kernels", payload, "Merge and dQ-sum launch shapes", "m7c shapes, ms.",
                ["B", "T", "tokens / program", "warps", "merge ms", "dQ sum ms"],
                [[str(r["B"]), str(r["T"]), str(r["tokens"]), f"{r['warps']}{' (committed)' if r['committed'] else ''}",
                  f"{r['merge_ms']:.3f}", f"{r['dq_sum_ms']:.3f}"] for r in payload["rows"]])


if __name__ == "__main__":
    main()
