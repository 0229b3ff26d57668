"""Needle / key-value retrieval accuracy by context length and depth.

A needle sample is the training task's sample (``nsa_titan.data.RetrievalTask``: [BOS] pairs \\n filler
\\nQUERY key SEP value [EOS]) with the block of key-value pairs moved into the filler, so that the queried
pair starts at ``depth`` (0 = right after BOS, 1 = right before the query) of the context. At depth 0 it is
exactly the training sample (tested), so depth 0 measures the trained skill and other depths how it
transfers. A sample counts as correct when greedy prediction gives every answer token (teacher forcing with
all answer tokens right is the same as greedy decoding of the answer): ``nsa_titan.data.retrieval_accuracy``.

    python -m nsa_titan.eval.needle --checkpoint CKPT [--lengths 1024,2048,...,65536] [--depths 0,0.25,0.5,0.75,1]
        [--samples 20] [--batch-size 1] [--config FILE] [--model.KEY VALUE ...] [--data.retrieval_* ...] [--out F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from nsa_titan.data import IGNORE_INDEX, RetrievalTask, retrieval_accuracy

NEEDLE_STREAM = 2  # RetrievalTask streams 0 and 1 are the train and val samples: evaluate on unseen ones
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


class NeedleTask:
    """``sample(index, depth)`` -> (tokens [context_len + 1], answer mask, queried pair's start position)."""

    def __init__(self, tokenizer, context_len: int, *, num_pairs: int = 16, key_len: int = 4, value_len: int = 4,
                 seed: int = 0, stream: int = NEEDLE_STREAM, filler_tokens=None, filler_eos_id=None):
        self.task = RetrievalTask(tokenizer, context_len, num_pairs=num_pairs, key_len=key_len, value_len=value_len,
                                  seed=seed, stream=stream, filler_tokens=filler_tokens, filler_eos_id=filler_eos_id)
        self.context_len = context_len

    def sample(self, index: int, depth: float) -> tuple[np.ndarray, np.ndarray, int]:
        # Draws the random numbers in RetrievalTask.sample's order, so that depth 0 reproduces its sample.
        t = self.task
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        rng = np.random.default_rng([t.seed, t.stream, int(index)])
        keys = t._tokens_of(t._strings(rng, t.num_pairs, t.key_len, unique=True))
        vals = t._tokens_of(t._strings(rng, t.num_pairs, t.value_len, unique=False))
        q = int(rng.integers(0, t.num_pairs))
        pairs, offset = [], 0
        for i in range(t.num_pairs):
            if i == q:
                offset = sum(len(x) for x in pairs)
            pairs += [keys[i], t.sep, vals[i], t.pair_delim if i + 1 < t.num_pairs else t.newline]
        block = np.concatenate(pairs)
        tail = np.concatenate([t.query, keys[q], t.sep, vals[q], np.array([t.eos], np.int64)])
        n_fill = self.context_len + 1 - 1 - len(block) - len(tail)
        if n_fill < 0:
            raise ValueError(f"context_len {self.context_len} is too short for {t.num_pairs} pairs")
        filler = t._filler(rng, n_fill)
        # Queried pair at depth * (where the query starts), as near as a contiguous pair block allows.
        target = round(depth * (self.context_len + 1 - len(tail))) - offset - 1
        cut = min(max(target, 0), n_fill)
        tokens = np.concatenate([np.array([t.bos], np.int64), filler[:cut], block, filler[cut:], tail])
        mask = np.zeros(self.context_len + 1, dtype=bool)
        mask[self.context_len - len(vals[q]):self.context_len] = True
        return tokens, mask, 1 + cut + offset


@torch.no_grad()
def evaluate_needle(model, tokenizer, *, lengths, depths, samples: int, device: torch.device, batch_size: int = 1,
                    seed: int = 0, task_kwargs: dict | None = None, autocast=contextlib.nullcontext,
                    log=print) -> list[dict]:
    """One row per (context length, depth): accuracy over ``samples`` needle samples, mean needle position."""
    rows = []
    for length in lengths:
        task = NeedleTask(tokenizer, length, seed=seed, **(task_kwargs or {}))
        for depth in depths:
            correct = torch.zeros((), dtype=torch.long, device=device)
            positions = []
            t0 = time.perf_counter()
            for start in range(0, samples, batch_size):
                drawn = [task.sample(i, depth) for i in range(start, min(start + batch_size, samples))]
                tokens = torch.from_numpy(np.stack([d[0] for d in drawn])).to(device)
                mask = torch.from_numpy(np.stack([d[1] for d in drawn])).to(device)
                positions += [d[2] for d in drawn]
                labels = torch.where(mask[:, 1:], tokens[:, 1:], IGNORE_INDEX)
                with autocast():
                    logits = model(tokens[:, :-1])
                correct += retrieval_accuracy(logits, labels)[0]
            row = {"context_len": length, "depth": depth, "accuracy": correct.item() / samples, "samples": samples,  # host sync ok: end of an eval cell
                   "needle_pos_mean": float(np.mean(positions)), "seconds": time.perf_counter() - t0}
            log(json.dumps(row))
            rows.append(row)
    return rows


def task_kwargs_from(data_cfg) -> dict:
    return {"num_pairs": data_cfg.retrieval_num_pairs, "key_len": data_cfg.retrieval_key_len,
            "value_len": data_cfg.retrieval_value_len}


def filler_from(data_cfg, tokenizer) -> dict:
    """The filler the training task had (build_dataloader's choice), from the val split: the text of data.path
    ('retrieval' with a path, 'text_files'), the stdlib corpus ('stdlib' + retrieval_mix), else random letters."""
    from nsa_titan.data import stdlib_documents, text_file_documents, tokenize_documents  # noqa: PLC0415

    if data_cfg.dataset == "stdlib":
        docs = stdlib_documents("val", data_cfg.val_fraction)
    elif data_cfg.dataset == "text_files" or (data_cfg.dataset == "retrieval" and data_cfg.path):
        docs = text_file_documents(data_cfg.path, "val", data_cfg.val_fraction)
    else:
        return {}
    corpus = tokenize_documents(docs, tokenizer)
    return {"filler_tokens": corpus.tokens, "filler_eos_id": corpus.eos_id}


def accuracy_table(rows: list[dict], label: str = "") -> str:
    """Markdown: one line per context length, one column per depth, plus the mean over depths."""
    depths = sorted({r["depth"] for r in rows})
    lines = [f"| {label or 'context'} | " + " | ".join(f"depth {d:g}" for d in depths) + " | mean |",
             "|---" * (len(depths) + 2) + "|"]
    for length in sorted({r["context_len"] for r in rows}):
        acc = {r["depth"]: r["accuracy"] for r in rows if r["context_len"] == length}
        cells = [f"{100 * acc[d]:.1f}" if d in acc else "-" for d in depths]
        lines.append(f"| {length} | " + " | ".join(cells) + f" | {100 * sum(acc.values()) / len(acc):.1f} |")
    return "\n".join(lines)


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> list[dict]:
    from nsa_titan.components.runtime import device_name, resolve_device, software_versions  # noqa: PLC0415
    from nsa_titan.data import build_tokenizer  # noqa: PLC0415
    from nsa_titan.generate import (build_inference_model, load_inference_config,  # noqa: PLC0415
                                    resolve_inference_args)

    parser = argparse.ArgumentParser(prog="python -m nsa_titan.eval.needle", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="weights (see nsa_titan/eval/weights.py); none: random init")
    parser.add_argument("--lengths", type=parse_ints, default=list(DEFAULT_LENGTHS))
    parser.add_argument("--depths", type=parse_floats, default=list(DEFAULT_DEPTHS))
    parser.add_argument("--samples", type=int, default=20, help="per (length, depth)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="bf16: autocast on CUDA")
    parser.add_argument("--out", help="write {'rows': [...], ...} as JSON here")
    ns, rest = parser.parse_known_args(argv)
    job_config = load_inference_config(rest)
    device = resolve_device(ns.device)
    tokenizer = build_tokenizer(job_config.data.tokenizer)
    args = resolve_inference_args(job_config, ns.checkpoint, max(ns.lengths))
    model = build_inference_model(args, ns.checkpoint, device)
    bf16 = ns.dtype == "bf16" and device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    rows = evaluate_needle(model, tokenizer, lengths=ns.lengths, depths=ns.depths, samples=ns.samples, device=device,
                           batch_size=ns.batch_size, seed=ns.seed, autocast=autocast,
                           task_kwargs={**task_kwargs_from(job_config.data), **filler_from(job_config.data, tokenizer)})
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
