"""NSA vs dense attention: the one command whose results users cite. Same config, data, steps and seed for both
variants (only ``model.attn_type`` differs); each is trained by the project's trainer in this process.

    # Retrieval (default): multi-query associative recall (nsa_titan/data/retrieval.py); accuracy by context
    # length (training length x 1, 2, 4, 8) and depth, per-step loss curves, NSA diagnostics per layer.
    python -m nsa_titan.eval.compare --config train_configs/m7c_125m.toml --training.steps 3000 --tag mqar_m7c
    # Loss parity on the corpus (data.dataset of the config): validation loss curves of both.
    python -m nsa_titan.eval.compare --mode parity --config train_configs/m7c_125m.toml \\
        --training.seq_len 8192 --training.steps 2000 --tag parity_m7c

Each variant trains into ``<job.dump_folder>/compare-<tag>/<variant>`` with checkpointing on. Resumable: a rerun
skips a variant whose training (``train.json``) and evaluation (``result.json``) were finished with the same
settings, resumes an interrupted training from its newest checkpoint, and refuses a folder made with other
settings (pass another --tag). ``--checkpoints nsa=PATH,dense=PATH`` evaluates existing checkpoints instead.
Writes ``<out>/<tag>.{json,md,png}`` (the PNG needs matplotlib: ``pip install nsa_titan[plot]``; without it the
markdown says so and holds every number). Trainer flags (``--section.key value``) pass through.
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
from nsa_titan.checkpoint.load import build_inference_model, resolve_inference_args
from nsa_titan.components.runtime import autocast_context, device_name, resolve_device, software_versions
from nsa_titan.config import ConfigError, job_config_to_dict, load_job_config
from nsa_titan.data import RetrievalTask, tokenizer_from_config
from nsa_titan.eval.compare_report import check_targets, draw_curves, loss_curves, report_lines
from nsa_titan.eval.needle import NEEDLE_STREAM, accuracy_by_length, eval_task_kwargs, evaluate_needle, parse_ints
from nsa_titan.eval.retrieval_diagnostics import retrieval_diagnostics
from nsa_titan.experiments.common import write_report
from nsa_titan.train import main as train_main


def _load_if_same(path: Path, fingerprint: dict) -> dict | None:
    """The saved stage result when it was made with ``fingerprint``; None when absent; an error when different."""
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("fingerprint") != fingerprint:
        raise ValueError(f"{path} was made with other settings ({saved.get('fingerprint')} vs {fingerprint}); pass "
                         f"another --tag, or delete {path.parent} to redo it")
    return saved


def train_variant(argv: list[str], variant: str, folder: Path) -> dict:
    """Train (or resume, or skip when finished) with the trainer into ``folder``; returns the stage record."""
    fingerprint = {"train_argv": argv, "variant": variant}
    done = _load_if_same(folder / "train.json", fingerprint)
    if done is not None:
        print(f"compare: {variant} already trained in {folder} (train.json); skipping training", flush=True)
        return done
    # The trainer rewrites its JSONL; keep an interrupted attempt's records for the loss curves (loss_curves).
    jsonl = folder / load_job_config(argv).metrics.jsonl_file
    if jsonl.is_file() and jsonl.stat().st_size:
        jsonl.rename(jsonl.with_name(f"{jsonl.stem}.attempt-{len(list(folder.glob('*.attempt-*'))):03d}.jsonl"))
    summary = train_main([*argv, "--model.attn_type", variant, "--job.dump_folder", str(folder),
                          "--checkpoint.enable", "--checkpoint.folder", "checkpoints"])
    if summary.get("interrupted"):
        raise KeyboardInterrupt(f"{variant} training was interrupted; run the same command again to resume it")
    found = list_checkpoints(folder / "checkpoints")
    if not found:
        raise ValueError(f"training {variant} left no checkpoint in {folder / 'checkpoints'}")
    record = {"fingerprint": fingerprint, "checkpoint": str(found[-1][1]),
              **{k: summary.get(k) for k in ("steps", "initial_loss", "final_loss", "tokens_per_s", "elapsed_s",
                                             "final_val")}}
    (folder / "train.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    return record


def evaluate_variant(ns, job_config, variant: str, ckpt: str, folder: Path, lengths: list[int]) -> dict:
    """Retrieval accuracy by length and depth (+ NSA diagnostics) of one checkpoint; cached in result.json."""
    fingerprint = {"checkpoint": ckpt, "lengths": lengths, "depth_bins": ns.depth_bins, "samples": ns.samples,
                   "diag_samples": ns.diag_samples}
    done = _load_if_same(folder / "result.json", fingerprint)
    if done is not None:
        return done
    device = resolve_device(job_config.training.device)
    tokenizer = tokenizer_from_config(job_config.data)
    args = resolve_inference_args(job_config, ckpt, max(lengths))
    model = build_inference_model(args, ckpt, device)
    autocast = functools.partial(autocast_context, device, job_config.training.mixed_precision)
    task_kwargs = eval_task_kwargs(job_config.data, tokenizer, args.window)
    t0 = time.perf_counter()
    rows = evaluate_needle(model, tokenizer, lengths=lengths, depth_bins=ns.depth_bins, samples=ns.samples,
                           device=device, batch_size=ns.eval_batch_size, seed=job_config.training.seed,
                           task_kwargs=task_kwargs, autocast=autocast)
    # Diagnostics on samples the accuracy did not use (indices after them), at the training length.
    task = RetrievalTask(tokenizer, job_config.training.seq_len, seed=job_config.training.seed, stream=NEEDLE_STREAM,
                         **task_kwargs)
    diag = retrieval_diagnostics(model, task, samples=ns.diag_samples, device=device, autocast=autocast,
                                 indices_from=ns.samples) if ns.diag_samples else None
    result = {"fingerprint": fingerprint, "rows": rows, "accuracy_by_length": accuracy_by_length(rows),
              "diagnostics": diag, "eval_seconds": time.perf_counter() - t0, "attn_impl": args.attn_impl,
              "device": device_name(device)}
    (folder / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m nsa_titan.eval.compare", description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("retrieval", "parity"), default="retrieval",
                        help="retrieval: MQAR accuracy by length/depth; parity: validation loss on the corpus")
    parser.add_argument("--variants", default="nsa,dense")
    parser.add_argument("--checkpoints", default="", help="variant=PATH,... : evaluate these instead of training")
    parser.add_argument("--lengths", type=parse_ints, help="retrieval: context lengths (default: seq_len x 1,2,4,8)")
    parser.add_argument("--depth-bins", type=int, default=4, help="retrieval: bins of the queried pair's depth")
    parser.add_argument("--samples", type=int, default=16, help="retrieval: samples per length (each with "
                        "data.retrieval_num_queries queries)")
    parser.add_argument("--diag-samples", type=int, default=8, help="retrieval: samples for the NSA diagnostics")
    parser.add_argument("--eval-batch-size", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default=None, help="names the outputs (default: compare_<mode>)")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> dict:
    ns, rest = parse_args(argv)
    tag = ns.tag or f"compare_{ns.mode}"
    # Retrieval trains on the retrieval task unless the flags say otherwise (later flags win).
    train_argv = (["--data.dataset", "retrieval"] if ns.mode == "retrieval" else []) + rest
    base = load_job_config(train_argv)
    if ns.mode == "parity" and base.metrics.val_freq == 0:
        train_argv += ["--metrics.val_freq", str(max(1, base.training.steps // 20))]  # the curves need val points
        base = load_job_config(train_argv)
    if ns.mode == "retrieval" and base.data.dataset != "retrieval":
        raise ConfigError(f"--mode retrieval trains on the retrieval task, not data.dataset={base.data.dataset!r}; "
                          "drop --data.dataset or use --mode parity")
    lengths = ns.lengths or [base.training.seq_len * k for k in (1, 2, 4, 8)]
    checkpoints = dict(kv.split("=", 1) for kv in ns.checkpoints.split(",") if kv)
    root = Path(base.job.dump_folder) / f"compare-{tag}"
    results = {}
    for variant in ns.variants.split(","):
        job_config = load_job_config([*train_argv, "--model.attn_type", variant])
        folder = root / variant
        folder.mkdir(parents=True, exist_ok=True)
        if variant in checkpoints:
            trained = {"checkpoint": checkpoints[variant]}
        else:
            trained = train_variant(train_argv, variant, folder)
        res = {**trained, "curves": loss_curves(folder / job_config.metrics.jsonl_file)}
        if ns.mode == "retrieval":
            res.update(evaluate_variant(ns, job_config, variant, trained["checkpoint"], folder, lengths))
        res.pop("fingerprint", None)
        results[variant] = res
    out = {"tag": tag, "mode": ns.mode, "device": device_name(resolve_device(base.training.device)),
           **software_versions(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "train_argv": train_argv, "targets": check_targets(ns.mode, results, base.training.seq_len),
           "results": results, "config": job_config_to_dict(base)}
    lines = report_lines(out, base)
    paths = write_report(Path(ns.out), tag, out, lines, draw=functools.partial(draw_curves, out))
    print("\n".join(lines))
    print(f"compare: wrote {', '.join(str(p) for p in paths.values())}")
    return out


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"compare error: {e}", file=sys.stderr)
        sys.exit(2)
