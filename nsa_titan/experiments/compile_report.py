"""compile on/off: tokens/s, MFU, peak memory, compile time and recompiles; NSA next to dense (SDPA) attention.

    python -m nsa_titan.experiments.compile_report --config train_configs/nsa_1b.toml --attn nsa,dense \\
        --out benchmarks/results --tag 1b_seq8192 [--from-plan benchmarks/results/ac_plan_1b_seq8192.json] \\
        [--seq-lens 8192,16384] [-- overrides]

One GPU, one trainer run per (sequence length, attention, compile off/on). Compile time = first step of the
compiled run - first step of the eager run (both pay kernel autotuning and allocator warm-up; only one pays
compilation). Recompiles come from the trainer's graph count (``summary.json`` "compile": graphs beyond one per
block kind). ``--from-plan``: take the local batch and AC ratio of the planner's 1-GPU recommendation (GA 1:
tokens/s per GPU hardly depends on GA). Targets: the best compiled NSA run reaches >= 40% MFU, and NSA is faster per
token than dense attention (same compile setting) at every length >= 8192. Writes ``compile_<tag>.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nsa_titan.config import load_job_config
from nsa_titan.experiments.common import (
    REPO,
    Runner,
    draw_speed_and_memory,
    environment_of,
    md_table,
    pending_note,
    write_report,
)

MFU_TARGET = 0.40
NSA_FROM_SEQ = 8192


def plan_flags(path: str) -> tuple[list[str], str]:
    """Trainer flags for the planner's 1-GPU recommendation, and a description."""
    result = json.loads(Path(path).read_text())
    best = [r for r in result["rows"] if r["gpus"] == 1 and r["status"] == "fits" and r.get("tokens_per_s_per_gpu")]
    if not best:
        raise SystemExit(f"{path}: no fitting 1-GPU row to take the batch and AC ratio from")
    r = max(best, key=lambda r: r["tokens_per_s_per_gpu"])
    return (["--training.local_batch_size", str(r["local_batch"]), "--activation_checkpoint.mode", "ratio",
             "--activation_checkpoint.ratio", str(r["ac_ratio"])],
            f"bs={r['local_batch']} AC={r['ac_ratio']:g} (from {path})")


def derive(rows: list[dict[str, Any]]) -> None:
    """compile_time_s, speedup (compiled vs eager) and nsa_vs_dense (tokens/s ratio, same compile and length)."""
    by = {(r["seq_len"], r["attn"], r["compiled"]): r for r in rows}
    for r in rows:
        eager = by.get((r["seq_len"], r["attn"], False))
        if r["compiled"] and eager and r.get("first_step_s") and eager.get("first_step_s"):
            r["compile_time_s"] = r["first_step_s"] - eager["first_step_s"]
        if r["compiled"] and eager and r.get("tokens_per_s") and eager.get("tokens_per_s"):
            r["speedup"] = r["tokens_per_s"] / eager["tokens_per_s"]
        dense = by.get((r["seq_len"], "dense", r["compiled"]))
        if r["attn"] == "nsa" and dense and r.get("tokens_per_s") and dense.get("tokens_per_s"):
            r["nsa_vs_dense"] = r["tokens_per_s"] / dense["tokens_per_s"]
        r["recompiles"] = (r.get("compile") or {}).get("recompiles")


def targets(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    compiled_nsa = [r for r in rows if r["attn"] == "nsa" and r["compiled"] and r.get("mfu") is not None]
    if compiled_nsa:
        best = max(compiled_nsa, key=lambda r: r["mfu"])
        verdict = "MET" if best["mfu"] >= MFU_TARGET else f"MISSED by {MFU_TARGET - best['mfu']:.1%}"
        lines.append(f"- compiled NSA MFU {best['mfu']:.1%} at seq {best['seq_len']} (target >= {MFU_TARGET:.0%} for "
                     f"1b with the best AC): {verdict}")
    for r in rows:
        if r.get("nsa_vs_dense") is not None and r["seq_len"] >= NSA_FROM_SEQ:
            mode = "compiled" if r["compiled"] else "eager"
            lines.append(f"- seq {r['seq_len']} {mode}: NSA {r['nsa_vs_dense']:.2f}x dense tokens/s (target > 1 from "
                         f"{NSA_FROM_SEQ} on): {'MET' if r['nsa_vs_dense'] > 1 else 'MISSED'}")
    return lines


def write_compile_report(out: Path, tag: str, rows: list[dict[str, Any]], meta: dict[str, Any],
                         pending: list[str]) -> dict[str, Any]:
    derive(rows)
    stem = f"compile_{tag}"
    env = environment_of(rows)
    lines = [f"# compile on/off: {tag}", "",
             f"{env['device']}, torch {env['torch']}, triton {env['triton']}; 1 GPU; {meta['steps']} steps, "
             f"timed after step {meta['warmup']}; {meta.get('plan') or 'batch/AC from the config'}; "
             f"trainer args {meta['train_args']}",
             "", *md_table(rows, [("seq", "seq_len", ""), ("attention", "attn", ""),
                                  ("compile", lambda r: "on" if r["compiled"] else "off", ""),
                                  ("tok/s", "tokens_per_s", ",.0f"), ("step s", "step_time_s", ".3f"),
                                  ("MFU", "mfu", ".1%"), ("TFLOP/s", "tflops_per_gpu", ".1f"),
                                  ("peak alloc GiB", "peak_mem_gib", ".1f"),
                                  ("reserved GiB", "peak_mem_reserved_gib", ".1f"),
                                  ("first step s", "first_step_s", ".1f"),
                                  ("compile s", "compile_time_s", ".1f"), ("recompiles", "recompiles", ""),
                                  ("compiled/eager", "speedup", ".2f"), ("NSA/dense", "nsa_vs_dense", ".2f"),
                                  ("error", "error", "")]),
             "", "Targets:", *(targets(rows) or ["- (nothing measured yet)"]), *pending_note(pending)]

    def draw(plt):
        ok = [r for r in rows if r.get("tokens_per_s")]
        labels = [f"{r['attn']} {'compiled' if r['compiled'] else 'eager'}\nseq {r['seq_len']}" for r in ok]
        colors = ["C1" if r["compiled"] else "C0" for r in ok]
        draw_speed_and_memory(plt, ok, labels, colors, "tokens_per_s", "tokens/s (1 GPU)",
                              f"{tag}: eager (blue) vs torch.compile (orange)")

    result = {"experiment": "compile", "tag": tag, **meta, **env, "rows": rows, "targets": targets(rows),
              "pending": pending}
    write_report(out, stem, result, lines, draw)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--attn", default="nsa,dense", help="attention types: nsa and/or dense (SDPA)")
    ap.add_argument("--seq-lens", default=None, help="comma list; default: the config's training.seq_len")
    ap.add_argument("--from-plan", default=None, help="ac_plan_<tag>.json: use its 1-GPU batch and AC ratio")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--run-timeout-s", type=float, default=400)
    ap.add_argument("--time-limit-s", type=float, default=None, help="start no new run after this")
    ap.add_argument("--cpu", action="store_true", help="on the CPU: checks the experiment, not speed")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--tag", default="compile")
    a, extra = ap.parse_known_args(argv)
    extra = [x for x in extra if x != "--"] + (["--training.device", "cpu"] if a.cpu else [])
    plan, plan_note = plan_flags(a.from_plan) if a.from_plan else ([], None)
    out = Path(a.out)
    runner = Runner(out / f"compile_{a.tag}", warmup=a.warmup, steps=a.steps, timeout_s=a.run_timeout_s,
                    time_limit_s=a.time_limit_s, force=a.force, gpu=not a.cpu)
    if a.seq_lens:
        seqs = [int(s) for s in a.seq_lens.split(",")]
    else:
        seqs = [load_job_config(["--config", a.config, *extra]).training.seq_len]
    rows = []
    for seq in seqs:
        for attn in a.attn.split(","):
            for compiled in (False, True):
                name = f"seq{seq}_{attn}_{'compile' if compiled else 'eager'}"
                args = ["--config", a.config, *extra, *plan, "--model.attn_type", attn,
                        "--compile.enable", str(compiled).lower()]
                if a.seq_lens:
                    args += ["--training.seq_len", str(seq), "--model.max_seq_len", str(seq)]
                row = runner.run(name, 1, args, {"seq_len": seq, "attn": attn, "compiled": compiled})
                if row is not None:
                    rows.append(row)
    meta = {"steps": a.steps, "warmup": a.warmup, "plan": plan_note, "train_args": ["--config", a.config, *extra]}
    result = write_compile_report(out, a.tag, rows, meta, runner.pending)
    print((out / f"compile_{a.tag}.md").read_text())
    return result


if __name__ == "__main__":
    main()
