"""Probe for the next attempt on the block-centric selected forward (m7c, qwen7b): can its merge read the
per-(token, slot) partials from L2 instead of DRAM if the forward writes them token chunk by token chunk?

    python benchmarks/probe_l2_partials.py [--out DIR]          # GPU: m7c's shapes at 8k batch 2
    TRITON_INTERPRET=1 python benchmarks/probe_l2_partials.py --check   # CPU: the chunked merge equals the whole one

The forward writes a [G, Dv] partial and its LSE for every (token, slot) pair, in the order of its block-sorted pair
list, and ``selected_blocks._sel_merge`` reads them back per token: at m7c's 8k batch 2 that is 402 MB written and
read once per layer, ~0.13 ms of DRAM time each way (NOTES_kernels.md, twenty-second and twenty-third views). Here a
stand-in producer (each pair's tile of gathered Q rows written as its partial, the real kernel's memory pattern
without its MMAs) writes the pairs in block order, then the real merge kernel (without the gate mix) runs; chunked,
the pairs are sorted by (token chunk, block) and producer and merge are launched per chunk, so that a chunk's
partials (C tokens * 49 KB at m7c's shapes and batch 2) may still be in L2 when the merge reads them. Everything is
captured in one CUDA graph per variant (launch gaps as in the model). Reported per chunk size C: the producer alone,
producer + merge, and the merge's share (their difference) against the whole-sequence pair. A merge share well below
the whole-sequence one says that chunking the real forward (its pair sort by (chunk, block), tables and merge per
chunk) pays; one that does not fall says L2 does not hold the partials and the idea can be dropped.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from nsa_titan.kernels.combine import pow2  # noqa: E402
from nsa_titan.kernels.selected_blocks import _sel_merge, _slot_tokens, slot_row  # noqa: E402


@triton.jit
def _probe_write(PAIRS, Q, OP, LP_, T, HKV, NPAIRS, G: tl.constexpr, NSEL: tl.constexpr, BT: tl.constexpr,
                 ROWS: tl.constexpr, D: tl.constexpr):
    """BT consecutive pairs of this (batch, KV head)'s list (pair index e = t * n + slot): each pair's G rows of Q
    times (slot + 1) written to its partial slot, its LSE = the slot number (what a forward tile stores, without its
    MMAs)."""
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, kv = (bh // HKV).to(tl.int64), bh % HKV
    r = tl.arange(0, ROWS)
    i = pid * BT + r // G
    ok = (r < BT * G) & (i < NPAIRS)
    e = tl.load(PAIRS + bh.to(tl.int64) * (T * NSEL) + i, mask=ok, other=0)
    t, slot, g = e // NSEL, e % NSEL, r % G
    d = tl.arange(0, D)
    q = tl.load(Q + ((b * T + t) * (HKV * G) + kv * G + g)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    row = slot_row(b, t, kv, slot, g, T, HKV, G, NSEL)
    tl.store(OP + row[:, None] * D + d[None, :], (q.to(tl.float32) * (slot + 1).to(tl.float32)[:, None]).to(q.dtype),
             mask=ok[:, None])
    tl.store(LP_ + row, slot.to(tl.float32), mask=ok)


def chunk_sorted_pairs(B, T, HKV, n, lp, chunk, gen, device):
    """[B * HKV, T * n] pair indices t * n + slot sorted by (token chunk, block), each token's n blocks distinct and
    random among its candidates (blocks 0 .. t // l', all of them when fewer than n); ``chunk`` T: by block only."""
    nb = -(-T // lp)
    blocks = torch.rand(B * HKV, T, nb, generator=gen).argsort(-1)[..., :n]  # n distinct blocks per token
    t = torch.arange(T)
    blocks = blocks % (t // lp + 1)[None, :, None]  # candidates only (duplicates at t < n * l' do not matter here)
    key = (t // chunk)[None, :, None] * nb + blocks
    return key.reshape(B * HKV, T * n).argsort(dim=-1, stable=True).to(torch.int32).to(device)


def run(B=2, T=8192, HKV=2, G=6, n=16, D=64, lp=64, chunks=(4096, 2048, 1024, 512, 256), device="cuda",
        check=False) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(B, T, HKV * G, D, generator=gen).to(device=device, dtype=dt)
    op = torch.zeros(B, T, HKV, n, G, D, device=device, dtype=dt)
    lpart = torch.zeros(B, T, HKV, n, G, device=device)
    idx = torch.zeros(B, HKV, T, n, dtype=torch.int64, device=device)  # every slot used
    o, lse = torch.empty(B, T, HKV * G, D, device=device, dtype=dt), torch.empty(B, T, HKV * G, device=device)
    gp, bt_w = pow2(G), 64 // G

    def launches(pairs, c, merge):
        mt = min(_slot_tokens(gp, n, D), c)  # merge tokens per program: no tile may reach past its chunk
        for c0 in range(0, T, c):
            _probe_write[(triton.cdiv(c * n, bt_w), B * HKV)](pairs[:, c0 * n:], q, op, lpart, T, HKV, c * n, G=G,
                                                               NSEL=n, BT=bt_w, ROWS=64, D=D)
            if merge:
                _sel_merge[(triton.cdiv(c, mt), B * HKV)](op[:, c0:], lpart[:, c0:], idx[:, :, c0:], o[:, c0:],
                                                          lse[:, c0:], o, o, o, o, T, G, HKV, NSEL=n, NP=pow2(n),
                                                          BT=mt, GP=gp, DV=D, DVP=D, MIX=False, num_warps=4)

    rows, results = [], {}
    for c in (T, *chunks):
        pairs = chunk_sorted_pairs(B, T, HKV, n, lp, c, gen, device)
        times = {}
        for merge in (False, True):
            if device == "cuda":
                launches(pairs, c, merge)  # compile outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    launches(pairs, c, merge)
                times[merge] = triton.testing.do_bench(graph.replay, rep=300)
            else:
                launches(pairs, c, merge)
        if check:
            results[c] = o.clone()
        else:
            rows.append(dict(B=B, T=T, chunk=c, producer_ms=times[False], producer_merge_ms=times[True],
                             merge_share_ms=times[True] - times[False]))
            print(rows[-1], flush=True)
    if check:  # every chunking merges to the same output: q times the mean of (slot + 1) weighted by 2^slot
        first = results[T]
        s = torch.arange(n, dtype=torch.float64)
        want = q.double() * float((2**s * (s + 1)).sum() / (2**s).sum())
        same = all(torch.equal(r, first) for r in results.values())
        err = float((first.double() - want).abs().max() / want.abs().max())
        return [dict(same=same, err=err)]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--check", action="store_true", help="tiny shapes on the CPU interpreter: results only")
    a = ap.parse_args()
    if a.check:
        res = run(B=1, T=96, HKV=2, G=3, n=4, D=16, lp=16, chunks=(32, 16), device="cpu", check=True)[0]
        print(res)
        sys.exit(0 if res["same"] and res["err"] < 1e-5 else 1)
    from attention_checks import run_header, write_table

    payload = run_header(rows=run())
    write_table(a.out, "probe_l2_partials", payload,
                "Merge reads of the block forward's partials, whole sequence vs token chunks",
                "m7c's shapes (B 2, T 8192, 2 KV heads, G 6, head dim 64, n 16), one CUDA graph per row, median ms of "
                "triton.testing.do_bench.",
                ["chunk (tokens)", "producer ms", "producer + merge ms", "merge's share ms"],
                [[str(r["chunk"]), f"{r['producer_ms']:.4f}", f"{r['producer_merge_ms']:.4f}",
                  f"{r['merge_share_ms']:.4f}"] for r in payload["rows"]])

if __name__ == "__main__":
    main()
