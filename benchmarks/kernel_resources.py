"""Registers, spills and tensor-core instructions of the band kernels, compiled offline for an H100 (sm_90).

    python benchmarks/kernel_resources.py [--out DIR]          # no GPU needed: the CPU machine will do

Every launch shape of the band kernels that band.py can pick for the 1b (head dim 128, next_pow2(G) 16) and
m7c (64, 8) attention shapes is compiled with this machine's Triton for sm_90 (its bundled ptxas), with and
without the mask-free interior (``SPLIT``); cuobjdump then gives registers per thread, stack bytes (spills
land there), the local loads/stores of spilled values (LDL/STL) and the wgmma instructions (HGMMA). Device
time is scarce: this shows before any GPU run whether a shape spills. Caveat: the GPU machines run an older
Triton (3.6 on 2026-11-25), whose code may differ; the JSON records the version that compiled.
Writes kernel_resources_sm90.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nsa_titan.kernels import band  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DQ": "*bf16", "LSE": "*fp32",
            "DELTA": "*fp32", "DS": "*fp32", "DKP_": "*fp32", "DVP_": "*fp32"}
KERNELS = {"band_fwd": band._band_fwd, "band_dq": band._band_bwd_dq, "band_dkdv": band._band_bwd_dkdv}
SHAPES = {"1b": (128, 16), "m7c": (64, 8)}  # head dim, next_pow2(G)
GEOMETRY = {"cmp": (16, 31, 0), "win": (1, 0, 512)}  # KSTRIDE, KOFF, WIN of the paper's l=32, d=16, w=512


def parse_usage(text: str) -> dict:
    """cuobjdump --dump-resource-usage -> {"REG": int, "STACK": int, ...} of the (only) kernel's line."""
    line = next(x for x in text.splitlines() if "REG:" in x)
    return {k: int(v) for k, v in (f.split(":", 1) for f in line.split() if ":" in f and f.split(":", 1)[1].isdigit())}


def compile_one(kernel: str, D: int, gp: int, geo: str, cfg: dict) -> dict:
    fn = KERNELS[kernel]
    kstride, koff, win = GEOMETRY[geo]
    const = dict(KSTRIDE=kstride, KOFF=koff, WIN=win, BT=max(1, cfg["rows"] // gp), GP=gp, BK=cfg["BK"], DK=D, DV=D,
                 DKP=D, DVP=D, DOC=False, SPLIT=bool(cfg.get("split", True)), ACC=True)
    names = fn.arg_names
    sig, attrs, consts = {}, {}, {}
    for i, n in enumerate(names):
        if n in const:
            sig[n], consts[(i,)] = "constexpr", const[n]
        elif n in POINTERS:
            sig[n], attrs[(i,)] = POINTERS[n], [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32" if n.endswith("scale") else "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = parse_usage(subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                                           capture_output=True, text=True, check=True).stdout)
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    count = {op: sum(f" {op}" in line for line in sass) for op in ("HGMMA", "LDL", "STL")}
    return dict(kernel=kernel, D=D, gp=gp, geometry=geo, cfg=cfg, regs=usage.get("REG"), stack=usage.get("STACK"),
                shared=k.metadata.shared, **count)


def shapes_to_check(kernel: str, D: int, gp: int, windowed: bool) -> list[dict]:
    """The launch config band.py picks on a GPU, the same with the split toggled, and the 8-warp alternative."""
    picked = band.launch_cfg(kernel, gp, D, windowed, cuda=True)
    flipped = dict(picked, split=not picked.get("split", True))
    eight = dict(picked, rows=128, num_warps=8, num_stages=2 if kernel == "band_dkdv" else 3)
    out = []
    for c in (picked, flipped, eight, dict(eight, split=False)):
        if c not in out:
            out.append(c)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    rows = []
    for name, (D, gp) in SHAPES.items():
        for kernel in KERNELS:
            for geo in GEOMETRY:
                for cfg in shapes_to_check(kernel, D, gp, geo == "win"):
                    r = dict(config=name, **compile_one(kernel, D, gp, geo, cfg))
                    print(json.dumps(r), flush=True)
                    rows.append(r)
    payload = dict(target="sm_90 (offline compile, no GPU)", triton=triton.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), rows=rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "kernel_resources_sm90.json"), "w") as f:
        json.dump(payload, f, indent=1)
    lines = [f"# Band kernels compiled for sm_90 offline (Triton {payload['triton']}, {payload['date']})", "",
             "cfg = rows/BK/warps/stages, split = mask-free interior on; stack bytes and LDL/STL = register spills.",
             "", "| config | kernel | geometry | cfg | split | regs | stack B | LDL | STL | HGMMA | shared B |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["cfg"]
        lines.append(f"| {r['config']} | {r['kernel']} | {r['geometry']} | {c['rows']}/{c['BK']}/{c['num_warps']}/"
                     f"{c['num_stages']} | {int(c.get('split', True))} | {r['regs']} | {r['stack']} | {r['LDL']} | "
                     f"{r['STL']} | {r['HGMMA']} | {r['shared']} |")
    with open(os.path.join(a.out, "kernel_resources_sm90.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
