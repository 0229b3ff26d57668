"""Parameter count and training FLOPs per token, counting NSA's attention as the work actually done.

Forward FLOPs per token = 2 x (every weight a token multiplies) + attention. Training = 3 x forward
(backward costs two forwards). Counted per layer:
- projections and SwiGLU: 2 * weight elements (wq, wkv, wgate, wo, w1, w2, w3);
- compression phi ('mlp'): it runs once per compressed token (every d positions) for each KV head, so
  2 * (phi_k + phi_v weights) * HKV / d per token; 'mean' costs nothing worth counting;
- attention: 2 * (Dk + Dv) * HQ * keys(t), averaged over positions t < T, with causal key counts:
  compressed: visible compressed tokens floor((t + 1 - l) / d) + 1 (0 before the first block ends);
  selected:   (min(n, t // l' + 1) - 1) * l' + (t mod l') + 1 (full past blocks + the causal current one);
  window:     min(w, t + 1); dense attention: t + 1.
The importance map and top-n sort are O(T/d) per token and left out. The output head counts 2 * dim * vocab;
the embedding lookup counts nothing.
"""

from __future__ import annotations

import torch

from nsa_titan.models.nsa.args import NSAModelArgs


def count_params(args: NSAModelArgs, include_embedding: bool = False) -> int:
    from nsa_titan.models.nsa.model import NSATransformer

    with torch.device("meta"):
        model = NSATransformer(args)
    total = sum(p.numel() for p in model.parameters())
    return total if include_embedding else total - model.tok_embeddings.weight.numel()


def mean_keys_per_query(args: NSAModelArgs, seq_len: int) -> dict[str, float]:
    """Average number of keys one query attends to in each branch, over positions 0..seq_len-1."""
    t = torch.arange(seq_len, dtype=torch.float64)
    if args.attn_type == "dense":
        return {"dense": float((t + 1).mean())}
    l, d, lp, n, w = args.cmp_block, args.cmp_stride, args.slc_block, args.slc_top_n, args.window
    cmp = torch.where(t + 1 >= l, torch.floor((t + 1 - l) / d) + 1, torch.zeros_like(t))
    slc = (torch.clamp(torch.floor(t / lp) + 1, max=n) - 1) * lp + torch.remainder(t, lp) + 1
    win = torch.clamp(t + 1, max=w)
    return {"cmp": float(cmp.mean()), "slc": float(slc.mean()), "win": float(win.mean())}


def forward_flops_per_token(args: NSAModelArgs, seq_len: int) -> float:
    dk, dv, hq, hkv = args.head_dim, args.dv, args.n_heads, args.n_kv_heads
    n_sets = 1 if (args.shared_kv or args.attn_type == "dense") else 3
    proj = args.dim * (hq * dk + n_sets * hkv * (dk + dv) + hq * dv)
    if args.attn_type == "nsa":
        proj += args.dim * hq * 3  # gates
    ffn = 3 * args.dim * args.ffn_hidden_dim
    phi = 0.0
    if args.attn_type == "nsa" and args.compress == "mlp":
        per_block = sum(args.cmp_block * h * h + h * h for h in (dk, dv))
        phi = 2.0 * per_block * hkv / args.cmp_stride
    keys = sum(mean_keys_per_query(args, seq_len).values())
    attn = 2.0 * (dk + dv) * hq * keys
    per_layer = 2.0 * (proj + ffn) + phi + attn
    return args.n_layers * per_layer + 2.0 * args.dim * args.vocab_size


def training_flops_per_token(args: NSAModelArgs, seq_len: int) -> float:
    return 3.0 * forward_flops_per_token(args, seq_len)
