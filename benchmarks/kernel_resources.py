"""Registers, spills and tensor-core instructions of the band kernels and the selected dK/dV, compiled offline
for an H100 (sm_90).

    python benchmarks/kernel_resources.py [--out DIR]          # no GPU needed: the CPU machine will do

Every launch shape of the band kernels that band.py can pick for the 1b (head dim 128, G 16) and m7c (64, G 6)
attention shapes (band rows are packed (token, head) pairs; the selected dK/dV packs them exactly at head dim 64
and pads each group to next_pow2(G) rows at 128) is compiled with this machine's Triton for sm_90 (its bundled
ptxas), with and without the mask-free interior (``SPLIT``), with the tensor-descriptor loads band.py uses on a GPU
and without them (``tma``), and the selected dK/dV at 128 rows / 8 warps and 64 / 4
(BK is not used there); cuobjdump then gives registers per thread, stack bytes (spills
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

from nsa_titan.kernels import band, band_bwd, selected_bwd  # noqa: E402

WARP_SIZE = 32  # threads per warp of the target (sm_90)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DQ": "*bf16", "LSE": "*fp32",
            "DELTA": "*fp32", "DS": "*fp32", "DKP_": "*fp32", "DVP_": "*fp32"}
SEL_POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "LSE": "*fp32", "DELTA": "*fp32",
                "KEYS": "*i32", "OFF": "*i32", "COFF": "*i32", "PROG": "*i32", "ORD": "*i32", "POFF": "*i32",
                "DK_": "*bf16", "DV_": "*bf16", "PK": "*fp32", "PV": "*fp32", "DSB": "*bf16", "DQP": "*fp32",
                "DS": "*fp32"}
KERNELS = {"band_fwd": band._band_fwd, "band_dq": band_bwd._band_bwd_dq, "band_dkdv": band_bwd._band_bwd_dkdv}
SHAPES = {"1b": (128, 16, 1), "m7c": (64, 6, 2)}  # head dim, G, KV heads
GEOMETRY = {"cmp": (16, 31, 0), "win": (1, 0, 512)}  # KSTRIDE, KOFF, WIN of the paper's l=32, d=16, w=512


def parse_usage(text: str) -> dict:
    """cuobjdump --dump-resource-usage -> {"REG": int, "STACK": int, ...} of the (only) kernel's line."""
    line = next(x for x in text.splitlines() if "REG:" in x)
    return {k: int(v) for k, v in (f.split(":", 1) for f in line.split() if ":" in f and f.split(":", 1)[1].isdigit())}


def compile_sm90(fn, consts: dict, pointers: dict, num_warps: int, num_stages: int, int_div16=()):
    """``fn`` compiled for sm_90 (no GPU needed) with these constexprs; other ints are i32, ``*scale`` args fp32,
    pointers 16-byte aligned as in real launches. ``int_div16``: the int arguments a real launch would pass as
    multiples of 16 (Triton specialises those: vector loads through strides, fewer index instructions).
    Constexpr parameters with a default and no entry in ``consts`` take their default, as in a launch.
    -> Triton's compiled kernel (``.asm`` holds ttir ... cubin)."""
    sig, attrs, const = {}, {}, {}
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}  # as a launch fills them
    consts = {**defaults, **consts}
    for i, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n], const[(i,)] = "constexpr", consts[n]
        elif n in pointers:
            sig[n] = pointers[n]
            if not pointers[n].startswith("tensordesc"):  # descriptors carry their own alignment
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32" if n.endswith("scale") else "i32"
            if n in int_div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, WARP_SIZE),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def usage_and_sass(k) -> tuple[dict, str]:
    """A compiled kernel's cubin through cuobjdump -> (parse_usage of its resource line, its SASS listing)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        run = lambda *a: subprocess.run([os.path.join(BIN, "cuobjdump"), *a, f.name], capture_output=True,  # noqa: E731
                                        text=True, check=True).stdout
        return parse_usage(run("--dump-resource-usage")), run("-sass")


def compile_kernel(fn, consts: dict, pointers: dict, num_warps: int, num_stages: int) -> dict:
    """Compile ``fn`` for sm_90 (compile_sm90) -> registers, stack bytes, shared bytes, LDL/STL/HGMMA counts."""
    k = compile_sm90(fn, consts, pointers, num_warps, num_stages)
    usage, sass = usage_and_sass(k)
    count = {op: sum(f" {op}" in line for line in sass.splitlines()) for op in ("HGMMA", "LDL", "STL")}
    return dict(regs=usage.get("REG"), stack=usage.get("STACK"), shared=k.metadata.shared, **count)


def compile_one(kernel: str, D: int, G: int, geo: str, cfg: dict, hkv: int = 1) -> dict:
    """A band kernel (geometry cmp or win) or the selected dK/dV (geo "sel": l' 64, n 16, dS stored; "sel_dqp":
    dQ partials stored instead). A band kernel takes tensor descriptors where band.py passes them on a GPU (cfg
    ``tma``, default on: K/V in the forward and dQ, Q/dO in dK/dV with one KV head); the selected dK/dV with
    pointer loads (its gathers of scattered tokens are not boxes)."""
    if kernel == "sel_dkdv":
        fn, pointers = selected_bwd._sel_bwd_dkdv, SEL_POINTERS
        rows = max(cfg["rows"], band.pow2(G))
        gs = G if cfg.get("exact_rows", D <= 64) else band.pow2(G)
        consts = dict(LP=64, BS=64, NSEL=16, G=G, GS=gs, BT=rows // gs, ROWS=rows, DK=D, DV=D, DKP=D, DVP=D,
                      STORE_DS=geo == "sel", STORE_DQ=geo == "sel_dqp", DOC=False,
                      MASK_SPLIT=bool(cfg.get("mask_split", False)))
    else:
        kstride, koff, win = GEOMETRY[geo]
        fn, pointers = KERNELS[kernel], dict(POINTERS)
        tma = uses_tma(kernel, hkv, cfg)
        if tma and kernel == "band_dkdv":
            pointers.update(Q=f"tensordesc<bf16[1,{cfg['rows']},{D}]>", DO=f"tensordesc<bf16[1,{cfg['rows']},{D}]>")
        elif tma:
            pointers.update(K=f"tensordesc<bf16[1,{cfg['BK']},1,{D}]>", V=f"tensordesc<bf16[1,{cfg['BK']},1,{D}]>")
        consts = dict(G=G, KSTRIDE=kstride, KOFF=koff, WIN=win, ROWS=cfg["rows"], BK=cfg["BK"], DK=D, DV=D, DKP=D,
                      DVP=D, DOC=False, SPLIT=bool(cfg.get("split", True)), ACC=True, TMA=tma,
                      KT=bool(cfg.get("keys_rows", False)))  # band_dkdv's orientation (band_bwd._dkdv_launch)
    res = compile_kernel(fn, consts, pointers, cfg["num_warps"], cfg["num_stages"])
    return dict(kernel=kernel, D=D, G=G, geometry=geo, cfg=cfg, **res)


def uses_tma(kernel: str, hkv: int, cfg: dict) -> bool:
    """Whether band.py passes descriptors to this launch on a GPU (dK/dV: only with one KV head)."""
    return bool(cfg.get("tma", True)) and (kernel != "band_dkdv" or hkv == 1)


def shapes_to_check(kernel: str, D: int, gp: int, windowed: bool) -> list[dict]:
    """The launch config band.py picks on a GPU, the same with pointer loads, with the split toggled, and the 8-warp
    alternative."""
    picked = band.launch_cfg(kernel, gp, D, windowed, cuda=True)
    flipped = dict(picked, split=not picked.get("split", True))
    eight = dict(picked, rows=128, num_warps=8, num_stages=2 if kernel == "band_dkdv" else 3)
    out = []
    for c in (picked, dict(picked, tma=False), flipped, eight, dict(eight, split=False)):
        if c not in out:
            out.append(c)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    rows = []
    for name, (D, G, hkv) in SHAPES.items():
        gp = band.pow2(G)
        for kernel in KERNELS:
            for geo in GEOMETRY:
                for cfg in shapes_to_check(kernel, D, gp, geo == "win"):
                    if cfg.get("tma") is False and not uses_tma(kernel, hkv, {}):
                        continue  # the same kernel as the picked shape's
                    r = dict(config=name, tma=uses_tma(kernel, hkv, cfg), **compile_one(kernel, D, G, geo, cfg, hkv))
                    print(json.dumps(r), flush=True)
                    rows.append(r)
        for cfg in (dict(rows=128, num_warps=8, num_stages=2), dict(rows=64, num_warps=4, num_stages=2)):
            for geo in ("sel", "sel_dqp") if gp <= 8 else ("sel",):
                r = dict(config=name, **compile_one("sel_dkdv", D, G, geo, dict(cfg, BK=64)))
                print(json.dumps(r), flush=True)
                rows.append(r)
    payload = dict(target="sm_90 (offline compile, no GPU)", triton=triton.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), rows=rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "kernel_resources_sm90.json"), "w") as f:
        json.dump(payload, f, indent=1)
    lines = [f"# Band kernels compiled for sm_90 offline (Triton {payload['triton']}, {payload['date']})", "",
             "cfg = rows/BK/warps/stages, split = mask-free interior on, tma = tensor-descriptor loads (band.py);",
             "stack bytes and LDL/STL = register spills.", "",
             "| config | kernel | geometry | cfg | split | tma | regs | stack B | LDL | STL | HGMMA | shared B |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["cfg"]
        band_row = r["kernel"] != "sel_dkdv"  # no key tiles (BK) and no split in the selected kernel
        lines.append(f"| {r['config']} | {r['kernel']} | {r['geometry']} | {c['rows']}/{c['BK'] if band_row else '-'}/"
                     f"{c['num_warps']}/{c['num_stages']} | {int(c.get('split', True)) if band_row else '-'} | "
                     f"{int(r.get('tma', False)) if band_row else '-'} | "
                     f"{r['regs']} | {r['stack']} | {r['LDL']} | {r['STL']} | {r['HGMMA']} | {r['shared']} |")
    with open(os.path.join(a.out, "kernel_resources_sm90.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
