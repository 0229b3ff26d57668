"""The Triton kernels as torch operators (custom ops: opaque to torch.compile, with fake shapes and autograd)
and ``nsa_attention`` on top of them.

The whole NSA attention is one forward operator and one backward operator rather than one per branch: the
backward can then take each branch's softmax term delta = rowsum(dO_i * O_i) from the gate backward (which
reads dO and O_i anyway) and let the three branches add their dQ into one tensor in-kernel, which saves three
rowdot passes and two dQ sums (about 15 passes over a [B, T, HQ, D] tensor per layer). The per-branch kernel
launchers (band.py, select.py, selected.py, combine.py) stay callable on their own for benchmarks.

Inside a CUDA graph the branches that do not wait for the selection run on a side stream: the window forward, and
the window's and the compressed branch's dK/dV in the backward. The selected branch is a chain of small kernels
(selection, sort, tables, merge, reduce) that leaves SMs idle; the band kernels fill them. H100, whole m7c model with
CUDA graphs: 1.012x at 8k batch 2, 1.006x at 2k batch 8 (benchmarks/results/streams_ab_m7c_H100.md). Eager calls
fork the backward only from EAGER_FORK_VALUES values of q, where the selected walk (bound by memory) and the band
dK/dV (by the tensor cores) overlap (attempt 113). Same kernels, same order of the dQ additions: results are bitwise
those of one stream.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from nsa_titan.kernels import band, band_bwd, band_dq2, combine, select, selected, selected_bwd
from nsa_titan.kernels.pair_sort import pair_key_dtype


def _c(x: Tensor) -> Tensor:
    """Kernels index the last dimension with stride 1; every other stride is passed explicitly."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _like(x: Tensor, shape=None, dtype=None) -> Tensor:
    return torch.empty(x.shape if shape is None else shape, dtype=dtype or x.dtype, device=x.device)


def _sparse_rows(block_idx: Tensor, prefix: int) -> Tensor:
    """block_idx with the slots of the first ``prefix`` tokens unused (-1): the sparse kernels skip those
    tokens, whose selected branch runs as causal attention (selected.causal_prefix)."""
    if prefix == 0:
        return block_idx
    t = torch.arange(block_idx.shape[2], device=block_idx.device)
    return torch.where((t < prefix)[:, None], -1, block_idx)


def _prefix(q, k_slc, v_slc, n, slc_block, causal_prefix):
    return selected.causal_prefix(q, v_slc, q.shape[2] // k_slc.shape[2], n, slc_block, causal_prefix)


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    """One side stream per GPU, made on first use: inside CUDA graphs the band branches run on it beside the selected
    branch's chain of small kernels (selection, sort, tables, merge), which leave most of the GPU idle between them."""
    return torch.cuda.Stream(device=device_index)


# An eager backward whose q holds at least this many values (batch x tokens x query heads x head dim) runs the band
# dK/dV on the side stream too (attempt 113): the selected dK/dV walk is bound by memory (paper 64k: 70 % of the
# H100's DRAM rate, a quarter of its tensor-core rate, ncu_walk_paper64k_s38) and the band dK/dV by the tensor cores,
# and on two streams their programs share the SMs. H100, eager fwd+bwd against one stream, medians of 18-30
# alternating pairs (ab_eager_fork_probe_s38): paper 8k-64k 1.043x-1.011x, qwen7b 8k 1.045x, 1b 8k batch 4 1.042x, 32k
# 1.037x, m7c 32k 1.056x, 64k 1.039x; but m7c 8k batch 2 0.952x and 2k batch 8 0.976x (12.6M values each), where the
# eager call is bound by the host and the fork's host time is the cost. The threshold is the smallest shape that
# gained (m7c 32k, 25.2M; qwen7b 8k 29.4M), which leaves out the 1b's 8k at batch 1 (16.8M, unmeasured, and bound by
# the host in eager calls as the m7c shapes that lost).
EAGER_FORK_VALUES = 3 << 23


def eager_backward_forks(q: Tensor) -> bool:
    """Whether an eager backward on q's shape runs the band dK/dV on the side stream (EAGER_FORK_VALUES)."""
    return q.numel() >= EAGER_FORK_VALUES


class _Side:
    """``with _Side(x):`` runs the block's launches on the side stream, after the main stream's work so far, when x is
    on a GPU and a CUDA graph is being captured or ``eager`` is set (else on the current stream); ``join()`` makes the
    main stream wait for them. Tensors that cross the streams are allocated on the main stream before the fork and
    live until after the join, so the caching allocator never hands their memory to the other stream early."""

    def __init__(self, x: Tensor, eager: bool = False):
        # Eager calls fork only where the caller says so: a replay pays nothing for the fork and the join, while an
        # eager call pays their host time, and small eager shapes are bound by the host. (A kernel-table run with
        # the streams on in eager calls had m7c 8k batch 1's eager forward at 1.34 ms of wall time against 0.82 the
        # session before: another machine, so not a clean A/B.)
        self.side = self.main = None
        if x.is_cuda:
            side = _side_stream(x.device.index or 0)  # made by the first call: graph trees run eagerly before capture
            if eager or torch.cuda.is_current_stream_capturing():
                self.side, self.main = side, torch.cuda.current_stream(x.device)

    def __enter__(self):
        if self.side is None:
            return None
        self.side.wait_stream(self.main)
        self._ctx = torch.cuda.stream(self.side)
        self._ctx.__enter__()
        return self.side

    def __exit__(self, *exc):
        if self.side is not None:
            self._ctx.__exit__(*exc)
        return False

    def join(self):
        if self.side is not None:
            self.main.wait_stream(self.side)


def _branches_fwd(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cmp_block, cmp_stride, slc_block, top_n,
                  window, doc_start, causal_prefix):
    b, t, hq, _ = q.shape
    # The window branch depends on nothing else: launched first, on the side stream where there is one.
    o_win, lse_win = q.new_empty(b, t, hq, v_win.shape[-1]), torch.empty(b, t, hq, device=q.device,
                                                                          dtype=torch.float32)
    fork = _Side(q)
    with fork:
        band.band_fwd(q, k_win, v_win, 1, 0, window, doc_start=doc_start, out=(o_win, lse_win))
    if k_cmp.shape[1] == 0:  # static shape: shorter than one compression block, nothing is visible
        o_cmp = q.new_zeros(b, t, hq, v_cmp.shape[-1])
        lse_cmp = torch.full((b, t, hq), float("inf"), device=q.device, dtype=torch.float32)
    else:
        o_cmp, lse_cmp = band.band_fwd(q, k_cmp, v_cmp, cmp_stride, cmp_block - 1, 0, doc_start=doc_start)
    block_idx = select.select_blocks(q, k_cmp, lse_cmp, cmp_block, cmp_stride, slc_block, top_n,
                                     doc_start=doc_start)
    prefix = _prefix(q, k_slc, v_slc, top_n, slc_block, causal_prefix)
    keys = out = None
    # The prefix is causal attention: band geometry (stride 1, offset 0) without a window.
    if prefix == t:  # every token selects all its candidate blocks
        o_slc, lse_slc = band.band_fwd(q, k_slc, v_slc, 1, 0, 0, doc_start=doc_start)
    else:
        # With no prefix rows to come after it, the selected forward writes the gate mix too: the multi-token
        # forward (attempt 84) and the block forward's merge (85) in an epilogue, the one-token forward by a combine
        # pass after it. It needs the window's output: the main stream waits for the side stream right before that
        # launch (the window's one band pass ran beside the compressed pass, the selection and the block sort).
        if prefix == 0:
            out = q.new_empty(b, t, hq, v_slc.shape[-1])
        o_slc, lse_slc, keys = selected.sel_fwd(q, k_slc, v_slc, _sparse_rows(block_idx, prefix), slc_block,
                                                doc_start=doc_start, with_pairs=True,
                                                mix=None if out is None else (o_cmp, o_win, gates, out),
                                                before_mix=fork.join)
        if prefix:  # the prefix's rows, over its own keys (a token t < prefix sees keys <= t only)
            band.band_fwd(q, k_slc[:, :prefix], v_slc[:, :prefix], 1, 0, 0, doc_start=doc_start,
                          n_queries=prefix, out=(o_slc, lse_slc))
    fork.join()
    if out is None:
        out = combine.combine_fwd(o_cmp, o_slc, o_win, gates)
    if keys is None:  # token-centric forward or no sparse tokens: the backward sorts the pairs itself
        keys = block_idx.new_empty(0, dtype=torch.int32)
    return out, block_idx, o_cmp, lse_cmp, o_slc, lse_slc, o_win, lse_win, keys


# --- the whole NSA attention as one operator: three branches, block selection, gate combination ---
def nsa_fwd_impl(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor,
                 v_win: Tensor, gates: Tensor, cmp_block: int, cmp_stride: int, slc_block: int, top_n: int,
                 window: int, doc_start: Tensor | None = None, causal_prefix: int = -1,
                 dq_buffer_bytes: int = selected.DS_BUDGET) -> tuple[
                     Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> out, block_idx, per branch (o, lse) for the backward (cmp, slc, win), and the selected branch's sorted
    (block, token, slot) keys when its forward is block-centric (else empty), which the backward reuses instead
    of sorting again. ``doc_start`` [B, T] int32 contiguous or None: document masking in every branch
    (reference.py's rules). ``causal_prefix``: see selected.causal_prefix (-1: automatic). ``dq_buffer_bytes``:
    only handed to the backward (selected._cfg's budget for stored dS / dQ partials)."""
    return _branches_fwd(*map(_c, (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win)), gates.contiguous(),
                         cmp_block, cmp_stride, slc_block, top_n, window, doc_start, causal_prefix)


# The two operators, registered through torch.library's Library API rather than @custom_op: same schema, fake
# implementation and autograd, but a call goes straight from the dispatcher to the function. @custom_op wraps its
# function in a dynamo-disable frame and checks outputs for aliasing at every call: ~50 us more per call under no_grad,
# which is how a compiled graph calls it (72 vs 22 us for a 16-argument stand-in on the CPU; the forward on an H100
# host: 0.64 ms through @custom_op, 0.49 ms for the function itself; benchmarks/results/host_time_s28_H100.md).
_LIB = torch.library.Library("nsa_titan", "DEF")  # kept: the registrations live as long as this object


def _define(name: str, fn) -> None:
    _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()), tags=(torch.Tag.pt2_compliant_tag,))
    for key in ("CPU", "CUDA"):  # the CPU: the Triton interpreter (tests)
        _LIB.impl(name, fn, key)


_define("nsa_fwd", nsa_fwd_impl)
nsa_fwd = torch.ops.nsa_titan.nsa_fwd.default


@torch.library.register_fake("nsa_titan::nsa_fwd", lib=_LIB)
def _(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cmp_block, cmp_stride, slc_block, top_n, window,
      doc_start=None, causal_prefix=-1, dq_buffer_bytes=selected.DS_BUDGET):
    b, t, hq, _ = q.shape
    hkv = k_slc.shape[2]
    o = _like(q, (b, t, hq, v_slc.shape[-1]))
    lse = _like(q, (b, t, hq), torch.float32)
    sparse = _prefix(q, k_slc, v_slc, top_n, slc_block, causal_prefix) < t
    if sparse and selected.forward_sorts_pairs(q, v_slc, hq // hkv, top_n, slc_block):
        nb = -(-t // slc_block)
        keys = _like(q, (b * hkv, t * top_n), pair_key_dtype(nb, t * top_n))
    else:
        keys = _like(q, (0,), torch.int32)
    return (o, _like(q, (b, hkv, t, top_n), torch.int64), _like(o), lse, _like(o), _like(lse), _like(o),
            _like(lse), keys)


def nsa_bwd_impl(dout: Tensor, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_slc: Tensor, v_slc: Tensor,
                 k_win: Tensor, v_win: Tensor, gates: Tensor, block_idx: Tensor, o_cmp: Tensor, lse_cmp: Tensor,
                 o_slc: Tensor, lse_slc: Tensor, o_win: Tensor, lse_win: Tensor, pair_keys: Tensor, cmp_block: int,
                 cmp_stride: int, slc_block: int, window: int, doc_start: Tensor | None = None, causal_prefix: int = -1,
                 dq_buffer_bytes: int = selected.DS_BUDGET) -> tuple[
                     Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (q, k/v per branch, gates). The gate backward also yields each branch's delta =
    rowsum(dO_i * O_i), and the three branches add their dQ into one tensor (no rowdot passes, no dQ sums).
    ``causal_prefix``: nsa_fwd's argument (resolved the same way from the same shapes). ``dq_buffer_bytes``: the
    most memory the selected branch's dQ may keep in stored dS / partials (selected._cfg)."""
    q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win = map(_c, (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win))
    # No dO_i = g_i * dOut is stored: every branch backward runs on dOut with its LSE lowered by log2(g_i) and
    # delta_i = dg_i (combine.combine_bwd): the same gradients, three [B, T, HQ, Dv] tensors fewer.
    dout = dout.contiguous()
    dgates, delta, (lse_cmp, lse_slc, lse_win) = combine.combine_bwd(dout, o_cmp, o_slc, o_win, gates,
                                                                      (lse_cmp, lse_slc, lse_win))
    t = q.shape[1]
    prefix = _prefix(q, k_slc, v_slc, block_idx.shape[-1], slc_block, causal_prefix)
    dq2 = k_cmp.shape[1] and band_dq2.dq2_enabled(q.shape[2] // k_win.shape[2], max(q.shape[-1], v_win.shape[-1]))
    # The window's and the compressed branch's dK/dV depend only on what combine_bwd made: on the side stream,
    # beside the selected branch's backward; their dQ adds into the selected branch's dQ, so it stays in order.
    dk_win, dv_win, dk_cmp, dv_cmp = map(torch.empty_like, (k_win, v_win, k_cmp, v_cmp))
    bands = ((k_win, v_win, lse_win, delta[2], 1, 0, window), (k_cmp, v_cmp, lse_cmp, delta[0], cmp_stride,
                                                               cmp_block - 1, 0))  # band_dq2's two branches
    fork = _Side(q, eager=eager_backward_forks(q))
    with fork:
        band_bwd.band_bwd(dout, q, k_win, v_win, o_win, lse_win, 1, 0, window, delta=delta[2], doc_start=doc_start,
                      parts="dkdv", dkv_out=(dk_win, dv_win))
        if k_cmp.shape[1] == 0:  # nothing was visible: no gradient flows through the compressed branch
            dk_cmp.zero_()
            dv_cmp.zero_()
        else:
            band_bwd.band_bwd(dout, q, k_cmp, v_cmp, o_cmp, lse_cmp, cmp_stride, cmp_block - 1, 0, delta=delta[0],
                          doc_start=doc_start, parts="dkdv", dkv_out=(dk_cmp, dv_cmp))
    parts = None  # the selected branch's dQ partials, left for band_dq2 to add (attempt 88)
    if prefix == t:
        dq, dk_slc, dv_slc = band_bwd.band_bwd(dout, q, k_slc, v_slc, o_slc, lse_slc, 1, 0, 0, delta=delta[1],
                                           doc_start=doc_start)
    else:
        dq, dk_slc, dv_slc, parts = selected_bwd.sel_bwd_parts(
            dout, q, k_slc, v_slc, o_slc, lse_slc, _sparse_rows(block_idx.contiguous(), prefix), slc_block,
            delta=delta[1], doc_start=doc_start, keys=pair_keys if pair_keys.numel() else None,
            dq_buffer_bytes=dq_buffer_bytes, sum_dq=not dq2)
        if prefix:  # the prefix rows' dQ (added to the sparse kernels' zeros) and their keys' dK/dV (added)
            if parts is not None:  # no sum kernel wrote the sparse rows' zeros
                dq.zero_()
            band_bwd.band_bwd(dout, q, k_slc[:, :prefix], v_slc[:, :prefix], o_slc, lse_slc, 1, 0, 0,
                          delta=delta[1], dq_acc=dq, doc_start=doc_start, n_queries=prefix,
                          dkv_acc=(dk_slc, dv_slc))
    if dq2:
        band_dq2.band_dq2(dout, q, *bands, dq, doc_start=doc_start, dq_partials=parts,
                          acc=parts is None or prefix > 0)
    else:
        band_bwd.band_bwd(dout, q, k_win, v_win, o_win, lse_win, 1, 0, window, delta=delta[2], dq_acc=dq,
                          doc_start=doc_start, parts="dq")
        if k_cmp.shape[1]:
            band_bwd.band_bwd(dout, q, k_cmp, v_cmp, o_cmp, lse_cmp, cmp_stride, cmp_block - 1, 0, delta=delta[0],
                              dq_acc=dq, doc_start=doc_start, parts="dq")
    fork.join()
    return dq, dk_cmp, dv_cmp, dk_slc, dv_slc, dk_win, dv_win, dgates


_define("nsa_bwd", nsa_bwd_impl)
nsa_bwd = torch.ops.nsa_titan.nsa_bwd.default


@torch.library.register_fake("nsa_titan::nsa_bwd", lib=_LIB)
def _(dout, q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, block_idx, o_cmp, lse_cmp, o_slc, lse_slc,
      o_win, lse_win, pair_keys, cmp_block, cmp_stride, slc_block, window, doc_start=None, causal_prefix=-1,
      dq_buffer_bytes=selected.DS_BUDGET):
    return tuple(_like(x) for x in (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates))


def _nsa_setup(ctx, inputs, output):
    (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cmp_block, cmp_stride, slc_block, _top_n, window, doc,
     causal_prefix, dq_buffer_bytes) = inputs
    _out, block_idx, o_cmp, lse_cmp, o_slc, lse_slc, o_win, lse_win, keys = output
    ctx.save_for_backward(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, block_idx, o_cmp, lse_cmp, o_slc,
                          lse_slc, o_win, lse_win, keys, doc)
    ctx.args = (cmp_block, cmp_stride, slc_block, window)
    ctx.causal_prefix, ctx.dq_buffer_bytes = causal_prefix, dq_buffer_bytes
    ctx.via_op = True  # the custom op's autograd; _Direct sets False: its backward calls nsa_bwd's function
    ctx.mark_non_differentiable(block_idx, o_cmp, lse_cmp, o_slc, lse_slc, o_win, lse_win, keys)
    # The eight auxiliary outputs never receive gradients: without this, autograd would allocate a zero
    # gradient for each of them (three [B, T, HQ, Dv] tensors: +37% peak memory, measured on an H100).
    ctx.set_materialize_grads(False)


def _nsa_backward(ctx, dout, *_unused):
    if dout is None:  # the combined output was not used: nothing flows back
        return (None,) * 16
    *saved, doc_start = ctx.saved_tensors
    bwd = nsa_bwd if ctx.via_op else nsa_bwd_impl  # the op's own function: see _Direct
    grads = bwd(dout, *saved, *ctx.args, doc_start, ctx.causal_prefix, ctx.dq_buffer_bytes)
    return (*grads, None, None, None, None, None, None, None, None)


def _op_backward(ctx, *grads):
    return _nsa_backward(ctx, *grads)  # looked up at each call, as _Direct.backward does (tests replace it)


torch.library.register_autograd("nsa_titan::nsa_fwd", _op_backward, setup_context=_nsa_setup, lib=_LIB)


class _Direct(torch.autograd.Function):
    """The two ops' own functions under a plain autograd.Function, for eager calls that nothing observes.

    Why: the custom op's Python dispatch (its autograd wrapper, the redispatch, the device kernel's aliasing checks)
    cost ~0.55 ms per eager forward+backward at m7c 8k batch 2 (2.2 ms of host time without it, ~2.8 with it; H100,
    benchmarks/results/host_time_s28_H100.md), and eager NSA at small shapes runs at the host's pace. The op stays
    where something must see it: torch.compile (an opaque node with a fake implementation), selective activation
    checkpointing and other dispatch modes (FakeTensorMode, FlopCounterMode), tensor subclasses and meta tensors.
    Same functions, same kernels, same order: the results are bitwise those of the op (tests/_kernel_checks.py)."""

    @staticmethod
    def forward(*args):
        return nsa_fwd_impl(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _nsa_setup(ctx, inputs, output)
        ctx.via_op = False

    @staticmethod
    def backward(ctx, *grads):
        return _nsa_backward(ctx, *grads)


def _through_op(tensors) -> bool:
    """Whether this call must dispatch the custom op (see _Direct): while compiling, under a dispatch mode, for tensor
    subclasses (FakeTensor, DTensor, functional wrappers) and for meta tensors."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():  # noqa: SLF001 - no public getter
        return True
    return any(type(x) is not Tensor or x.is_meta for x in tensors)


OPS = {"nsa_fwd": nsa_fwd, "nsa_bwd": nsa_bwd}


def nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, p, doc_start=None, causal_prefix: int = -1,
                  dq_buffer_bytes: int = selected.DS_BUDGET, via_op: bool | None = None):
    """Same contract as torch_impl.nsa_attention: (o [B,T,HQ,Dv], block_idx [B,HKV,T,n] int64, -1 unused).

    ``p`` is duck-typed: cmp_block (l), cmp_stride (d), slc_block (l'), slc_top_n (n), window (w).
    ``doc_start`` [B, T] (any integer dtype) or None: document masking (reference.py's rules).
    ``causal_prefix``: leading tokens whose selected branch runs as causal attention, -1 automatic (the same
    result either way; selected.causal_prefix says when it pays). Tests and A/B runs set it.
    ``dq_buffer_bytes``: the backward's budget for the selected branch's stored dS or dQ partials, above which
    dQ recomputes (the model's ``dq_buffer_gib``; default selected.DS_BUDGET, 2 GiB).
    ``via_op``: dispatch the custom op (True) or call its functions under a plain autograd.Function (False); None
    chooses (_through_op: the op only where something must see it). Tests set it to hold both paths alike.
    """
    if doc_start is not None:
        doc_start = doc_start.to(torch.int32).contiguous()
    tensors = (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)
    if via_op is None:
        via_op = _through_op(tensors)
    fwd = nsa_fwd if via_op else _Direct.apply
    out, block_idx, *_ = fwd(*tensors, p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n, p.window, doc_start,
                             causal_prefix, int(dq_buffer_bytes))
    return out, block_idx
