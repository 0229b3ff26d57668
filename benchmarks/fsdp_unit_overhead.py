"""FSDP2's host time per unit: one training step with k blocks per FSDP2 unit, communication taken out.

    python benchmarks/fsdp_unit_overhead.py --config train_configs/m7c_125m.toml --ks 1,2,4,12 [--world 2] \
        [--steps 8] [--tag X] [--out DIR] [-- trainer overrides ...]

Every run is ``nsa_titan.experiments.probe`` in its own process: rank 0 of a fake process group of ``--world``
ranks (collectives return at once), so FSDP2 shards, gathers and hooks exactly as on that many GPUs while the
bytes cost nothing. What changes with ``parallelism.fsdp_blocks_per_unit`` k is then the host work per step
(hooks, copy-out of gathered buffers, reduce-scatter bookkeeping: once per unit) on top of the compute. The
first row, ``no dp``, is one process without data parallelism: the step without any FSDP2 work.

Reading it: on a GPU where the step is host-bound (m7c on 2 x H100: the GPU idled 390 of 531 ms,
docs/experiments.md) the step time falls with k until the GPU is the bound; on the CPU with a tiny model the
compute is small, so the differences are mostly FSDP2's host time. Writes fsdp_unit_overhead_<tag>.json / .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def probe(train_args: list[str], world: int | None, warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "nsa_titan.experiments.probe", "--result", out, "--warmup", str(warmup),
               "--steps", str(steps), *(["--fake-world-size", str(world)] if world else []), *train_args]
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if not os.path.exists(out):
            return {"error": f"probe exit {proc.returncode}: {proc.stderr[-400:]}"}
        with open(out) as f:
            return json.load(f)


def to_markdown(payload: dict) -> str:
    rows = payload["rows"]
    base = next((r for r in rows if r["k"] == "no dp" and r.get("step_time_s")), None)
    lines = [f"# FSDP2 host time per unit: {payload['tag']} ({payload['device']})", "",
             f"torch {payload['torch']}, {payload['date']}; fake process group of {payload['world']} ranks "
             f"(collectives free), {payload['steps']} timed steps after {payload['warmup']}; trainer args "
             f"`{' '.join(payload['train_args'])}`.", "",
             "| blocks per unit | FSDP2 units of blocks | step ms | vs no dp (ms) | tokens/s |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['k']} | - | error: {r['error'][:80]} | - | - |")
            continue
        extra = f"{1e3 * (r['step_time_s'] - base['step_time_s']):+.1f}" if base else "-"
        lines.append(f"| {r['k']} | {r.get('units', '-')} | {1e3 * r['step_time_s']:.1f} | {extra} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="train_configs/m7c_125m.toml")
    ap.add_argument("--ks", default="1,2,4,12", help="blocks per FSDP2 unit to time")
    ap.add_argument("--world", type=int, default=2, help="fake process group size")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tag", default="m7c")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a, extra = ap.parse_known_args()
    train_args = ["--config", a.config, *(x for x in extra if x != "--")]
    n_layers = _n_layers(train_args)
    rows = [dict(k="no dp", **probe(train_args, None, a.warmup, a.steps))]
    for k in (int(x) for x in a.ks.split(",")):
        r = probe([*train_args, "--parallelism.fsdp_blocks_per_unit", str(k)], a.world, a.warmup, a.steps)
        rows.append(dict(k=k, units=-(-n_layers // k), **r))
        print(json.dumps({kk: rows[-1].get(kk) for kk in ("k", "step_time_s", "error")}), flush=True)
    first = next((r for r in rows if "error" not in r), {})
    payload = dict(tag=a.tag, device=first.get("device"), torch=first.get("torch"), world=a.world, warmup=a.warmup,
                   steps=a.steps, train_args=train_args, rows=rows,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    sys.path.insert(0, HERE)
    from attention_checks import write_results  # the benchmarks' one JSON + markdown writer

    write_results(a.out, f"fsdp_unit_overhead_{a.tag}", payload, to_markdown(payload))


def _n_layers(train_args: list[str]) -> int:
    sys.path.insert(0, REPO)
    from nsa_titan.config import load_job_config

    return load_job_config(train_args).model_args().n_layers


if __name__ == "__main__":
    main()
