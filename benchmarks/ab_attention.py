"""A/B of the NSA attention kernels: this checkout against another source tree, in one run on one GPU.

    git archive <commit> nsa_titan | tar -x -C /tmp/base          # the baseline tree
    python benchmarks/ab_attention.py --baseline /tmp/base --cases paper:8192:1,1b:8192:4,m7c:8192:2

Each tree runs in its own process (its own ``nsa_titan`` on sys.path, its own Triton cache entries): forward+
backward of ``nsa_titan.kernels.nsa_attention`` on the same random bf16 inputs, median of
triton.testing.do_bench (interleaved rounds: A, B, A, B, ... to spread clock drift over both), and peak
memory above the inputs. Writes ab_attention_<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def measure(cases: list[tuple[str, int, int]], tree: str) -> list[dict]:
    """Runs in the child: time and peak memory of every case with the nsa_titan of ``tree``."""
    import torch

    import nsa_titan
    from nsa_titan.kernels import nsa_attention

    if not os.path.realpath(nsa_titan.__file__).startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"imported {nsa_titan.__file__}, not the tree {tree}")
    # These benchmark modules put this checkout first on sys.path when imported: import them only after the
    # tree's package is loaded (sys.modules then keeps the tree's).
    from attention_checks import make_inputs
    from attention_timing import bench_one
    from profile_block import ATTN_CONFIGS, PAPER_P

    torch.manual_seed(0)
    rows = []
    for name, T, B in cases:
        HQ, HKV, DK, DV = ATTN_CONFIGS[name]
        ins = [x.requires_grad_(True) for x in make_inputs(B, T, HQ, HKV, DK, DV, PAPER_P)]
        dout = torch.randn(B, T, HQ, DV, device="cuda", dtype=torch.bfloat16)
        ms, peak = bench_one(lambda: nsa_attention(*ins, PAPER_P)[0], ins, dout, bwd=True)  # noqa: B023
        rows.append(dict(config=name, T=T, B=B, fwdbwd_ms=ms, peak_GiB=peak))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="a folder holding the baseline's nsa_titan package")
    ap.add_argument("--cases", default="paper:8192:1,paper:32768:1,1b:8192:4,m7c:8192:2,qwen7b:8192:1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    cases = [(c.split(":")[0], int(c.split(":")[1]), int(c.split(":")[2])) for c in a.cases.split(",")]
    if a.child:
        sys.path.insert(0, a.child)
        print("ROWS " + json.dumps(measure(cases, a.child)), flush=True)
        return
    results = {"baseline": [], "current": []}
    for _ in range(a.rounds):
        for label, tree in (("baseline", os.path.abspath(a.baseline)), ("current", REPO)):
            env = dict(os.environ, PYTHONPATH=tree)
            proc = subprocess.run([sys.executable, __file__, "--baseline", a.baseline, "--cases", a.cases,
                                   "--child", tree], env=env, capture_output=True, text=True, cwd="/")
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")), None)
            if line is None:
                raise SystemExit(f"{label} failed:\n{proc.stderr[-3000:]}")
            results[label].append(json.loads(line[5:]))
    import torch
    import triton

    table = []
    for i, (name, T, B) in enumerate(cases):
        row = dict(config=name, T=T, B=B)
        for label in results:
            row[f"{label}_ms"] = min(r[i]["fwdbwd_ms"] for r in results[label])
            row[f"{label}_GiB"] = results[label][0][i]["peak_GiB"]
            row[f"{label}_ms_rounds"] = [round(r[i]["fwdbwd_ms"], 3) for r in results[label]]
        row["speedup"] = row["baseline_ms"] / row["current_ms"]
        table.append(row)
        print(f"{name} T={T} B={B}: baseline {row['baseline_ms']:.3f} ms {row['baseline_GiB']:.2f} GiB -> current "
              f"{row['current_ms']:.3f} ms {row['current_GiB']:.2f} GiB ({row['speedup']:.3f}x)", flush=True)
    payload = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   baseline=a.baseline, rounds=a.rounds, cases=table)
    os.makedirs(a.out, exist_ok=True)
    name = "ab_attention_" + payload["device"].replace(" ", "_") + ".json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
