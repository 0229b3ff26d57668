"""The selection kernel's block importances are fp32-exact on the GPU, not only in the interpreter.

Triton's combiner turns a broadcast-multiply-sum of dot-sized tiles (``sum(a[:, :, None] * b[None], 1)``, 16 rows
and more) into ``tt.dot`` at its default tf32 input precision. select.py's eq. 9 overlap map was written that way,
so on an H100 every program of 16 tokens or more rounded the group-summed probabilities to tf32 (rel. ~5e-4) and
0.4 % of m7c's rows at 8k picked other blocks than a float64 selection (select_precision_H100.md, 2026-11-26);
the interpreter computes the broadcast in fp32 and could not see it. This test compiles the kernel for sm_90 (no
GPU needed: Triton's own compiler, through benchmarks/kernel_resources.compile_sm90) at the tile shapes the
launcher picks and fails if any fp32 dot runs at plain tf32. Compiled in a child process: the kernel must be a
JIT function, not the interpreter's, whatever TRITON_INTERPRET the test process has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, re, sys
from kernel_resources import compile_sm90
from nsa_titan.kernels import select
out = []
for BT, GP, DK in json.loads(sys.argv[1]):
    consts = dict(CD=16, CL=32, LP=64, R=4, LD=2, NSEL=16, W=16, BT=BT, GP=GP, CI=64, BJ=15, DK=DK, DKP=DK,
                  DOC=False, SORTED_MERGE=True, TMA=False, HL=select.heads_on_register_rows(BT * GP, GP))
    ptr = {"Q": "*bf16", "KC": "*bf16", "LSE": "*fp32", "IDX": "*i64", "DS": "*fp32"}
    k = compile_sm90(select._select_kernel, consts, ptr, num_warps=4, num_stages=3)
    dots = []
    for line in k.asm["ttir"].splitlines():
        if "tt.dot" in line:
            prec = re.search(r"inputPrecision = (\w+)", line)
            types = re.findall(r"tensor<([0-9x]+)x(\w+)>", line)
            # the IR printer leaves out the attribute's default value, which is ieee
            dots.append(dict(precision=prec.group(1) if prec else "ieee", a=types[0] if types else None))
    out.append(dict(BT=BT, GP=GP, DK=DK, dots=dots))
print(json.dumps(out))
"""


def test_selection_importance_dot_is_not_plain_tf32():
    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend to compile for sm_90")
    # (tokens per program, padded group, head dim): m7c's default 16 and 32 tokens, the 1b's default 8 and 4, and
    # 8 at G 8 (no dot); 128-row tiles take the heads-on-register-rows order (select.heads_on_register_rows)
    shapes = [(16, 8, 64), (32, 8, 64), (8, 16, 128), (4, 16, 128), (8, 8, 128)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([repo, os.path.join(repo, "benchmarks"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(shapes)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == len(shapes)
    for r in res:
        # The q K_cmp^T score dot is bf16 (exact products): it must be there, or the parse found nothing.
        assert any(d["a"] and d["a"][1] == "bf16" for d in r["dots"]), r
        f32 = [d for d in r["dots"] if d["a"] and d["a"][1] == "f32"]
        assert all(d["precision"] in ("tf32x3", "ieee") for d in f32), (
            f"select kernel at BT={r['BT']} GP={r['GP']} DK={r['DK']}: an fp32 dot at plain tf32 precision "
            f"(the overlap map must stay fp32-exact): {r['dots']}")
        assert f32, r  # the overlap map is an explicit fp32 dot at every tile shape
