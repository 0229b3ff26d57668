"""Training curves of one or several runs into one PNG: loss (and validation loss), tokens/s per GPU, memory.

    python -m nsa_titan.plot outputs/m7c_125m [outputs/other_run ...] [--out curves.png]

Reads each dump folder's metrics.jsonl. A resumed run appends to that file after a ``resume`` marker, so a
step can appear twice (logged by the interrupted run after its last checkpoint, then again after the
resume): the last record of each step wins, which is the history the final weights came from. Needs
matplotlib (``pip install matplotlib`` or ``pip install -e .[plot]``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def read_curves(dump_folder: str | Path, jsonl_file: str = "metrics.jsonl") -> dict[str, dict[int, dict[str, Any]]]:
    """{'train': {step: record}, 'val': {step: record}}, the last record of each step (see the module doc)."""
    path = Path(dump_folder) / jsonl_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a run's dump folder (its job.dump_folder)")
    curves: dict[str, dict[int, dict[str, Any]]] = {"train": {}, "val": {}}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line: skip, say so
            print(f"{path}:{n}: not a JSON record, skipped", file=sys.stderr)
            continue
        if rec.get("type") in curves:
            curves[rec["type"]][rec["step"]] = rec
    return curves


def plot_runs(folders: list[str], out: str | Path) -> Path:
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt  # noqa: PLC0415 - optional
    except ImportError:
        raise SystemExit("nsa_titan.plot needs matplotlib: pip install matplotlib (or pip install -e .[plot])") \
            from None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for folder in folders:
        curves = read_curves(folder)
        train = [curves["train"][s] for s in sorted(curves["train"])]
        label = Path(folder).name
        steps = [r["step"] for r in train]
        axes[0].plot(steps, [r["loss"] for r in train], label=f"{label} train")
        if curves["val"]:
            val = [curves["val"][s] for s in sorted(curves["val"])]
            axes[0].plot([r["step"] for r in val], [r.get("val_loss") for r in val], "o--", label=f"{label} val")
        axes[1].plot(steps, [r["tokens_per_s_per_gpu"] for r in train], label=label)
        axes[2].plot(steps, [r["peak_mem_gib"] for r in train], label=label)
    for ax, title in zip(axes, ("loss", "tokens/s per GPU", "peak memory (GiB)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", help="dump folders of training runs")
    ap.add_argument("--out", default="curves.png", help="PNG to write")
    a = ap.parse_args(argv)
    try:
        print(f"wrote {plot_runs(a.folders, a.out)}")
    except FileNotFoundError as e:  # a wrong folder: the message says what to pass, no traceback
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
