"""The whole-attention cases of tests/test_kernels.py and the helpers its checks share: ``run_case`` (the Triton
NSA attention against the float64 reference), the selected branch's inputs of a case and its dQ (``sel_dq``), and
``_tuned_entry`` (a tuned.py launch shape set for the length of a block). The named checks are in the
_kernel_checks*.py files.
"""

from __future__ import annotations

import contextlib
import zlib

# (name, B, T, HQ, HKV, Dk, Dv, (l, d, l', n, w), dtype)
CASES = [  # small T and few KV heads: the interpreter pays per program and per Triton op
    ("g1_odd_b2", 2, 45, 1, 1, 32, 32, (8, 4, 8, 4, 12), "float32"),
    ("g2_dk_ne_dv", 1, 70, 2, 1, 48, 32, (8, 4, 8, 4, 10), "float32"),
    ("g6_l_lt_lp", 1, 80, 6, 1, 32, 32, (16, 8, 16, 3, 40), "float32"),
    ("g3_hkv2_lp16", 1, 72, 6, 2, 16, 16, (16, 8, 16, 3, 24), "float32"),  # packed rows: 3 heads, 2 groups
    ("g16_l_eq_lp", 1, 70, 16, 1, 32, 16, (8, 8, 8, 5, 12), "float32"),
    ("g2_fp16", 1, 61, 4, 2, 32, 32, (8, 4, 8, 4, 24), "float16"),
    ("short_T", 1, 5, 2, 1, 32, 32, (8, 4, 16, 4, 24), "float32"),  # T < l: no compressed token
]
# Packed documents (doc_start from these first positions per batch row): starts inside blocks, on block edges,
# one-token documents, a document that starts after block 0 ends.
DOC_CASES = [
    ("doc_g2_b2", 2, 77, 4, 2, 32, 32, (8, 4, 16, 4, 24), "float32", [[0, 23, 40, 64], [0, 50]]),
    ("doc_g6", 1, 130, 12, 2, 16, 16, (16, 8, 16, 4, 24), "float32", [[0, 7, 33, 96]]),
    ("doc_g16_tiny_docs", 1, 70, 16, 1, 32, 32, (8, 8, 8, 5, 12), "float32", [[0, 1, 35, 36, 69]]),
]
# The selected branch's causal prefix (selected.causal_prefix; element 10, element 9 the documents or None): the
# whole prefix n * l', a shorter one, one inside documents, and a sequence short enough that every token is in it
# (-1, automatic). The interpreter runs the token-centric sparse kernels, so without these the prefix would be
# tested only by the last kind.
PREFIX_CASES = [
    ("prefix_g6_hkv2", 1, 80, 12, 2, 16, 16, (16, 8, 16, 3, 24), "float32", None, 48),
    ("prefix_short_b2", 2, 77, 4, 2, 32, 32, (8, 4, 16, 4, 24), "float32", None, 20),
    ("prefix_doc_g6", 1, 130, 12, 2, 16, 16, (16, 8, 16, 4, 24), "float32", [[0, 7, 33, 96]], 64),
    ("prefix_all_doc", 1, 60, 4, 2, 32, 32, (8, 4, 16, 4, 24), "float32", [[0, 23, 40]], -1),
]
TOL = {"float32": 2e-4, "float16": 1e-2, "bfloat16": 2e-2}


def doc_starts(starts_per_row, t):
    import torch

    rows = [torch.tensor(st)[torch.searchsorted(torch.tensor(st), torch.arange(t), right=True) - 1]
            for st in starts_per_row]
    return torch.stack(rows)


@contextlib.contextmanager
def _no_descriptor_fallback():
    """launch_tma's fallback warning (a descriptor form that did not compile, so pointer loads ran) as an error: a
    check of a descriptor path must run that path."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*tensor-descriptor loads", category=UserWarning)
        yield


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def case_inputs(case, device):
    """-> (params, documents or None, causal prefix, the attention's 8 inputs, dout) of a case, seeded by its name."""
    import torch

    from nsa_titan.models.nsa.common import NSAParams

    name, B, T, HQ, HKV, DK, DV, geo, dt = case[:9]
    doc = doc_starts(case[9], T).to(device) if len(case) > 9 and case[9] is not None else None
    prefix = case[10] if len(case) > 10 else -1
    p = NSAParams(*geo)
    dtype = getattr(torch, dt)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # not hash(): it changes with each process
    tc = p.num_cmp_tokens(T)

    def rnd(*s):
        return (torch.randn(*s, generator=gen) * 1.5).to(device=device, dtype=dtype)

    ins = [rnd(B, T, HQ, DK), rnd(B, tc, HKV, DK), rnd(B, tc, HKV, DV), rnd(B, T, HKV, DK), rnd(B, T, HKV, DV),
           rnd(B, T, HKV, DK), rnd(B, T, HKV, DV),
           torch.rand(B, T, HQ, 3, generator=gen).to(device)]
    return p, doc, prefix, ins, rnd(B, T, HQ, DV)


def fake_outputs_match(case, device) -> dict:
    """nsa_fwd's fake implementation (the shapes and dtypes torch.compile plans its buffers with) against the real
    op's outputs for a case, under whatever tuned entries are set: a mismatch fails only inside a compiled model
    (inductor's assert_size_stride), which the interpreter checks do not run."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nsa_titan.kernels import ops  # noqa: F401  (registers torch.ops.nsa_titan)

    p, doc, prefix, ins, _ = case_inputs(case, device)
    doc = None if doc is None else doc.to(torch.int32).contiguous()
    args = (p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n, p.window)
    real = torch.ops.nsa_titan.nsa_fwd(*ins, *args, doc, prefix)
    with FakeTensorMode() as mode:
        fake = torch.ops.nsa_titan.nsa_fwd(*(mode.from_tensor(x) for x in ins), *args,
                                           None if doc is None else mode.from_tensor(doc), prefix)
    shapes = [(tuple(a.shape), a.dtype, tuple(b.shape), b.dtype) for a, b in zip(real, fake)]
    return {"ok": len(real) == len(fake) and all(a == c and b == d for a, b, c, d in shapes),
            "real_keys": shapes[-1][0], "fake_keys": shapes[-1][2]}


def run_case(case, device):
    import torch

    from nsa_titan.kernels import nsa_attention
    from nsa_titan.models.nsa import reference, torch_impl

    T, dt = case[2], case[8]
    p, doc, prefix, ins, dout = case_inputs(case, device)
    errs = {}

    def run(fn, xs):
        xs = [x.detach().requires_grad_(True) for x in xs]
        out, sel = fn(*xs, p, doc_start=doc)
        out.backward(dout.to(out.dtype))
        return out.detach(), sel, [x.grad for x in xs]

    def fast(*a, **kw):
        return nsa_attention(*a, **kw, causal_prefix=prefix)

    out, idx, grads = run(fast, ins)
    ref_out, chosen, ref_grads = run(reference.nsa_attention, [x.double() for x in ins])
    errs["out"] = rel_err(out, ref_out)
    names = ["q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"]
    for n_, g, rg in zip(names, grads, ref_grads):
        if rg is None or rg.numel() == 0:  # k_cmp/v_cmp when T < l: nothing depends on them
            assert g is None or not g.abs().any()
            continue
        errs["d" + n_] = rel_err(g, rg)
    mine = torch_impl.blocks_to_mask(idx.long(), T, p)
    sel_ok = bool((mine == chosen).all())
    # Same indices in the same order as the portable path (descending importance, ties to the lower index).
    _, ti_idx = torch_impl.nsa_attention(*[x.float() for x in ins], p, doc_start=doc)
    order_ok = bool((ti_idx == idx).all())
    _, _, grads2 = run(fast, ins)
    determ = all(a is None or bool(torch.equal(a, b)) for a, b in zip(grads, grads2))
    worst = max(errs.values())
    ok = worst < TOL[dt] and sel_ok and order_ok and determ and all(
        g is None or bool(torch.isfinite(g).all()) for g in grads)
    return {"ok": ok, "worst": worst, "sel_ok": sel_ok, "order_ok": order_ok, "determ": determ, "errs": errs}


@contextlib.contextmanager
def _tuned_entry(kernel: str, case, cfg: dict | None):
    """tuned.py's launch shape of ``kernel`` for the case's (next_pow2(G), head dim) key set to ``cfg`` inside the
    block (None: left as it is), restored after: the whole attention then takes the path that entry switches on."""
    from nsa_titan.kernels.combine import pow2
    from nsa_titan.kernels.tuned import TUNED

    key = (kernel, pow2(case[3] // case[4]), max(case[5], case[6]), False)
    before = TUNED.get(key)
    if cfg is not None:
        TUNED[key] = cfg
    try:
        yield
    finally:
        if cfg is not None and before is None:
            del TUNED[key]
        elif cfg is not None:
            TUNED[key] = before


_SEL_INPUTS: dict = {}


def _sel_inputs(case, device):
    """The selected-branch checks' shared inputs for one case, made once for the three of them: random q, K/V of the
    compressed and the selected branch, dO; the compressed branch's LSE; the selection with chunks of 16 compressed
    tokens merged both ways (select_merge; the default chunks run in the whole-attention cases); the block-centric
    forward (32-row chunks) with its sorted pair keys. None when T < l (no compressed token)."""
    import torch

    from nsa_titan.kernels import band, select, selected
    from nsa_titan.models.nsa.common import NSAParams

    if (case[0], device) not in _SEL_INPUTS:
        name, B, T, HQ, HKV, DK, DV, geo, dt, *starts = case
        p, dtype = NSAParams(*geo), getattr(torch, dt)
        doc = doc_starts(starts[0], T).to(device=device, dtype=torch.int32) if starts else None
        gen = torch.Generator().manual_seed(2)
        q, kc, ks, vs, do = (torch.randn(*s, generator=gen).to(device=device, dtype=dtype) for s in
                             [(B, T, HQ, DK), (B, p.num_cmp_tokens(T), HKV, DK), (B, T, HKV, DK), (B, T, HKV, DV),
                              (B, T, HQ, DV)])
        x = None
        if kc.shape[1]:
            _, lse_c = band.band_fwd(q, kc, kc, p.cmp_stride, p.cmp_block - 1, 0, doc_start=doc)
            idx_topk, idx = (select.select_blocks(q, kc, lse_c, p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n,
                                                  cfg=dict(merge=m, CI=16), doc_start=doc) for m in ("topk", "sorted"))
            o, lse, keys = selected.sel_fwd(q, ks, vs, idx, p.slc_block, cfg=dict(algo="blocks", rows=32),
                                            doc_start=doc, with_pairs=True)
            x = dict(p=p, doc=doc, q=q, kc=kc, lse_c=lse_c, ks=ks, vs=vs, do=do, idx_topk=idx_topk, idx=idx, o=o,
                     lse=lse, keys=keys)
        _SEL_INPUTS[case[0], device] = x
    return _SEL_INPUTS[case[0], device]


def sel_dq(x, cfg_dq: dict):
    """dQ of the selected backward on _sel_inputs' ``x`` with dQ launch config ``cfg_dq``, for the checks that compare
    dQ only. The dK/dV walk that sel_bwd runs as well (and that stores dS for the 'ds' kernels: the same dS per pair
    however the walk is chunked) takes the block forward's sorted keys and one chunk per block, its cheapest form on
    the interpreter; sel_bwd_paths and the whole-attention cases check the walks and the sort."""
    from nsa_titan.kernels import selected_bwd

    return selected_bwd.sel_bwd(x["do"], x["q"], x["ks"], x["vs"], x["o"], x["lse"], x["idx"], x["p"].slc_block,
                                cfg_dq=cfg_dq, cfg_dkdv=dict(chunk_tiles=1 << 20), doc_start=x["doc"],
                                keys=x["keys"])[0]
