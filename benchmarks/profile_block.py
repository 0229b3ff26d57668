"""Where one transformer block's time goes: NSA block vs dense block, both compiled, forward+backward.

    python benchmarks/profile_block.py --flavors 1b,m7c --seq 8192 --batch 4,2 [--out DIR]
    python benchmarks/profile_block.py --attention paper,m7c,qwen7b --seq 8192   # kernels alone

For each flavor and attention type, one TransformerBlock with fp32 parameters under bf16 autocast (what the
trainer runs on one GPU) is compiled with ``fullgraph=True`` and timed (median of triton.testing.do_bench),
then profiled with torch.profiler: every GPU kernel's total time is assigned to a category (NSA attention
kernels, SDPA/flash, matmuls, inductor-fused elementwise, copies, other). ``--attention`` times the NSA
attention function alone (random bf16 inputs) and splits it per kernel the same way.
Writes profile_block_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nsa_titan.models import get_model_args  # noqa: E402
from nsa_titan.models.nsa.common import NSAParams  # noqa: E402
from nsa_titan.models.nsa.model import TransformerBlock  # noqa: E402

# name -> (HQ, HKV, DK, DV); NSA sizes are the paper's for all
ATTN_CONFIGS = {"paper": (64, 4, 128, 128), "1b": (16, 1, 128, 128), "m7c": (12, 2, 64, 64),
                "qwen7b": (28, 4, 128, 128)}
PAPER_P = NSAParams(32, 16, 64, 16, 512)

CATEGORIES = [  # first match wins (lower-cased kernel name)
    ("nsa: compressed/window", ("_band_",)),
    ("nsa: select", ("_select_kernel",)),
    ("nsa: selected", ("_sel_",)),
    ("nsa: combine/rowdot", ("_combine_", "_rowdot")),
    ("sdpa/flash", ("flash", "fmha", "attention")),
    ("sort/search", ("sort", "search", "radix")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul", "splitk")),
    ("inductor fused", ("triton_",)),
    ("copy/cast", ("copy", "cast", "elementwise", "vectorized", "fill", "reduce")),
]


def category(name: str) -> str:
    n = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in n for k in keys):
            return cat
    return "other"


def profile_kernels(fn, iters: int = 5) -> dict:
    """Run fn `iters` times under the profiler; per-kernel and per-category GPU ms per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    counts = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time_total / 1e3 / iters
            counts[e.name] += 1
    per_cat = defaultdict(float)
    for k, ms in per_kernel.items():
        per_cat[category(k)] += ms
    # Every kernel (not a top few): diffing an NSA block against a dense one needs the small ones too.
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    return dict(kernel_ms=sum(per_kernel.values()), launches=sum(counts.values()) / iters,
                categories=dict(sorted(per_cat.items(), key=lambda kv: -kv[1])),
                top=[(k[:110], round(ms, 4), counts[k] // iters) for k, ms in top])


def time_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def block_case(flavor: str, attn_type: str, T: int, B: int, compile_: bool) -> dict:
    args = get_model_args(flavor, attn_type=attn_type, max_seq_len=max(T, 1024))
    torch.manual_seed(0)
    block = TransformerBlock(0, args).cuda()
    block.init_weights()
    from nsa_titan.models.nsa.attention import rope_tables

    cos, sin = (x.cuda()[:T] for x in rope_tables(args.head_dim, T, args.rope_theta))
    run_block = torch.compile(block, fullgraph=True) if compile_ else block
    x = torch.randn(B, T, args.dim, device="cuda", requires_grad=True)
    dy = torch.randn(B, T, args.dim, device="cuda")

    def fwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return run_block(x, cos, sin)

    def fwdbwd():
        fwd().backward(dy)

    for _ in range(3):  # compile, autotune, allocator warm-up
        fwdbwd()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwdbwd()
    torch.cuda.synchronize()
    row = dict(flavor=flavor, attn_type=attn_type, T=T, B=B, compiled=compile_,
               fwd_ms=time_ms(lambda: fwd()), fwdbwd_ms=time_ms(fwdbwd),
               peak_GiB=(torch.cuda.max_memory_allocated() - base) / 2**30)
    row["tokens_per_s_block"] = B * T / row["fwdbwd_ms"] * 1e3
    row["profile"] = profile_kernels(fwdbwd)
    return row


def attention_fwdbwd(name: str, T: int, B: int = 1):
    """-> (fwdbwd, inputs, dout): one forward+backward of the NSA attention on random bf16 inputs of a config."""
    from attention_checks import make_inputs

    from nsa_titan.kernels import nsa_attention

    HQ, HKV, DK, DV = ATTN_CONFIGS[name]
    ins = [x.requires_grad_(True) for x in make_inputs(B, T, HQ, HKV, DK, DV, PAPER_P)]
    dout = torch.randn(B, T, HQ, DV, device="cuda", dtype=torch.bfloat16)

    def fwdbwd():
        for x in ins:
            x.grad = None
        nsa_attention(*ins, PAPER_P)[0].backward(dout)

    return fwdbwd, ins, dout


def attention_case(name: str, T: int, B: int = 1) -> dict:
    fwdbwd, ins, dout = attention_fwdbwd(name, T, B)
    q, k, v = ins[0], ins[3], ins[4]

    def sdpa():
        q.grad = k.grad = v.grad = None
        torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=True).backward(dout.transpose(1, 2))

    row = dict(config=name, T=T, B=B, nsa_fwdbwd_ms=time_ms(fwdbwd), sdpa_fwdbwd_ms=time_ms(sdpa))
    row["nsa_over_sdpa_time"] = row["nsa_fwdbwd_ms"] / row["sdpa_fwdbwd_ms"]
    row["profile"] = profile_kernels(fwdbwd)
    return row


def to_markdown(payload: dict) -> str:
    lines = [f"# Block profile: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}. Compiled blocks "
             "(fullgraph), fp32 params + bf16 autocast; forward+backward; GPU ms per call from torch.profiler.", ""]
    for r in payload.get("blocks", []):
        p = r["profile"]
        lines += [f"## {r['flavor']} {r['attn_type']} T={r['T']} B={r['B']}: fwd {r['fwd_ms']:.2f} ms, "
                  f"fwd+bwd {r['fwdbwd_ms']:.2f} ms, {r['tokens_per_s_block']:,.0f} tok/s per block, "
                  f"peak {r['peak_GiB']:.2f} GiB, {p['launches']:.0f} kernels", "",
                  "| category | ms | share |", "|---|---|---|"]
        lines += [f"| {c} | {ms:.3f} | {ms / p['kernel_ms']:.1%} |" for c, ms in p["categories"].items()]
        lines += ["", "| kernel | ms | calls |", "|---|---|---|"]
        lines += [f"| `{k}` | {ms:.3f} | {n} |" for k, ms, n in p["top"][:15]]
        lines.append("")
    for r in payload.get("attention", []):
        p = r["profile"]
        lines += [f"## attention {r['config']} T={r['T']} B={r.get('B', 1)}: NSA {r['nsa_fwdbwd_ms']:.2f} ms, SDPA "
                  f"{r['sdpa_fwdbwd_ms']:.2f} ms fwd+bwd", "", "| kernel | ms | calls |", "|---|---|---|"]
        lines += [f"| `{k}` | {ms:.3f} | {n} |" for k, ms, n in p["top"][:20]]
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavors", default="")
    ap.add_argument("--batch", default="", help="local batch per flavor, comma-separated")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--attention", default="", help="attention configs to split per kernel, each NAME or "
                    "NAME:BATCH (batch 1 by default), of " + ",".join(ATTN_CONFIGS))
    ap.add_argument("--attention-seqs", default="8192")
    ap.add_argument("--eager", action="store_true", help="do not compile the blocks")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attention_checks import run_header

    payload = run_header(blocks=[], attention=[])
    flavors = [f for f in a.flavors.split(",") if f]
    batches = [int(b) for b in a.batch.split(",")] if a.batch else [1] * len(flavors)
    for flavor, B in zip(flavors, batches):
        for attn_type in ("nsa", "dense"):
            r = block_case(flavor, attn_type, a.seq, B, not a.eager)
            print(json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
            print(json.dumps(r["profile"]["categories"]), flush=True)
            payload["blocks"].append(r)
            torch.cuda.empty_cache()
    for spec in [c for c in a.attention.split(",") if c]:
        name, _, batch = spec.partition(":")
        for T in (int(t) for t in a.attention_seqs.split(",")):
            r = attention_case(name, T, int(batch or 1))
            print(json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
            payload["attention"].append(r)
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"profile_block{a.tag}_" + payload["device"].replace(" ", "_"))
    with open(base + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    md = to_markdown(payload)
    with open(base + ".md", "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
