"""Instructions per loop iteration of the block-centric selected kernels, compiled offline for an H100 (sm_90).

    python benchmarks/loop_instructions.py [--out DIR]          # no GPU needed

The selected dK/dV walk is issue-bound (NOTES_kernels attempt 56: an instruction every ~7 cycles per warp at 2
programs per SM), so the SASS instructions of its loop body are a cost model one can read without a GPU. For the
walk at m7c's shape (G 6 packed exactly, head dim 64, dQ partials) and the 1b's (G 16, head dim 128, dS stored,
mask-free steps), for the block forward at m7c's and the band dK/dV at m7c's window and compressed geometries
(pointer loads: two KV heads), each with and without the launch option ``i32_rows``
(attempt 95: row arithmetic in 32 bits from each batch's bases, keys decoded unsigned), this prints registers, stack
bytes and, per loop of the kernel (a backward branch in the SASS), its instruction count by opcode. Ints that a
launch passes as multiples of 16 (strides, T) are compiled as such, as Triton specialises them. Writes
loop_instructions_sm90.json and .md.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from kernel_resources import POINTERS, SEL_POINTERS, compile_sm90, usage_and_sass  # noqa: E402

from nsa_titan.kernels import band_bwd, selected_blocks, selected_bwd  # noqa: E402

DIV16 = ("T", "sqb", "sqt", "sqh", "skb", "sks", "skh", "svb", "svs", "svh")
FWD_POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KEYS": "*i32", "OFF": "*i32", "COFF": "*i32",
                "PROG": "*i32", "OP": "*bf16", "LP_": "*fp32", "DS": "*fp32"}
CASES = {  # name: (kernel, constexprs, pointers, warps, stages) as the model launches them on an H100 (tuned.py)
    "walk_m7c": (selected_bwd._sel_bwd_dkdv, dict(LP=64, BS=64, NSEL=16, G=6, GS=6, BT=10, ROWS=64, DK=64, DV=64,
                                                  DKP=64, DVP=64, STORE_DS=False, STORE_DQ=True, DOC=False,
                                                  MASK_SPLIT=False), dict(SEL_POINTERS, DQP="*bf16"), 4, 3),
    "walk_m7c_mask_split": (selected_bwd._sel_bwd_dkdv, dict(LP=64, BS=64, NSEL=16, G=6, GS=6, BT=10, ROWS=64, DK=64,
                                                             DV=64, DKP=64, DVP=64, STORE_DS=False, STORE_DQ=True,
                                                             DOC=False, MASK_SPLIT=True),
                            dict(SEL_POINTERS, DQP="*bf16"), 4, 3),  # attempt 58's mask-free steps (off for m7c)
    "walk_1b": (selected_bwd._sel_bwd_dkdv, dict(LP=64, BS=64, NSEL=16, G=16, GS=16, BT=4, ROWS=64, DK=128, DV=128,
                                                 DKP=128, DVP=128, STORE_DS=True, STORE_DQ=False, DOC=False,
                                                 MASK_SPLIT=True), SEL_POINTERS, 4, 3),
    "block_fwd_m7c": (selected_blocks._sel_fwd_blocks, dict(G=6, LP=64, BS=64, NSEL=16, BT=10, ROWS=64, TILES=4, DK=64,
                                                            DV=64, DKP=64, DVP=64, DOC=False), FWD_POINTERS, 4, 1),
    # The band dK/dV at m7c's window and compressed geometries (two KV heads: pointer loads of Q and dO rows).
    "band_dkdv_m7c_win": (band_bwd._band_bwd_dkdv, dict(G=6, KSTRIDE=1, KOFF=0, WIN=512, ROWS=64, BK=64, DK=64, DV=64,
                                                         DKP=64, DVP=64, DOC=False, SPLIT=True, TMA=False, KT=False),
                          POINTERS, 4, 3),
    "band_dkdv_m7c_cmp": (band_bwd._band_bwd_dkdv, dict(G=6, KSTRIDE=16, KOFF=31, WIN=0, ROWS=64, BK=64, DK=64, DV=64,
                                                         DKP=64, DVP=64, DOC=False, SPLIT=True, TMA=False, KT=False),
                          POINTERS, 4, 3),
}


def sass_loops(sass: str) -> list[dict]:
    """Every backward branch of a cuobjdump -sass listing as a loop: its instruction count and opcodes."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            loops.append(dict(instructions=len(body), ops=dict(ops.most_common())))
    return loops


def measure(name: str, i32: bool) -> dict:
    fn, consts, pointers, warps, stages = CASES[name]
    k = compile_sm90(fn, dict(consts, I32=i32), pointers, warps, stages, int_div16=DIV16)
    usage, sass = usage_and_sass(k)
    return dict(case=name, i32_rows=i32, regs=usage.get("REG"), stack=usage.get("STACK"), loops=sass_loops(sass))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    rows = [measure(name, i32) for name in CASES for i32 in (False, True)]
    payload = dict(target="sm_90 (offline compile, no GPU)", triton=triton.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), rows=rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "loop_instructions_sm90.json"), "w") as f:
        json.dump(payload, f, indent=1)
    lines = [f"# Loop instructions of the block-centric selected kernels, sm_90 offline (Triton {payload['triton']}, "
             f"{payload['date']})", "", "Per loop (backward branch in the SASS): instructions per iteration per warp; "
             "integer = IMAD, LEA, SHF, IADD3, VIADD, ISETP, SEL, LOP3, PLOP3.", "",
             "| case | i32_rows | regs | stack B | loop | instructions | integer | HGMMA |",
             "|---|---|---|---|---|---|---|---|"]
    integer = ("IMAD", "LEA", "SHF", "IADD3", "VIADD", "ISETP", "SEL", "LOP3", "PLOP3")
    for r in rows:
        for i, lp in enumerate(r["loops"]):
            lines.append(f"| {r['case']} | {int(r['i32_rows'])} | {r['regs']} | {r['stack']} | {i + 1} | "
                         f"{lp['instructions']} | {sum(lp['ops'].get(o, 0) for o in integer)} | "
                         f"{lp['ops'].get('HGMMA', 0)} |")
    with open(os.path.join(a.out, "loop_instructions_sm90.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
