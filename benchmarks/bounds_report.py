"""What bounds a whole-model NSA / dense ratio: replayed training steps, split into attention and the rest.

    python benchmarks/bounds_report.py --flavor 1b --seq 32768 --target 2.0 --dense DENSE.json --nsa NSA.json \
        [--variant "NSA, mean phi and one shared K/V set=VARIANT.json" ...] [--ac full] [--out DIR --tag TAG]

Inputs: ``benchmarks/step_graph_probe.py --profile N`` results of the same trainer flags with
``--model.attn_type dense`` and with NSA: one training step captured as one CUDA graph and replayed, so the step
time holds no host time and the profile gives every kernel's time. Per run:
- attention kernels: the profile's NSA categories (band, selected, selection, combine) or SDPA's;
- the rest: every other kernel (matmuls, inductor's fused kernels, the optimizer), the same work in both models;
- NSA's attention = its step - its rest (kernels on the side stream overlap, so the attention kernels' sum can
  exceed that).
Then: the ratio now; the ceiling with free attention (dense step / NSA's rest); the NSA step the target needs and
the attention time that leaves, as a speed-up over today's; and the useful attention FLOP rates (now, needed, and
SDPA's in the dense step), counted with ``nsa_titan.models.nsa.flops`` (the causal keys each branch sees; the
selection one QK^T over the compressed keys per forward; a backward 2.5x its forward, as the kernel table counts;
with ``--ac full`` every forward runs twice). Beside the useful work, the work our kernels execute
(``executed_tflop``): the band branches' deterministic backward does 7 matmul units (dQ: QK^T, dP, dQ; dK/dV: QK^T,
dP, dV, dK) where dQ atomics would do 5, and the selected branch's dQ is one unit from stored dS while that buffer fits
the model's dq_buffer_gib, else 3 recomputed (a lower bound: the G-16 selected forward's 4-token tiles also walk blocks
only some of their tokens chose). Its rate is set against SDPA's, whose executed work is the useful work.
``--from-json``: rewrite an earlier report (its JSON) with today's arithmetic, no GPU needed.
Writes bounds_<tag>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_block import CATEGORIES  # noqa: E402 - the kernel categories step_graph_probe's profile uses

from nsa_titan.models.nsa.args import get_model_args  # noqa: E402
from nsa_titan.models.nsa.flops import forward_flops_breakdown, mean_keys_per_query  # noqa: E402

NSA_CATEGORIES = tuple(name for name, _ in CATEGORIES if name.startswith("nsa: "))
ATTENTION_CATEGORIES = (*NSA_CATEGORIES, "sdpa/flash")
BACKWARD_PER_FORWARD = 2.5  # attention backward / forward FLOPs (dQ, dK, dV and the recomputed P: 5 units to 2)
# Matmul units our backward kernels execute per 2 forward units (one unit: QK^T or PV over a branch's visible pairs).
BAND_BACKWARD_UNITS = 7  # nsa_titan/kernels/band_bwd.py: dQ kernel 3, dK/dV kernel 4 (no atomics)
SELECTED_BACKWARD_UNITS = {"ds": 5, "recompute": 7}  # the walk 4, and dQ = dS K (1) or recomputed (3): selected._cfg


def split_step(probe: dict) -> dict:
    """One step_graph_probe result -> step ms, attention kernels ms, the rest's kernels ms, per-category ms."""
    prof = probe["replay_profile"]
    cats = prof["categories"]
    attention = sum(v for k, v in cats.items() if k in ATTENTION_CATEGORIES)
    return {"step_ms": probe["graph_step_s"] * 1e3, "attention_kernels_ms": attention,
            "rest_ms": prof["kernel_ms"] - attention, "categories": cats,
            "tokens": probe["tokens_per_step_per_rank"], "device": probe["device"], "torch": probe["torch"],
            "triton": probe.get("triton"),  # recorded by the probe since the thirty-second session
            "date": probe["date"], "tag": probe.get("tag")}


def selected_dq_form(flavor: str, tokens: int) -> str:
    """How the NSA backward gets the selected branch's dQ for a step of ``tokens`` tokens: 'ds' when the dS buffer
    (tokens x HQ x n x l' bf16) fits the flavor's dq_buffer_gib (selected._cfg's rule), else 'recompute'."""
    args = get_model_args(flavor)
    ds_bytes = tokens * args.n_heads * args.slc_top_n * args.slc_block * 2
    return "ds" if ds_bytes <= args.dq_buffer_gib * 2**30 else "recompute"


def attention_tflop(flavor: str, seq: int, tokens: int, ac_full: bool) -> dict:
    """Attention TFLOP of one training step for ``tokens`` tokens of length-``seq`` rows: useful ('nsa', 'dense') and
    what our NSA kernels execute ('nsa_executed': the band backward's 7 units, the selected dQ's form)."""
    out = {}
    for attn_type in ("nsa", "dense"):
        args = get_model_args(flavor, attn_type=attn_type)
        parts = {k: v for k, v in forward_flops_breakdown(args, seq).items() if k.startswith("attn_")}
        fwd = sum(parts.values())
        select = 0.0
        if attn_type == "nsa":  # the selection's QK^T over the compressed keys (no backward)
            select = args.n_layers * 2.0 * args.head_dim * args.n_heads * mean_keys_per_query(args, seq)["cmp"]
        forwards = (fwd + select) * (2 if ac_full else 1)
        out[attn_type] = (forwards + BACKWARD_PER_FORWARD * fwd) * tokens / 1e12
        if attn_type == "nsa":
            sel_units = SELECTED_BACKWARD_UNITS[selected_dq_form(flavor, tokens)]
            band = parts["attn_cmp"] + parts["attn_win"]
            backward = (BAND_BACKWARD_UNITS * band + sel_units * parts["attn_slc"]) / 2
            out["nsa_executed"] = (forwards + backward) * tokens / 1e12
    return out


def bounds(dense: dict, nsa: dict, target: float, flops: dict) -> dict:
    """The arithmetic of the report (inputs: split_step results and attention_tflop)."""
    attention_now = nsa["step_ms"] - nsa["rest_ms"]
    needed_step = dense["step_ms"] / target
    needed_attention = needed_step - nsa["rest_ms"]
    sdpa_ms = dense["attention_kernels_ms"]
    return {"ratio": dense["step_ms"] / nsa["step_ms"], "target": target,
            "ceiling_free_attention": dense["step_ms"] / nsa["rest_ms"],
            "attention_now_ms": attention_now, "nsa_step_needed_ms": needed_step,
            "attention_needed_ms": needed_attention,
            # None: the rest alone is slower than the target allows, no attention speed reaches it
            "attention_speedup_needed": attention_now / needed_attention if needed_attention > 0 else None,
            "useful_tflop": flops,
            "useful_tflops_per_s": {
                "nsa_now": flops["nsa"] / attention_now * 1e3,
                "nsa_needed": flops["nsa"] / needed_attention * 1e3 if needed_attention > 0 else None,
                "sdpa": flops["dense"] / sdpa_ms * 1e3 if sdpa_ms else None},
            # SDPA executes its useful work (dQ by atomics), so its rate above is its executed rate too
            "executed_tflops_per_s": {
                "nsa_now": flops["nsa_executed"] / attention_now * 1e3,
                "nsa_needed": flops["nsa_executed"] / needed_attention * 1e3 if needed_attention > 0 else None}}


def to_markdown(rep: dict) -> str:
    b, rows = rep["bounds"], rep["rows"]
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = [f"# What bounds {rep['flavor']} at {rep['seq']} tokens{' (full AC)' if rep['ac_full'] else ''}: "
             f"{rows[0]['device']}", "",
             f"torch {rows[0]['torch']}, triton {rows[0]['triton'] or rep['triton'] or 'not recorded'}, "
             f"{rows[0]['date'][:10]}; `benchmarks/bounds_report.py` over "
             "`step_graph_probe.py` results (one training step replayed from a CUDA graph, profiled per kernel). "
             "The rest = the kernels outside the attention, the same work in both models.", "",
             "| run | step ms | rest ms | attention kernels ms (" + "; ".join(NSA_CATEGORIES) + "; or SDPA) "
             "| tokens/s vs dense |", "|---|---|---|---|---|"]
    for r in rows:
        c = r["categories"]
        att = ("; ".join(f"{c.get(k, 0):.1f}" for k in NSA_CATEGORIES) if any(k in c for k in NSA_CATEGORIES)
               else f"SDPA {c.get('sdpa/flash', 0):.1f}")
        lines.append(f"| {r['label']} | {r['step_ms']:.1f} | {r['rest_ms']:.1f} | {att} | "
                     f"{rows[0]['step_ms'] / r['step_ms']:.3f}x |")
    t, e, speedup = b["useful_tflops_per_s"], b["executed_tflops_per_s"], b["attention_speedup_needed"]
    lines += ["", f"- NSA / dense = **{b['ratio']:.2f}x** against the target {b['target']:.1f}x. With free attention "
              f"NSA's step would be its {rows[1]['rest_ms']:.0f} ms of rest: a ceiling of "
              f"{b['ceiling_free_attention']:.2f}x.",
              f"- {b['target']:.1f}x needs an NSA step of {b['nsa_step_needed_ms']:.0f} ms: attention at "
              f"{b['attention_needed_ms']:.0f} ms instead of {b['attention_now_ms']:.0f} "
              + (f"(**{speedup:.2f}x** faster attention kernels)." if speedup
                 else "(out of reach: the rest alone is too slow)."),
              f"- Useful attention work: {b['useful_tflop']['nsa']:.0f} TFLOP per NSA step at {t['nsa_now']:.0f} "
              f"TFLOP/s now, {fmt(t['nsa_needed'], '.0f')} needed; SDPA runs {fmt(t['sdpa'], '.0f')} TFLOP/s in the "
              "dense step.",
              f"- Executed by our kernels (the band backward's 7 matmul units to the useful 5, no atomics: "
              f"deterministic): {b['useful_tflop']['nsa_executed']:.0f} TFLOP at {e['nsa_now']:.0f} TFLOP/s now, "
              f"{fmt(e['nsa_needed'], '.0f')} needed"
              + (f" = **{e['nsa_needed'] / t['sdpa']:.0%} of SDPA's rate** in the same step." if e["nsa_needed"]
                 and t["sdpa"] else "."), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--target", type=float, help="the NSA / dense tokens/s target")
    ap.add_argument("--dense", help="step_graph_probe JSON with --model.attn_type dense")
    ap.add_argument("--nsa", help="step_graph_probe JSON of the NSA model")
    ap.add_argument("--from-json", metavar="BOUNDS_JSON",
                    help="an earlier bounds_<tag>.json: its rows again, with this version's arithmetic (no probes)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=FILE",
                    help="more NSA runs to list (e.g. other model flags); the bounds use --nsa")
    ap.add_argument("--ac", choices=("none", "full"), default="none", help="the runs' activation checkpointing")
    ap.add_argument("--triton", default=None, help="the runs' Triton version, for probe results that lack it")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default=None)
    a = ap.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            old = json.load(f)
        rows = old["rows"]
        flops = attention_tflop(old["flavor"], old["seq"], rows[1]["tokens"], old["ac_full"])
        rep = {**old, "bounds": bounds(rows[0], rows[1], old["bounds"]["target"], flops)}
        return _write(rep, a.out, a.tag or f"{old['flavor']}_{old['seq']}")
    missing = [f"--{k}" for k in ("flavor", "seq", "target", "dense", "nsa") if getattr(a, k) is None]
    if missing:
        raise SystemExit(f"bounds_report: give {', '.join(missing)} (or --from-json an earlier report)")
    for v in a.variant:
        if "=" not in v:
            raise SystemExit(f"--variant {v!r}: give LABEL=FILE, e.g. --variant 'NSA, mean phi=run.json'")
    labelled = [("dense attention (SDPA)", a.dense), (f"NSA ({a.flavor})", a.nsa),
                *(tuple(v.rsplit("=", 1)) for v in a.variant)]
    rows = []
    for label, path in labelled:
        with open(path) as f:
            rows.append({"label": label, "file": os.path.basename(path), **split_step(json.load(f))})
    flops = attention_tflop(a.flavor, a.seq, rows[1]["tokens"], a.ac == "full")
    rep = {"flavor": a.flavor, "seq": a.seq, "ac_full": a.ac == "full", "triton": a.triton, "rows": rows,
           "bounds": bounds(rows[0], rows[1], a.target, flops)}
    return _write(rep, a.out, a.tag or f"{a.flavor}_{a.seq}")


def _write(rep: dict, out: str | None, tag: str) -> dict:
    """Print the report's markdown; with ``out``, write bounds_<tag>.json and .md there."""
    md = to_markdown(rep)
    print(md)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"bounds_{tag}.json"), "w") as f:
            json.dump(rep, f, indent=1)
        with open(os.path.join(out, f"bounds_{tag}.md"), "w") as f:
            f.write(md)
    return rep


if __name__ == "__main__":
    main()
