"""FSDP2 vs FSDP1 vs DDP: tokens/s per GPU, step time and peak memory on 1 and N GPUs, with and without AC.

    python -m nsa_titan.experiments.dp_compare --config train_configs/nsa_1b.toml --gpus 1,2 --ac none,full \\
        --out benchmarks/results --tag 1b_seq8192 -- --training.seq_len 8192 --training.local_batch_size 1

Every run is the trainer (``torchrun`` for N > 1) with the same per-GPU batch, so per-GPU tokens/s of an N-GPU run
divided by the 1-GPU run's is the scaling efficiency (target for FSDP2 on 2 GPUs: >= 95%). The 1-GPU run has no
data parallelism (one process), the baseline every wrapper is compared with. ``--ac`` takes ``none``, ``full``,
``selective_op``, ``ratio:P`` or ``memory_budget:B``. Writes ``dp_compare_<tag>.{md,json,png}``; the runs'
metrics stay in ``<out>/dp_compare_<tag>/runs/`` and are reused by a second invocation (``--time-limit-s``).
``--rounds R`` runs every cell R times, interleaved, and reports each cell's median round with the spread: on a
host whose speed drifts (2 x H100, 2026-11-25: the same 1-GPU m7c run at 0.083 and 0.094 s per step minutes
apart, with full AC 0.114 and 0.163) one round per cell can make any scaling ratio.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from nsa_titan.config import ConfigError, load_job_config
from nsa_titan.experiments.common import (
    REPO,
    Runner,
    draw_speed_and_memory,
    environment_of,
    md_table,
    pending_note,
    visible_gpus,
    write_report,
)

DP_KINDS = ("fsdp2", "fsdp1", "ddp")
SCALING_TARGET = 0.95  # FSDP2 per-GPU tokens/s / one GPU's (issue 12; m7c's is 0.90: --scaling-target)
AC_COST_TARGET = 1.35  # AC full's step time / AC none's under FSDP2
MEMORY_TARGET = 0.93  # FSDP2 peak reserved / FSDP1's
# --step-graph: the flags of the runs that can capture their steps (the trainer refuses diagnostics under the graph)
STEP_GRAPH_ARGS = ["--compile.step_graph", "--metrics.nsa_diagnostics", "false"]


def ac_args(spec: str) -> list[str]:
    """'none' | 'full' | 'selective_op' | 'ratio:P' | 'memory_budget:B' -> trainer flags."""
    mode, _, value = spec.partition(":")
    if mode not in ("none", "full", "selective_op", "ratio", "memory_budget"):
        raise SystemExit(f"--ac: unknown mode {mode!r}; use none, full, selective_op, ratio:P or memory_budget:B")
    out = ["--activation_checkpoint.mode", mode]
    if mode in ("ratio", "memory_budget"):
        if not value:
            raise SystemExit(f"--ac {spec}: give the value, e.g. {mode}:0.5")
        out += [f"--activation_checkpoint.{mode}", value]
    return out


def _compile_section(config: str, extra: list[str]) -> Any:
    """The runs' compile settings (the config file and the trainer flags), or None for a config the trainer would
    refuse: that is not decided here, each run reports it."""
    try:
        return load_job_config(["--config", config, *extra]).compile
    except ConfigError:
        return None


def plan_runs(gpus: list[int], acs: list[str], kinds: list[str]) -> list[dict[str, Any]]:
    runs = []
    for ac in acs:
        for g in gpus:
            for dp in (["none"] if g == 1 else kinds):
                name = f"ac-{ac.replace(':', '')}_{g}gpu" + ("" if g == 1 else f"_{dp}")
                runs.append({"name": name, "gpus": g, "ac": ac, "data_parallel": dp})
    return runs


def round_name(name: str, k: int) -> str:
    """Run name of round k (1-based); round 1 keeps the plain name, so earlier single-round runs stay cached."""
    return name if k == 1 else f"{name}_r{k}"


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's rows from several rounds -> one row: the round of median tokens/s per GPU (the lower middle
    one for an even count, so every number comes from one real run), plus every round's tokens/s and their
    spread (max - min over that median). Failed rounds are left out; a cell with none left keeps the first
    round's error."""
    ok = [r for r in rounds if r.get("tokens_per_s_per_gpu")]
    if not ok:
        return rounds[0]
    by_speed = sorted(ok, key=lambda r: r["tokens_per_s_per_gpu"])
    mid = dict(by_speed[(len(by_speed) - 1) // 2])
    speeds = [r["tokens_per_s_per_gpu"] for r in ok]
    mid.update(rounds_tokens_per_s_per_gpu=speeds, rounds_failed=len(rounds) - len(ok),
               round_spread=(max(speeds) - min(speeds)) / mid["tokens_per_s_per_gpu"])
    return mid


def _rounds(row: dict[str, Any]) -> str:
    speeds = row.get("rounds_tokens_per_s_per_gpu") or []
    return "/".join(f"{v / 1e3:.0f}k" for v in speeds) + (f" ({row['round_spread']:.0%})" if len(speeds) > 1 else "")


def add_scaling(rows: list[dict[str, Any]]) -> None:
    """``scaling``: mean tokens/s per GPU over the 1-GPU run's at the same AC; ``scaling_median``: the same on
    the median log window (robust to one slow window)."""
    base = {r["ac"]: r for r in rows if r["gpus"] == 1 and r.get("tokens_per_s_per_gpu")}
    for r in rows:
        b = base.get(r["ac"])
        for key, col in (("scaling", "tokens_per_s_per_gpu"), ("scaling_median", "tokens_per_s_per_gpu_median")):
            r[key] = r[col] / b[col] if b and r.get(col) and b.get(col) else None


def _spread(row: dict[str, Any]) -> str:
    lo, hi = row.get("step_time_min_s"), row.get("step_time_max_s")
    return f"{lo:.3f}-{hi:.3f}" if lo is not None and hi is not None else ""


def targets(rows: list[dict[str, Any]], scaling_target: float = SCALING_TARGET) -> list[str]:
    """Issue 12's targets, each where its rows exist: FSDP2 scaling, AC full's cost under FSDP2, FSDP2 vs FSDP1."""
    lines = []

    def verdict(ok: bool, miss: str) -> str:
        return "MET" if ok else f"MISSED by {miss}"

    by = {(r["ac"], r["gpus"], r["data_parallel"]): r for r in rows if r.get("tokens_per_s_per_gpu")}
    for r in rows:
        if r["data_parallel"] == "fsdp2" and r["gpus"] > 1 and r.get("scaling") is not None:
            short = f"{scaling_target - r['scaling']:.1%}"
            lines.append(f"- AC {r['ac']}: FSDP2 on {r['gpus']} GPUs runs at {r['scaling']:.1%} of 1-GPU tokens/s "
                         f"per GPU (target >= {scaling_target:.0%}): {verdict(r['scaling'] >= scaling_target, short)}")
    for g in sorted({r["gpus"] for r in rows if r["gpus"] > 1}):
        none, full = by.get(("none", g, "fsdp2")), by.get(("full", g, "fsdp2"))
        if none and full:
            ratio = full["step_time_s"] / none["step_time_s"]
            over = f"{ratio - AC_COST_TARGET:.2f}x"
            lines.append(f"- FSDP2 on {g} GPUs: AC full's step takes {ratio:.2f}x AC none's "
                         f"(target <= {AC_COST_TARGET}x): {verdict(ratio <= AC_COST_TARGET, over)}")
        for ac in dict.fromkeys(r["ac"] for r in rows):
            f2, f1 = by.get((ac, g, "fsdp2")), by.get((ac, g, "fsdp1"))
            if not (f2 and f1):
                continue
            speed = f2["tokens_per_s_per_gpu"] / f1["tokens_per_s_per_gpu"]
            how = " (FSDP2 with the step graph, FSDP1 without: it cannot be captured)" if f2.get("step_graph") else ""
            lines.append(f"- AC {ac}, {g} GPUs: FSDP2 / FSDP1 tokens/s = {speed:.3f}{how} (target >= 1): "
                         f"{verdict(speed >= 1, f'{1 - speed:.1%}')}")
            m2, m1 = f2.get("peak_mem_reserved_gib"), f1.get("peak_mem_reserved_gib")
            if m2 and m1:
                share = m2 / m1
                lines.append(f"- AC {ac}, {g} GPUs: FSDP2 peak reserved = {share:.1%} of FSDP1's (target <= "
                             f"{MEMORY_TARGET:.0%}): {verdict(share <= MEMORY_TARGET, f'{share - MEMORY_TARGET:.1%}')}")
    return lines


def write_dp_report(out: Path, tag: str, rows: list[dict[str, Any]], meta: dict[str, Any],
                    pending: list[str]) -> dict[str, Any]:
    add_scaling(rows)
    stem = f"dp_compare_{tag}"
    env = environment_of(rows)
    lines = [f"# FSDP2 vs FSDP1 vs DDP: {tag}", "",
             f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}; "
             f"{meta['steps']} steps, timed after step "
             f"{meta['warmup']}" + (f"; {meta['rounds']} rounds per cell, interleaved: each row is the cell's "
                                    "median round" if meta.get("rounds", 1) > 1 else "")
             + f"; trainer args {meta['train_args']}", "",
             *md_table(rows, [("AC", "ac", ""), ("GPUs", "gpus", ""), ("data parallel", "data_parallel", ""),
                              ("step graph", lambda r: "yes" if r.get("step_graph") else "", ""),
                              ("tok/s/GPU", "tokens_per_s_per_gpu", ",.0f"), ("step s", "step_time_s", ".3f"),
                              ("scaling", "scaling", ".1%"), ("median step s", "step_time_median_s", ".3f"),
                              ("min-max step s", _spread, ""), ("scaling (median)", "scaling_median", ".1%"),
                              ("rounds tok/s/GPU (spread)", _rounds, ""),
                              ("peak alloc GiB", "peak_mem_gib", ".1f"),
                              ("active GiB", "peak_mem_active_gib", ".1f"),
                              ("reserved GiB", "peak_mem_reserved_gib", ".1f"), ("MFU", "mfu", ".1%"),
                              ("TFLOP/s/GPU", "tflops_per_gpu", ".1f"), ("GPU busy", "gpu_busy", ".0%"),
                              ("error", "error", "")]),
             "", "Targets:",
             *(targets(rows, meta.get("scaling_target", SCALING_TARGET)) or ["- (no 2-GPU FSDP2 run measured)"]),
             *pending_note(pending)]

    def draw(plt):
        ok = [r for r in rows if r.get("tokens_per_s_per_gpu")]
        labels = [f"{r['gpus']}gpu {r['data_parallel']}\nAC {r['ac']}" for r in ok]
        ac_color = {ac: f"C{i}" for i, ac in enumerate(dict.fromkeys(r["ac"] for r in ok))}
        draw_speed_and_memory(plt, ok, labels, [ac_color[r["ac"]] for r in ok], "tokens_per_s_per_gpu",
                              "tokens/s per GPU", f"{tag}: data-parallel wrappers")

    result = {"experiment": "dp_compare", "tag": tag, **meta, **env, "rows": rows,
              "targets": targets(rows, meta.get("scaling_target", SCALING_TARGET)),
              "pending": pending}
    write_report(out, stem, result, lines, draw)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--ac", default="none,full", help="comma list of AC settings (see above)")
    ap.add_argument("--data-parallel", default=",".join(DP_KINDS))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="untimed first steps (also the log window)")
    ap.add_argument("--run-timeout-s", type=float, default=300)
    ap.add_argument("--time-limit-s", type=float, default=None, help="start no new run after this")
    ap.add_argument("--cpu", action="store_true", help="CPU processes with gloo: checks the experiment, not speed")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--tag", default="dp")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every cell this many times, interleaved (all cells, then all again): a host whose speed "
                         "drifts shows as spread instead of skewing one cell; each cell reports its median round")
    ap.add_argument("--step-graph", action="store_true",
                    help="capture the steps of the runs that can be captured (one GPU and FSDP2: --compile.step_graph, "
                         "diagnostics off) and run DDP and FSDP1 as they are: each wrapper at its best, in one table "
                         "(needs --compile.enable after --)")
    ap.add_argument("--scaling-target", type=float, default=SCALING_TARGET,
                    help="FSDP2 per-GPU tokens/s / one GPU's to call MET (issue 12: 0.95 for 1b, 0.90 for m7c)")
    a, extra = ap.parse_known_args(argv)
    extra = [x for x in extra if x != "--"] + (["--training.device", "cpu"] if a.cpu else [])
    if not any(x == "--compile.mode" or x.startswith("--compile.mode=") for x in extra):
        # Like with like: compile.mode 'auto' (the m7c config's) would replay the 1-GPU run as CUDA graphs, which
        # data-parallel runs cannot use, and the scaling column would then measure graphs, not the wrapper.
        extra += ["--compile.mode", "default"]
    kinds = a.data_parallel.split(",")
    cc = _compile_section(a.config, extra)
    captured = cc is not None and cc.step_graph  # compile.step_graph in the flags: every run captures
    if captured and set(kinds) - {"fsdp2"}:
        raise SystemExit(f"--compile.step_graph captures FSDP2 steps only (DDP's reducer and FSDP1 cannot be "
                         f"captured), but --data-parallel asks for {a.data_parallel}: pass --data-parallel fsdp2, or "
                         "dp_compare's --step-graph instead, which captures the one-GPU and FSDP2 runs only")
    if a.step_graph and cc is not None and not cc.enable:
        raise SystemExit("--step-graph captures compiled steps: add --compile.enable after --")
    if a.step_graph and a.cpu:
        raise SystemExit("--step-graph captures CUDA graphs, which --cpu runs cannot: drop one of them")
    out = Path(a.out)
    runner = Runner(out / f"dp_compare_{a.tag}", warmup=a.warmup, steps=a.steps, timeout_s=a.run_timeout_s,
                    time_limit_s=a.time_limit_s, force=a.force, gpu=not a.cpu)
    have = None if a.cpu else visible_gpus()
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: give 1 or more")
    runs = plan_runs([int(g) for g in a.gpus.split(",")], a.ac.split(","), kinds)
    per_cell: dict[str, list[dict[str, Any]]] = {run["name"]: [] for run in runs}
    for k in range(1, a.rounds + 1):
        for run in runs:
            name = round_name(run["name"], k)
            if have is not None and run["gpus"] > max(have, 1) and runner.cached(name) is None:
                per_cell[run["name"]].append({**run, "error": f"needs {run['gpus']} GPUs, {have} visible"})
                continue
            args = ["--config", a.config, *extra, *ac_args(run["ac"])]
            if run["data_parallel"] != "none":
                args += ["--parallelism.data_parallel", run["data_parallel"]]
            graph = a.step_graph and run["data_parallel"] in ("none", "fsdp2")
            if graph:
                args += STEP_GRAPH_ARGS
            row = runner.run(name, run["gpus"], args, {"ac": run["ac"], "data_parallel": run["data_parallel"],
                                                       "step_graph": graph or captured})
            if row is not None:
                per_cell[run["name"]].append(row)
    rows = [merge_rounds(rs) for rs in per_cell.values() if rs]
    meta = {"steps": a.steps, "warmup": a.warmup, "rounds": a.rounds, "train_args": ["--config", a.config, *extra],
            "scaling_target": a.scaling_target, "step_graph_runs": "1 GPU and fsdp2" if a.step_graph else None}
    result = write_dp_report(out, a.tag, rows, meta, runner.pending)
    print((out / f"dp_compare_{a.tag}.md").read_text())
    return result


if __name__ == "__main__":
    main()
