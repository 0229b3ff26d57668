"""tests/test_kernels.py's checks of the selected branch's backward paths (dQ from stored dS, recomputed, by
neighbouring tokens; dK/dV) and of the attention's backward with a non-contiguous gradient."""

from __future__ import annotations

from _kernel_cases import (
    CASES,
    DOC_CASES,
    _no_descriptor_fallback,
    _sel_inputs,
    doc_starts,
    rel_err,
    sel_dq,
)

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

    from nsa_titan.kernels import tma

    worst, took, unequal = {}, 0, []
    with _no_descriptor_fallback():
        for case in DS_TMA_CASES:
            x = _sel_inputs(case, device)
            lp = x["p"].slc_block
            took += tma.descriptor(x["ks"], list(x["ks"].shape), list(x["ks"].stride()),
                                   [1, lp, 1, x["ks"].shape[-1]]) is not None
            dq = {(npi, use): sel_dq(x, dict(algo="ds", NPI=npi, tma=use)) for npi in (1, 2) for use in (False, True)}
            if not torch.equal(dq[1, False], dq[1, True]):
                unequal.append(case[0])
            worst[case[0]] = rel_err(dq[2, True], dq[2, False])
    return {"ok": took == len(DS_TMA_CASES) and not unequal and all(w < 1e-5 for w in worst.values()),
            "worst": worst, "cases_with_descriptors": took, "unequal_one_block": unequal}


def _sel_dq_tokens_check(device):
    """dQ for four neighbouring tokens as one tile (selected_dq, attempt 80: _sel_bwd_dq_ds_tokens from the stored
    dS, _sel_bwd_dq_tokens recomputed) and of eight both ways, against one token per program from the stored
    dS (the paths agree to 1e-5 in fp32: sel_bwd_paths), every case whose groups of four chose different blocks (T
    not a multiple of 4; documents; fp16), pointer loads, and K (and V) through descriptors in the G 16 case with
    free slots: each token's blocks summed in another order, so a float bound."""

    def groups_differ(idx):  # some group of 4 tokens chose different blocks: the union code runs
        t = idx.shape[2] - idx.shape[2] % 4
        g = idx[:, :, :t].sort(-1).values.unflatten(2, (t // 4, 4))
        return bool((g != g[:, :, :, :1]).any())

    import torch

    worst, skipped, chunked = {}, [], {}
    with _no_descriptor_fallback():
        for case in CASES + DOC_CASES + DS_TMA_CASES[-1:]:
            if (x := _sel_inputs(case, device)) is None:
                continue
            if not groups_differ(x["idx"]):
                skipped.append(case[0])
                continue
            ref = sel_dq(x, dict(algo="ds", NPI=1, tma=False, NT=1))
            # NT 8: groups of <= 8 heads (qwen7b's G 7) fill 64 MMA rows with eight tokens
            for algo, nt in (("ds", 4), ("recompute", 4), ("ds", 8), ("recompute", 8)):
                for use in (False, True) if case in DS_TMA_CASES else (False,):
                    got = sel_dq(x, dict(algo=algo, NT=nt, tma=use))
                    worst[case[0], algo, nt, use] = rel_err(got, ref)
                    if algo == "ds" and nt == 4 and x["q"].shape[0] * x["ks"].shape[2] > 1:
                        # dS stored one (batch, KV head) at a time (attempt 111): the same dS, the same dQ bits
                        chunked[case[0]] = torch.equal(sel_dq(x, dict(algo=algo, NT=nt, tma=use, ds_chunk=1)), got)
    bound = {c[0]: 1e-3 if c[8] == "float16" else 1e-5 for c in CASES + DOC_CASES + DS_TMA_CASES}
    ran = {(algo, nt, use) for _, algo, nt, use in worst}
    return {"ok": len({k[0] for k in worst}) >= 6 and len(ran) == 8 and all(w < bound[k[0]] for k, w in worst.items())
            and len(chunked) >= 4 and all(chunked.values()), "chunked_equal": chunked,
            "skipped": skipped,
            "worst": {f"{k[0]}_{k[1]}_nt{k[2]}{'_tma' if k[3] else ''}": w for k, w in worst.items()}}


def _sel_bwd_paths_check(device):
    """The selected branch's backward by its paths against each other, every case: dQ recomputed per token with
    one dK/dV chunk per block (direct stores only) vs dQ = dS K from the stored dS with blocks cut into chunks of
    one query tile (partials added by the reduce kernel) vs dQ summed from per-(token, slot) partials that the
    dK/dV walk stores (fp32, and in the inputs' dtype), the last one with the pair keys the block-centric
    forward sorted; the walk with its mask-free steps (mask_split) and with 64-bit row arithmetic (i32_rows off;
    on by default) for the partials and the dS paths; and its chunks in token order (order="tokens"). The
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
                (dict(algo="ds"), dict(chunk_tiles=4, mask_split=True), True),
                # The walk's row arithmetic in 64 bits (i32_rows off) against the default 32 bits from each batch's
                # bases (the b2 cases check the bases, the document cases DS's), for the partials and the dS buffers.
                (dict(algo="partials", partial_bits=16), dict(chunk_tiles=1, i32_rows=False), False),
                (dict(algo="ds"), dict(chunk_tiles=2, i32_rows=False, mask_split=True), True),
                # The walk's chunks in token order (attempt 114): with the dS stored one (batch, KV head) pair at a
                # time (each launch then adds its own partials), and with the dQ partials and mask-free steps.
                (dict(algo="ds", ds_chunk=1), dict(chunk_tiles=1, order="tokens"), False),
                (dict(algo="partials"), dict(chunk_tiles=2, order="tokens", mask_split=True), True)]
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
