"""Shared helpers of tests/test_checkpoint.py and tests/test_failures.py: tiny CPU runs of nsa_titan.train."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "_fault_worker.py"

# The brief's tiny debug model: a step takes milliseconds on one CPU thread.
TINY = ("--model.dim 64 --model.n_layers 2 --model.n_heads 4 --model.n_kv_heads 2 --model.head_dim 16 "
        "--model.ffn_hidden_dim 96 --model.cmp_block 8 --model.cmp_stride 4 --model.slc_block 16 "
        "--model.slc_top_n 3 --model.window 24 --model.attn_impl torch --training.seq_len 64 "
        "--training.local_batch_size 2 --training.device cpu --metrics.log_freq 1 "
        "--lr_scheduler.warmup_steps 2 --optimizer.lr 3e-3").split()
STEPS = 20


def args(dump: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return [*TINY, "--training.steps", str(steps), "--job.dump_folder", str(dump), *extra]


def ckpt_args(dump: Path, *extra: str, steps: int = STEPS, interval: int = 5) -> list[str]:
    return args(dump, "--checkpoint.enable", "--checkpoint.interval", str(interval), *extra, steps=steps)


def run(argv: list[str], hooks=None) -> tuple[dict, str]:
    """main() in this process; returns (summary, printed output)."""
    from nsa_titan.train import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = main(argv, hooks=hooks)
    return summary, out.getvalue()


def losses(dump: Path) -> dict[int, float]:
    """Per-step training loss of the LAST run in ``dump`` (each run rewrites metrics.jsonl; log_freq 1)."""
    recs = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["type"] == "train"}


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_worker(scenario: str, step: int, argv: list[str], *, timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WORKER), scenario, str(step), "--", *argv], cwd=REPO,
                          env=env or subprocess_env(), capture_output=True, text=True, timeout=timeout)
