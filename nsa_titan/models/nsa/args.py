"""Model arguments and the named flavors of the NSA transformer.

Notation follows the NSA paper (arXiv 2502.11089, section 3):
l = ``cmp_block`` (compression block length), d = ``cmp_stride``, l' = ``slc_block``,
n = ``slc_top_n`` (selected blocks, forced ones included), w = ``window``.

This file is the one source of the model's settings: the config's ``[model]`` section is generated from
these fields (types, choices, docstrings), and ``validate`` holds every rule. It imports no torch, so the
config (and ``--help``) can read it cheaply.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass
from typing import Literal

BYTE_VOCAB_SIZE = 260  # 256 bytes + EOS/BOS/PAD/SEP (see nsa_titan.data.tokenizer)


@dataclass
class NSAModelArgs:
    dim: int = 256
    """Model (residual stream) width."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 8
    """Query heads (HQ)."""
    n_kv_heads: int = 2
    """Key/value heads per branch (HKV); the GQA group is G = n_heads / n_kv_heads."""
    head_dim: int = 32
    """Query/key head dimension d_k."""
    v_head_dim: int | None = None
    """Value head dimension d_v (None: same as head_dim). The paper uses d_k=192, d_v=128."""
    vocab_size: int = BYTE_VOCAB_SIZE
    """Embedding/output rows; must be >= the tokenizer's vocabulary."""
    ffn_hidden_dim: int = 768
    """SwiGLU hidden width."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    max_seq_len: int = 1024
    """Longest sequence the RoPE table covers."""
    cmp_block: int = 16
    """l: tokens summarised by one compressed token."""
    cmp_stride: int = 8
    """d: distance between the starts of consecutive compression blocks (d divides l and l')."""
    slc_block: int = 32
    """l': selection block size."""
    slc_top_n: int = 4
    """n: selection blocks per (token, KV head), including block 0 and the two local blocks."""
    window: int = 64
    """w: sliding-window length (query t sees t-w+1 .. t)."""
    compress: Literal["mlp", "mean"] = "mlp"
    """phi: 'mlp' (paper: MLP over the block with an intra-block position embedding) or 'mean' pooling."""
    shared_kv: bool = False
    """One K/V projection shared by the three branches instead of one per branch."""
    attn_impl: Literal["auto", "torch", "triton", "reference"] = "auto"
    """'auto': Triton kernels on CUDA when nsa_titan.kernels provides them, else 'torch'; 'torch': the
    vectorised portable path (compiles with fullgraph=True); 'triton': the kernels (CUDA, or CPU under
    TRITON_INTERPRET=1 for tests); 'reference': the dense plain-PyTorch spec (slow, O(T^2) memory)."""
    attn_type: Literal["nsa", "dense"] = "nsa"
    """'nsa': native sparse attention; 'dense': plain causal attention (for comparisons)."""
    dq_buffer_gib: float = 2.0
    """Triton kernels only: the most transient memory (GiB) one attention layer's backward may hold so that the
    selected branch's dQ is one matmul from stored values (its dS, B*T*HQ*n*l'*2 bytes: 2 GiB for the 1b at 64k
    tokens per step, 4 GiB for the paper config at 32k; or, for groups of <= 8 heads at head dim <= l', per-slot
    dQ partials of the same size) instead of recomputing the scores per token. Where all of the dS does not fit,
    it is stored for as many (batch, KV head) pairs at a time as fit (T*G*n*l'*2 bytes each), and recomputed only
    where one pair's exceeds this (H100, paper config attention fwd+bwd at 64k: 119.6 ms recomputed, 113.4 in
    chunks of one KV head; qwen7b 64k 71.6 -> 63.1). Smaller saves that memory at the backward's peak."""

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def dv(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    def validate(self, seq_len: int | None = None) -> None:
        """Raise ValueError naming the field and the fix for any inconsistent setting."""

        def bad(field: str, msg: str) -> ValueError:
            return ValueError(f"model.{field}: {msg}")

        for name, tp in field_types().items():  # sizes are positive; which fields are sizes follows from the types
            value = getattr(self, name)
            if tp in (int, int | None) and value is not None and value < 1:
                raise bad(name, f"must be >= 1, got {value}")
            if tp is float and not value > 0:
                raise bad(name, f"must be > 0, got {value}")
        if self.n_heads % self.n_kv_heads:
            raise bad("n_kv_heads", f"n_heads={self.n_heads} must be a multiple of "
                      f"n_kv_heads={self.n_kv_heads}; choose a divisor of n_heads")
        if self.head_dim % 2:
            raise bad("head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.cmp_block % self.cmp_stride:
            raise bad("cmp_stride", f"d={self.cmp_stride} must divide l=cmp_block={self.cmp_block}")
        if self.slc_block % self.cmp_stride:
            raise bad("slc_block", f"l'={self.slc_block} must be a multiple of d=cmp_stride={self.cmp_stride}")
        if self.slc_top_n < 3:
            raise bad("slc_top_n", f"n={self.slc_top_n} must be >= 3: block 0 and the two local blocks "
                      "are always selected and count towards n")
        for name, choices in field_choices().items():  # the Literal annotations are the choice lists
            if getattr(self, name) not in choices:
                raise bad(name, f"unknown {getattr(self, name)!r}; choose one of {', '.join(map(repr, choices))}")
        if seq_len is not None and seq_len > self.max_seq_len:
            raise bad("max_seq_len", f"training.seq_len={seq_len} exceeds max_seq_len={self.max_seq_len}; "
                      "raise --model.max_seq_len or lower --training.seq_len")


@functools.cache  # the annotations never change; validate() and the config read them (do not mutate)
def field_types() -> dict[str, typing.Any]:
    """Field name -> resolved annotation (``Literal[...]``, ``int``, ``int | None`` ...), in declaration order."""
    hints = typing.get_type_hints(NSAModelArgs)
    return {f.name: hints[f.name] for f in dataclasses.fields(NSAModelArgs)}


def field_choices() -> dict[str, tuple]:
    """The fields that take one of a fixed set of values, with those values (from their ``Literal`` type)."""
    return {name: typing.get_args(tp) for name, tp in field_types().items() if typing.get_origin(tp) is Literal}


def _flavors() -> dict[str, NSAModelArgs]:
    debug = NSAModelArgs()
    m7c = NSAModelArgs(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=2, head_dim=64, ffn_hidden_dim=2048,
        max_seq_len=8192, cmp_block=32, cmp_stride=16, slc_block=64, slc_top_n=16, window=512,
    )
    # ~1B parameters with the paper's GQA group of 16 and head_dim 128, paper NSA sizes.
    one_b = NSAModelArgs(
        dim=2048, n_layers=18, n_heads=16, n_kv_heads=1, head_dim=128, ffn_hidden_dim=5632,
        vocab_size=32000, max_seq_len=8192, cmp_block=32, cmp_stride=16, slc_block=64,
        slc_top_n=16, window=512,
    )
    # The study's shape (Qwen2.5-7B: dim 3584, 28 layers, 28 query / 4 KV heads = G 7, head_dim 128, SwiGLU
    # 18944, vocabulary 152064, RoPE base 1e6, 32k context) with the paper's NSA sizes: 7.86B parameters, more
    # than Qwen's 7.62B because each of the three branches has its own K/V projection (plus phi and gates).
    qwen7b = NSAModelArgs(
        dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128, ffn_hidden_dim=18944,
        vocab_size=152064, norm_eps=1e-6, rope_theta=1e6, max_seq_len=32768, cmp_block=32, cmp_stride=16,
        slc_block=64, slc_top_n=16, window=512,
    )
    return {
        "debug": debug,
        "m7c": m7c,
        "m7c_gpt2": dataclasses.replace(m7c, vocab_size=50304),  # GPT-2 vocab padded to 64
        "1b": one_b,
        "qwen7b": qwen7b,
    }


MODEL_FLAVORS: dict[str, NSAModelArgs] = _flavors()


def get_model_args(flavor: str, **overrides) -> NSAModelArgs:
    """A fresh copy of a flavor's arguments, with ``overrides`` (None values ignored) applied."""
    if flavor not in MODEL_FLAVORS:
        close = difflib.get_close_matches(flavor, list(MODEL_FLAVORS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"model.flavor: unknown flavor {flavor!r}{hint}; valid flavors: {', '.join(MODEL_FLAVORS)}")
    names = {f.name for f in dataclasses.fields(NSAModelArgs)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"model: unknown field(s) {unknown}; valid fields: {sorted(names)}")
    return dataclasses.replace(MODEL_FLAVORS[flavor], **{k: v for k, v in overrides.items() if v is not None})
