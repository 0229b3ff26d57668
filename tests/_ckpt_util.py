"""Shared helpers of the tests that train tiny CPU runs of nsa_titan.train (checkpoints, failures, data, tokenizers)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from nsa_titan.fault import TrainHooks

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "_fault_worker.py"

# The brief's tiny debug model: a step takes milliseconds on one CPU thread.
TINY = ("--model.dim 64 --model.n_layers 2 --model.n_heads 4 --model.n_kv_heads 2 --model.head_dim 16 "
        "--model.ffn_hidden_dim 96 --model.cmp_block 8 --model.cmp_stride 4 --model.slc_block 16 "
        "--model.slc_top_n 3 --model.window 24 --model.attn_impl torch --training.seq_len 64 "
        "--training.local_batch_size 2 --training.device cpu --metrics.log_freq 1 "
        "--lr_scheduler.warmup_steps 2 --optimizer.lr 3e-3 --data.num_workers 0").split()
# data.num_workers 0: torchdata's loader (when installed) runs in-process; forking loader workers for every
# tiny run would cost more than the run. The worker paths have their own tests (test_data*.py).
STEPS = 20


def args(dump: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return [*TINY, "--training.steps", str(steps), "--job.dump_folder", str(dump), *extra]


def ckpt_args(dump: Path, *extra: str, steps: int = STEPS, interval: int = 5) -> list[str]:
    return args(dump, "--checkpoint.enable", "--checkpoint.interval", str(interval), *extra, steps=steps)


class StopAt(TrainHooks):
    """Interrupt the run (as Ctrl-C would) at the start of ``step``: the schedule still plans all its steps."""

    def __init__(self, step: int):
        self.step = step

    def on_step_start(self, step):
        if step == self.step:
            raise KeyboardInterrupt


def run(argv: list[str], hooks=None) -> tuple[dict, str]:
    """main() in this process; returns (summary, printed output)."""
    from nsa_titan.train import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = main(argv, hooks=hooks)
    return summary, out.getvalue()


def losses(dump: Path) -> dict[int, float]:
    """Per-step training loss of the LAST run in ``dump`` (log_freq 1): a resumed run appends to metrics.jsonl
    after a ``resume`` marker, so its records are those after the last marker."""
    recs = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    starts = [i for i, r in enumerate(recs) if r["type"] == "resume"]
    return {r["step"]: r["loss"] for r in recs[starts[-1] + 1 if starts else 0:] if r["type"] == "train"}


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_worker(scenario: str, step: int, argv: list[str], *, timeout: float = 240,
               env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WORKER), scenario, str(step), "--", *argv], cwd=REPO,
                          env=env or subprocess_env(), capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, step: int, argv: list[str], *, tmp_path: Path, world: int = 2,
              worker_opts: tuple[str, ...] = (), timeout: float = 300, env: dict[str, str] | None = None) -> list[dict]:
    """``world`` gloo ranks of the worker (as torchrun would start them); per rank: returncode, stdout, stderr,
    and seconds until it exited. Output goes to files: a rank blocked on a full pipe would stall the others."""
    import time

    port = free_port()
    procs, files = [], []
    for r in range(world):
        out, err = open(tmp_path / f"rank{r}.out", "w+"), open(tmp_path / f"rank{r}.err", "w+")
        rank_env = subprocess_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port), **(env or {}))
        cmd = [sys.executable, str(WORKER), scenario, str(step), *worker_opts, "--", *argv]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=out, stderr=err))
        files.append((out, err))
    start, ended = time.monotonic(), [None] * world
    while any(e is None for e in ended):
        for r, p in enumerate(procs):
            if ended[r] is None and p.poll() is not None:
                ended[r] = time.monotonic() - start
        if time.monotonic() - start > timeout:
            for p in procs:
                p.kill()
            raise TimeoutError(f"ranks still running after {timeout}s: {[r for r, e in enumerate(ended) if e is None]}")
        time.sleep(0.05)
    results = []
    for r, (p, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0), err.seek(0)
        results.append({"rank": r, "returncode": p.returncode, "stdout": out.read(), "stderr": err.read(),
                        "seconds": ended[r]})
        out.close(), err.close()
    return results


def explain(results: list[dict]) -> str:
    return "\n".join(f"--- rank {r['rank']} rc={r['returncode']}\n{r['stdout'][-1500:]}\n{r['stderr'][-3000:]}"
                     for r in results)
