"""tests/test_kernels.py's checks of the selection and the selected branch's forward (token- and block-centric,
the gate mix in their epilogues) and of the pair tables and sort the block-centric kernels walk."""

from __future__ import annotations

from _kernel_cases import (
    CASES,
    DOC_CASES,
    TOL,
    _no_descriptor_fallback,
    _sel_inputs,
    _tuned_entry,
    fake_outputs_match,
    rel_err,
    run_case,
    sel_dq,
)


def _blocks_fwd_check(device):
    """The block-centric selected forward (selected_blocks.py) against the token-centric one, every case: one tile
    of 32 rows per program, and three tiles of 16 rows (the loop over a program's tiles, its last chunk of a
    block part-full), that one also with 64-bit row arithmetic (i32_rows off; on by default), which must give the
    same bits."""
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
        # 64-bit row arithmetic (i32_rows off) against the default 32 bits from each batch's bases: the same
        # addresses, so the same bits
        i64 = selected.sel_fwd(x["q"], x["ks"], x["vs"], x["idx"], x["p"].slc_block,
                               cfg=dict(tiled_cfg, i32_rows=False), doc_start=x["doc"])
        if not (torch.equal(i64[0], tiled[0]) and torch.equal(i64[1], tiled[1])):
            w = float("inf")
        worst[case[0]] = w
        # the gate mix in the merge's epilogue (attempt 85): combine_fwd's bits, o and lse unchanged
        mixed[case[0]] = _mix_gap(selected, x, x["p"].slc_block, tiled_cfg, *tiled)
    return {"ok": len(worst) == len(CASES) + len(DOC_CASES) - 1 and max(worst.values()) < float("inf")
            and max(mixed.values()) == 0.0, "worst": worst, "mix": mixed}


# A whole-attention case whose selected forward runs block-centric under a tuned entry: T past 2 n l' (no causal
# prefix), G 3 over two KV heads.
FAKE_CASE = ("fake_g3", 1, 192, 6, 2, 16, 16, (16, 8, 16, 4, 24), "float32")


def _fwd_fake_check(device):
    """nsa_fwd's fake implementation (the output shapes and dtypes a compiled model plans its buffers with) against
    the real op, with the selected forward token-centric (no keys handed on) and block-centric (its sorted keys
    handed on): a mismatch fails only inside a compiled model (inductor's assert_size_stride), as attempt 92's
    chunked forward did on its first GPU run."""
    res = {"token": fake_outputs_match(FAKE_CASE, device)}
    with _tuned_entry("sel_fwd", FAKE_CASE, dict(algo="blocks", rows=16, tiles=2)):
        res["blocks"] = fake_outputs_match(FAKE_CASE, device)
    return {"ok": all(r["ok"] for r in res.values()) and res["token"]["real_keys"] == (0,)
            and res["blocks"]["real_keys"] != (0,), **res}


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
    (the pointer form then runs 2-block tiles: another summation order, so a float bound, not the bit; cases with
    descriptors), and the forward with one block per step, which must match to the bit (every case). Cases whose
    head dims are not their own power of two fall back to pointer loads; at least one case must take the descriptor
    path, and no launch may fall back for any other reason (launch_tma's warning is an error here)."""
    import torch

    from nsa_titan.kernels import selected, tma

    worst, took, cases, unequal_one_block = {}, 0, 0, []
    with _no_descriptor_fallback():
        for case in CASES + DOC_CASES:
            if (x := _sel_inputs(case, device)) is None:
                continue
            lp = x["p"].slc_block
            boxes = all(tma.descriptor(*sp) is not None for sp in tma.kv_specs(x["ks"], x["vs"], 16).values())
            took += boxes
            cases += 1
            outs = []
            # Without descriptors (head dim 48) tma=True runs the pointer loads again: the one-block forward below
            # shows that fallback (to the bit); the two-block runs would only repeat the pointer form.
            for use in (False, True) if boxes else ():
                cfg = dict(algo="token", NPI=2, tma=use)
                o, lse = selected.sel_fwd(x["q"], x["ks"], x["vs"], x["idx"], lp, cfg=cfg, doc_start=x["doc"])
                dq = sel_dq(x, dict(algo="recompute", NPI=2, tma=use))
                fin = torch.isfinite(lse)
                outs.append((o, torch.where(fin, lse, 0.0), fin.float(), dq))
            if outs:
                worst[case[0]] = max(rel_err(a, b) for a, b in zip(*outs))
            # One block per step (the GPU default forward for G 16 at head dim 128, tuned.py): the same tiles and
            # summation order either way, so the outputs must be equal to the bit.
            one = [selected.sel_fwd(x["q"], x["ks"], x["vs"], x["idx"], lp, cfg=dict(algo="token", NPI=1, tma=use),
                                    doc_start=x["doc"]) for use in (False, True)]
            if not all(torch.equal(a, b) for a, b in zip(*one)):
                unequal_one_block.append(case[0])
    bound = {c[0]: 1e-3 if c[8] == "float16" else 1e-5 for c in CASES + DOC_CASES}
    return {"ok": cases == len(CASES) + len(DOC_CASES) - 1 and len(worst) == took > 0 and not unequal_one_block
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


def _pair_table_check(device):
    """The selected branch's pair tables (one Triton kernel for the keys, torch.sort, one Triton kernel for the
    block offsets, chunk offsets and partial-slot offsets, one for the programs' blocks) against their torch spec, on
    random selections with unused slots: one block, a few, many; chunks of 1, 3, 16 and 64 pairs (16: some
    blocks of exactly two chunks)."""
    import torch

    from nsa_titan.kernels.pair_sort import block_pairs, block_pairs_reference

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
    float64 where METHOD is another sort (with METHOD "counting" other verdicts hold those runs). Past
    pair_sort.MAX_BINS buckets the default is the radix sort (2047 blocks: 4096 bins), below it the counting sort
    (2046 blocks: 2048 bins)."""
    import torch

    from nsa_titan.kernels import pair_sort
    from nsa_titan.kernels.pair_sort import pair_keys, sorted_pair_keys

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
    # More buckets than pair_sort.MAX_BINS (a 4096-bin histogram spills on sm_90): the default sorts by radix there,
    # with the same keys (the spec, pair_keys), and the counting kernel is not launched.
    big = torch.randint(-1, 2047, (1, 2, 9, 3), generator=torch.Generator().manual_seed(3)).to(device)
    counting, calls = pair_sort.counting_sort_pair_keys, []
    pair_sort.counting_sort_pair_keys = lambda *a: calls.append(1) or counting(*a)
    try:
        radix_past_bins = torch.equal(sorted_pair_keys(big, 2047), pair_keys(big, 2047)[0]) and not calls
        radix_past_bins = radix_past_bins and torch.equal(sorted_pair_keys(big[..., :2] % 2046, 2046),
                                                          pair_keys(big[..., :2] % 2046, 2046)[0]) and len(calls) == 1
    finally:
        pair_sort.counting_sort_pair_keys = counting
    # The whole attention with the counting sort: run here only while it is not the default (METHOD). As the
    # default (since attempt 86) these two runs are, launch for launch, the whole-attention case g2_dk_ne_dv and
    # sel_tokens' model_mix run of g6_l_lt_lp block-centric (the same tuned entry), whose verdicts hold them.
    method, model = pair_sort.METHOD, {}
    runs = ((CASES[2], dict(algo="blocks", rows=16, tiles=2)), (CASES[1], None)) if method != "counting" else ()
    pair_sort.METHOD = "counting"
    try:
        for case, cfg in runs:
            with _tuned_entry("sel_fwd", case, cfg):
                model[case[0]] = run_case(case, device)
    finally:
        pair_sort.METHOD = method
    return {"ok": not bad and len(sels) >= 3 + len(CASES) + len(DOC_CASES) - 1 and all(r["ok"] for r in model.values())
            and radix_past_bins, "mismatch": bad, "selections": len(sels), "radix_past_bins": radix_past_bins,
            "model": {k: r["worst"] for k, r in model.items()}}
