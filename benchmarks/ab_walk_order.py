"""Eager NSA forward+backward with the selected dK/dV walk's chunks in token order against block order (attempt 114).

    python benchmarks/ab_walk_order.py --cases paper:65536:1,paper:32768:1 [--out DIR]

tuned.py's G 16 / head dim 128 walk entry names a ``many_pairs`` shape (short chunks in token order,
selected_bwd.walk_shape) for launches of many (token, slot) pairs. This script times each case with that entry
as it is (token order where the case reaches its threshold) and with ``many_pairs`` removed (block order), sampled
as ab_eager_fork.py samples (alternating pairs, L2 flushed, median of per-pair ratios). The two chunkings add the
walk's fp32 partials in different groups, so the gradients are not bitwise equal: the largest relative difference
is reported. Writes ab_walk_order<tag>_<device>.json and .md.
"""

from __future__ import annotations

import contextlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

ENTRY = ("sel_dkdv", 16, 128, False)  # tuned.py's key of the walk with a many_pairs shape


@contextlib.contextmanager
def token_order(on: bool):
    """tuned.py's walk entry with its many_pairs shape (on) or without it (off: every launch in block order)."""
    from nsa_titan.kernels.tuned import TUNED

    entry = TUNED[ENTRY]
    many = entry["many_pairs"]
    if not on:
        entry.pop("many_pairs")
    try:
        yield
    finally:
        entry["many_pairs"] = many


def measure(name: str, T: int, B: int, budget_ms: float = 3000.0) -> dict:
    from ab_eager_fork import attention_call, paired_samples, summarize

    from nsa_titan.kernels.tuned import TUNED

    ins, call = attention_call(name, T, B)
    grads = []
    for on in (False, True):
        with token_order(on):
            call()
        grads.append([x.grad.clone() for x in ins])
    diff = max(float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
               for a, b in zip(*grads))
    del grads
    block, token, reps = paired_samples(call, token_order, budget_ms)
    row = dict(config=name, T=T, B=B, threshold_pairs=TUNED[ENTRY]["many_pairs"]["from_pairs"], reps_per_sample=reps,
               grad_rel_diff=diff, **summarize(block, token, ("block_order", "token_order")))
    print(f"{name} T={T} B={B}: block order {row['block_order_ms']:.3f} -> token order {row['token_order_ms']:.3f} ms; "
          f"speed-up {row['speedup_median']:.3f} (IQR {row['speedup_q1']:.3f}-{row['speedup_q3']:.3f}); gradients "
          f"differ by {diff:.1e}", flush=True)
    return row


def to_markdown(payload: dict) -> str:
    lines = [f"# The walk's chunks in token order against block order: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}; `benchmarks/ab_walk_order.py`: "
             "NSA attention eager fwd+bwd, median of per-pair speed-ups (block order / token order) over alternating "
             "pairs of samples; token order applies from tuned.py's many_pairs threshold of (token, slot) pairs per "
             "walk launch, so a case below it times the same code twice.", "",
             "| case | block order ms | token order ms | speed-up (IQR) | pairs x calls | grads rel. diff |",
             "|---|---|---|---|---|---|"]
    for r in payload["cases"]:
        lines.append(f"| {r['config']} {r['T']} B={r['B']} | {r['block_order_ms']:.3f} | {r['token_order_ms']:.3f} | "
                     f"{r['speedup_median']:.3f} ({r['speedup_q1']:.3f}-{r['speedup_q3']:.3f}) | {r['pairs']} x "
                     f"{r['reps_per_sample']} | {r['grad_rel_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main():
    from ab_eager_fork import ab_parser, parse_cases, run_cases
    from profile_block import ATTN_CONFIGS

    a = ab_parser(__doc__, "paper:65536:1,paper:32768:1,paper:16384:1,1b:65536:1").parse_args()
    run_cases(a, "ab_walk_order", parse_cases(a.cases, ATTN_CONFIGS), measure, to_markdown)


if __name__ == "__main__":
    main()
