"""Generate text with an NSA (or dense) model: prefill the prompt, then decode with the KV cache.

    python -m nsa_titan.generate --checkpoint CKPT --prompt "def fibonacci(n):" \
        [--max-new-tokens 200] [--temperature 0 | 0.8] [--top-p 0.95] [--seed 0] [--num-samples 1] \
        [--device auto] [--dtype fp32|bf16] [--config train_configs/debug_model.toml] [--model.KEY VALUE ...]

CKPT: a DCP checkpoint folder, an export folder / .safetensors file, or a torch.save'd state dict (see
nsa_titan/checkpoint/load.py). The model is the one the checkpoint records (DCP marker or export config.json);
without such a record it comes from the training flags (``--config`` and ``--model.*``), as does the
tokenizer (``--data.tokenizer``). ``--model.attn_impl`` and ``--model.max_seq_len`` may always be given (they
do not change the weights); the RoPE table is extended to prompt + new tokens when needed. Temperature 0
is greedy decoding. Without ``--checkpoint`` the model is randomly initialised (a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time

import torch

from nsa_titan.checkpoint.load import build_inference_model, load_inference_config, resolve_inference_args
from nsa_titan.components.runtime import autocast_context, device_name, resolve_device
from nsa_titan.config import ConfigError
from nsa_titan.data import tokenizer_from_config
from nsa_titan.models.nsa.decode import KVCache, decode_step, prefill


def sample_next(logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> next tokens [B, 1]. temperature <= 0: argmax. top_p < 1: nucleus sampling over the
    smallest set of most likely tokens whose probability reaches top_p (the most likely one always kept)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # mass before this token has not reached top_p yet
    choice = torch.multinomial(sorted_p * keep, 1, generator=generator)  # multinomial renormalises
    return order.gather(-1, choice)


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, eos_id: int | None = None, autocast=contextlib.nullcontext, cache_dtype=None):
    """prompt [B, T] int64 -> (new tokens [B, <= max_new_tokens], timings dict). Rows that produced
    ``eos_id`` keep emitting it; generation stops early once every row has. Same seed, same tokens."""
    device = prompt.device
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(model, prompt.shape[0], prompt.shape[1] + max_new_tokens, dtype=cache_dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    with autocast():
        logits = prefill(model, prompt, cache)[:, -1]
    sync()
    t1 = time.perf_counter()
    out, done = [], torch.zeros(prompt.shape[0], 1, dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        nxt = sample_next(logits.float(), temperature=temperature, top_p=top_p, generator=gen)
        if eos_id is not None:
            nxt = torch.where(done, eos_id, nxt)
            done = done | (nxt == eos_id)
        out.append(nxt)
        # The one host sync per step: reading the sampled tokens' EOS state.
        if i + 1 == max_new_tokens or (eos_id is not None and bool(done.all())):
            break
        with autocast():
            logits = decode_step(model, cache, nxt)
    sync()
    t2 = time.perf_counter()
    new = torch.cat(out, dim=1) if out else prompt.new_zeros(prompt.shape[0], 0)
    steps = max(new.shape[1] - 1, 0)  # decode steps run (the first new token comes from the prefill)
    return new, {"prompt_tokens": prompt.shape[1], "new_tokens": new.shape[1], "prefill_s": t1 - t0,
                 "decode_s": t2 - t1, "decode_ms_per_token": 1e3 * (t2 - t1) / steps if steps else None}


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m nsa_titan.generate", description=__doc__.split("\n")[0],
                                     epilog="Other --section.key flags (e.g. --config, --model.flavor, "
                                            "--data.tokenizer) configure the model and tokenizer as in training.")
    parser.add_argument("--checkpoint", help="DCP folder, export folder, .safetensors or torch.save'd state dict")
    parser.add_argument("--prompt", default="", help="prompt text")
    parser.add_argument("--prompt-file", help="read the prompt from this file instead")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=1, help="rows decoded together (same prompt)")
    parser.add_argument("--prefix", choices=("eos", "bos", "none"), default="eos",
                        help="token before the prompt: 'eos' = start of a document, as in the packed corpus")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast (CUDA only)")
    parser.add_argument("--no-stop-at-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ns, rest = parser.parse_known_args(argv)
    if ns.max_new_tokens < 1 or ns.num_samples < 1 or not 0 < ns.top_p <= 1 or ns.temperature < 0:
        parser.error("need --max-new-tokens >= 1, --num-samples >= 1, 0 < --top-p <= 1, --temperature >= 0")
    return ns, rest


def main(argv: list[str] | None = None) -> dict:
    ns, rest = parse_args(argv)
    job_config = load_inference_config(rest)
    tokenizer = tokenizer_from_config(job_config.data)  # data.eos_token / bos_token apply, as in training
    text = open(ns.prompt_file, encoding="utf-8").read() if ns.prompt_file else ns.prompt
    prefix = {"eos": [tokenizer.eos_id], "bos": [tokenizer.bos_id], "none": []}[ns.prefix]
    ids = prefix + tokenizer.encode(text)
    if not ids:
        raise ConfigError("empty prompt with --prefix none: give --prompt text or another --prefix")
    device = resolve_device(ns.device)
    args = resolve_inference_args(job_config, ns.checkpoint, len(ids) + ns.max_new_tokens)
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(f"data.tokenizer has {tokenizer.vocab_size} tokens, the model only {args.vocab_size} embedding "
                          "rows: pass the tokenizer the model was trained with (--data.tokenizer)")
    torch.manual_seed(ns.seed)  # random init (no checkpoint) is reproducible too
    model = build_inference_model(args, ns.checkpoint, device)
    bf16 = ns.dtype == "bf16" and device.type == "cuda"
    autocast = functools.partial(autocast_context, device, "bf16" if bf16 else "fp32")
    prompt = torch.tensor([ids] * ns.num_samples, dtype=torch.long, device=device)
    new, stats = generate(model, prompt, ns.max_new_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          seed=ns.seed, eos_id=None if ns.no_stop_at_eos else tokenizer.eos_id, autocast=autocast,
                          cache_dtype=torch.bfloat16 if bf16 else None)
    texts = [tokenizer.decode(row.tolist()) for row in new.cpu()]  # host sync ok: generation finished
    result = {"texts": texts, "tokens": new.cpu().tolist(), **stats, "device": device_name(device),  # host sync ok: generation finished
              "attn_type": args.attn_type, "checkpoint": ns.checkpoint}
    if ns.json:
        print(json.dumps(result))
    else:
        for i, t in enumerate(texts):
            print(f"--- sample {i} ---\n{text}{t}")
        ms = stats["decode_ms_per_token"]
        print(f"[{stats['prompt_tokens']} prompt tokens, prefill {stats['prefill_s']:.3f}s; {stats['new_tokens']} new "
              f"tokens, {'n/a' if ms is None else f'{ms:.2f}'} ms/token; {result['device']}]", file=sys.stderr)
    return result


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, ValueError, FileNotFoundError) as e:  # settings mistakes: the message says the fix
        print(f"generate error: {e}", file=sys.stderr)
        sys.exit(2)
