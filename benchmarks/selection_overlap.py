"""How much do neighbouring queries' block selections overlap, at init and as a model trains?

    python benchmarks/selection_overlap.py --flavor m7c --seq 8192 --batch 2 --steps 0,100,300 [--out DIR]

A query-tiled selected-attention kernel (BT consecutive tokens share one pass over the union of their
selected blocks) loads each K/V block once per tile instead of once per token, but computes BT rows for
every block in the union. Its cost relative to the per-token kernel is set by ``|union| / n`` per tile:
1 when the BT tokens chose the same blocks, BT when they share nothing. This script trains the flavor on the
default corpus (AdamW, bf16 autocast, the Triton kernels) and, at the given steps, records per layer the mean
``|union| / n`` for tiles of BT = 1, 2, 4, 8, 16 tokens (forced blocks included, as the kernel sees them),
and the same statistic for random q/k inputs (what bench_attention.py times).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nsa_titan.components.runtime import device_name  # noqa: E402
from nsa_titan.config import load_job_config  # noqa: E402
from nsa_titan.data import build_dataloader, build_tokenizer  # noqa: E402
from nsa_titan.models import build_model, get_model_args  # noqa: E402

TILES = (1, 2, 4, 8, 16)


def union_ratio(block_idx: torch.Tensor, bt: int) -> float:
    """block_idx [B, HKV, T, n] (-1 unused) -> mean over tiles of |union of the tile's blocks| / n."""
    B, H, T, n = block_idx.shape
    t = T - T % bt
    x = block_idx[:, :, :t].reshape(B, H, t // bt, bt * n).sort(-1).values
    new = torch.ones_like(x, dtype=torch.bool)
    new[..., 1:] = x[..., 1:] != x[..., :-1]
    return ((new & (x >= 0)).sum(-1).float().mean() / n).item()  # host sync ok: analysis script


@torch.no_grad()
def layer_selections(model, tokens) -> list[torch.Tensor]:
    """Run the model's forward block by block and return each layer's block_idx."""
    t = tokens.shape[1]
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]
    h = model.tok_embeddings(tokens)
    out = []
    for block in model.layers.values():
        a, blocks = block.attention(block.attention_norm(h), cos, sin, return_blocks=True)
        h = h + a
        h = h + block.feed_forward(block.ffn_norm(h))
        out.append(blocks)
    return out


def random_input_ratios(args, T: int) -> dict:
    from nsa_titan.kernels import band, select
    from nsa_titan.models.nsa.common import NSAParams

    p = NSAParams.from_args(args)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, args.n_heads, args.head_dim, device="cuda", generator=g).bfloat16()
    kc = torch.randn(1, p.num_cmp_tokens(T), args.n_kv_heads, args.head_dim, device="cuda", generator=g).bfloat16()
    vc = torch.randn_like(kc)
    _, lse = band.band_fwd(q, kc, vc, p.cmp_stride, p.cmp_block - 1, 0)
    idx = select.select_blocks(q, kc, lse, p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n)
    return {bt: union_ratio(idx, bt) for bt in TILES}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="m7c")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", default="0,100,300", help="report at these optimizer steps")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    report_at = sorted(int(s) for s in a.steps.split(","))
    cfg = load_job_config(["--model.flavor", a.flavor, "--training.seq_len", str(a.seq)])
    args = get_model_args(a.flavor, max_seq_len=max(a.seq, 1024), attn_impl="triton")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(args)
    model.init_weights()
    tok = build_tokenizer(cfg.data.tokenizer)
    loader = build_dataloader(cfg.data, tok, seq_len=a.seq, local_batch_size=a.batch, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    probe = next(loader)["input"].cuda()
    rows = []
    step = 0
    while True:
        if step in report_at:
            model.eval()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                sel = layer_selections(model, probe)
            model.train()
            per_layer = [{bt: round(union_ratio(s, bt), 3) for bt in TILES} for s in sel]
            mean = {bt: round(sum(r[bt] for r in per_layer) / len(per_layer), 3) for bt in TILES}
            rows.append(dict(step=step, mean=mean, per_layer=per_layer))
            print(json.dumps(dict(step=step, mean=mean)), flush=True)
        if step >= report_at[-1]:
            break
        batch = next(loader)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batch["input"].cuda())
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].cuda().flatten(),
                                                 ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)  # host sync ok: analysis script
    import triton

    payload = dict(device=device_name(torch.device("cuda")), torch=torch.__version__, triton=triton.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   flavor=a.flavor, seq=a.seq, batch=a.batch, lr=a.lr, tiles=list(TILES), trained=rows,
                   random_inputs=random_input_ratios(args, a.seq))
    print(json.dumps(dict(random_inputs=payload["random_inputs"])), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"selection_overlap_{a.flavor}_seq{a.seq}.json"), "w") as f:
        json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
