"""Whole-model NSA / dense throughput table from ``bench_train.py`` results (one run = one JSON per tag).

    python benchmarks/whole_model_table.py benchmarks/results/train_1b_seq8192.json ... \
        --out benchmarks/results/whole_model_NVIDIA_H100_80GB_HBM3

Each JSON holds NSA variants (``triton_compile``, ``torch_compile``, ``*_cg``) and a dense one measured in the
same command on the same GPU; every NSA variant is divided by the dense variant of the same compile mode
(``dense_compile`` for plain compile, ``dense_compile_cg`` for CUDA graphs, ``dense_compile_sg`` for the step
graph; the plain one when only it ran).
Tokens/s are the last log window's (steady state: the first steps compile and record CUDA graphs).
A command of several rounds (``bench_train.py --rounds``) gives each variant's median tokens/s, and the ratio is
the median of the rounds' own NSA / dense ratios (NSA and dense of one round ran back to back), with their range.
Targets are issue 11's (whole model, compiled, one GPU).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from statistics import median

TARGETS = {("1b", 8192): 1.0, ("1b", 32768): 2.0, ("1b", 65536): 3.0, ("m7c", 8192): 1.0, ("m7c", 32768): 2.5}


def _tps(row: dict) -> float | None:
    return row.get("last_window_tokens_per_s_per_gpu") or row.get("tokens_per_s_per_gpu")


def _median_tps(rows: list[dict]) -> float | None:
    values = [t for r in rows if (t := _tps(r))]
    return median(values) if values else None


def _max_peak(rows: list[dict]) -> float | None:
    values = [r["peak_mem_gib"] for r in rows if r.get("peak_mem_gib")]
    return max(values) if values else None


def nsa_dense_pairs(result: dict) -> list[tuple[str, list[dict], list[dict]]]:
    """(variant, its NSA rows, the rows of the dense variant of the same compile mode, [] if none ran) for every NSA
    variant that ran; several rows per variant where the command ran several rounds."""
    by = defaultdict(list)
    for r in result["rows"]:
        if "error" not in r:
            by[r["variant"]].append(r)
    def same_mode(name: str) -> str:  # the CUDA-graph and step-graph variants end in their mode's suffix
        return next((f"dense_compile{s}" for s in ("_cg", "_sg") if name.endswith(s)), "dense_compile")

    return [(name, rows, by.get(same_mode(name)) or by.get("dense_compile", []))
            for name, rows in by.items() if not name.startswith("dense")]


def ratio_rows(result: dict) -> list[dict]:
    rows = []
    for name, nsa, dense in nsa_dense_pairs(result):
        r, flavor, tr = nsa[0], nsa[0]["model"]["flavor"], nsa[0]["training"]
        nsa_tps, dense_tps = _median_tps(nsa), _median_tps(dense)
        dense_by_round = {x.get("round", 1): _tps(x) for x in dense}
        per_round = [_tps(x) / dense_by_round[x.get("round", 1)] for x in nsa
                     if _tps(x) and dense_by_round.get(x.get("round", 1))]
        if per_round:
            ratio = median(per_round)
        else:
            ratio = nsa_tps / dense_tps if nsa_tps and dense_tps else None
        rows.append(dict(flavor=flavor, seq_len=tr["seq_len"], local_batch=tr["local_batch_size"], variant=name,
                         nsa_tokens_per_s=nsa_tps, dense_variant=dense[0]["variant"] if dense else None,
                         dense_tokens_per_s=dense_tps, ratio=ratio, rounds=max(len(per_round), 1),
                         ratio_min=min(per_round, default=ratio), ratio_max=max(per_round, default=ratio),
                         nsa_peak_gib=_max_peak(nsa), dense_peak_gib=_max_peak(dense),
                         target=TARGETS.get((flavor, tr["seq_len"])), device=r.get("device"), date=r.get("date"),
                         source_tag=result.get("tag")))
    return rows


def _rounds(r: dict) -> str:
    """'1', or 'n: lo-hi' (the rounds' NSA / dense ratios)."""
    n = r.get("rounds", 1)
    return str(n) if n == 1 else f"{n}: {r['ratio_min']:.4f}-{r['ratio_max']:.4f}"


def markdown(rows: list[dict], meta: dict) -> str:
    f = lambda v, s: "-" if v is None else format(v, s)  # noqa: E731
    lines = [f"# Whole model, NSA vs dense: {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}; `bench_train.py`, one GPU, "
             "fp32 weights + bf16 autocast, tokens/s of the last 5-step log window; NSA and dense of a row come "
             "from the same command (its tag, last column, names the results file `train_<tag>.json`; a tag with "
             "`acfull` ran both with full activation checkpointing; rows measured before the code's last kernel "
             "change keep their date, column `date`). A command of several rounds (`bench_train.py --rounds`, NSA "
             "and dense back to back in each) gives the median tokens/s and the median of the rounds' ratios; column "
             "`rounds` has their number and the ratios' range.", "",
             "| flavor | seq | batch | NSA variant | NSA tok/s | dense tok/s | NSA / dense | target | rounds | NSA GiB "
             "| dense GiB | run tag | date |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["flavor"], r["seq_len"], r["local_batch"], r["variant"])):
        if r["target"] is None:
            tgt = "-"
        elif r["ratio"] is None:  # no dense run in that command: nothing to judge
            tgt = f">= {r['target']:.1f} (no dense run)"
        else:
            tgt = f">= {r['target']:.1f} " + ("met" if r["ratio"] >= r["target"] else "missed")
        lines.append(f"| {r['flavor']} | {r['seq_len']} | {r['local_batch']} | {r['variant']} | "
                     f"{f(r['nsa_tokens_per_s'], ',.0f')} | {f(r['dense_tokens_per_s'], ',.0f')} | "
                     f"{f(r['ratio'], '.4f')} | {tgt} | {_rounds(r)} | {f(r['nsa_peak_gib'], '.1f')} | "
                     f"{f(r['dense_peak_gib'], '.1f')} | {r.get('source_tag') or '-'} | "
                     f"{(r.get('date') or '-')[:10]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench_train.py JSON files")
    ap.add_argument("--out", required=True, help="output path without suffix (.json and .md are written)")
    a = ap.parse_args()
    results = [json.loads(Path(p).read_text()) for p in a.results]
    rows = [row for res in results for row in ratio_rows(res)]
    meta = {k: results[0].get(k) for k in ("device", "torch", "triton", "date")}
    Path(a.out + ".json").write_text(json.dumps({**meta, "sources": a.results, "rows": rows}, indent=1) + "\n")
    Path(a.out + ".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
