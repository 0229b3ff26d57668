"""The kernel checks of tests/test_kernels.py: the whole-attention cases (``run_case``, _kernel_cases.py: the Triton
NSA attention against the float64 reference) and the named checks (``CHECKS``) of single kernels and paths: the
general ones here, the selected branch's in _kernel_checks_selected.py / _kernel_checks_backward.py, the band
kernels' in _kernel_checks_band.py. They run only in that file's child process (TRITON_INTERPRET=1 on CPU, or
``--cuda``), which prints one verdict per case and check.
"""

from __future__ import annotations

# test_kernels.py takes the cases and run_case from here with CHECKS.
from _kernel_cases import CASES, DOC_CASES, PREFIX_CASES, rel_err, run_case  # noqa: F401
from _kernel_checks_backward import (
    _dout_backward_check,
    _sel_bwd_paths_check,
    _sel_dq_ds_tma_check,
    _sel_dq_tokens_check,
)
from _kernel_checks_band import (
    _add_splits_balanced_check,
    _band_dq2_check,
    _band_dq2_partials_check,
    _band_split_check,
    _band_tma_check,
    _decode_fused_check,
)
from _kernel_checks_selected import (
    _blocks_fwd_check,
    _fwd_fake_check,
    _pair_sort_check,
    _pair_table_check,
    _sel_tma_check,
    _sel_tokens_check,
    _select_heads_on_registers_check,
    _select_merge_check,
    _select_slot_order_check,
    _select_tma_check,
)


def _small_inputs(device, batch: int = 1, seed: int = 0, grad: bool = False):
    """-> (p, [q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates]): the small case the op-path checks share (T = 40,
    HQ 4, HKV 2, head dim 32, 9 compressed tokens), seeded; ``grad``: leaves that require grad."""
    import torch

    from nsa_titan.models.nsa.common import NSAParams

    T, HQ, HKV, D = 40, 4, 2, 32
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, T, HQ, D), (batch, 9, HKV, D), (batch, 9, HKV, D)] + [(batch, T, HKV, D)] * 4
    xs = [torch.randn(*s, generator=gen) for s in shapes] + [torch.rand(batch, T, HQ, 3, generator=gen)]
    return NSAParams(8, 4, 16, 4, 24), [x.to(device).requires_grad_(grad) for x in xs]


def _compile_check(device):
    """fullgraph=True must trace through the custom ops (aot_eager: no C++ toolchain needed on CPU)."""
    import torch

    from nsa_titan.kernels import nsa_attention

    p, (*xs, gates) = _small_inputs(device, grad=True)
    fn = torch.compile(lambda *a: nsa_attention(*a, p), fullgraph=True, backend="aot_eager")
    out, idx = fn(*xs, gates)
    ref, ridx = nsa_attention(*xs, gates, p)
    out.sum().backward()
    return {"ok": bool(torch.equal(idx, ridx)) and rel_err(out.detach(), ref.detach()) < 1e-6
            and xs[0].grad is not None}


def _aux_grads_check(device):
    """The forward op's auxiliary outputs (block indices, branch outputs and LSEs) get no gradient: autograd
    must not materialise zero gradients for them (three [B, T, HQ, Dv] tensors of peak memory). Both paths: the
    custom op's autograd and the eager _Direct function (ops.nsa_attention's via_op)."""

    from nsa_titan.kernels import nsa_attention, ops

    p, (*xs, gates) = _small_inputs(device, grad=True)
    seen = {}
    backward = ops._nsa_backward

    def spy(ctx, dout, *aux):
        seen.setdefault(ctx.via_op, []).append([a is None for a in aux])
        return backward(ctx, dout, *aux)

    ops._nsa_backward = spy  # what both the op's autograd and _Direct.backward call
    try:
        for via_op in (True, False):
            out, _ = nsa_attention(*xs, gates, p, via_op=via_op)
            out.sum().backward()
    finally:
        ops._nsa_backward = backward
    return {"ok": seen == {True: [[True] * 8], False: [[True] * 8]} and xs[0].grad is not None, "seen": seen}


def _direct_path_check(device):
    """Eager calls skip the custom op's dispatch (ops._Direct) and get bitwise its results: outputs, block indices
    and every gradient, with and without documents. The op stays where something must see it: under a dispatch
    mode (selective activation checkpointing's is one) and for meta tensors."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from nsa_titan.kernels import nsa_attention, ops

    p, (*xs, gates) = _small_inputs(device, batch=2, seed=11)
    dout = torch.randn(xs[0].shape, generator=torch.Generator().manual_seed(12)).to(device)
    docs = torch.tensor([0] * 17 + [17] * 23, device=device).expand(2, 40)
    same = []
    for doc in (None, docs):
        runs = []
        for via_op in (True, False):
            ins = [x.detach().requires_grad_(True) for x in (*xs, gates)]
            out, idx = nsa_attention(*ins, p, doc_start=doc, via_op=via_op)
            out.backward(dout)
            runs.append([out.detach(), idx, *(x.grad for x in ins)])
        same.append(all(torch.equal(a, b) for a, b in zip(*runs)))

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    plain = ops._through_op((*xs, gates))
    with Seen():
        moded = ops._through_op((*xs, gates))
    meta = ops._through_op((xs[0].to("meta"), *xs[1:], gates))
    return {"ok": all(same) and not plain and moded and meta, "same": same, "plain": plain, "mode": moded,
            "meta": meta}


def _dq_buffer_check(device):
    """The model's dq_buffer_gib reaches the backward through the custom ops: with the default budget the selected
    branch's dQ comes from the stored dS (both KV heads' at once), with a budget of one KV head's dS from dS stored
    one KV head at a time (attempt 111: the same dS, so the same dQ to the bit), with a 1-byte budget it is
    recomputed; the gradients agree (two paths, fp32 rounding only)."""
    import torch

    from nsa_titan.kernels import nsa_attention, selected_bwd

    p, (*xs, gates) = _small_inputs(device, seed=5)
    q, k_slc = xs[0], xs[3]
    G = q.shape[2] // k_slc.shape[2]
    one_head = q.shape[1] * G * p.slc_top_n * p.slc_block * q.element_size()  # one (batch, KV head)'s dS bytes
    algos, cfg = [], selected_bwd._cfg

    def spy(kernel, *a):
        c = cfg(kernel, *a)
        if kernel == "sel_dq":
            algos.append((c.get("algo", "recompute"), c.get("ds_chunk")))
        return c

    grads = []
    selected_bwd._cfg = spy
    try:
        for budget in ({}, {"dq_buffer_bytes": one_head}, {"dq_buffer_bytes": 1}):
            ins = [x.detach().requires_grad_(True) for x in (*xs, gates)]
            out, _ = nsa_attention(*ins, p, causal_prefix=0, **budget)
            out.backward(torch.ones_like(out))
            grads.append([x.grad for x in ins])
    finally:
        selected_bwd._cfg = cfg
    worst = max(rel_err(a, b) for a, b in zip(grads[0], grads[2]))
    chunked_dq_equal = torch.equal(grads[0][0], grads[1][0])
    chunked_worst = max(rel_err(a, b) for a, b in zip(grads[0], grads[1]))
    want = [("ds", 2), ("ds", 1), ("recompute", None)]
    return {"ok": algos == want and worst < 1e-5 and chunked_dq_equal and chunked_worst < 1e-5, "algos": algos,
            "worst": worst, "chunked_dq_equal": chunked_dq_equal, "chunked_worst": chunked_worst}

# The named checks in the order the child runs them: (verdict name, function of the device).
CHECKS = (("compile_fullgraph", _compile_check), ("no_aux_grads", _aux_grads_check),
          ("direct_path", _direct_path_check), ("dq_buffer", _dq_buffer_check),
          ("sel_blocks", _blocks_fwd_check), ("nsa_fwd_fake", _fwd_fake_check),
          ("sel_bwd_paths", _sel_bwd_paths_check), ("sel_tma", _sel_tma_check), ("sel_tokens", _sel_tokens_check),
          ("sel_dq_ds_tma", _sel_dq_ds_tma_check), ("sel_dq_tokens", _sel_dq_tokens_check),
          ("select_merge", _select_merge_check),
          ("select_tma", _select_tma_check), ("select_heads_on_registers", _select_heads_on_registers_check),
          ("select_slot_order", _select_slot_order_check), ("dout_backward", _dout_backward_check),
          ("pair_table", _pair_table_check), ("band_split", _band_split_check),
          ("add_splits_balanced", _add_splits_balanced_check), ("band_tma", _band_tma_check),
          ("band_dq2", _band_dq2_check), ("band_dq2_partials", _band_dq2_partials_check),
          ("decode_fused", _decode_fused_check), ("pair_sort", _pair_sort_check))
