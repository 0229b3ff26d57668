"""NSA vs dense attention on needle retrieval: train both the same number of steps on the retrieval task
(same config, seed and data; only ``model.attn_type`` differs), then evaluate by context length and depth.

    python -m nsa_titan.eval.compare --config train_configs/m7c_125m.toml --data.dataset retrieval \
        --training.seq_len 4096 --training.steps 400 --lengths 1024,2048,4096,8192,16384,32768,65536 \
        --samples 20 --out benchmarks/results --tag needle_m7c

Each variant is trained by the project's trainer (``nsa_titan.train.main`` in this process, checkpointing on)
into ``<job.dump_folder>/compare-<tag>/<variant>`` and evaluated from its final DCP checkpoint (which
generate and the other evals load too); a re-run resumes there instead of training again.
``--checkpoints nsa=PATH,dense=PATH`` evaluates existing checkpoints instead (e.g. from a multi-GPU torchrun
training). Writes ``<out>/<tag>.json`` and ``<out>/<tag>.md`` with device, software versions, date and the
targets' status.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import time
from pathlib import Path


from nsa_titan.checkpoint import list_checkpoints
from nsa_titan.components.runtime import autocast_context, device_name, resolve_device, software_versions
from nsa_titan.config import ConfigError, job_config_to_dict, load_job_config
from nsa_titan.data import build_tokenizer
from nsa_titan.eval.needle import accuracy_table, evaluate_needle, filler_from, parse_floats, parse_ints, task_kwargs_from
from nsa_titan.generate import build_inference_model, resolve_inference_args
from nsa_titan.train import main as train_main


def train_variant(argv: list[str], variant: str, folder: Path) -> tuple[str, dict]:
    """Train with the project's trainer (``nsa_titan.train.main``, in this process) into ``folder`` with
    checkpointing on; returns (the final checkpoint folder, the run's summary). Re-running resumes from the
    newest checkpoint there, so a finished variant is not trained again."""
    summary = train_main([*argv, "--model.attn_type", variant, "--job.dump_folder", str(folder),
                          "--checkpoint.enable", "--checkpoint.folder", "checkpoints"])
    found = list_checkpoints(folder / "checkpoints")
    if not found:
        raise ValueError(f"training {variant} left no checkpoint in {folder / 'checkpoints'}")
    info = {k: summary.get(k) for k in ("steps", "initial_loss", "final_loss", "tokens_per_s", "interrupted")}
    return str(found[-1][1]), info


def check_targets(results: dict) -> dict:
    """The issue's targets: NSA accuracy at 8k >= dense's, and >= 99 % at 32k (mean over depths)."""
    def mean_acc(variant, length):
        rows = [r for r in results.get(variant, {}).get("rows", []) if r["context_len"] == length]
        return sum(r["accuracy"] for r in rows) / len(rows) if rows else None

    nsa8, dense8, nsa32 = mean_acc("nsa", 8192), mean_acc("dense", 8192), mean_acc("nsa", 32768)
    return {"nsa_8k": nsa8, "dense_8k": dense8, "nsa_32k": nsa32,
            "nsa_8k_ge_dense": None if nsa8 is None or dense8 is None else nsa8 >= dense8,
            "nsa_32k_ge_99pct": None if nsa32 is None else nsa32 >= 0.99}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m nsa_titan.eval.compare", description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="nsa,dense")
    parser.add_argument("--checkpoints", default="", help="variant=PATH,... : evaluate these instead of training")
    parser.add_argument("--lengths", type=parse_ints, default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--depths", type=parse_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--eval-batch-size", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="needle")
    ns, rest = parser.parse_known_args(argv)
    checkpoints = dict(kv.split("=", 1) for kv in ns.checkpoints.split(",") if kv)
    results, base = {}, None
    for variant in ns.variants.split(","):
        job_config = load_job_config([*rest, "--model.attn_type", variant])
        base = base or job_config
        device = resolve_device(job_config.training.device)
        tokenizer = build_tokenizer(job_config.data.tokenizer)
        info, ckpt = {}, checkpoints.get(variant)
        if ckpt is None:
            ckpt, info = train_variant(rest, variant, Path(job_config.job.dump_folder) / f"compare-{ns.tag}" / variant)
        args = resolve_inference_args(job_config, ckpt, max(ns.lengths))
        model = build_inference_model(args, ckpt, device)
        autocast = functools.partial(autocast_context, device, job_config.training.mixed_precision)
        t0 = time.perf_counter()
        rows = evaluate_needle(model, tokenizer, lengths=ns.lengths, depths=ns.depths, samples=ns.samples,
                               device=device, batch_size=ns.eval_batch_size, seed=job_config.training.seed,
                               task_kwargs={**task_kwargs_from(job_config.data), **filler_from(job_config.data, tokenizer)},
                               autocast=autocast)
        results[variant] = {**info, "checkpoint": ckpt, "rows": rows, "eval_seconds": time.perf_counter() - t0,
                            "attn_impl": args.attn_impl}
        del model
    out = {"tag": ns.tag, "device": device_name(device), **software_versions(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "targets": check_targets(results), "results": results, "config": job_config_to_dict(base),
           "samples_per_cell": ns.samples}
    folder = Path(ns.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{ns.tag}.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    md = [f"# Needle retrieval: {', '.join(results)} ({ns.tag})", "",
          f"{out['device']}, torch {out['torch']}, triton {out['triton']}, {out['date']}; "
          f"{ns.samples} samples per cell, accuracy in %; depth = where the queried pair sits (0: start, 1: end).",
          f"Training: {base.training.steps} steps, seq_len {base.training.seq_len}, data {base.data.dataset}.", "",
          f"Targets: {json.dumps(out['targets'])}", ""]
    for variant, res in results.items():
        md += [f"## {variant}", "", accuracy_table(res["rows"], variant), ""]
    (folder / f"{ns.tag}.md").write_text("\n".join(md))
    print("\n".join(md))
    return out


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"compare error: {e}", file=sys.stderr)
        sys.exit(2)
