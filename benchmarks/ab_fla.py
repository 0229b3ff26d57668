"""NSA against fla-core's parallel_nsa, forward+backward, sampled in alternating pairs on one GPU.

    python benchmarks/ab_fla.py --cases paper:65536:1,paper:32768:1 [--tag _x] [--out DIR]

bench_attention.py times NSA, then SDPA, then fla-core, each by do_bench, seconds apart; on one H100 the same
kernels' paper 64k wall time moved between 108.7 and 112.7 ms from run to run (thirty-eighth and thirty-ninth
sessions), so the "vs fla" ratio of one such run carries that drift. Here the two alternate, their order swapped
every pair, the L2 flushed before each sample, and the ratio is the median of per-pair ratios (fla / NSA), as
ab_eager_fork.py samples: clock drift between pairs cancels within a pair. The calls are bench_attention.py's (NSA:
all three branches on make_inputs' tensors; fla: its compressed and selected branches on the same q and
selected-branch K/V, random gates). fla-core must be importable (carry its wheel: NOTES_kernels.md); configs it
cannot run (G not a power of 2 >= 16) are refused up front. Writes ab_fla<tag>_<device>.json and .md.
"""

from __future__ import annotations

import contextlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def parse_cases(text: str, configs: dict) -> list[tuple[str, int, int]]:
    """ab_eager_fork.parse_cases, and a config fla-core cannot run is refused with the reason."""
    from ab_eager_fork import parse_cases as cases_of
    from attention_timing import fla_unsupported

    out = cases_of(text, configs)
    for name, T, B in out:
        why = fla_unsupported(configs[name])
        if why:
            raise SystemExit(f"--cases {name}:{T}:{B}: fla-core's parallel_nsa is {why}")
    return out


def measure(fla_nsa, name: str, cfg: dict, T: int, B: int, budget_ms: float = 6000.0) -> dict:
    import torch
    from ab_eager_fork import paired_samples, summarize
    from attention_checks import make_inputs

    from nsa_titan.kernels import nsa_attention

    torch.manual_seed(0)
    p = cfg["p"]
    ins = [x.requires_grad_(True) for x in make_inputs(B, T, cfg["HQ"], cfg["HKV"], cfg["DK"], cfg["DV"], p)]
    q, k, v = ins[0], ins[3], ins[4]
    dout = torch.randn(B, T, cfg["HQ"], cfg["DV"], device="cuda", dtype=torch.bfloat16)
    gates = [torch.rand(B, T, cfg["HQ"], device="cuda", dtype=q.dtype).requires_grad_(True) for _ in range(2)]
    state = {"fla": False}

    def call():
        for x in ins + gates:
            x.grad = None
        if state["fla"]:
            out = fla_nsa(q, k, v, g_cmp=gates[0], g_slc=gates[1], block_counts=p.slc_top_n, block_size=p.slc_block,
                          window_size=0)
        else:
            out = nsa_attention(*ins, p)[0]
        out.backward(dout)

    @contextlib.contextmanager
    def fla_side(on: bool):
        state["fla"] = on
        try:
            yield
        finally:
            state["fla"] = False

    nsa_ms, fla_ms, reps = paired_samples(call, fla_side, budget_ms)
    s = summarize(fla_ms, nsa_ms, ("fla", "nsa"))  # per-pair fla / NSA
    row = dict(config=name, T=T, B=B, nsa_ms=s["nsa_ms"], fla_ms=s["fla_ms"], nsa_vs_fla=s["speedup_median"],
               nsa_vs_fla_q1=s["speedup_q1"], nsa_vs_fla_q3=s["speedup_q3"], pairs=s["pairs"], reps_per_sample=reps)
    print(f"{name} T={T} B={B}: NSA {row['nsa_ms']:.2f} ms, fla {row['fla_ms']:.2f} ms; NSA vs fla "
          f"{row['nsa_vs_fla']:.3f}x (IQR {row['nsa_vs_fla_q1']:.3f}-{row['nsa_vs_fla_q3']:.3f}), {row['pairs']} pairs",
          flush=True)
    return row


def to_markdown(payload: dict) -> str:
    lines = [f"# NSA against fla-core, paired: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}; `benchmarks/ab_fla.py`: "
             "forward+backward, NSA with all three branches, fla-core's parallel_nsa with its compressed and selected "
             "branches; NSA vs fla = median of per-pair ratios fla / NSA over alternating pairs of samples (the "
             "ms columns are each side's median).", "",
             "| case | NSA ms | fla ms | NSA vs fla (IQR) | pairs x calls |", "|---|---|---|---|---|"]
    for r in payload["cases"]:
        lines.append(f"| {r['config']} {r['T']} B={r['B']} | {r['nsa_ms']:.2f} | {r['fla_ms']:.2f} | "
                     f"{r['nsa_vs_fla']:.3f}x ({r['nsa_vs_fla_q1']:.3f}-{r['nsa_vs_fla_q3']:.3f}) | {r['pairs']} x "
                     f"{r['reps_per_sample']} |")
    return "\n".join(lines) + "\n"


def main():
    from ab_eager_fork import ab_parser, run_cases
    from attention_timing import load_fla
    from bench_attention import CONFIGS

    a = ab_parser(__doc__, "paper:65536:1,paper:32768:1").parse_args()
    cases = parse_cases(a.cases, CONFIGS)
    fla_nsa = load_fla()
    if fla_nsa is None:
        raise SystemExit("fla-core's parallel_nsa is not importable: install the fla-core wheel (NOTES_kernels.md)")
    run_cases(a, "ab_fla", cases, lambda name, T, B: measure(fla_nsa, name, CONFIGS[name], T, B), to_markdown)


if __name__ == "__main__":
    main()
