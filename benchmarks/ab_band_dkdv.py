"""A/B of the band dK/dV's split plans (band_bwd._split_plan) in this tree: uniform parts against balanced chunks.

    python benchmarks/ab_band_dkdv.py [--cases 1b:32768,m7c:8192:2] [--plans uniform,balanced] [--rounds 2] [--tag NAME]

The compressed keys' dK/dV (``band_bwd(..., parts="dkdv")`` with the compressed geometry, partial sums included) on
random bf16 inputs, timed by ``triton.testing.do_bench`` with TUNED's no-window ``band_dkdv`` entries given each
plan's launch options (PLANS) in turn, rounds interleaved (NOTES_kernels.md attempt 109); the JSON rows also give each
plan's grid, (nsplit, chunk rows, programs). A case is CONFIG:T[:B] with
CONFIG one of bench_attention.CONFIGS. Writes ab_band_dkdv_<tag>_<device>.json and .md. Needs a GPU; the summary is
tested on CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parse_cases(text: str) -> list[tuple[str, int, int]]:
    """'1b:32768,m7c:8192:2' -> [(config, T, B)]."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise SystemExit(f"--cases: {item!r} is not CONFIG:T or CONFIG:T:B (e.g. 1b:32768 or m7c:8192:2)")
        out.append((parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 1))
    return out


PLANS = {  # launch options set on TUNED's no-window band_dkdv entries for each plan (band_bwd._split_plan)
    "uniform": dict(balanced=False),
    "balanced": dict(balanced=True, balanced_min_queries=0),  # at any chunk length
    "balanced_cap": dict(balanced=True, balanced_min_queries=0, balanced_cap=True),  # <= 4 programs per SM (110)
    "tuned": {},  # TUNED as it is: balanced where its entry says so and the chunk is long enough
}


def summarize(times: dict[str, dict[str, list[float]]]) -> list[dict]:
    """{case: {plan: [ms...]}} -> rows with every plan's times and, for each plan but uniform, its speed-up
    (uniform median / the plan's median) under "speedup" (a dict by plan)."""
    rows = []
    for case, t in times.items():
        u = statistics.median(t["uniform"])
        rows.append({"case": case, "ms": t, "speedup": {k: u / statistics.median(v) for k, v in t.items()
                                                         if k != "uniform"}})
    return rows


def to_markdown(meta: dict, rows: list[dict]) -> str:
    plans = list(rows[0]["ms"]) if rows else ["uniform"]
    others = [p for p in plans if p != "uniform"]
    lines = [f"# Band dK/dV split plans: {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date'][:10]}; `benchmarks/ab_band_dkdv.py`, "
             f"{meta['rounds']} interleaved rounds, compressed geometry, ms of the dK/dV with its partial sums; "
             "speed-up = uniform's median / the plan's.", "",
             "| case | " + " | ".join(f"{p} ms" for p in plans) + " | " + " | ".join(f"{p} speed-up" for p in others)
             + " |", "|---" * (1 + len(plans) + len(others)) + "|"]
    for r in rows:
        lines.append(f"| {r['case']} | " + " | ".join(" / ".join(f"{x:.3f}" for x in r["ms"][p]) for p in plans)
                     + " | " + " | ".join(f"{r['speedup'][p]:.3f}x" for p in others) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1b:8192,1b:32768,1b:65536,m7c:8192:2,m7c:32768,paper:65536")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, uniform first; of {list(PLANS)}")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    cases = parse_cases(a.cases)
    plans = a.plans.split(",")
    if plans[0] != "uniform" or any(p not in PLANS for p in plans):
        raise SystemExit(f"--plans: {a.plans!r} must start with uniform and name plans of {list(PLANS)}")
    import torch
    import triton

    sys.path.insert(0, HERE)
    from bench_attention import CONFIGS

    from nsa_titan.kernels import band, band_bwd
    from nsa_titan.kernels.tuned import TUNED

    if not torch.cuda.is_available():
        raise SystemExit("ab_band_dkdv.py times GPU kernels: run it on a CUDA machine")
    keys = [k for k in TUNED if k[0] == "band_dkdv" and not k[3]]
    saved = {key: dict(TUNED[key]) for key in keys}
    times: dict[str, dict[str, list[float]]] = {}
    grids: dict[str, dict[str, list[int]]] = {}  # case -> plan -> (nsplit, chunk rows, programs) of _split_plan
    for _ in range(a.rounds):
        for name, T, B in cases:
            cfg = CONFIGS[name]
            p, hq, hkv, dk = cfg["p"], cfg["HQ"], cfg["HKV"], cfg["DK"]
            S = p.num_cmp_tokens(T)
            g = torch.Generator(device="cuda").manual_seed(0)
            q, do = (torch.randn(B, T, hq, dk, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(B, S, hkv, dk, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
            stride, koff = p.cmp_stride, p.cmp_block - 1
            o, lse = band.band_fwd(q, k, v, stride, koff, 0)
            delta = torch.randn(B, T, hq, device="cuda", generator=g)
            for plan in plans:
                for key in keys:
                    TUNED[key].update(PLANS[plan])
                ms = triton.testing.do_bench(lambda: band_bwd.band_bwd(do, q, k, v, o, lse, stride, koff, 0,
                                                                        delta=delta, parts="dkdv"), warmup=5, rep=80)
                times.setdefault(f"{name} T={T} B={B}", {name_: [] for name_ in plans})[plan].append(ms)
                G = hq // hkv
                grids.setdefault(f"{name} T={T} B={B}", {})[plan] = list(
                    band_bwd._dkdv_launch(G, dk, 0, q, None, S, T, B, hkv, stride, koff)[5])
                for key in keys:
                    TUNED[key].clear()
                    TUNED[key].update(saved[key])
    rows = summarize(times)
    for r in rows:
        r["grid"] = grids[r["case"]]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "rounds": a.rounds}
    md = to_markdown(meta, rows)
    print(md)
    stem = f"ab_band_dkdv{'_' + a.tag if a.tag else ''}_{meta['device'].replace(' ', '_')}"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, stem + ".json"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    with open(os.path.join(a.out, stem + ".md"), "w") as f:
        f.write(md)


if __name__ == "__main__":
    main()
