"""Can the model learn the retrieval task in minutes? Several short trainings side by side on one GPU, one report.

    python benchmarks/mqar_calibration.py --out OUT --time-limit-s 540 [--runs NAME,NAME ...]
    python benchmarks/mqar_calibration.py --out OUT --report-only      # rebuild the report from OUT/<run>/

Each run is ``python -m nsa_titan.train`` on ``--data.dataset retrieval`` with its own layout (pairs, queries,
value length, unique values), attention (dense / NSA) and learning rate; all start at once and share the GPU
(small models leave most of an H100 idle alone), each stopped by SIGINT at the time limit (it then writes its
summary). The report lists, per run, validation retrieval accuracy over steps beside two baselines: chance and the
layout's key-blind shortcut (``nsa_titan.data.retrieval.shortcut_accuracy``): only accuracy above the shortcut
shows that keys are matched. Writes ``mqar_calibration_<tag>.{json,md,png}`` to ``--results``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nsa_titan.data.retrieval import shortcut_accuracy  # noqa: E402

BASE = ["--config", "train_configs/m7c_125m.toml", "--data.dataset", "retrieval", "--metrics.log_freq", "100",
        "--metrics.val_freq", "250", "--metrics.val_steps", "8", "--checkpoint.enable", "false",
        "--lr_scheduler.warmup_steps", "100", "--training.steps", "4000", "--compile.enable"]
# 64 queries over 16 pairs ('repeat' queries): four times the supervised answers per sample of the first H100 runs,
# whose 16 answers per 512 tokens gave too little signal in 4,000 steps (benchmarks/results/mqar_calibration_*).
# At seq 512 m7c's NSA selects all of the context (16 blocks of 64): this calibrates the task, not NSA.
SHORT = ["--training.seq_len", "512", "--model.window", "64", "--training.local_batch_size", "32",
         "--data.retrieval_num_pairs", "16", "--data.retrieval_num_queries", "64"]
# name -> trainer overrides on top of BASE (the layout for the shortcut is read back from the resulting config)
RUNS = {
    "dense_repeat_v2u_lr3e-4": [*SHORT, "--model.attn_type", "dense", "--data.retrieval_value_len", "2",
                                "--data.retrieval_unique_values", "--optimizer.lr", "3e-4"],
    "dense_repeat_v2u_lr1e-3": [*SHORT, "--model.attn_type", "dense", "--data.retrieval_value_len", "2",
                                "--data.retrieval_unique_values", "--optimizer.lr", "1e-3"],
    "dense_repeat_v1_lr3e-4": [*SHORT, "--model.attn_type", "dense", "--optimizer.lr", "3e-4"],
    "nsa_repeat_v2u_lr3e-4": [*SHORT, "--model.attn_type", "nsa", "--data.retrieval_value_len", "2",
                              "--data.retrieval_unique_values", "--optimizer.lr", "3e-4"],
}


def layout(args: list[str]) -> dict:
    """The retrieval layout of a run's trainer arguments (config defaults where a flag is absent)."""
    from nsa_titan.config import load_job_config  # noqa: PLC0415 - optional (only the report needs the config)

    dc = load_job_config(args).data
    return {"pairs": dc.retrieval_num_pairs, "queries": dc.retrieval_num_queries,
            "value_len": dc.retrieval_value_len, "mode": dc.retrieval_queries, "unique": dc.retrieval_unique_values}


def launch(out: Path, names: list[str], limit_s: float, extra: list[str]) -> None:
    procs = {}
    for name in names:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "nsa_titan.train", *BASE, *RUNS[name], *extra, "--job.dump_folder", str(folder)]
        (folder / "command.txt").write_text(" ".join(cmd) + "\n")
        procs[name] = subprocess.Popen(cmd, cwd=REPO, stdout=open(folder / "train.log", "w"), stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + limit_s
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(2)
    for p in procs.values():  # SIGINT: the trainer finishes its step and writes its summary
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs.values():
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def report(out: Path, results: Path, tag: str) -> dict:
    runs = []
    for folder in sorted(p for p in out.iterdir() if (p / "metrics.jsonl").exists()):
        args = (folder / "command.txt").read_text().split() if (folder / "command.txt").exists() else []
        args = args[args.index("nsa_titan.train") + 1:] if "nsa_titan.train" in args else []
        lay = layout(args)
        recs = [json.loads(line) for line in open(folder / "metrics.jsonl")]
        val = [[r["step"], r["val_loss"], r.get("retrieval_acc")] for r in recs if r.get("type") == "val"]
        summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
        runs.append({"name": folder.name, **lay, "val": val, "final_acc": val[-1][2] if val else None,
                     "chance": 10.0 ** -lay["value_len"], "device": summary.get("device"),
                     "torch": summary.get("torch"), "triton": summary.get("triton"),
                     "shortcut": shortcut_accuracy(lay["pairs"], lay["queries"], 10 ** lay["value_len"],
                                                   queries=lay["mode"], unique_values=lay["unique"], samples=5000)})
    first = next((r for r in runs if r["device"]), {})
    result = {"benchmark": "mqar_calibration", "tag": tag, "device": first.get("device"),
              "torch": first.get("torch"), "triton": first.get("triton"),
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "runs": runs}
    stem = results / f"mqar_calibration_{tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f} %"  # noqa: E731
    lines = [f"# MQAR calibration: {tag}", "", f"{result['device']}, torch {result['torch']}, triton "
             f"{result['triton']}, {result['date']}; `benchmarks/mqar_calibration.py`, runs side by side on one GPU.",
             "", "| run | pairs / queries | value tokens | queries | unique values | last val step | val accuracy | "
             "chance | key-blind shortcut | above shortcut |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        above = r["final_acc"] is not None and r["final_acc"] > r["shortcut"] + 0.05
        lines.append(f"| {r['name']} | {r['pairs']} / {r['queries']} | {r['value_len']} | {r['mode']} | "
                     f"{r['unique']} | {r['val'][-1][0] if r['val'] else '-'} | {pct(r['final_acc'])} | "
                     f"{pct(r['chance'])} | {pct(r['shortcut'])} | {'yes' if above else 'no'} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - optional
    except ImportError:
        return result
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, r in enumerate(runs):
        ax.plot([v[0] for v in r["val"]], [100 * (v[2] or 0) for v in r["val"]], color=f"C{i}", label=r["name"])
        ax.axhline(100 * r["shortcut"], color=f"C{i}", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("val retrieval accuracy % (dashed: shortcut)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="run folders")
    ap.add_argument("--results", default=None, help="where the report goes (default: --out)")
    ap.add_argument("--tag", default="h100")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--time-limit-s", type=float, default=540)
    ap.add_argument("--report-only", action="store_true")
    a, extra = ap.parse_known_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"unknown run(s) {unknown}; choose from {sorted(RUNS)}")
    if not a.report_only:
        launch(out, names, a.time_limit_s, [x for x in extra if x != "--"])
    results = Path(a.results or out)
    report(out, results, a.tag)
    print((results / f"mqar_calibration_{a.tag}.md").read_text())


if __name__ == "__main__":
    main()
