"""Probe: band_gluon._band_fwd_wg against band.py's Triton _band_fwd (TUNED shape) on one GPU.

    python benchmarks/probes/gluon_band_fwd.py [--out DIR] [--cases paper:65536,1b:32768] [--variants 128x64x4,...]

For each case and branch (compressed: stride 16, offset 31; window 512), random bf16 inputs: the Triton kernel's
output and LSE, each Gluon variant's (ROWS x BK x NBUF) max abs difference from them, and the kernels' median
times (triton.testing.do_bench, eager launches). Writes gluon_band_fwd_probe<tag>_<device>.json.
"""
import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nsa_titan.kernels import band, band_gluon  # noqa: E402

CONFIGS = {"paper": (64, 4, 128), "1b": (16, 1, 128), "qwen7b": (28, 4, 128), "m7c": (12, 2, 64)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="paper:8192,paper:65536,1b:32768,1b:65536,qwen7b:32768,m7c:32768")
    ap.add_argument("--variants", default="128x64x4,128x64x3,128x128x2,64x64x3,64x64x2")
    ap.add_argument("--out", default=".")
    ap.add_argument("--tag", default="")
    ap.add_argument("--branches", default="cmp,win")
    a = ap.parse_args()
    rows_out = []
    torch.manual_seed(0)
    for case in a.cases.split(","):
        name, T = case.split(":")
        T = int(T)
        HQ, HKV, D = CONFIGS[name]
        q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
        for br in a.branches.split(","):
            if br == "cmp":
                ks, ko, win = 16, 31, 0
                S = (T - 32) // 16 + 1
            else:
                ks, ko, win = 1, 0, 512
                S = T
            k = torch.randn(1, S, HKV, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(1, S, HKV, D, device="cuda", dtype=torch.bfloat16)
            o_ref, lse_ref = band.band_fwd(q, k, v, ks, ko, win)
            ms_ref = triton.testing.do_bench(lambda: band.band_fwd(q, k, v, ks, ko, win), warmup=50, rep=300)
            row = dict(config=name, T=T, branch=br, triton_ms=ms_ref, variants={})
            print(f"{name} {T} {br}: triton {ms_ref:.3f} ms", flush=True)
            for var in a.variants.split(","):
                rows, bk, nbuf = map(int, var.split("x"))
                o = torch.empty_like(o_ref)
                lse = torch.empty_like(lse_ref)
                scale = D**-0.5 * band.LOG2E
                fn = lambda: band_gluon.launch(q, k, v, o, lse, ks, ko, win, T, rows, bk, nbuf, True, scale)  # noqa: E731
                try:
                    t0 = time.time()
                    fn()
                    torch.cuda.synchronize()
                    comp = time.time() - t0
                    fin = torch.isfinite(lse_ref)
                    do = (o.float() - o_ref.float()).abs().max().item()
                    dl = (lse[fin] - lse_ref[fin]).abs().max().item() if fin.any() else 0.0
                    same_inf = bool(torch.equal(torch.isinf(lse), torch.isinf(lse_ref)))
                    bitwise = bool(torch.equal(o, o_ref))
                    ms = triton.testing.do_bench(fn, warmup=50, rep=300)
                    r = dict(ms=ms, speedup=ms_ref / ms, max_abs_o=do, max_abs_lse=dl, inf_rows_same=same_inf,
                             bitwise_o=bitwise, first_call_s=comp)
                except Exception as e:  # noqa: BLE001
                    r = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
                row["variants"][var] = r
                print(f"   {var}: {r}", flush=True)
            rows_out.append(row)
    dev = torch.cuda.get_device_name()
    meta = dict(device=dev, torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    path = os.path.join(a.out, f"gluon_band_fwd_probe{a.tag}_{dev.replace(' ', '_')}.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows_out), f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
