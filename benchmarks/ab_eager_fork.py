"""Eager NSA forward+backward with its band dK/dV on the side stream against one stream, in one process on one GPU.

    python benchmarks/ab_eager_fork.py --cases paper:65536:1,m7c:8192:2 [--out DIR]

Attempt 113 (ops.EAGER_FORK_VALUES) decides per shape whether an eager backward forks. This script times both
choices for each case whatever the threshold says: single calls (or back-to-back groups of them, >= 20 ms per
sample, so that host-bound shapes are timed at their host's pace as in use), the L2 flushed before each sample,
the two choices alternating and their order swapped every pair, and the median of the per-pair ratios (the
clock drift that moves both by a few per cent between rounds cancels within a pair). It also checks that the two
give bitwise the same gradients. Writes ab_eager_fork<tag>_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def summarize(base_ms: list[float], fork_ms: list[float], names: tuple[str, str] = ("one_stream", "forked")) -> dict:
    """Per-pair speed-ups (base / other) -> their median and quartiles, with both medians as <names[0]>_ms and
    <names[1]>_ms (this script's: one stream, forked)."""
    if len(base_ms) != len(fork_ms) or len(base_ms) < 2:
        raise ValueError(f"need >= 2 pairs of samples, got {len(base_ms)} and {len(fork_ms)}")
    ratios = [b / f for b, f in zip(base_ms, fork_ms)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {f"{names[0]}_ms": statistics.median(base_ms), f"{names[1]}_ms": statistics.median(fork_ms),
            "speedup_median": statistics.median(ratios), "speedup_q1": q1, "speedup_q3": q3, "pairs": len(ratios)}


def attention_call(name: str, T: int, B: int):
    """-> (inputs, call): one eager NSA attention forward+backward of ``name``'s shape on random inputs."""
    import torch
    from attention_checks import make_inputs
    from profile_block import ATTN_CONFIGS, PAPER_P

    from nsa_titan.kernels import nsa_attention

    torch.manual_seed(0)
    HQ, HKV, DK, DV = ATTN_CONFIGS[name]
    ins = [x.requires_grad_(True) for x in make_inputs(B, T, HQ, HKV, DK, DV, PAPER_P)]
    dout = torch.randn(B, T, HQ, DV, device="cuda", dtype=torch.bfloat16)

    def call():
        for x in ins:
            x.grad = None
        nsa_attention(*ins, PAPER_P)[0].backward(dout)

    return ins, call


def paired_samples(call, choice, budget_ms: float = 4000.0) -> tuple[list[float], list[float], int]:
    """Time ``call`` under ``choice(False)`` and ``choice(True)`` (context managers) in alternating pairs, the order
    swapped every pair, the L2 flushed before each sample of >= 20 ms (back-to-back calls where one is shorter).
    -> (ms without, ms with, calls per sample)."""
    import torch

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def sample(on: bool, reps: int) -> float:
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with choice(on):
            start.record()
            for _ in range(reps):
                call()
            end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    for on in (False, True):
        sample(on, 3)  # warm-up: compilation, autotuning, the side stream's first use
    one = sample(False, 1)
    reps = max(1, int(20 / one))
    pairs = max(8, min(30, int(budget_ms / (2 * reps * one))))
    off, on_ms = [], []
    for i in range(pairs):
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            (on_ms if on else off).append(sample(on, reps))
    return off, on_ms, reps


def measure(name: str, T: int, B: int, budget_ms: float = 4000.0) -> dict:
    from attention_checks import eager_fork

    from nsa_titan.kernels import ops

    ins, call = attention_call(name, T, B)
    forks_by_default = ops.eager_backward_forks(ins[0])
    grads = []
    for fork in (False, True):
        with eager_fork(fork):
            call()
        grads.append([x.grad.clone() for x in ins])
    same = all(a.equal(b) for a, b in zip(*grads))
    del grads
    base, forked, reps = paired_samples(call, eager_fork, budget_ms)
    row = dict(config=name, T=T, B=B, q_values=ins[0].numel(), forks_by_default=forks_by_default,
               bitwise_same=same, reps_per_sample=reps, **summarize(base, forked))
    print(f"{name} T={T} B={B}: one stream {row['one_stream_ms']:.3f} -> forked {row['forked_ms']:.3f} ms; speed-up "
          f"{row['speedup_median']:.3f} (IQR {row['speedup_q1']:.3f}-{row['speedup_q3']:.3f}), {row['pairs']} pairs x "
          f"{reps}; gradients bitwise the same: {same}", flush=True)
    return row


def to_markdown(payload: dict) -> str:
    lines = [f"# Eager backward on two streams against one: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}; "
             "`benchmarks/ab_eager_fork.py`: NSA attention fwd+bwd, median of per-pair speed-ups (one stream / "
             "forked) over alternating pairs of samples; `forks` = the shape's choice under "
             f"ops.EAGER_FORK_VALUES = {payload['threshold']}.", "",
             "| case | q values | forks | one stream ms | forked ms | speed-up (IQR) | pairs x calls | bitwise |",
             "|---|---|---|---|---|---|---|---|"]
    for r in payload["cases"]:
        lines.append(f"| {r['config']} {r['T']} B={r['B']} | {r['q_values'] / 1e6:.1f}M | {r['forks_by_default']} | "
                     f"{r['one_stream_ms']:.3f} | {r['forked_ms']:.3f} | {r['speedup_median']:.3f} "
                     f"({r['speedup_q1']:.3f}-{r['speedup_q3']:.3f}) | {r['pairs']} x {r['reps_per_sample']} | "
                     f"{r['bitwise_same']} |")
    return "\n".join(lines) + "\n"


def parse_cases(text: str, configs) -> list[tuple[str, int, int]]:
    """"CONFIG:T:B,..." -> [(config, T, B)], each config one of ``configs`` (a bad case is refused by its form)."""
    out = []
    for case in text.split(","):
        parts = case.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise SystemExit(f"--cases {case!r}: give CONFIG:T:B, e.g. paper:65536:1")
        if parts[0] not in configs:
            raise SystemExit(f"--cases {case!r}: unknown config {parts[0]!r}; choose from {sorted(configs)}")
        out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


def ab_parser(doc: str, cases: str) -> argparse.ArgumentParser:
    """The paired A/B scripts' options: --cases (CONFIG:T:B,..., default ``cases``), --tag, --out."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=cases)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    return ap


def run_cases(a: argparse.Namespace, kind: str, cases: list, measure_fn, to_md, **header) -> None:
    """The paired A/B scripts' loop: ``measure_fn(*case)`` (a row, or a list of rows) per case, the GPU's cache
    emptied between cases, then <a.out>/<kind><a.tag>_<device>.json and .md (``to_md(payload)``); ``header`` goes
    into the JSON beside the device, versions, date and the rows (key ``cases``)."""
    import torch
    from attention_checks import run_header, write_results

    rows = []
    for case in cases:
        got = measure_fn(*case)
        rows += got if isinstance(got, list) else [got]
        torch.cuda.empty_cache()
    payload = run_header(**header, cases=rows)
    write_results(a.out, f"{kind}{a.tag}_" + payload["device"].replace(" ", "_"), payload, to_md(payload))


def main():
    a = ab_parser(__doc__, "paper:65536:1,paper:8192:1,1b:32768:1,m7c:32768:1,m7c:8192:2").parse_args()
    from profile_block import ATTN_CONFIGS

    from nsa_titan.kernels import ops

    run_cases(a, "ab_eager_fork", parse_cases(a.cases, ATTN_CONFIGS), measure, to_markdown,
              threshold=ops.EAGER_FORK_VALUES)


if __name__ == "__main__":
    main()
