"""How much of one model's peak memory over another's is parameter state: trainer summaries against arithmetic.

    python benchmarks/memory_bound.py --baseline DENSE/summary.json NSA/summary.json [VARIANT/summary.json ...] \
        [--out DIR --tag TAG]

Each input is a one-GPU trainer ``summary.json`` (its peak allocated memory, its parameter count with embeddings,
its device, versions and config). A parameter costs the same bytes in every model whatever its attention: its fp32
master weight and AdamW's two fp32 moments (12 B; gradients are not alive at a peak before the backward, e.g. in the
loss, and are the same 4 B more where they are). So each run's peak is predicted as the baseline's plus its extra
parameters times 12 B; the residual (measured - predicted) is what the run's activations and workspaces at its peak
add over the baseline's. A residual of ~0 says the two peaks hold the same activations and the whole difference is
the parameters: no kernel or activation change can remove it, only a model with fewer parameters can.
Writes memory_bound_<tag>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

GIB = 1024**3
PARAM_STATE_BYTES = {"adamw": 4 + 8}  # fp32 master weight + exp_avg + exp_avg_sq (gradients freed between steps)


def run_facts(summary: dict, path: str) -> dict:
    """The facts of one summary.json the bound needs, with a clear error where one is missing."""
    model, config = summary.get("model") or {}, summary.get("config") or {}
    peak, params = summary.get("peak_mem_gib"), model.get("params_with_embedding")
    if peak is None or params is None:
        raise SystemExit(f"{path}: no peak_mem_gib / model.params_with_embedding: pass the summary.json a CUDA "
                         "training run of nsa_titan.train wrote (CPU runs record no peak)")
    per_gpu, total = summary.get("tokens_per_s_per_gpu"), summary.get("tokens_per_s")
    if per_gpu and total and round(total / per_gpu) != 1:
        raise SystemExit(f"{path}: a run on {round(total / per_gpu)} GPUs; its parameter state is sharded or "
                         "replicated by the data parallelism: pass one-GPU runs")
    optimizer = (config.get("optimizer") or {}).get("name", "adamw")
    if optimizer not in PARAM_STATE_BYTES:
        raise SystemExit(f"{path}: optimizer {optimizer!r} has no state size here; known: {sorted(PARAM_STATE_BYTES)}")
    args = model.get("args") or {}
    return {"file": path, "peak_gib": peak, "params": params, "state_bytes_per_param": PARAM_STATE_BYTES[optimizer],
            "attn_type": args.get("attn_type"), "compress": args.get("compress"), "shared_kv": args.get("shared_kv"),
            "seq_len": (config.get("training") or {}).get("seq_len"),
            "ac": (config.get("activation_checkpoint") or {}).get("mode"),
            "device": summary.get("device"), "torch": summary.get("torch"), "triton": summary.get("triton"),
            "date": summary.get("date")}


def bound(baseline: dict, run: dict) -> dict:
    """Predicted peak = baseline peak + extra parameters x state bytes; the residual is what activations add."""
    extra = run["params"] - baseline["params"]
    state_gib = extra * run["state_bytes_per_param"] / GIB
    predicted = baseline["peak_gib"] + state_gib
    return {**run, "extra_params": extra, "extra_state_gib": state_gib, "over_baseline_gib": run["peak_gib"] -
            baseline["peak_gib"], "predicted_gib": predicted, "residual_gib": run["peak_gib"] - predicted}


def label(r: dict) -> str:
    if r["attn_type"] == "dense":
        return "dense"
    parts = [f"compress {r['compress']}"] + (["one shared K/V set"] if r["shared_kv"] else [])
    return "NSA (" + ", ".join(parts) + ")"


def markdown(baseline: dict, rows: list[dict]) -> str:
    b = baseline
    out = [f"# Peak memory over {label(b)}: parameter state against the rest ({b['device']})", "",
           f"torch {b['torch']}, triton {b['triton']}, {b['date']}; seq {b['seq_len']}, AC {b['ac']}; "
           "`benchmarks/memory_bound.py` over the runs' summary.json. Predicted = the baseline's peak + the extra "
           f"parameters x {b['state_bytes_per_param']} B (the optimizer's state per parameter with its fp32 weight); "
           "residual = measured - predicted: what the run's activations at its peak add.", "",
           "| run | params | extra params | peak GiB | over baseline GiB | extra parameter state GiB | predicted GiB | "
           "residual GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|",
           f"| {label(b)} (baseline) | {b['params']:,} | 0 | {b['peak_gib']:.3f} | 0 | 0 | - | - |"]
    for r in rows:
        out.append(f"| {label(r)} | {r['params']:,} | {r['extra_params']:,} | {r['peak_gib']:.3f} | "
                   f"{r['over_baseline_gib']:+.3f} | {r['extra_state_gib']:.3f} | {r['predicted_gib']:.3f} | "
                   f"{r['residual_gib']:+.4f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="summary.json of the reference run (e.g. dense)")
    ap.add_argument("runs", nargs="+", help="summary.json of the runs to compare with it")
    ap.add_argument("--out", help="folder for memory_bound_<tag>.json / .md")
    ap.add_argument("--tag", default="run")
    a = ap.parse_args(argv)
    load = lambda p: run_facts(json.load(open(p)), p)  # noqa: E731
    baseline = load(a.baseline)
    rows = [bound(baseline, load(p)) for p in a.runs]
    for r in rows:
        if (r["seq_len"], r["ac"]) != (baseline["seq_len"], baseline["ac"]):
            raise SystemExit(f"{r['file']}: seq {r['seq_len']}, AC {r['ac']} against the baseline's "
                             f"{baseline['seq_len']}, {baseline['ac']}: compare runs of one length and AC mode")
    md = markdown(baseline, rows)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        stem = os.path.join(a.out, f"memory_bound_{a.tag}")
        with open(stem + ".json", "w") as f:
            json.dump({"baseline": baseline, "runs": rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(md)
        print(f"wrote {stem}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    main()
