"""Parameter count and training FLOPs per token, counting NSA's attention as the work actually done.

Forward FLOPs per token = 2 x (every weight a token multiplies) + attention. Training = 3 x forward
(backward costs two forwards). Counted per layer:
- projections and SwiGLU: 2 * weight elements (wq, wkv, wgate, wo, w1, w2, w3);
- compression phi ('mlp'): it runs once per compressed token for each KV head, so
  2 * (phi_k + phi_v weights) * HKV * Tc / T per token, Tc = (T - l) // d + 1 (about 1/d of the tokens);
  'mean' costs nothing worth counting;
- attention: 2 * (Dk + Dv) * HQ * keys(t), averaged over positions t < T, with causal key counts:
  compressed: visible compressed tokens floor((t + 1 - l) / d) + 1 (0 before the first block ends);
  selected:   (min(n, t // l' + 1) - 1) * l' + (t mod l') + 1 (full past blocks + the causal current one);
  window:     min(w, t + 1); dense attention: t + 1.
The importance map and top-n sort are O(T/d) per token and left out. The output head counts 2 * dim * vocab;
the embedding lookup counts nothing. ``forward_flops_breakdown`` returns these parts separately; given
``keys`` (keys per query per branch) it prices other attention patterns with the same coefficients, e.g.
the dense-equivalent work of a masked reference (tests compare that with FlopCounterMode exactly).
"""

from __future__ import annotations

import torch

from nsa_titan.models.nsa.args import NSAModelArgs
from nsa_titan.models.nsa.common import NSAParams
from nsa_titan.models.nsa.model import NSATransformer


def count_params(args: NSAModelArgs, include_embedding: bool = False) -> int:
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


def forward_flops_breakdown(args: NSAModelArgs, seq_len: int,
                            keys: dict[str, float] | None = None) -> dict[str, float]:
    """Forward FLOPs per token by part: 'linear' (projections, gates, SwiGLU, output head), 'phi' (compression
    MLP) and one 'attn_<branch>' per attention branch. ``keys``: keys per query per branch (default: the causal
    work actually done, ``mean_keys_per_query``)."""
    dk, dv, hq, hkv = args.head_dim, args.dv, args.n_heads, args.n_kv_heads
    n_sets = 1 if (args.shared_kv or args.attn_type == "dense") else 3
    proj = args.dim * (hq * dk + n_sets * hkv * (dk + dv) + hq * dv)
    if args.attn_type == "nsa":
        proj += args.dim * hq * 3  # gates
    ffn = 3 * args.dim * args.ffn_hidden_dim
    parts = {"linear": args.n_layers * 2.0 * (proj + ffn) + 2.0 * args.dim * args.vocab_size, "phi": 0.0}
    if args.attn_type == "nsa" and args.compress == "mlp":
        per_block = sum(args.cmp_block * h * h + h * h for h in (dk, dv))
        # Exact count of compressed tokens (the last partial block is never compressed), not T / d.
        n_cmp = NSAParams.from_args(args).num_cmp_tokens(seq_len)
        parts["phi"] = args.n_layers * 2.0 * per_block * hkv * n_cmp / seq_len
    for branch, k in (keys or mean_keys_per_query(args, seq_len)).items():
        parts[f"attn_{branch}"] = args.n_layers * 2.0 * (dk + dv) * hq * k
    return parts


def forward_flops_per_token(args: NSAModelArgs, seq_len: int) -> float:
    return sum(forward_flops_breakdown(args, seq_len).values())


def training_flops_per_token(args: NSAModelArgs, seq_len: int) -> float:
    return 3.0 * forward_flops_per_token(args, seq_len)
