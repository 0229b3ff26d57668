"""Retrieval accuracy by context length and depth, on the training task (``nsa_titan.data.RetrievalTask``).

At each context length the task keeps its training shape (pairs, queries, key/value lengths, gap) and only the
distractor text grows, so longer contexts put the pairs further from their queries: at 2x-8x the training
length this measures how retrieval extrapolates. Each query is scored on its own (correct when the argmax is
right at every value token: ``nsa_titan.data.query_correct``; teacher forcing with all answer tokens right is
the same as greedy decoding of the answer) and binned by the depth of the pair it asks for (0 = start of the
pair region, 1 = its end, the nearest the queries may be). Samples come from a stream training never draws.

    python -m nsa_titan.eval.needle --checkpoint CKPT [--lengths 512,1024,2048,4096] [--depth-bins 4]
        [--samples 20] [--batch-size 1] [--config FILE] [--model.KEY VALUE ...] [--data.retrieval_* ...] [--out F]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from nsa_titan.checkpoint.load import build_inference_model, load_inference_config, resolve_inference_args
from nsa_titan.components.runtime import autocast_context, device_name, resolve_device, software_versions
from nsa_titan.data import (
    IGNORE_INDEX,
    RetrievalTask,
    query_correct,
    stdlib_documents,
    text_file_documents,
    tokenize_documents,
    tokenizer_from_config,
)
from nsa_titan.data.build import retrieval_task_kwargs

NEEDLE_STREAM = 2  # RetrievalTask streams 0 and 1 are the train and val samples: evaluate on unseen ones


def draw_batch(task: RetrievalTask, indices) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(input [B, T], labels [B, T] with -100 off the answers, depth of each query's pair [B, M])."""
    drawn = [task.sample_with_layout(int(i)) for i in indices]
    tokens = torch.from_numpy(np.stack([d[0] for d in drawn]))
    mask = torch.from_numpy(np.stack([d[1] for d in drawn]))
    labels = torch.where(mask[:, 1:], tokens[:, 1:], IGNORE_INDEX)
    return tokens[:, :-1], labels, np.stack([d[2].depth for d in drawn])


def depth_bin_of(depth: np.ndarray, bins: int) -> np.ndarray:
    """Bin index in [0, bins) of depths in [0, 1] (1 falls into the last bin)."""
    return np.minimum((depth * bins).astype(np.int64), bins - 1)


@torch.no_grad()
def evaluate_needle(model, tokenizer, *, lengths, depth_bins: int, samples: int, device: torch.device,
                    task_kwargs: dict, batch_size: int = 1, seed: int = 0, autocast=contextlib.nullcontext,
                    log=print) -> list[dict]:
    """One row per (context length, depth bin): accuracy over the queries of ``samples`` samples."""
    rows = []
    for length in lengths:
        task = RetrievalTask(tokenizer, length, seed=seed, stream=NEEDLE_STREAM, **task_kwargs)
        correct, total = np.zeros(depth_bins, np.int64), np.zeros(depth_bins, np.int64)
        t0 = time.perf_counter()
        for start in range(0, samples, batch_size):
            inputs, labels, depth = draw_batch(task, range(start, min(start + batch_size, samples)))
            with autocast():
                logits = model(inputs.to(device))
            ends, right = query_correct(logits, labels.to(device))
            # Queries end in position order, which is their order in the layout: row-major selection matches.
            hits = right[ends].view(depth.shape).cpu().numpy()  # host sync ok: one per eval batch
            b = depth_bin_of(depth, depth_bins)
            np.add.at(correct, b, hits)
            np.add.at(total, b, 1)
        seconds = time.perf_counter() - t0
        for i in range(depth_bins):
            row = {"context_len": length, "depth": f"{i / depth_bins:.2f}-{(i + 1) / depth_bins:.2f}",
                   "accuracy": float(correct[i] / max(total[i], 1)), "queries": int(total[i]), "samples": samples,
                   "seconds": seconds}
            log(json.dumps(row))
            rows.append(row)
    return rows


def accuracy_by_length(rows: list[dict]) -> dict[int, float]:
    """Query-weighted accuracy over all depths, per context length."""
    out = {}
    for length in sorted({r["context_len"] for r in rows}):
        sel = [r for r in rows if r["context_len"] == length]
        out[length] = sum(r["accuracy"] * r["queries"] for r in sel) / max(sum(r["queries"] for r in sel), 1)
    return out


def accuracy_table(rows: list[dict], label: str = "") -> str:
    """Markdown: one line per context length, one column per depth bin, plus all depths together."""
    depths = list(dict.fromkeys(r["depth"] for r in rows))
    overall = accuracy_by_length(rows)
    lines = [f"| {label or 'context'} | " + " | ".join(f"depth {d}" for d in depths) + " | all |",
             "|---" * (len(depths) + 2) + "|"]
    for length in sorted(overall):
        acc = {r["depth"]: r["accuracy"] for r in rows if r["context_len"] == length}
        cells = [f"{100 * acc[d]:.1f}" if d in acc else "-" for d in depths]
        lines.append(f"| {length} | " + " | ".join(cells) + f" | {100 * overall[length]:.1f} |")
    return "\n".join(lines)


def filler_from(data_cfg, tokenizer) -> dict:
    """The filler the training task had (build_dataloader's choice), from the val split: the text of data.path,
    else the stdlib corpus, unless data.retrieval_filler is 'letters' (then random letters)."""
    if data_cfg.retrieval_filler == "letters" or data_cfg.dataset == "hf":
        return {}
    if data_cfg.path and data_cfg.dataset in ("text_files", "retrieval"):
        docs = text_file_documents(data_cfg.path, "val", data_cfg.val_fraction)
    else:
        docs = stdlib_documents("val", data_cfg.val_fraction)
    corpus = tokenize_documents(docs, tokenizer)
    return {"filler_tokens": corpus.tokens, "filler_eos_id": corpus.eos_id}


def eval_task_kwargs(data_cfg, tokenizer, window: int) -> dict:
    """RetrievalTask arguments of the training task: its shape (``[data]``, gap default = ``window``) and filler."""
    return {**retrieval_task_kwargs(data_cfg, window), **filler_from(data_cfg, tokenizer)}


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m nsa_titan.eval.needle", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="weights (see nsa_titan/checkpoint/load.py); none: random init")
    parser.add_argument("--lengths", type=parse_ints, help="context lengths (default: training.seq_len x 1,2,4,8)")
    parser.add_argument("--depth-bins", type=int, default=4, help="equal-width bins of the queried pair's depth")
    parser.add_argument("--samples", type=int, default=20, help="per length (each has data.retrieval_num_queries)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="bf16: autocast on CUDA")
    parser.add_argument("--out", help="write {'rows': [...], ...} as JSON here")
    ns, rest = parser.parse_known_args(argv)
    job_config = load_inference_config(rest)
    lengths = ns.lengths or [job_config.training.seq_len * k for k in (1, 2, 4, 8)]
    device = resolve_device(ns.device)
    tokenizer = tokenizer_from_config(job_config.data)
    args = resolve_inference_args(job_config, ns.checkpoint, max(lengths))
    model = build_inference_model(args, ns.checkpoint, device)
    autocast = functools.partial(autocast_context, device, ns.dtype)
    rows = evaluate_needle(model, tokenizer, lengths=lengths, depth_bins=ns.depth_bins, samples=ns.samples,
                           device=device, batch_size=ns.batch_size, seed=ns.seed, autocast=autocast,
                           task_kwargs=eval_task_kwargs(job_config.data, tokenizer, args.window))
    print(accuracy_table(rows, args.attn_type))
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps({"rows": rows, "checkpoint": ns.checkpoint, "attn_type": args.attn_type,
                                            "device": device_name(device), **software_versions()}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"needle error: {e}", file=sys.stderr)
        sys.exit(2)
