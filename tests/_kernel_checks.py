"""The kernel checks of tests/test_kernels.py: the whole-attention cases (``run_case``: the Triton NSA attention
against the float64 reference) and the named checks (``CHECKS``) of single kernels and paths. They run only in
that file's child process (TRITON_INTERPRET=1 on CPU, or ``--cuda``), which prints one verdict per case and check.
"""

from __future__ import annotations

import contextlib
import os
import sys
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


def run_case(case, device):
    import torch

    from nsa_titan.kernels import nsa_attention
    from nsa_titan.models.nsa import reference, torch_impl
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
    dout = rnd(B, T, HQ, DV)
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


def _compile_check(device):
    """fullgraph=True must trace through the custom ops (aot_eager: no C++ toolchain needed on CPU)."""
    import torch

    from nsa_titan.kernels import nsa_attention
    from nsa_titan.models.nsa.common import NSAParams

    p = NSAParams(8, 4, 16, 4, 24)
    B, T, HQ, HKV, D = 1, 40, 4, 2, 32
    xs = [torch.randn(*s, device=device, requires_grad=True) for s in
          [(B, T, HQ, D), (B, 9, HKV, D), (B, 9, HKV, D)] + [(B, T, HKV, D)] * 4]
    gates = torch.rand(B, T, HQ, 3, device=device, requires_grad=True)
    fn = torch.compile(lambda *a: nsa_attention(*a, p), fullgraph=True, backend="aot_eager")
    out, idx = fn(*xs, gates)
    ref, ridx = nsa_attention(*xs, gates, p)
    out.sum().backward()
    return {"ok": bool(torch.equal(idx, ridx)) and rel_err(out.detach(), ref.detach()) < 1e-6
            and xs[0].grad is not None}


def _aux_grads_check(device):
    """The forward op's auxiliary outputs (block indices, branch outputs and LSEs) get no gradient: autograd
    must not materialise zero gradients for them (three [B, T, HQ, Dv] tensors of peak memory)."""
    import torch

    from nsa_titan.kernels import nsa_attention, ops
    from nsa_titan.models.nsa.common import NSAParams

    p = NSAParams(8, 4, 16, 4, 24)
    B, T, HQ, HKV, D = 1, 40, 4, 2, 32
    xs = [torch.randn(*s, device=device, requires_grad=True) for s in
          [(B, T, HQ, D), (B, 9, HKV, D), (B, 9, HKV, D)] + [(B, T, HKV, D)] * 4]
    gates = torch.rand(B, T, HQ, 3, device=device, requires_grad=True)
    seen = []
    backward = ops._nsa_backward

    def spy(ctx, dout, *aux):
        seen.append([a is None for a in aux])
        return backward(ctx, dout, *aux)

    ops.nsa_fwd.register_autograd(spy, setup_context=ops._nsa_setup)
    try:
        out, _ = nsa_attention(*xs, gates, p)
        out.sum().backward()
    finally:
        ops.nsa_fwd.register_autograd(backward, setup_context=ops._nsa_setup)
    return {"ok": seen == [[True] * 8] and xs[0].grad is not None, "seen": seen}


def _dq_buffer_check(device):
    """The model's dq_buffer_gib reaches the backward through the custom ops: with the default budget the selected
    branch's dQ comes from the stored dS, with a 1-byte budget it is recomputed; the gradients agree (two paths,
    fp32 rounding only)."""
    import torch

    from nsa_titan.kernels import nsa_attention, selected_bwd
    from nsa_titan.models.nsa.common import NSAParams

    p = NSAParams(8, 4, 16, 4, 24)
    B, T, HQ, HKV, D = 1, 40, 4, 2, 32
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(*s, generator=gen).to(device) for s in
          [(B, T, HQ, D), (B, 9, HKV, D), (B, 9, HKV, D)] + [(B, T, HKV, D)] * 4]
    gates = torch.rand(B, T, HQ, 3, generator=gen).to(device)
    algos, cfg = [], selected_bwd._cfg

    def spy(kernel, *a):
        c = cfg(kernel, *a)
        if kernel == "sel_dq":
            algos.append(c.get("algo", "recompute"))
        return c

    grads = []
    selected_bwd._cfg = spy
    try:
        for budget in ({}, {"dq_buffer_bytes": 1}):
            ins = [x.detach().requires_grad_(True) for x in (*xs, gates)]
            out, _ = nsa_attention(*ins, p, causal_prefix=0, **budget)
            out.backward(torch.ones_like(out))
            grads.append([x.grad for x in ins])
    finally:
        selected_bwd._cfg = cfg
    worst = max(rel_err(a, b) for a, b in zip(*grads))
    return {"ok": algos == ["ds", "recompute"] and worst < 1e-5, "algos": algos, "worst": worst}


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


def _blocks_fwd_check(device):
    """The block-centric selected forward (selected_blocks.py) against the token-centric one, every case: one tile
    of 32 rows per program, and three tiles of 16 rows (the loop over a program's tiles, its last chunk of a
    block part-full)."""
    import torch

    from nsa_titan.kernels import selected

    worst, mixed = {}, {}
    for case in CASES + DOC_CASES:
        if (x := _sel_inputs(case, device)) is None:
            continue
        o_tok, lse_tok = selected.sel_fwd(x["q"], x["ks"], x["vs"], x["idx"], x["p"].slc_block,
                                          cfg=dict(algo="token"), doc_start=x["doc"])
        tiled_cfg = dict(algo="blocks", rows=16, tiles=3)
        tiled = selected.sel_fwd(x["q"], x["ks"], x["vs"], x["idx"], x["p"].slc_block, cfg=tiled_cfg,
                                 doc_start=x["doc"])
        w = 0.0
        for o_blk, lse_blk in ((x["o"], x["lse"]), tiled):
            same_inf = bool(torch.equal(torch.isfinite(lse_tok), torch.isfinite(lse_blk)))
            fin = torch.isfinite(lse_tok)
            err = max(rel_err(o_blk, o_tok), float((lse_blk[fin] - lse_tok[fin]).abs().max()))
            w = max(w, err if same_inf and err < TOL[case[8]] else float("inf"))
        worst[case[0]] = w
        # the gate mix in the merge's epilogue (attempt 85): combine_fwd's bits, o and lse unchanged
        mixed[case[0]] = _mix_gap(selected, x, x["p"].slc_block, tiled_cfg, *tiled)
    return {"ok": len(worst) == len(CASES) + len(DOC_CASES) - 1 and max(worst.values()) < float("inf")
            and max(mixed.values()) == 0.0, "worst": worst, "mix": mixed}


def _select_merge_check(device):
    """The selection's two ways of merging a chunk into the running top-n (select.py cfg merge: tl.topk of both,
    or sort the chunk's keys and one bitonic merge with the sorted top) give the same indices, every case."""
    import torch

    same = {c[0]: bool(torch.equal(x["idx_topk"], x["idx"])) for c in CASES + DOC_CASES
            if (x := _sel_inputs(c, device)) is not None}
    return {"ok": len(same) == len(CASES) + len(DOC_CASES) - 1 and all(same.values()), "same": same}


def _select_tma_check(device):
    """The selection with K_cmp's chunks through a tensor descriptor (select.py TMA: rows before 0 or past TC read
    zeros) against pointer loads: the same scores and merges, so the same indices, every case whose head dim is its
    own power of two (the others fall back to pointer loads); launch_tma's fallback warning is an error here."""
    import torch

    from nsa_titan.kernels import select, tma

    same = {}
    with _no_descriptor_fallback():
        for case in CASES + DOC_CASES:
            if (x := _sel_inputs(case, device)) is None:
                continue
            kc, p = x["kc"], x["p"]
            if tma.descriptor(kc, list(kc.shape), list(kc.stride()), [1, 16, 1, kc.shape[-1]]) is None:
                continue
            idx = select.select_blocks(x["q"], kc, x["lse_c"], p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n,
                                       cfg=dict(merge="sorted", CI=16, tma=True), doc_start=x["doc"])
            same[case[0]] = bool(torch.equal(idx, x["idx"]))
    return {"ok": len(same) >= 6 and all(same.values()), "same": same}


def _select_heads_on_registers_check(device):
    """The selection with a token's heads on the 128-row tile's register rows (select.py HL, the default where
    heads_on_register_rows applies: 4 to 32 heads per token) against the plain row order: the same group sums
    (added in another order), so the same indices, in every case with such a group (documents too)."""
    import torch

    from nsa_titan.kernels import select
    from nsa_titan.kernels.combine import pow2

    same = {}
    for case in CASES + DOC_CASES:
        if (x := _sel_inputs(case, device)) is None or select.heads_on_register_rows(128, pow2(case[3] // case[4])) < 0:
            continue
        p = x["p"]
        idx = [select.select_blocks(x["q"], x["kc"], x["lse_c"], p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n,
                                    cfg=dict(merge="sorted", CI=16, rows=128, perm=perm), doc_start=x["doc"])
               for perm in (True, False)]
        same[case[0]] = bool(torch.equal(idx[0], idx[1]) and torch.equal(idx[1], x["idx"]))
    # The cases above leave a token few blocks to choose besides its forced ones; here 5 of 8 slots are free, over
    # 49 blocks, so tokens that got each other's scores would choose differently.
    from nsa_titan.kernels import band
    from nsa_titan.models.nsa.common import NSAParams

    p = NSAParams(8, 4, 8, 8, 16)
    gen = torch.Generator().manual_seed(5)
    q, kc = (torch.randn(*sh, generator=gen).to(device) for sh in ((2, 390, 16, 16), (2, p.num_cmp_tokens(390), 2, 16)))
    _, lse = band.band_fwd(q, kc, kc, p.cmp_stride, p.cmp_block - 1, 0)
    idx = [select.select_blocks(q, kc, lse, p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n,
                                cfg=dict(merge="sorted", CI=16, rows=128, perm=perm)) for perm in (True, False)]
    same["free_g8_hkv2"] = bool(torch.equal(idx[0], idx[1]))
    return {"ok": len(same) == 6 and all(same.values()), "same": same}


def _select_slot_order_check(device):
    """What the token-centric kernels' slot bound (selected.token_group's n_used) rests on: the selection fills a
    token's first min(n, t // l' - doc_start // l' + 1) slots (its candidate blocks) and leaves the rest -1, every
    case. If a future selection left a gap, the token kernels would skip blocks it chose."""
    import torch

    bad = {}
    for case in CASES + DOC_CASES:
        if (x := _sel_inputs(case, device)) is None:
            continue
        idx, lp = x["idx"], x["p"].slc_block
        B, _, T, n = idx.shape
        t = torch.arange(T, device=idx.device)
        ds = torch.zeros(B, T, dtype=torch.long, device=idx.device) if x["doc"] is None else x["doc"].long()
        count = (t // lp - ds // lp + 1).clamp(max=n)  # [B, T]
        want = torch.arange(n, device=idx.device) < count[..., None]  # [B, T, n]
        bad[case[0]] = int(((idx >= 0) != want[:, None]).sum())
    return {"ok": len(bad) == len(CASES) + len(DOC_CASES) - 1 and not any(bad.values()), "bad": bad}


def _sel_tma_check(device):
    """The token-centric selected forward and dQ recompute with K/V through tensor descriptors (selected.py TMA: one
    block per tile, unused slots read at negative rows) against pointer loads, every case, with two blocks per step
    (the pointer form then runs 2-block tiles: another summation order, so a float bound, not the bit), and the
    forward with one block per step, which must match to the bit. Cases whose head dims are not their own power of
    two fall back to pointer loads; at least one case must take the descriptor path, and no launch may fall back for
    any other reason (launch_tma's warning is an error here)."""
    import torch

    from nsa_titan.kernels import selected, selected_bwd, tma

    worst, took, unequal_one_block = {}, 0, []
    with _no_descriptor_fallback():
        for case in CASES + DOC_CASES:
            if (x := _sel_inputs(case, device)) is None:
                continue
            lp = x["p"].slc_block
            took += all(tma.descriptor(*sp) is not None for sp in tma.kv_specs(x["ks"], x["vs"], 16).values())
            outs = []
            for use in (False, True):
                cfg = dict(algo="token", NPI=2, tma=use)
                o, lse = selected.sel_fwd(x["q"], x["ks"], x["vs"], x["idx"], lp, cfg=cfg, doc_start=x["doc"])
                dq = selected_bwd.sel_bwd(x["do"], x["q"], x["ks"], x["vs"], x["o"], x["lse"], x["idx"], lp,
                                          cfg_dq=dict(algo="recompute", NPI=2, tma=use), doc_start=x["doc"])[0]
                fin = torch.isfinite(lse)
                outs.append((o, torch.where(fin, lse, 0.0), fin.float(), dq))
            worst[case[0]] = max(rel_err(a, b) for a, b in zip(*outs))
            # One block per step (the GPU default forward for G 16 at head dim 128, tuned.py): the same tiles and
            # summation order either way, so the outputs must be equal to the bit.
            one = [selected.sel_fwd(x["q"], x["ks"], x["vs"], x["idx"], lp, cfg=dict(algo="token", NPI=1, tma=use),
                                    doc_start=x["doc"]) for use in (False, True)]
            if not all(torch.equal(a, b) for a, b in zip(*one)):
                unequal_one_block.append(case[0])
    bound = {c[0]: 1e-3 if c[8] == "float16" else 1e-5 for c in CASES + DOC_CASES}
    return {"ok": len(worst) == len(CASES) + len(DOC_CASES) - 1 and took > 0 and not unequal_one_block
            and all(w < bound[k] for k, w in worst.items()), "worst": worst, "cases_with_descriptors": took,
            "unequal_one_block": unequal_one_block}


def _sel_tokens_check(device):
    """The token forward for NT = 4 and 8 neighbouring tokens over their blocks' union (selected._sel_fwd_tokens,
    attempt 79; selected.union_walk lists the union one way up to NT 4 and another beyond) against one token per
    program, every case (T not a multiple of NT leaves a last group of fewer tokens; documents; fp16; groups of
    1-16 heads, each token's rows padded so that the tile has >= 16), with pointer loads (NT 4 also with
    descriptors): the same keys per row, the later tokens' blocks in another order, so a float bound. A block chosen
    by a later token only is walked with its rows alone. The descriptor form may not fall back (launch_tma's warning
    is an error here) where the head dims allow it."""
    # (NT 8 with pointer loads only: NT 4 runs the same kernel's descriptor path, and the interpreter is slow)
    runs = {nt: _sel_union_check(device, dict(algo="tokens", NT=nt), descriptors=nt == 4) for nt in (4, 8)}
    mixed = _sel_mix_model_check(device)
    return {"ok": all(r["ok"] for r in runs.values()) and mixed["ok"], **{f"NT{nt}": r for nt, r in runs.items()},
            "model_mix": mixed}


def _sel_mix_model_check(device):
    """The whole attention with the token forward (attempt 84) or the block forward (85) as the selected branch's
    default (a tuned.py entry), so that ops has the gate mix written in their epilogues: against the float64
    reference, and the epilogues ran."""
    from nsa_titan.kernels import selected

    model, calls = {}, []
    fwd = selected.sel_fwd
    selected.sel_fwd = lambda *a, **kw: calls.append(kw.get("mix") is not None) or fwd(*a, **kw)
    try:
        # G 2 with Dk != Dv; G 6 over two KV heads with documents; G 6 block-centric (the merge mixes)
        for case, cfg in ((CASES[1], dict(algo="tokens", NT=4)), (DOC_CASES[1], dict(algo="tokens", NT=4)),
                          (CASES[2], dict(algo="blocks", rows=16, tiles=2))):
            with _tuned_entry("sel_fwd", case, cfg):
                model[case[0] + "_" + cfg["algo"]] = run_case(case, device)
    finally:
        selected.sel_fwd = fwd
    return {"ok": sum(calls) >= len(model) and all(r["ok"] for r in model.values()),
            "worst": {k: r["worst"] for k, r in model.items()}, "mixed_calls": sum(calls)}


def _sel_union_check(device, cfg, descriptors=True):
    import torch

    from nsa_titan.kernels import selected, tma

    worst, ran, cases = {}, 0, 0
    with _no_descriptor_fallback():
        for case in CASES + DOC_CASES:
            if (x := _sel_inputs(case, device)) is None:
                continue
            cases += 1
            lp = x["p"].slc_block
            boxes = all(tma.descriptor(*sp) is not None for sp in tma.kv_specs(x["ks"], x["vs"], 16).values())
            ref = selected.sel_fwd(x["q"], x["ks"], x["vs"], x["idx"], lp, cfg=dict(algo="token", NPI=1),
                                   doc_start=x["doc"])
            for use in (False, True) if boxes and descriptors else (False,):
                o, lse = selected.sel_fwd(x["q"], x["ks"], x["vs"], x["idx"], lp,
                                          cfg=dict(cfg, tma=use), doc_start=x["doc"])
                fin = torch.isfinite(ref[1])
                ran += 1
                worst[case[0], use] = max(rel_err(o, ref[0]), rel_err(torch.where(fin, lse, 0.0),
                                                                      torch.where(fin, ref[1], 0.0)),
                                          float((torch.isfinite(lse) != fin).any()))
                if not use:  # the gate mix in the epilogue (attempt 84): combine_fwd's bits, o and lse unchanged
                    worst[case[0] + "_mix", use] = _mix_gap(selected, x, lp, dict(cfg, tma=use), o, lse)
    bound = {c[0]: 1e-3 if c[8] == "float16" else 1e-5 for c in CASES + DOC_CASES}
    bound.update({c[0] + "_mix": 0.0 for c in CASES + DOC_CASES})
    # every case with inputs ran (all but short_T, whose T has no compressed token), with and without the mix
    return {"ok": cases >= len(CASES) + len(DOC_CASES) - 1 and len({k[0] for k in worst}) == 2 * cases
            and all(w <= bound[k[0]] for k, w in worst.items()),
            "ran": ran, "worst": {f"{k[0]}{'_tma' if k[1] else ''}": w for k, w in worst.items()}}


def _mix_gap(selected, x, lp, cfg, o, lse):
    """sel_fwd with ``mix``: the largest difference of its mixed output from combine_fwd over its own o, and of its
    o and lse from the run without the mix (all exact: one code computes the mix, and the walk is unchanged)."""
    import torch

    from nsa_titan.kernels.combine import combine_fwd

    gen = torch.Generator().manual_seed(3)
    oc, ow = (torch.randn(o.shape, generator=gen).to(o) for _ in range(2))
    gates = torch.rand(*o.shape[:3], 3, generator=gen).to(o.device)
    out = torch.empty_like(o)
    o2, lse2 = selected.sel_fwd(x["q"], x["ks"], x["vs"], x["idx"], lp, cfg=cfg, doc_start=x["doc"],
                                mix=(oc, ow, gates, out))
    same = torch.equal(o2, o) and torch.equal(torch.nan_to_num(lse2, posinf=0.0), torch.nan_to_num(lse, posinf=0.0))
    return float((out - combine_fwd(oc, o2, ow, gates)).abs().max()) + (0.0 if same else 1.0)


# dQ from stored dS through descriptors needs l' >= 16 (a slot's dS rows are one box's width). A group of 16 fills
# the 16-row box exactly (the 1b's and the paper config's shape), a smaller one reads the next slots' rows too
# (qwen7b's G 7); of the cases above only g3_hkv2_lp16 qualifies, so three G 16 cases (one with documents, one with
# free slots and an odd T) join it.
DS_TMA_CASES = [
    ("g16_lp16", 1, 70, 16, 1, 32, 32, (16, 8, 16, 3, 24), "float32"),
    ("doc_g16_lp16", 1, 70, 16, 1, 32, 16, (16, 8, 16, 3, 24), "float32", [[0, 9, 40]]),
    CASES[3],
    # 3 of 6 slots free over 10 blocks: neighbouring tokens choose different blocks (sel_dq_tokens' union)
    ("g16_lp16_free", 1, 161, 16, 1, 32, 32, (16, 8, 16, 6, 24), "float32"),
]


def _sel_dq_ds_tma_check(device):
    """dQ = dS K from the dS the dK/dV walk stored, with K and dS through tensor descriptors (selected_bwd TMA: one
    block and one [G, l'] dS box per MMA) against pointer loads: with one block per step the same tiles and
    summation order, so equal to the bit; with two blocks per step (the pointer form then runs 128-key tiles) a
    float bound. Both cases must take the descriptor path (launch_tma's fallback warning is an error here)."""
    import torch

    from nsa_titan.kernels import selected_bwd, tma

    worst, took, unequal = {}, 0, []
    with _no_descriptor_fallback():
        for case in DS_TMA_CASES:
            x = _sel_inputs(case, device)
            lp = x["p"].slc_block
            took += tma.descriptor(x["ks"], list(x["ks"].shape), list(x["ks"].stride()),
                                   [1, lp, 1, x["ks"].shape[-1]]) is not None
            dq = {}
            for npi in (1, 2):
                for use in (False, True):
                    dq[npi, use] = selected_bwd.sel_bwd(x["do"], x["q"], x["ks"], x["vs"], x["o"], x["lse"], x["idx"],
                                                        lp, cfg_dq=dict(algo="ds", NPI=npi, tma=use),
                                                        doc_start=x["doc"])[0]
            if not torch.equal(dq[1, False], dq[1, True]):
                unequal.append(case[0])
            worst[case[0]] = rel_err(dq[2, True], dq[2, False])
    return {"ok": took == len(DS_TMA_CASES) and not unequal and all(w < 1e-5 for w in worst.values()),
            "worst": worst, "cases_with_descriptors": took, "unequal_one_block": unequal}


def _sel_dq_tokens_check(device):
    """dQ for four neighbouring tokens as one tile (selected_dq, attempt 80: _sel_bwd_dq_ds_tokens from the stored
    dS, _sel_bwd_dq_tokens recomputed) against one token per program from the stored dS (the paths agree to 1e-5 in
    fp32: sel_bwd_paths), every case whose groups of four chose different blocks (T not a multiple of 4; documents;
    fp16), pointer loads, and K (and V) through descriptors in the G 16 case with free slots: each token's blocks
    summed in another order, so a float bound."""
    from nsa_titan.kernels import selected_bwd

    def groups_differ(idx):  # some group of 4 tokens chose different blocks: the union code runs
        t = idx.shape[2] - idx.shape[2] % 4
        g = idx[:, :, :t].sort(-1).values.unflatten(2, (t // 4, 4))
        return bool((g != g[:, :, :, :1]).any())

    worst, skipped = {}, []
    with _no_descriptor_fallback():
        for case in CASES + DOC_CASES + DS_TMA_CASES[-1:]:
            if (x := _sel_inputs(case, device)) is None:
                continue
            if not groups_differ(x["idx"]):
                skipped.append(case[0])
                continue
            lp = x["p"].slc_block
            ref = selected_bwd.sel_bwd(x["do"], x["q"], x["ks"], x["vs"], x["o"], x["lse"], x["idx"], lp,
                                       cfg_dq=dict(algo="ds", NPI=1, tma=False, NT=1),
                                       doc_start=x["doc"])[0]
            for algo in ("ds", "recompute"):
                for use in (False, True) if case in DS_TMA_CASES else (False,):
                    got = selected_bwd.sel_bwd(x["do"], x["q"], x["ks"], x["vs"], x["o"], x["lse"], x["idx"], lp,
                                               cfg_dq=dict(algo=algo, NT=4, tma=use), doc_start=x["doc"])[0]
                    worst[case[0], algo, use] = rel_err(got, ref)
    bound = {c[0]: 1e-3 if c[8] == "float16" else 1e-5 for c in CASES + DOC_CASES + DS_TMA_CASES}
    ran = {(algo, use) for _, algo, use in worst}
    return {"ok": len({k[0] for k in worst}) >= 6 and len(ran) == 4 and all(w < bound[k[0]] for k, w in worst.items()),
            "skipped": skipped, "worst": {f"{k[0]}_{k[1]}{'_tma' if k[2] else ''}": w for k, w in worst.items()}}


def _sel_bwd_paths_check(device):
    """The selected branch's backward by its paths against each other, every case: dQ recomputed per token with
    one dK/dV chunk per block (direct stores only) vs dQ = dS K from the stored dS with blocks cut into chunks of
    one query tile (partials added by the reduce kernel) vs dQ summed from per-(token, slot) partials that the
    dK/dV walk stores (fp32, and in the inputs' dtype), the last one with the pair keys the block-centric
    forward sorted; and the walk with its mask-free steps (mask_split) for the partials and the dS paths. The
    whole-attention cases above run the default path only (on the interpreter: dS, two tiles per chunk)."""
    from nsa_titan.kernels import selected_bwd

    worst = {}
    variants = [(dict(algo="recompute"), dict(chunk_tiles=1 << 20), False),
                (dict(algo="ds"), dict(chunk_tiles=1, exact_rows=False), False),  # heads padded to pow2(G) rows
                (dict(algo="partials"), dict(chunk_tiles=1), False),
                (dict(algo="partials", partial_bits=16), dict(chunk_tiles=2), True),
                # The walk's steps past a block's own tokens without the causal mask (cases with l' = 16: the
                # split needs l' to fill the key tile); chunks of one tile cut the own tokens over several chunks.
                (dict(algo="partials"), dict(chunk_tiles=1, mask_split=True), False),
                (dict(algo="ds"), dict(chunk_tiles=4, mask_split=True), True)]
    for case in CASES + DOC_CASES:
        if (x := _sel_inputs(case, device)) is None:
            continue
        outs = [selected_bwd.sel_bwd(x["do"], x["q"], x["ks"], x["vs"], x["o"], x["lse"], x["idx"], x["p"].slc_block,
                                     cfg_dq=a, cfg_dkdv=b, doc_start=x["doc"], keys=x["keys"] if reuse else None)
                for a, b, reuse in variants]
        worst[case[0]] = max(rel_err(y, z) for other in outs[1:] for y, z in zip(other, outs[0]))
    # fp16 inputs: the fp16 dQ partials round once more than the other paths (1e-3 relative is 2 fp16 ulps).
    bound = {c[0]: 1e-3 if c[8] == "float16" else 1e-5 for c in CASES + DOC_CASES}
    return {"ok": len(worst) == len(CASES) + len(DOC_CASES) - 1 and all(w < bound[k] for k, w in worst.items()),
            "worst": worst}


def _dout_backward_check(device):
    """nsa_bwd runs every branch backward on dOut with the branch's LSE lowered by log2(g_i) and delta_i = dg_i
    (combine.combine_bwd) instead of on a stored dO_i = g_i * dOut. The kernels' results both ways: the band
    kernels in the compressed geometry with documents and the window geometry, the selected branch on two cases
    (its default dQ path and dQ recomputed), with some gates exactly 0 (log2 = -inf: the row's gradient must be 0,
    not NaN) and 1. The whole-attention cases above run the new way end to end against float64."""
    import torch

    from nsa_titan.kernels import band, band_bwd, combine, selected_bwd

    worst, gen = {}, torch.Generator().manual_seed(5)

    def both(bwd, dout, o, lse, gates, col, **kw):
        do_i = dout * gates[..., col:col + 1]
        want = bwd(do_i, o, lse, delta=(do_i * o).sum(-1), **kw)
        z = torch.zeros_like(o)
        _, delta, lse_g = combine.combine_bwd(dout, *[o if i == col else z for i in range(3)], gates,
                                              [lse if i == col else lse * 0 for i in range(3)])
        got = bwd(dout, o, lse_g[col], delta=delta[col], **kw)
        return max(rel_err(a, b) for a, b in zip(got, want)), all(bool(torch.isfinite(x).all()) for x in got)

    B, T, HQ, HKV, D = 1, 100, 6, 2, 16
    doc = doc_starts([[0, 37, 70]], T).to(device=device, dtype=torch.int32)
    finite = True
    for name, (kstride, koff, win, ds) in {"band_cmp_doc": (4, 7, 0, doc), "band_win": (1, 0, 40, None)}.items():
        S = T if kstride == 1 else (T - koff - 1) // kstride + 1
        q, k, v, dout = (torch.randn(*s, generator=gen).to(device) for s in
                         [(B, T, HQ, D), (B, S, HKV, D), (B, S, HKV, D), (B, T, HQ, D)])
        gates = torch.rand(B, T, HQ, 3, generator=gen).to(device)
        gates[0, ::7, 0, :] = 0.0  # underflowed sigmoid
        gates[0, 3::7, 1, :] = 1.0
        o, lse = band.band_fwd(q, k, v, kstride, koff, win, doc_start=ds)
        worst[name], ok = both(
            lambda do, o, lse, **kw: band_bwd.band_bwd(do, q, k, v, o, lse, kstride, koff, win, **kw),
            dout, o, lse, gates, 2, doc_start=ds)
        finite &= ok
    for case in [c for c in CASES + DOC_CASES if c[0] in ("g16_l_eq_lp", "doc_g6")]:
        x = _sel_inputs(case, device)
        gates = torch.rand(*x["do"].shape[:-1], 3, generator=gen).to(device)
        gates[..., ::5, :, :] = 0.0
        for dq_path in (None, dict(algo="recompute")):
            w, ok = both(lambda do, o, lse, **kw: selected_bwd.sel_bwd(do, x["q"], x["ks"], x["vs"], o, lse, x["idx"],
                                                                      x["p"].slc_block, cfg_dq=dq_path, **kw),  # noqa: B023
                         x["do"], x["o"], x["lse"], gates, 1, doc_start=x["doc"])
            worst[f"{case[0]}_{'recompute' if dq_path else 'default'}"] = w
            finite &= ok
    return {"ok": len(worst) == 6 and finite and max(worst.values()) < 1e-5, "worst": worst, "finite": finite}


def _pair_table_check(device):
    """The selected branch's pair tables (one Triton kernel for the keys, torch.sort, one Triton kernel for the
    block offsets, chunk offsets and partial-slot offsets, one for the programs' blocks) against their torch spec, on
    random selections with unused slots: one block, a few, many; chunks of 1, 3, 16 and 64 pairs (16: some
    blocks of exactly two chunks)."""
    import torch

    from nsa_titan.kernels.selected_blocks import block_pairs, block_pairs_reference

    bad = []
    for B, HKV, T, n, nb, seed in ((1, 1, 5, 3, 1, 0), (2, 2, 37, 4, 5, 1), (1, 2, 300, 5, 40, 2)):
        gen = torch.Generator().manual_seed(seed)
        idx = torch.randint(-1, nb, (B, HKV, T, n), generator=gen).to(device)
        for bt in (1, 3, 16, 64):
            got = block_pairs(idx, nb, bt)
            want = block_pairs_reference(idx, nb, bt)
            names = ("keys", "off", "coff", "poff", "prog")
            bad += [f"{T}/{bt}/{k}" for k, a, b in zip(names, got, want) if not torch.equal(a.long(), b.long())]
    return {"ok": not bad, "mismatch": bad}


def _pair_sort_check(device):
    """The counting sort of the pair keys (pair_sort.py, attempt 86) against torch.sort's, bit for bit: random
    selections with unused slots (one block, a few, many) with one chunk per row and with 16-pair chunks (several
    per row, T*n not a multiple of them), the selected cases' own selections, and the whole attention with the
    counting sort as the default (G 6 block-centric, whose forward sorts; G 2, whose backward does) against
    float64."""
    import torch

    from nsa_titan.kernels import pair_sort
    from nsa_titan.kernels.selected_blocks import sorted_pair_keys

    bad, sels = [], []
    for B, HKV, T, n, nb, seed in ((1, 1, 5, 3, 1, 0), (2, 2, 37, 4, 5, 1), (1, 2, 300, 5, 40, 2)):
        gen = torch.Generator().manual_seed(seed)
        sels.append((f"rand{T}", torch.randint(-1, nb, (B, HKV, T, n), generator=gen).to(device), nb))
    for case in CASES + DOC_CASES:
        if (x := _sel_inputs(case, device)) is not None:
            sels.append((case[0], x["idx"], -(-case[2] // x["p"].slc_block)))
    chunk = pair_sort.CHUNK
    try:
        for ch in (chunk, 16):
            pair_sort.CHUNK = ch
            bad += [f"{name}/{ch}" for name, idx, nb in sels
                    if not torch.equal(sorted_pair_keys(idx, nb, "counting"), sorted_pair_keys(idx, nb, "radix"))]
    finally:
        pair_sort.CHUNK = chunk
    method, model = pair_sort.METHOD, {}
    pair_sort.METHOD = "counting"
    try:
        for case, cfg in ((CASES[2], dict(algo="blocks", rows=16, tiles=2)), (CASES[1], None)):
            with _tuned_entry("sel_fwd", case, cfg):
                model[case[0]] = run_case(case, device)
    finally:
        pair_sort.METHOD = method
    return {"ok": not bad and len(sels) >= 3 + len(CASES) + len(DOC_CASES) - 1 and all(r["ok"] for r in model.values()),
            "mismatch": bad, "selections": len(sels), "model": {k: r["worst"] for k, r in model.items()}}


def _naive_band(q, k, v, do, kstride, koff, win, ds):
    """Float64 band attention by its definition (band.py's module doc) -> (o, dq, dk, dv); rows that see no key
    give 0."""
    import torch

    q, k, v = (x.double().requires_grad_(True) for x in (q, k, v))
    G = q.shape[2] // k.shape[2]
    t = torch.arange(q.shape[1])[:, None]
    i = torch.arange(k.shape[1])[None, :]
    vis = i * kstride + koff <= t
    if win:
        vis = vis & (i * kstride + koff > t - win)
    vis = vis[None, None] if ds is None else vis[None, None] & (i * kstride >= ds.cpu()[:, None, :, None])
    kk, vv = (x.repeat_interleave(G, 2).transpose(1, 2) for x in (k, v))
    s = (q.transpose(1, 2) @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~vis, float("-inf"))
    p = torch.where(vis.any(-1, keepdim=True), s.softmax(-1), 0.0)
    o = (p @ vv).transpose(1, 2)
    return (o, *torch.autograd.grad(o, (q, k, v), do.double()))


def _band_split_check(device):
    """The band kernels' mask-free interior tiles (band.py SPLIT) against the all-masked loop, and the dK/dV with the
    keys as MMA rows (band_bwd KT) against the default orientation: forward, dQ and dK/dV of the compressed and the
    window geometry, two KV heads of G = 3 (tiles of 16 rows hold 5 1/3 tokens: a token's heads straddle two tiles)
    and with documents. Tiles of 16 keys over T = 100 give every loop masked and unmasked parts (the whole-attention
    cases above use tiles of 64 keys, where the interior part is mostly empty). The interior tiles are those whose
    mask is all true, and the transposed scores are the same sums, so all paths must agree to the bit; any tolerance
    only covers a future reordering. All are also held to a float64 band attention (``naive``)."""
    import torch

    from nsa_titan.kernels import band, band_bwd

    worst, naive = {}, 0.0
    B, T, HQ, HKV, D = 1, 100, 6, 2, 16
    doc = doc_starts([[0, 37, 70]], T).to(device=device, dtype=torch.int32)
    for name, (kstride, koff, win, ds) in {"cmp": (4, 7, 0, None), "win": (1, 0, 40, None),
                                          "win_doc": (1, 0, 40, doc), "cmp_doc": (4, 7, 0, doc)}.items():
        gen = torch.Generator().manual_seed(3)
        S = T if kstride == 1 else (T - koff - 1) // kstride + 1
        q, k, v, do = (torch.randn(*s, generator=gen).to(device) for s in
                       [(B, T, HQ, D), (B, S, HKV, D), (B, S, HKV, D), (B, T, HQ, D)])
        outs, want = [], _naive_band(q.cpu(), k.cpu(), v.cpu(), do.cpu(), kstride, koff, win, ds)
        # The third: dK/dV with the keys as the MMA rows (band_bwd KT: the same sums, transposed).
        for split, keys_rows in ((False, False), (True, False), (True, True)):
            cfg = dict(rows=16, BK=16, num_warps=4, num_stages=1, split=split)
            o, lse = band.band_fwd(q, k, v, kstride, koff, win, cfg=cfg, doc_start=ds)
            grads = band_bwd.band_bwd(do, q, k, v, o, lse, kstride, koff, win, cfg_dq=cfg,
                                      cfg_dkdv=dict(cfg, keys_rows=keys_rows), doc_start=ds)
            fin = torch.isfinite(lse)
            outs.append([o, torch.where(fin, lse, 0.0), fin.float(), *grads])
            naive = max(naive, *(rel_err(a.cpu().double(), b) for a, b in zip([o, *grads], want)))
        worst[name] = max(rel_err(a, b) for other in outs[1:] for a, b in zip(outs[0], other))
    # The interpreter runs both loop bodies op for op: equal to the bit (1e-5 leaves room for a reordering). On
    # a GPU the fp32 dots run as tf32 and the two bodies compile to different instruction orders (3e-5 to 7e-5
    # seen on an H100): the fp32 bound of the cases above.
    return {"ok": max(worst.values()) < (1e-5 if device == "cpu" else TOL["float32"]) and naive < TOL["float32"],
            "worst": worst, "naive": naive}



def _band_tma_check(device):
    """The band kernels with tiles loaded through tensor descriptors (band.py TMA: K/V in the forward and dQ, Q/dO in
    dK/dV with one KV head) against pointer loads: the compressed and the window geometry, with and without
    documents, batch 2 (tiles past the end of the first batch must read zeros, not the second batch), K/V as strided
    slices of one wider tensor (as the model's fused K/V projection makes them), a prefix call (n_queries, keys
    k[:, :p]: a batch stride that is not S rows), and G = 3 with one KV head (16-row tiles hold 5 1/3 tokens). Masked
    rows and keys are hidden by the mask or by LSE = +inf either way, so both must agree to the bit on the
    interpreter; both are also held to a float64 band attention. Head dim 24 (not its own power of two) must fall
    back to pointer loads."""
    import torch

    from nsa_titan.kernels import band, band_bwd, tma

    with _no_descriptor_fallback():
        worst, naive, took = {}, 0.0, True
        B, T, D = 2, 100, 16
        doc = doc_starts([[0, 37, 70], [0, 50, 51]], T).to(device=device, dtype=torch.int32)
        for name, (HQ, HKV, kstride, koff, win, ds, nq) in {
                "cmp": (6, 2, 4, 7, 0, None, None), "win": (6, 2, 1, 0, 40, None, None),
                "win_doc": (6, 2, 1, 0, 40, doc, None), "cmp_doc": (6, 2, 4, 7, 0, doc, None),
                "prefix": (6, 2, 1, 0, 0, None, 45), "cmp_1kv": (3, 1, 4, 7, 0, None, None),
                "win_1kv_doc": (3, 1, 1, 0, 40, doc, None)}.items():
            gen = torch.Generator().manual_seed(5)
            S = T if kstride == 1 else (T - koff - 1) // kstride + 1
            q, do = (torch.randn(B, T, HQ, D, generator=gen).to(device) for _ in range(2))
            kv = torch.randn(B, S, 3 * HKV, D, generator=gen).to(device)  # k, v: strided slices, as from one projection
            k, v = kv[:, :, HKV:2 * HKV], kv[:, :, 2 * HKV:]
            if nq is not None:
                k, v = k[:, :nq], v[:, :nq]
            specs = [tma.kv_specs(k, v, 16)] + ([band_bwd._rows_specs(q, do, 16, HKV)] if HKV == 1 else [])
            took = took and all(tma.descriptor(*s) is not None for sp in specs for s in sp.values()) and all(specs)
            took = took and (HKV == 1 or band_bwd._rows_specs(q, do, 16, HKV) == {})  # dK/dV rows: one KV head only
            outs = []
            for use in (False, True):
                cfg = dict(rows=16, BK=16, num_warps=4, num_stages=1, tma=use)
                o, lse = band.band_fwd(q, k, v, kstride, koff, win, cfg=cfg, doc_start=ds, n_queries=nq)
                dq, dk, dv = band_bwd.band_bwd(do, q, k, v, o, lse, kstride, koff, win, cfg_dq=cfg, cfg_dkdv=cfg,
                                           doc_start=ds, n_queries=nq)
                rows = slice(None) if nq is None else slice(0, nq)
                o, lse, dq = o[:, rows], lse[:, rows], dq[:, rows]
                fin = torch.isfinite(lse)
                outs.append([o, torch.where(fin, lse, 0.0), fin.float(), dq, dk, dv])
                want = _naive_band(q[:, rows].cpu(), k.cpu(), v.cpu(), do[:, rows].cpu(), kstride, koff, win,
                                   None if ds is None else ds[:, rows])
                naive = max(naive, *(rel_err(a.cpu().double(), b) for a, b in zip((o, dq, dk, dv), want)))
            worst[name] = max(rel_err(a, b) for a, b in zip(*outs))
    odd = torch.randn(1, 8, 1, 24, device=device)
    fallback = all(tma.descriptor(*s) is None for s in tma.kv_specs(odd, odd, 16).values())
    return {"ok": took and fallback and max(worst.values()) < (1e-5 if device == "cpu" else TOL["float32"])
            and naive < TOL["float32"], "worst": worst, "naive": naive, "took_tma": took, "fallback_d24": fallback}


def _band_dq2_check(device):
    """The window's and the compressed branch's dQ in one launch (band_bwd.band_dq2, attempt 82) against the two
    band_bwd dQ calls the model's backward makes otherwise, both adding into a dQ that holds another branch's part:
    pointer loads and descriptors, G = 3 over two KV heads and over one, batch 2, with documents. Against float64:
    the given dQ plus each branch's float64 band-attention dQ (``_naive_band``). Dropping either branch, or the
    dQ already there, fails it by O(1)."""
    import torch

    from nsa_titan.kernels import band, band_bwd, combine

    worst, naive = {}, 0.0
    B, T, D, win, (kstride, koff) = 2, 100, 16, 40, (4, 7)
    doc = doc_starts([[0, 37, 70], [0, 50, 51]], T).to(device=device, dtype=torch.int32)
    for name, (HQ, HKV, ds, use) in {"g3_hkv2": (6, 2, None, False), "g3_hkv2_tma": (6, 2, None, True),
                                     "g3_doc_tma": (3, 1, doc, True), "g3_doc": (3, 1, doc, False)}.items():
        gen = torch.Generator().manual_seed(7)
        S = (T - koff - 1) // kstride + 1
        q, do, base = (torch.randn(B, T, HQ, D, generator=gen).to(device) for _ in range(3))
        kw, vw = (torch.randn(B, T, HKV, D, generator=gen).to(device) for _ in range(2))
        kc, vc = (torch.randn(B, S, HKV, D, generator=gen).to(device) for _ in range(2))
        cfg = dict(rows=16, BK=16, num_warps=4, num_stages=1, tma=use)
        o_w, lse_w = band.band_fwd(q, kw, vw, 1, 0, win, cfg=cfg, doc_start=ds)
        o_c, lse_c = band.band_fwd(q, kc, vc, kstride, koff, 0, cfg=cfg, doc_start=ds)
        d_w, d_c = combine.rowdot(do, o_w), combine.rowdot(do, o_c)
        two = base.clone()
        band_bwd.band_bwd(do, q, kw, vw, o_w, lse_w, 1, 0, win, cfg_dq=cfg, delta=d_w, dq_acc=two, doc_start=ds,
                          parts="dq")
        band_bwd.band_bwd(do, q, kc, vc, o_c, lse_c, kstride, koff, 0, cfg_dq=cfg, delta=d_c, dq_acc=two,
                          doc_start=ds, parts="dq")
        one = band_bwd.band_dq2(do, q, (kw, vw, lse_w, d_w, 1, 0, win), (kc, vc, lse_c, d_c, kstride, koff, 0),
                                base.clone(), doc_start=ds, cfg=cfg)
        worst[name] = rel_err(one, two)
        want = base.cpu().double()
        for k, v, geo in ((kw, vw, (1, 0, win)), (kc, vc, (kstride, koff, 0))):
            want = want + _naive_band(q.cpu(), k.cpu(), v.cpu(), do.cpu(), *geo, ds)[1]
        naive = max(naive, rel_err(one.cpu().double(), want))
    # The model's backward with it switched on (a tuned.py entry): whole attention against the float64 reference.
    model, calls = {}, []
    fused = band_bwd.band_dq2
    band_bwd.band_dq2 = lambda *a, **kw: calls.append(1) or fused(*a, **kw)
    try:
        for case in (CASES[1], DOC_CASES[1]):  # G 2 with Dk != Dv; G 6 over two KV heads with documents
            with _tuned_entry("band_dq2", case, dict(rows=16, BK=16, num_warps=4, num_stages=1)):
                model[case[0]] = run_case(case, device)
    finally:
        band_bwd.band_dq2 = fused
    # fp32 on both paths; the fused one adds the two branches before the given dQ (one rounding fewer)
    return {"ok": max(worst.values()) < (1e-5 if device == "cpu" else TOL["float32"]) and naive < TOL["float32"]
            and len(calls) >= len(model) and all(r["ok"] for r in model.values()),
            "worst": worst, "naive": naive, "model": {k: r["worst"] for k, r in model.items()},
            "fused_calls": len(calls)}


def _decode_fused_check(device):
    """The fused decode kernel (kernels/decode.py): a tiny NSA model decoded token by token through it gives the
    logits of a full forward. The model's attention weights are sharpened (tests/test_decode.py) so that a wrong
    block choice shows in the logits. Three models, 100 tokens, batch 2 (two rows of the caches' [B, HKV] stride):
    every step from an empty cache (G 2, two KV heads: no compressed token yet, fewer past blocks than n, the window
    ring filling, then wrapping, one compressed tile, then two from t = 71 on); after a prompt that ends mid-block
    (G 6, one KV head: 69 = 37 + 2 blocks, the phase of test_decode's 37 in both the selection blocks and the
    compression stride); after one that ends on a block edge (80, as 64), shared K/V with mean compression, two
    layers (each layer its own caches and workspace). On the interpreter the first two models have one layer and
    the prompts are prefilled (the kernel costs ~0.1 s per step and layer there); on CUDA every model has two
    layers and starts from an empty cache, and the reference is the torch decode path (fused=False, itself tested
    against a full forward); the kernel's fp32 dots are full precision there (no tf32), so the bound is the same."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from nsa_titan.models.nsa.decode import KVCache, decode_step, prefill
    from test_decode import tiny_model  # noqa: PLC0415 - tests/ is on the path only in this child

    worst = 0.0
    for n_prefill, layers, kw in [(0, 1, {"slc_top_n": 4}), (69, 1, {"slc_top_n": 5, "n_heads": 6, "n_kv_heads": 1}),
                                  (80, 2, {"slc_top_n": 4, "shared_kv": True, "compress": "mean"})]:
        model = tiny_model(n_layers=layers if device == "cpu" else 2, **kw).to(device)
        tokens = torch.randint(0, 260, (2, 100), generator=torch.Generator().manual_seed(1)).to(device)
        n_prefill = n_prefill if device == "cpu" else 0
        logits = {}
        for fused in (True, False) if device != "cpu" else (True,):
            cache = KVCache(model, 2, 100, fused=fused)
            assert all((layer.fused is not None) == fused for layer in cache.layers)
            out = [prefill(model, tokens[:, :n_prefill], cache)] if n_prefill else []
            out += [decode_step(model, cache, tokens[:, t: t + 1])[:, None] for t in range(n_prefill, 100)]
            logits[fused] = torch.cat(out, 1)
        with torch.no_grad():
            want = model(tokens) if device == "cpu" else logits[False]
            worst = max(worst, float((logits[True] - want).abs().max()))
    return {"ok": worst < 1e-4, "worst": worst}


# The named checks in the order the child runs them: (verdict name, function of the device).
CHECKS = (("compile_fullgraph", _compile_check), ("no_aux_grads", _aux_grads_check), ("dq_buffer", _dq_buffer_check),
          ("sel_blocks", _blocks_fwd_check),
          ("sel_bwd_paths", _sel_bwd_paths_check), ("sel_tma", _sel_tma_check), ("sel_tokens", _sel_tokens_check),
          ("sel_dq_ds_tma", _sel_dq_ds_tma_check), ("sel_dq_tokens", _sel_dq_tokens_check),
          ("select_merge", _select_merge_check),
          ("select_tma", _select_tma_check), ("select_heads_on_registers", _select_heads_on_registers_check),
          ("select_slot_order", _select_slot_order_check), ("dout_backward", _dout_backward_check),
          ("pair_table", _pair_table_check), ("band_split", _band_split_check), ("band_tma", _band_tma_check),
          ("band_dq2", _band_dq2_check), ("decode_fused", _decode_fused_check), ("pair_sort", _pair_sort_check))
