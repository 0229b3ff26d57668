"""Llama-style transformer (RMSNorm, SwiGLU, RoPE) with NSA attention. Knows nothing of distribution."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nsa_titan.models.nsa.args import NSAModelArgs
from nsa_titan.models.nsa.attention import DenseAttention, NSAAttention, rope_tables


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for lin in (self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: NSAModelArgs):
        super().__init__()
        self.attention = NSAAttention(args) if args.attn_type == "nsa" else DenseAttention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Depth-scaled init of the residual projections keeps the stream's variance flat with depth.
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x, cos, sin, doc_start=None, cache=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, doc_start=doc_start, cache=cache)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)


class NSATransformer(nn.Module):
    def __init__(self, args: NSAModelArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by the layer index keeps parameter names stable when blocks are wrapped
        # (FSDP, checkpointing) or pipelined.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        # Not persistent: they are recomputed by init_weights and never belong in a checkpoint.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialise every parameter and buffer in place: works after ``to_empty`` from meta.

        The order of the random calls is part of the contract: ``parallelize_nsa`` initialises FSDP2 units one
        at a time in this same order, so every parallelism starts from the weights one process would have.
        """
        self.init_buffers(buffer_device)
        for _unit, init in self.init_units():
            init()

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """The RoPE tables (not parameters: never sharded, never checkpointed)."""
        device = buffer_device or self.rope_cos.device
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device)
        self.rope_cos, self.rope_sin = cos, sin

    def init_units(self) -> list[tuple[nn.Module | list[nn.Module], Callable[[], None]]]:
        """(module(s), initialiser) in initialisation order: the embedding, each block, [final norm + output]."""
        return [(self.tok_embeddings, self._init_embedding),
                *((block, block.init_weights) for block in self.layers.values()),
                ([self.norm, self.output], self._init_head)]

    @torch.no_grad()
    def _init_embedding(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)

    @torch.no_grad()
    def _init_head(self) -> None:
        self.norm.reset_parameters()
        bound = 3 * self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=self.args.dim**-0.5, a=-bound, b=bound)

    def forward(self, tokens: torch.Tensor, doc_start: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """tokens [B, T] int64 -> logits [B, T, vocab].

        Packed documents (data/documents.py): ``doc_start`` [B, T] limits attention to each token's document;
        ``positions`` [B, T] are the RoPE positions (default 0..T-1 for every row).
        ``cache``: a KVCache (models/nsa/decode.py; ``prefill`` and ``decode_step`` pass it). The tokens are then
        positions ``cache.pos`` onward, and each block's attention reads and extends its layer's cache.
        """
        if cache is not None and (doc_start is not None or positions is not None):
            raise ValueError("decoding with a KV cache serves one document per row: doc_start / positions are for "
                             "packed training sequences")
        start, t = (0 if cache is None else cache.pos), tokens.shape[1]
        if positions is None:
            cos, sin = self.rope_cos[start: start + t], self.rope_sin[start: start + t]
        else:  # [B, T, 1, 1, D/2]: broadcasts against [B, T, H, 2, D/2] in apply_rope
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.tok_embeddings(tokens)
        for i, block in enumerate(self.layers.values()):
            # Training calls each block without a cache, so a compiled block never sees one.
            if cache is None:
                h = block(h, cos, sin, doc_start=doc_start)
            else:
                h = block(h, cos, sin, cache=cache.layers[i])
        return self.output(self.norm(h))


def build_model(args: NSAModelArgs) -> NSATransformer:
    """Construct on the current default device (use ``torch.device('meta')`` to defer allocation)."""
    return NSATransformer(args)
