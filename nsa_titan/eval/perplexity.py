"""Perplexity on held-out text: the val split of the training corpus (by default the embedded stdlib corpus).

    python -m nsa_titan.eval.perplexity --checkpoint CKPT [--seq-len 1024] [--batch-size 8] [--max-batches N]
        [--config FILE] [--model.KEY VALUE ...] [--data.dataset stdlib] [--data.val_fraction 0.01] [--out FILE.json]

The val split is read in its fixed order, one pass over every chunk of seq_len + 1 tokens (or the first
``max_batches`` batches): each chunk is one forward of seq_len inputs predicting the next token, so the
numbers are comparable between models evaluated with the same seq_len. The loss is token-weighted.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch

from nsa_titan.checkpoint.load import build_inference_model, load_inference_config, resolve_inference_args
from nsa_titan.components.runtime import autocast_context, device_name, resolve_device, software_versions
from nsa_titan.components.train_step import count_target_tokens, move_batch, token_loss_sum
from nsa_titan.config import ConfigError
from nsa_titan.data import build_dataloader, tokenizer_from_config


@torch.no_grad()
def evaluate_perplexity(model, data_cfg, tokenizer, *, seq_len: int, batch_size: int, device: torch.device,
                        max_batches: int | None = None, autocast=contextlib.nullcontext) -> dict:
    """{"loss", "ppl", "bits_per_token", "tokens", "batches", "seq_len"} over the val split of ``data_cfg``."""
    # The model's window is the retrieval gap's default (data.retrieval_mix > 0 mixes retrieval samples in).
    window = getattr(getattr(model, "args", None), "window", None)
    loader = build_dataloader(data_cfg, tokenizer, seq_len=seq_len, local_batch_size=batch_size, split="val",
                              seed=0, pin_memory=False, window=window)
    chunks = getattr(loader.text, "chunks_per_rank", None)  # None: a streamed dataset of unknown length
    one_pass = None if chunks is None else max(chunks // batch_size, 1)
    if one_pass is None and max_batches is None:
        raise ValueError("a streamed dataset has no known length: pass --max-batches")
    n_batches = min(x for x in (one_pass, max_batches) if x is not None)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    n_tokens = torch.zeros((), device=device, dtype=torch.long)
    for _ in range(n_batches):
        batch = move_batch(next(loader), device)
        with autocast():
            logits = model(batch["input"])
        loss_sum += token_loss_sum(logits, batch["labels"]).double()
        n_tokens += count_target_tokens([batch])
    loss = (loss_sum / n_tokens.clamp(min=1)).item()  # host sync ok: end of the eval
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "bits_per_token": loss / math.log(2),
            "tokens": int(n_tokens.item()), "batches": n_batches, "seq_len": seq_len,  # host sync ok: end of the eval
            "full_pass": one_pass is not None and n_batches == one_pass}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m nsa_titan.eval.perplexity", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="weights (see nsa_titan/checkpoint/load.py); none: random init")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-batches", type=int)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="bf16: autocast on CUDA")
    parser.add_argument("--out", help="also write the result as JSON here")
    ns, rest = parser.parse_known_args(argv)
    job_config = load_inference_config(rest)
    device = resolve_device(ns.device)
    tokenizer = tokenizer_from_config(job_config.data)
    args = resolve_inference_args(job_config, ns.checkpoint, ns.seq_len)
    model = build_inference_model(args, ns.checkpoint, device)
    autocast = functools.partial(autocast_context, device, ns.dtype)
    t0 = time.perf_counter()
    result = evaluate_perplexity(model, job_config.data, tokenizer, seq_len=ns.seq_len, batch_size=ns.batch_size,
                                 device=device, max_batches=ns.max_batches, autocast=autocast)
    result.update(seconds=time.perf_counter() - t0, checkpoint=ns.checkpoint, dataset=job_config.data.dataset,
                  attn_type=args.attn_type, device=device_name(device), **software_versions())
    print(json.dumps(result, indent=1))
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"perplexity error: {e}", file=sys.stderr)
        sys.exit(2)
