"""tests/test_kernels.py's checks of the band kernels (the window and the compressed branch: split backward,
descriptors, both dQs in one launch) against a float64 band by its definition, and of the fused decode step."""

from __future__ import annotations

import os
import sys

from _kernel_cases import (
    CASES,
    DOC_CASES,
    PREFIX_CASES,
    TOL,
    _no_descriptor_fallback,
    _sel_inputs,
    _tuned_entry,
    doc_starts,
    rel_err,
    run_case,
)


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
        # The third: dK/dV with the keys as the MMA rows (band_bwd KT: the same sums, transposed); the fourth with the
        # compressed keys' queries cut into equal parts per key tile instead of balanced splits (band_bwd._split_plan:
        # the same partials summed in another grouping).
        for split, keys_rows, balanced in ((False, False, True), (True, False, True), (True, True, True),
                                           (True, True, False))[:4 if win == 0 else 3]:  # a window: one split
            cfg = dict(rows=16, BK=16, num_warps=4, num_stages=1, split=split)
            o, lse = band.band_fwd(q, k, v, kstride, koff, win, cfg=cfg, doc_start=ds)
            grads = band_bwd.band_bwd(do, q, k, v, o, lse, kstride, koff, win, cfg_dq=cfg,
                                      cfg_dkdv=dict(cfg, keys_rows=keys_rows, balanced=balanced), doc_start=ds)
            fin = torch.isfinite(lse)
            outs.append([o, torch.where(fin, lse, 0.0), fin.float(), *grads])
            if balanced and win == 0:  # the sums of balanced partials added into a caller's tensors, and written
                acc = (torch.ones_like(k), torch.ones_like(v))  # to its own (the model's dkv_acc and dkv_out)
                into = (torch.empty_like(k), torch.empty_like(v))
                kw = dict(cfg_dq=cfg, cfg_dkdv=dict(cfg, keys_rows=keys_rows, balanced=True), doc_start=ds,
                          parts="dkdv")
                band_bwd.band_bwd(do, q, k, v, o, lse, kstride, koff, win, dkv_acc=acc, **kw)
                band_bwd.band_bwd(do, q, k, v, o, lse, kstride, koff, win, dkv_out=into, **kw)
                naive = max(naive, *(rel_err(a.cpu().double(), b) for a, b in zip([acc[0] - 1, acc[1] - 1, *into],
                                                                                  [*want[2:], *want[2:]])))
            naive = max(naive, *(rel_err(a.cpu().double(), b) for a, b in zip([o, *grads], want)))
        worst[name] = max(rel_err(a, b) for other in outs[1:] for a, b in zip(outs[0], other))
    # The interpreter runs both loop bodies op for op: equal to the bit (1e-5 leaves room for a reordering). On
    # a GPU the fp32 dots run as tf32 and the two bodies compile to different instruction orders (3e-5 to 7e-5
    # seen on an H100): the fp32 bound of the cases above.
    return {"ok": max(worst.values()) < (1e-5 if device == "cpu" else TOL["float32"]) and naive < TOL["float32"],
            "worst": worst, "naive": naive}



def _add_splits_balanced_check(device):
    """combine.add_splits over band_bwd's balanced partials reads only the slots a key tile's splits write: with
    chunk 50 packed rows, G 2, l 8 / d 4 keys (tile t of 4 keys first seen by query 16 t + 7) and 38 queries, the
    tiles have 2, 1 and 1 splits (62, 30 and 0 rows), and every slot past those holds NaN, which must not reach the
    sum; added into ones (dkv_acc) and written (acc False)."""
    import math

    import torch

    from nsa_titan.kernels.combine import add_splits

    S, H, D, bk, chunk, tq, g = 10, 1, 16, 4, 50, 38, 2
    part = torch.randn(3, 1, S, H, D, generator=torch.Generator().manual_seed(0)).to(device)
    used = [max(1, math.ceil(max(tq - (i // bk * bk * 4 + 7), 0) * g / chunk)) for i in range(S)]
    want = torch.stack([part[:u, 0, i].sum(0) for i, u in enumerate(used)])[None]  # [1, S, H, D]
    for i, u in enumerate(used):
        part[u:, 0, i] = float("nan")
    acc = torch.ones(1, S + 2, H, D, device=device)  # more rows than keys, as the model's dkv_acc may have
    add_splits(part, acc, balanced=(chunk, tq, bk, 4, 7, g))
    out = torch.empty(1, S, H, D, device=device)
    add_splits(part, out, acc=False, balanced=(chunk, tq, bk, 4, 7, g))
    err = max(rel_err(acc[:, :S].cpu().double() - 1, want.double()), rel_err(out.cpu().double(), want.double()))
    return {"ok": used[:4] == [2] * 4 and used[4] == 1 and err < 1e-6 and bool((acc[:, S:] == 1).all()),
            "used": used, "err": err}


def _band_tma_check(device):
    """The band kernels with tiles loaded through tensor descriptors (band.py TMA: K/V in the forward and dQ, Q/dO in
    dK/dV with one KV head) against pointer loads: the compressed and the window geometry, with and without
    documents, batch 2 (tiles past the end of the first batch must read zeros, not the second batch), K/V as strided
    slices of one wider tensor (as the model's fused K/V projection makes them), a prefix call (n_queries, keys
    k[:, :p]: a batch stride that is not S rows), and G = 3 with one KV head (16-row tiles hold 5 1/3 tokens). Masked
    rows and keys are hidden by the mask or by LSE = +inf either way, so both must agree to the bit on the
    interpreter; both are also held to a float64 band attention, and so is dK/dV with its query tiles indexed in 32
    bits from each batch's bases (i32_rows). Head dim 24 (not its own power of two) must fall back to pointer
    loads."""
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
            rows = slice(None) if nq is None else slice(0, nq)
            want = _naive_band(q[:, rows].cpu(), k.cpu(), v.cpu(), do[:, rows].cpu(), kstride, koff, win,
                               None if ds is None else ds[:, rows])  # once: the same inputs for all three runs
            # The third: pointer loads with dK/dV's query tiles indexed in 32 bits from each batch's bases
            # (i32_rows, attempt 95: the same addresses, so the same bits).
            for use, i32 in ((False, False), (True, False), (False, True)):
                cfg = dict(rows=16, BK=16, num_warps=4, num_stages=1, tma=use)
                o, lse = band.band_fwd(q, k, v, kstride, koff, win, cfg=cfg, doc_start=ds, n_queries=nq)
                dq, dk, dv = band_bwd.band_bwd(do, q, k, v, o, lse, kstride, koff, win, cfg_dq=cfg,
                                               cfg_dkdv=dict(cfg, i32_rows=i32), doc_start=ds, n_queries=nq)
                o, lse, dq = o[:, rows], lse[:, rows], dq[:, rows]
                fin = torch.isfinite(lse)
                outs.append([o, torch.where(fin, lse, 0.0), fin.float(), dq, dk, dv])
                naive = max(naive, *(rel_err(a.cpu().double(), b) for a, b in zip((o, dq, dk, dv), want)))
            worst[name] = max(rel_err(a, b) for other in outs[1:] for a, b in zip(outs[0], other))
    odd = torch.randn(1, 8, 1, 24, device=device)
    fallback = all(tma.descriptor(*s) is None for s in tma.kv_specs(odd, odd, 16).values())
    return {"ok": took and fallback and max(worst.values()) < (1e-5 if device == "cpu" else TOL["float32"])
            and naive < TOL["float32"], "worst": worst, "naive": naive, "took_tma": took, "fallback_d24": fallback}


def _band_dq2_check(device):
    """The window's and the compressed branch's dQ in one launch (band_dq2.band_dq2, attempt 82) against the two
    band_bwd dQ calls the model's backward makes otherwise, both adding into a dQ that holds another branch's part:
    pointer loads and descriptors, G = 3 over two KV heads and over one, batch 2, with documents. Against float64:
    the given dQ plus each branch's float64 band-attention dQ (``_naive_band``). Dropping either branch, or the
    dQ already there, fails it by O(1)."""
    import torch

    from nsa_titan.kernels import band, band_bwd, band_dq2, combine

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
        one = band_dq2.band_dq2(do, q, (kw, vw, lse_w, d_w, 1, 0, win), (kc, vc, lse_c, d_c, kstride, koff, 0),
                                base.clone(), doc_start=ds, cfg=cfg)
        worst[name] = rel_err(one, two)
        want = base.cpu().double()
        for k, v, geo in ((kw, vw, (1, 0, win)), (kc, vc, (kstride, koff, 0))):
            want = want + _naive_band(q.cpu(), k.cpu(), v.cpu(), do.cpu(), *geo, ds)[1]
        naive = max(naive, rel_err(one.cpu().double(), want))
    # The model's backward with it switched on (a tuned.py entry): whole attention against the float64 reference.
    model, calls = {}, []
    fused = band_dq2.band_dq2
    band_dq2.band_dq2 = lambda *a, **kw: calls.append(1) or fused(*a, **kw)
    try:
        for case in (CASES[1], DOC_CASES[1]):  # G 2 with Dk != Dv; G 6 over two KV heads with documents
            with _tuned_entry("band_dq2", case, dict(rows=16, BK=16, num_warps=4, num_stages=1)):
                model[case[0]] = run_case(case, device)
    finally:
        band_dq2.band_dq2 = fused
    # fp32 on both paths; the fused one adds the two branches before the given dQ (one rounding fewer)
    return {"ok": max(worst.values()) < (1e-5 if device == "cpu" else TOL["float32"]) and naive < TOL["float32"]
            and len(calls) >= len(model) and all(r["ok"] for r in model.values()),
            "worst": worst, "naive": naive, "model": {k: r["worst"] for k, r in model.items()},
            "fused_calls": len(calls)}


def _band_dq2_partials_check(device):
    """The selected branch's dQ partials added inside band_dq2 (attempt 88) against the selected backward's own sum
    kernel followed by band_dq2 adding into its dQ: G 3 over two KV heads and G 6 with documents (fp32 partials),
    G 2 in fp16 with fp16 partials (the model's choice on a GPU: partials in the inputs' dtype; the fused sum rounds
    once fewer, so 2 fp16 ulps apart); the fused call writes a NaN-filled dQ (acc False), so a read of it shows. dK/dV
    must not change. Then the model's backward with the path switched on (tuned entries for 'partials' and band_dq2),
    whole attention against float64, with documents and with a causal prefix (whose rows are added before the
    partials); there the sum kernel must not run. Dropping the partials fails it by O(1)."""
    import torch

    from nsa_titan.kernels import band, band_dq2, combine, selected_bwd

    worst = {}
    cfg = dict(rows=16, BK=16, num_warps=4, num_stages=1)
    for case, bits in ((CASES[3], 32), (DOC_CASES[1], 32), (CASES[5], 16)):
        x = _sel_inputs(case, device)
        p, q, do, doc = x["p"], x["q"], x["do"], x["doc"]
        o_w, lse_w = band.band_fwd(q, x["ks"], x["vs"], 1, 0, p.window, doc_start=doc)
        o_c, lse_c = band.band_fwd(q, x["kc"], x["kc"], p.cmp_stride, p.cmp_block - 1, 0, doc_start=doc)
        branches = ((x["ks"], x["vs"], lse_w, combine.rowdot(do, o_w), 1, 0, p.window),
                    (x["kc"], x["kc"], lse_c, combine.rowdot(do, o_c), p.cmp_stride, p.cmp_block - 1, 0))
        a = dict(algo="partials", partial_bits=bits)
        args = (do, q, x["ks"], x["vs"], x["o"], x["lse"], x["idx"], p.slc_block)
        dq, dk, dv = selected_bwd.sel_bwd(*args, cfg_dq=a, doc_start=doc)
        want = band_dq2.band_dq2(do, q, *branches, dq, doc_start=doc, cfg=cfg)
        _, dk2, dv2, parts = selected_bwd.sel_bwd_parts(*args, cfg_dq=a, doc_start=doc, sum_dq=False)
        assert parts[0].dtype == (torch.float32 if bits == 32 else q.dtype)
        got = band_dq2.band_dq2(do, q, *branches, torch.full_like(q, float("nan")), doc_start=doc, cfg=cfg,
                                dq_partials=parts, acc=False)
        without = band_dq2.band_dq2(do, q, *branches, torch.zeros_like(q), doc_start=doc, cfg=cfg)
        worst[f"{case[0]}_{bits}"] = rel_err(got, want)
        worst[f"{case[0]}_{bits}_dkdv"] = max(rel_err(dk2, dk), rel_err(dv2, dv))
        worst[f"{case[0]}_{bits}_without"] = -rel_err(without, want)  # must be far from 0 (negated: max below)
    model, fused_calls, sums = {}, [], []
    dq2, dq_sum = band_dq2.band_dq2, selected_bwd.sel_dq_sum
    band_dq2.band_dq2 = lambda *a, **kw: (fused_calls.append(kw.get("dq_partials") is not None), dq2(*a, **kw))[1]
    selected_bwd.sel_dq_sum = lambda *a, **kw: (sums.append(1), dq_sum(*a, **kw))[1]
    try:
        for case in (DOC_CASES[1], PREFIX_CASES[0]):  # G 6 over two KV heads: documents; a causal prefix of 48
            with _tuned_entry("band_dq2", case, cfg), _tuned_entry("sel_dq", case, dict(algo="partials")):
                model[case[0]] = run_case(case, device)
    finally:
        band_dq2.band_dq2, selected_bwd.sel_dq_sum = dq2, dq_sum
    tol = {k: 2e-3 if k.startswith(CASES[5][0]) else 1e-5 if device == "cpu" else TOL["float32"] for k in worst}
    unit_ok = all(w < tol[k] for k, w in worst.items() if not k.endswith("without")) and all(
        -w > 0.1 for k, w in worst.items() if k.endswith("without"))
    return {"ok": unit_ok and len(fused_calls) >= 2 and all(fused_calls) and not sums
            and all(r["ok"] for r in model.values()),
            "worst": worst, "model": {k: r["worst"] for k, r in model.items()}, "fused_calls": len(fused_calls),
            "sum_calls": len(sums)}


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
