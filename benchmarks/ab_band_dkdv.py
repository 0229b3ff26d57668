"""A/B of the band dK/dV's split plans (band_bwd._split_plan) in this tree: uniform parts against balanced chunks.

    python benchmarks/ab_band_dkdv.py [--cases 1b:32768,1b:65536,m7c:32768,paper:65536] [--rounds 2] [--tag NAME]

The compressed keys' dK/dV (``band_bwd(..., parts="dkdv")`` with the compressed geometry, partial sums included) on
random bf16 inputs, timed by ``triton.testing.do_bench`` with TUNED's no-window ``band_dkdv`` entries set to
``balanced`` False and True in turn, rounds interleaved (NOTES_kernels.md attempt 109). A case is CONFIG:T[:B] with
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


def summarize(times: dict[str, dict[str, list[float]]]) -> list[dict]:
    """{case: {"uniform": [ms...], "balanced": [ms...]}} -> rows with each plan's median and the speed-up of balanced
    (uniform median / balanced median)."""
    rows = []
    for case, t in times.items():
        u, b = statistics.median(t["uniform"]), statistics.median(t["balanced"])
        rows.append({"case": case, "uniform_ms": t["uniform"], "balanced_ms": t["balanced"], "speedup": u / b})
    return rows


def to_markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Band dK/dV split plans, uniform vs balanced: {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date'][:10]}; `benchmarks/ab_band_dkdv.py`, "
             f"{meta['rounds']} interleaved rounds, compressed geometry, ms of the dK/dV with its partial sums.", "",
             "| case | uniform ms | balanced ms | speed-up (medians) |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {' / '.join(f'{x:.3f}' for x in r['uniform_ms'])} | "
                     f"{' / '.join(f'{x:.3f}' for x in r['balanced_ms'])} | {r['speedup']:.3f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1b:8192,1b:32768,1b:65536,m7c:8192:2,m7c:32768,paper:65536")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    cases = parse_cases(a.cases)
    import torch
    import triton

    sys.path.insert(0, HERE)
    from bench_attention import CONFIGS

    from nsa_titan.kernels import band, band_bwd
    from nsa_titan.kernels.tuned import TUNED

    if not torch.cuda.is_available():
        raise SystemExit("ab_band_dkdv.py times GPU kernels: run it on a CUDA machine")
    keys = [k for k in TUNED if k[0] == "band_dkdv" and not k[3]]
    times: dict[str, dict[str, list[float]]] = {}
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
            for plan in ("uniform", "balanced"):
                for key in keys:
                    TUNED[key]["balanced"] = plan == "balanced"
                ms = triton.testing.do_bench(lambda: band_bwd.band_bwd(do, q, k, v, o, lse, stride, koff, 0,
                                                                        delta=delta, parts="dkdv"), warmup=5, rep=80)
                times.setdefault(f"{name} T={T} B={B}", {"uniform": [], "balanced": []})[plan].append(ms)
    for key in keys:
        TUNED[key].pop("balanced", None)
    rows = summarize(times)
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
