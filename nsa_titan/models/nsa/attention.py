"""The attention modules: projections, RoPE, compression phi, gates; the math is in reference/torch_impl."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nsa_titan.models.nsa import local_attention, reference, torch_impl
from nsa_titan.models.nsa.args import NSAModelArgs
from nsa_titan.models.nsa.common import NSAParams

# Resolved once at import: the forward must not import or try/except (it runs under torch.compile).
try:
    from nsa_titan.kernels import nsa_attention as _triton_nsa_attention  # also registers torch.ops.nsa_titan.*

    _TRITON_ERROR = None
except ImportError as _e:  # triton missing, or no kernels for this platform
    _triton_nsa_attention, _TRITON_ERROR = None, _e

# The function behind each concrete model.attn_impl (the choices themselves are NSAModelArgs.attn_impl's type).
NSA_IMPLS = {"reference": reference.nsa_attention, "torch": torch_impl.nsa_attention, "triton": _triton_nsa_attention}

# Ops of this package whose outputs selective activation checkpointing saves instead of recomputing (attention is
# the expensive part): the Triton forward, registered when nsa_titan.kernels imports. parallelize_nsa hands them to
# the generic AC code, which knows no model.
SELECTIVE_AC_SAVE_OPS = ("nsa_titan.nsa_fwd",)


def compile_cache_tag(kernels: Path | None = None) -> str:
    """A tag for torch.compile's cache keys that changes with the sources behind this package's custom ops
    (nsa_titan/kernels/*.py, read as files: no triton needed). The compile caches key a graph by its traced code,
    where a custom op is only a name; after an upgrade that changes an op's arguments, outputs or shape rules, a
    cached graph from the old version calls it the old way (seen: "nsa_bwd() Expected a value of type 'Tensor'
    for argument 'pair_keys'" when a new checkout reused an older one's cache). parallelize_nsa hands the tag to
    apply_compile, which knows no model. ``kernels``: another copy of that folder (tests)."""
    digest = hashlib.sha256()
    for f in sorted((kernels or Path(__file__).resolve().parents[2] / "kernels").glob("*.py")):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return "nsa_titan-ops-" + digest.hexdigest()[:16]


def resolve_attn_impl(name: str, device: torch.device) -> str:
    """The implementation that runs for ``model.attn_impl = name`` on ``device``: 'auto' is 'triton' on CUDA when
    the kernels import, else 'torch'; any other name is itself ('triton' without the kernels is an error)."""
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_nsa_attention is not None else "torch"
    if name == "triton" and _triton_nsa_attention is None:
        raise RuntimeError(f"model.attn_impl='triton' needs nsa_titan.kernels ({_TRITON_ERROR}); "
                           "use --model.attn_impl torch")
    return name


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables in the layout ``apply_rope`` consumes (fp32): cos [T, 1, 1, D/2] and the signed sine
    [T, 1, 2, D/2] = (-sin, +sin). Slicing dim 0 selects positions; nothing else reads them."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    sin = angles.sin()
    return angles.cos()[:, None, None, :], torch.stack((-sin, sin), dim=1)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [B, T, H, D]; tables from ``rope_tables`` sliced to T positions.

    With the halves x1, x2: (x1 cos - x2 sin, x2 cos + x1 sin), computed as x * cos + swap(x) * (-sin, sin)
    in fp32 — bit for bit the same values, in 4 kernels instead of 7 (decoding runs this per token).
    """
    xf = x.float().unflatten(-1, (2, x.shape[-1] // 2))  # [B, T, H, 2, D/2]
    return (xf * cos + xf.flip(-2) * sin_signed).flatten(-2).to(x.dtype)


class Compressor(nn.Module):
    """phi: maps each block of l positions (stride d) of one head to a single key or value.

    Keys reach phi already rotated by RoPE, so a compressed key carries its block's position the same way
    the raw keys do. 'mlp' (the paper's choice) adds a learnable intra-block position embedding and runs
    a two-layer MLP over the flattened block; 'mean' averages the block.
    """

    def __init__(self, head_dim: int, block: int, stride: int, kind: str):
        super().__init__()
        self.block, self.stride, self.kind = block, stride, kind
        if kind == "mlp":
            self.pos_emb = nn.Parameter(torch.empty(block, head_dim))
            self.fc1 = nn.Linear(block * head_dim, head_dim, bias=False)
            self.fc2 = nn.Linear(head_dim, head_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h, d = x.shape
        if t < self.block:
            return x.new_zeros(b, 0, h, d)
        blocks = x.unfold(1, self.block, self.stride)  # [B, Tc, H, D, l]
        if self.kind == "mean":
            return blocks.mean(dim=-1)
        blocks = blocks.transpose(-1, -2) + self.pos_emb.to(x.dtype)  # [B, Tc, H, l, D]
        return self.fc2(F.silu(self.fc1(blocks.flatten(-2))))

    def init_weights(self) -> None:
        if self.kind == "mlp":
            nn.init.normal_(self.pos_emb, std=0.02)
            # Scaled so that a compressed token starts with roughly the magnitude of one raw key.
            nn.init.normal_(self.fc1.weight, std=self.fc1.in_features**-0.5)
            nn.init.normal_(self.fc2.weight, std=self.fc2.in_features**-0.5)


def compress_pair(ck: Compressor, cv: Compressor, k: torch.Tensor, v: torch.Tensor):
    """(ck(k), cv(v)) in one pass when both are MLPs of one width: the two compressors' matmuls, forward and
    backward, run as batched matmuls over both (six launches instead of twelve) and their unfold, position
    embedding and backward scatter as one kernel each under torch.compile. They were ~0.16 ms of small kernels per
    m7c block at 8k batch 2 on an H100, half of what an NSA block spends besides attention
    (benchmarks/results/profile_block_blocks8k_s10_*). Decoding compresses one block at a time with each Compressor
    on its own (the same function)."""
    b, t, h, d = k.shape
    if ck.kind != "mlp" or cv.kind != "mlp" or v.shape[-1] != d or t < ck.block:
        return ck(k), cv(v)
    blocks = torch.stack((k, v)).unfold(2, ck.block, ck.stride).transpose(-1, -2)  # [2, B, Tc, H, l, D]
    pos = torch.stack((ck.pos_emb, cv.pos_emb)).to(k.dtype)[:, None, None, None]  # [2, 1, 1, 1, l, D]
    x = (blocks + pos).flatten(-2).flatten(1, 3)  # [2, B * Tc * H, l * D]
    w1 = torch.stack((ck.fc1.weight, cv.fc1.weight)).transpose(1, 2)  # [2, l * D, D]
    w2 = torch.stack((ck.fc2.weight, cv.fc2.weight)).transpose(1, 2)  # [2, D, D]
    out = torch.bmm(F.silu(torch.bmm(x, w1)), w2).view(2, b, blocks.shape[2], h, d)
    return out[0], out[1]


def kv_and_gate_logits(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor,
                       multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x @ wkv^T, x @ wgate^T). With ``multiple`` > 1 one matmul over both weights stacked, the gate's rows padded
    with zeros so that the stack has a multiple of ``multiple`` rows, and the two results sliced out of it: the same
    values as two matmuls. The gate projection alone has 3 * n_heads outputs; where that is not a multiple of 8 (m7c:
    36), cuBLAS ran sm80 cutlass kernels with 2-element alignment for its three GEMMs on an H100, 0.057 ms per m7c
    block at 8k batch 2; padded to 40, 0.029 (attempt 90; benchmarks/results/profile_block_{s23,gate_s23}_*). Stacked
    into the K/V GEMM, one GEMM forward and one each for dX and dW instead of two (attempt 94: whole compiled m7c at
    8k batch 2, 344,183 / 344,592 -> 345,131 / 345,444 tokens/s, interleaved, +0.26 %). ``multiple`` 1 (the CPU,
    decode steps: gate_pad_multiple): the two projections."""
    if multiple == 1:
        return F.linear(x, wkv), F.linear(x, wgate)
    nkv, ng = wkv.shape[0], wgate.shape[0]
    pad = -(nkv + ng) % multiple
    y = F.linear(x, torch.cat((wkv, F.pad(wgate, (0, 0, 0, pad)) if pad else wgate)))
    return y[..., :nkv], y[..., nkv:nkv + ng]


def gate_pad_multiple(x: torch.Tensor) -> int:
    """kv_and_gate_logits' ``multiple`` for input x: 8 for a GEMM on a GPU; 1 on the CPU, where alignment does not
    pick the kernel, and for a decode step's few rows, which would pay two more ops per layer for nothing."""
    return 8 if x.is_cuda and x.numel() // x.shape[-1] >= 256 else 1


class NSAAttention(nn.Module):
    """Native sparse attention: compressed, selected and sliding-window branches mixed by sigmoid gates."""

    def __init__(self, args: NSAModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim, self.v_head_dim = args.head_dim, args.dv
        self.n_kv_sets = 1 if args.shared_kv else 3
        self.params = NSAParams.from_args(args)
        self.impl_name = args.attn_impl
        self.dq_buffer_bytes = int(args.dq_buffer_gib * 2**30)  # the Triton backward's budget (NSAModelArgs)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        # One fused projection for all branches' K and V: one matmul instead of six.
        self.wkv = nn.Linear(args.dim, self.n_kv_sets * args.n_kv_heads * (args.head_dim + args.dv), bias=False)
        self.compress_k = Compressor(args.head_dim, args.cmp_block, args.cmp_stride, args.compress)
        self.compress_v = Compressor(args.dv, args.cmp_block, args.cmp_stride, args.compress)
        self.wgate = nn.Linear(args.dim, args.n_heads * 3, bias=False)
        self.wo = nn.Linear(args.n_heads * args.dv, args.dim, bias=False)
        # Opt-in diagnostics (components/diagnostics.py: NSADiagnostics.attach sets both); None costs nothing.
        self.diagnostics = None
        self.diagnostics_out = None  # this layer's last values (a flat device tensor)

    def project(self, x, cos, sin):
        """x [B, T, dim] -> q, (k_cmp_raw, v_cmp_raw), (k_slc, v_slc), (k_win, v_win), gates; nothing compressed
        yet (a KV cache keeps the raw compression-branch keys and compresses one block at a time)."""
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        kv, logits = kv_and_gate_logits(x, self.wkv.weight, self.wgate.weight, gate_pad_multiple(x))
        kv = kv.view(b, t, self.n_kv_sets, self.n_kv_heads, self.head_dim + self.v_head_dim)
        k, v = kv.split([self.head_dim, self.v_head_dim], dim=-1)
        k = apply_rope(k.flatten(2, 3), cos, sin).view_as(k)
        ks, vs = k.unbind(2), v.unbind(2)
        if self.n_kv_sets == 1:
            ks, vs = ks * 3, vs * 3
        gates = torch.sigmoid(logits.float()).view(b, t, self.n_heads, 3)
        return q, (ks[0], vs[0]), (ks[1], vs[1]), (ks[2], vs[2]), gates

    def forward(self, x, cos, sin, return_blocks: bool = False, doc_start=None, cache=None):
        """x [B, T, dim] (positions given by the RoPE rows cos/sin) -> [B, T, dim].

        ``cache``: this layer's KV cache (models/nsa/decode.py). A prompt (T > 1, empty cache) runs as in training
        and fills it; a single new token (T = 1) is stored and attends through the cache (``cache.attend``).
        ``doc_start`` [B, T]: packed documents (training only; decoding serves one document per row).
        """
        b, t, _ = x.shape
        q, raw, slc, win, gates = self.project(x, cos, sin)
        blocks = None
        if cache is not None and t == 1:
            out = cache.attend(q, raw, slc, win, gates)
        else:
            cmp = compress_pair(self.compress_k, self.compress_v, raw[0], raw[1])
            # Models built by the trainer hold a resolved name; 'auto' (e.g. generate) resolves here. The device
            # type is static, so under torch.compile this runs once, at trace time.
            name = resolve_attn_impl(self.impl_name, q.device)
            kernel_args = {"dq_buffer_bytes": self.dq_buffer_bytes} if name == "triton" else {}
            out, blocks = NSA_IMPLS[name](q, *cmp, *slc, *win, gates, self.params, doc_start=doc_start, **kernel_args)
            if cache is not None:
                cache.fill(raw, slc, win, cmp)
            diag = self.diagnostics
            if diag is not None and diag.enabled:  # a host bool (the trainer sets it on log steps): no device read
                self.diagnostics_out = diag.record(q, cmp, slc, win, gates, blocks, self.params)
        if not torch.is_autocast_enabled(x.device.type):
            # Without autocast wo needs its own dtype (the torch path mixes the branches in fp32). Under autocast wo
            # casts its input itself: a cast to the residual stream's fp32 here only sent the bf16 attention output
            # through fp32 and back, a [B, T, HQ, Dv] copy each way, forward and backward (H100, 1b at 8k batch 2:
            # 0.085 ms per block).
            out = out.to(self.wo.weight.dtype)
        out = self.wo(out.reshape(b, t, self.n_heads * self.v_head_dim))
        return (out, blocks) if return_blocks else out

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wkv, self.wgate):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.compress_k.init_weights()
        self.compress_v.init_weights()


class DenseAttention(nn.Module):
    """Plain causal GQA attention with the same projections: the baseline NSA is compared against."""

    def __init__(self, args: NSAModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim, self.v_head_dim = args.head_dim, args.dv
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wkv = nn.Linear(args.dim, args.n_kv_heads * (args.head_dim + args.dv), bias=False)
        self.wo = nn.Linear(args.n_heads * args.dv, args.dim, bias=False)

    def forward(self, x, cos, sin, doc_start=None, cache=None):
        """x [B, T, dim] -> [B, T, dim]; ``doc_start`` and ``cache`` as in NSAAttention.forward."""
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        k, v = self.wkv(x).view(b, t, self.n_kv_heads, -1).split([self.head_dim, self.v_head_dim], dim=-1)
        k = apply_rope(k, cos, sin)
        if cache is not None and t == 1:
            return self.wo(cache.attend(q, k, v).reshape(b, t, self.n_heads * self.v_head_dim))
        if cache is not None:
            cache.fill(k, v)
        if doc_start is None:
            out = local_attention.causal_attention(q, k, v)  # flash-attn when installed, else SDPA(is_causal)
            return self.wo(out.reshape(b, t, self.n_heads * self.v_head_dim))
        # Packed documents: causal within each document; FlexAttention on CUDA, an explicit mask on CPU.
        out = local_attention.document_attention(q, k, v, doc_start)
        return self.wo(out.reshape(b, t, self.n_heads * self.v_head_dim))

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wkv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
