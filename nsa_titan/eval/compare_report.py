"""Reading and reporting for ``eval.compare``: loss curves from the trainer's JSONL, the issue's targets, the
markdown and the PNG. Kept apart from compare.py so that the command stays short."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nsa_titan.data.retrieval import shortcut_accuracy
from nsa_titan.eval.needle import accuracy_table
from nsa_titan.eval.retrieval_diagnostics import diagnostics_table

COLORS = {"nsa": "tab:blue", "dense": "tab:orange"}


def loss_curves(jsonl: Path) -> dict[str, list]:
    """{"train": [[step, loss], ...] every step, "val": [[step, val_loss, retrieval_acc or None], ...]}.

    Train records carry their window's per-step losses (``step_losses``). Interrupted attempts' files
    (``<stem>.attempt-NNN.jsonl``, set aside by compare before a resume) are read first; steps redone after the
    resume point appear twice, and the last record of a step wins.
    """
    train, val = {}, {}
    files = [*sorted(jsonl.parent.glob(f"{jsonl.stem}.attempt-*.jsonl")), jsonl]
    lines = [line for f in files if f.is_file() for line in f.read_text().splitlines()]
    for line in lines:
        rec = json.loads(line)
        if rec.get("type") == "train":
            losses = rec.get("step_losses") or [rec["loss"]]
            first = rec["step"] - len(losses) + 1
            train.update({first + i: x for i, x in enumerate(losses)})
        elif rec.get("type") == "val":
            val[rec["step"]] = [rec["val_loss"], rec.get("retrieval_acc")]
    return {"train": [[s, train[s]] for s in sorted(train)], "val": [[s, *val[s]] for s in sorted(val)]}


def _acc(results: dict, variant: str, length: int) -> float | None:
    by_len = results.get(variant, {}).get("accuracy_by_length", {})
    value = by_len.get(length, by_len.get(str(length)))  # int keys become strings in a JSON round trip
    return None if value is None else float(value)


def check_targets(mode: str, results: dict, seq_len: int) -> dict[str, Any]:
    """Issue 13's targets. Retrieval: NSA >= dense - 2 points at the training length, NSA >= dense at 2x-8x, and
    the calibration (dense >= 95 % at the training length). Parity: NSA final val loss <= dense's + 0.02."""
    if mode == "parity":
        last = {v: (r["curves"]["val"] or [[None, None]])[-1][1] for v, r in results.items()}
        nsa, dense = last.get("nsa"), last.get("dense")
        return {"nsa_final_val_loss": nsa, "dense_final_val_loss": dense,
                "nsa_le_dense_plus_0.02": None if nsa is None or dense is None else nsa <= dense + 0.02}
    out: dict[str, Any] = {}
    nsa, dense = _acc(results, "nsa", seq_len), _acc(results, "dense", seq_len)
    out["dense_ge_95pct_at_train_len"] = None if dense is None else dense >= 0.95
    out["nsa_ge_dense_minus_2pts_at_train_len"] = None if nsa is None or dense is None else nsa >= dense - 0.02
    for k in (2, 4, 8):
        n, d = _acc(results, "nsa", k * seq_len), _acc(results, "dense", k * seq_len)
        out[f"nsa_ge_dense_at_{k}x"] = None if n is None or d is None else n >= d
    return out


def report_lines(out: dict, base) -> list[str]:
    """The markdown report."""
    tc, dc = base.training, base.data
    lines = [f"# NSA vs dense: {out['mode']} ({out['tag']})", "",
             f"{out['device']}, torch {out['torch']}, triton {out['triton']}, {out['date']}. Both variants: "
             f"{base.model.flavor}, {tc.steps} steps, seq_len {tc.seq_len}, batch {tc.local_batch_size} x "
             f"{tc.grad_accum_steps}, seed {tc.seed}, data {dc.dataset}.",
             f"Command-line flags of the training: `{' '.join(out['train_argv'])}`", "",
             "| variant | steps | first loss | final loss | tokens/s | train time (s) |", "|---|---|---|---|---|---|"]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for variant, r in out["results"].items():
        lines.append(f"| {variant} | {r.get('steps', '-')} | {fmt(r.get('initial_loss'), '.4f')} | "
                     f"{fmt(r.get('final_loss'), '.4f')} | {fmt(r.get('tokens_per_s'), ',.0f')} | "
                     f"{fmt(r.get('elapsed_s'), '.0f')} |")
    lines += ["", f"Targets: `{json.dumps(out['targets'])}`", ""]
    if out["mode"] == "parity":
        lines += ["| step | " + " | ".join(f"{v} val loss" for v in out["results"]) + " |",
                  "|---" * (len(out["results"]) + 1) + "|"]
        by_step: dict[int, dict] = {}
        for variant, r in out["results"].items():
            for step, loss, _ in r["curves"]["val"]:
                by_step.setdefault(step, {})[variant] = loss
        for step in sorted(by_step):
            lines.append(f"| {step} | " + " | ".join(fmt(by_step[step].get(v), ".4f") for v in out["results"]) + " |")
        return lines
    lines += [f"Retrieval accuracy in % (queries answered exactly; {dc.retrieval_num_pairs} pairs, "
              f"{dc.retrieval_num_queries} queries, key {dc.retrieval_key_len} / value {dc.retrieval_value_len} tokens "
              "per sample; only the distractor text grows with the context). Depth: where the queried pair sits in "
              "the pair region (0: start, 1: end, still more than the window before the queries).", "",
              f"Chance: {100 / 10 ** dc.retrieval_value_len:.1f} % (digit values). Key-blind shortcut: "
              f"{100 * _shortcut(dc):.1f} % (queries {getattr(dc, 'retrieval_queries', 'distinct')}, unique values "
              f"{getattr(dc, 'retrieval_unique_values', False)}): what a model scores from the task's statistics "
              "without matching keys (`data.retrieval.shortcut_accuracy`); only accuracy above it shows retrieval.",
              ""]
    for variant, r in out["results"].items():
        lines += [f"## {variant}", "", accuracy_table(r.get("rows", []), variant), ""]
        if r.get("diagnostics"):
            lines += ["NSA diagnostics per layer (trained model, retrieval samples at the training length):", "",
                      *diagnostics_table(r["diagnostics"]), ""]
    return lines


def _shortcut(dc) -> float:
    return shortcut_accuracy(dc.retrieval_num_pairs, dc.retrieval_num_queries, 10 ** dc.retrieval_value_len,
                             queries=getattr(dc, "retrieval_queries", "distinct"),
                             unique_values=getattr(dc, "retrieval_unique_values", False), samples=5000)


def draw_curves(out: dict, plt) -> None:
    """Retrieval: per-step training loss and accuracy by length. Parity: validation and training loss."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for variant, r in out["results"].items():
        color = COLORS.get(variant)
        train = r["curves"]["train"]
        if train:
            axes[0].plot([s for s, _ in train], [x for _, x in train], color=color, label=variant, lw=0.8)
        if out["mode"] == "parity":
            val = r["curves"]["val"]
            axes[1].plot([v[0] for v in val], [v[1] for v in val], "o-", color=color, label=variant, ms=3)
        else:
            by_len = sorted((int(k), v) for k, v in r.get("accuracy_by_length", {}).items())
            axes[1].plot([k for k, _ in by_len], [100 * v for _, v in by_len], "o-", color=color, label=variant)
    axes[0].set(title="training loss per step", xlabel="step", ylabel="loss (nats/token)")
    if out["mode"] == "parity":
        axes[1].set(title="validation loss", xlabel="step", ylabel="loss (nats/token)")
    else:
        axes[1].set(title="retrieval accuracy by context length", xlabel="context length (tokens)",
                    ylabel="queries answered (%)", ylim=(-2, 102))
        axes[1].set_xscale("log", base=2)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"NSA vs dense, {out['mode']} ({out['tag']}, {out['device']})")
