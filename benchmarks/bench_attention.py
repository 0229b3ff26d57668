"""NSA Triton kernels on a GPU: correctness vs float64 (bf16 inputs) and speed vs SDPA full causal attention.

    python benchmarks/bench_attention.py [--check] [--bench] [--breakdown] [--out DIR] [--quick]

--check: every output and gradient of nsa_titan.kernels.nsa_attention on bf16 inputs against a float64
  computation of the spec (reference.py's rules) done in query chunks, so that 64k fits (the dense reference
  is O(T^2)). The selected branch of the float64 side uses the kernel's own block indices (a near-tie may
  legitimately flip between bf16 and float64); the selection itself is checked separately: in float64, no
  unchosen candidate may beat a chosen free block by more than a small tolerance.
--bench: forward and forward+backward times (median of triton.testing.do_bench), peak memory per case, for
  the paper config (HQ64/HKV4/D128, l=32, d=16, l'=64, n=16, w=512), 1b (HQ16/HKV1/D128), m7c (HQ12/HKV2/D64)
  and a Qwen2.5-7B shape (HQ28/HKV4/D128, G=7), T = 4k..64k, next to SDPA full causal attention and
  fla-core's parallel_nsa when importable (carry its wheel: see benchmarks/NOTES_kernels.md).
--breakdown: per-operator times at the largest T of the paper config.
Writes attention_<device>.json and .md to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nsa_titan.kernels import band, band_bwd, nsa_attention, select, selected, selected_bwd  # noqa: E402
from nsa_titan.models.nsa.common import NSAParams  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_checks import DEV, check, make_inputs, rel  # noqa: E402  (the --check half)
from attention_timing import HOST_BOUND, bench_fla, bench_one, graph_ms, kernel_ms, load_fla  # noqa: E402

PAPER = dict(HQ=64, HKV=4, DK=128, DV=128, p=NSAParams(32, 16, 64, 16, 512))
M7C = dict(HQ=12, HKV=2, DK=64, DV=64, p=NSAParams(32, 16, 64, 16, 512))
CONFIGS = {  # the attention shapes of the paper, our 1b and m7c flavors, and a Qwen2.5-7B-shaped model (G=7)
    "paper": PAPER,
    "1b": dict(HQ=16, HKV=1, DK=128, DV=128, p=PAPER["p"]),
    "m7c": M7C,
    "qwen7b": dict(HQ=28, HKV=4, DK=128, DV=128, p=PAPER["p"]),
}




def flops(T, cfg, fwd_only):
    """Attention FLOPs NSA really does (causal halves counted), fwd; bwd = 2.5x attention + select recompute."""
    p, HQ, DK, DV = cfg["p"], cfg["HQ"], cfg["DK"], cfg["DV"]
    tc = p.num_cmp_tokens(T)
    cmp_ = T * tc / 2 * HQ * (DK + DV) * 2
    slc = T * min(p.slc_top_n * p.slc_block, T / 2) * HQ * (DK + DV) * 2
    win = T * min(p.window, T / 2) * HQ * (DK + DV) * 2
    sel = T * tc / 2 * HQ * DK * 2
    f = cmp_ + slc + win + sel
    return f if fwd_only else f + 2.5 * (cmp_ + slc + win)


def bench(cfgs, Ts, dq_buffer_bytes: int = selected.DS_BUDGET):
    """``dq_buffer_bytes``: the backward's budget for the selected branch's stored dS / dQ partials (the model's
    dq_buffer_gib; default 2 GiB): above it dQ recomputes."""
    rows = []
    fla_nsa = load_fla()
    for cname, cfg in cfgs:
        for T in Ts:
            HQ, HKV, DK, DV, p = cfg["HQ"], cfg["HKV"], cfg["DK"], cfg["DV"], cfg["p"]
            ins = [x.requires_grad_(True) for x in make_inputs(1, T, HQ, HKV, DK, DV, p)]
            dout = torch.randn(1, T, HQ, DV, device="cuda", dtype=torch.bfloat16)
            row = dict(config=cname, T=T)
            if dq_buffer_bytes != selected.DS_BUDGET:
                row["dq_buffer_gib"] = dq_buffer_bytes / 2**30

            def nsa(*a):
                return nsa_attention(*a, dq_buffer_bytes=dq_buffer_bytes)
            try:
                for bwd in (False, True):
                    ms, mem = bench_one(lambda: nsa(*ins, p)[0], ins, dout, bwd)  # noqa: B023
                    row["nsa_fwdbwd_ms" if bwd else "nsa_fwd_ms"] = ms
                    row["nsa_fwdbwd_GiB" if bwd else "nsa_fwd_GiB"] = mem
                    row["nsa_fwdbwd_TFLOPs" if bwd else "nsa_fwd_TFLOPs"] = flops(T, cfg, not bwd) / ms / 1e9
                row["nsa_fwdbwd_kernel_ms"] = kernel_ms(lambda: nsa(*ins, p)[0], ins, dout)  # noqa: B023
            except Exception as e:  # OOM or a kernel failure: record it, keep benchmarking
                row["nsa_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            q, k, v = ins[0], ins[3], ins[4]
            graphs = host_bound(row.get("nsa_fwdbwd_ms"), row.get("nsa_fwdbwd_kernel_ms"))
            if graphs:  # its eager wall time measures launches: the same call replayed from a CUDA graph too
                try:
                    row["nsa_fwdbwd_graph_ms"] = graph_ms(lambda: nsa(*ins, p)[0], ins, dout)  # noqa: B023
                except Exception as e:
                    row["nsa_graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"

            def sdpa():
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True, enable_gqa=True)

            try:
                for bwd in (False, True):
                    ms, mem = bench_one(sdpa, [q, k, v], dout.transpose(1, 2), bwd)
                    row["sdpa_fwdbwd_ms" if bwd else "sdpa_fwd_ms"] = ms
                    row["sdpa_fwdbwd_GiB" if bwd else "sdpa_fwd_GiB"] = mem
            except Exception as e:
                row["sdpa_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if graphs and "nsa_fwdbwd_graph_ms" in row:  # SDPA the same way, for a like-for-like ratio
                try:
                    row["sdpa_fwdbwd_graph_ms"] = graph_ms(sdpa, [q, k, v], dout.transpose(1, 2))
                except Exception as e:
                    row["sdpa_graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if "nsa_fwdbwd_ms" in row and "sdpa_fwdbwd_ms" in row:
                row["speedup_fwd"] = row["sdpa_fwd_ms"] / row["nsa_fwd_ms"]
                row["speedup_fwdbwd"] = row["sdpa_fwdbwd_ms"] / row["nsa_fwdbwd_ms"]
            bench_fla(fla_nsa, row, cfg, q, k, v, dout)
            print(json.dumps(row), flush=True)
            rows.append(row)
            ins = dout = q = k = v = None  # free this length's tensors before the next one
            torch.cuda.empty_cache()
    return rows


def breakdown(cfg, T):
    """Per-operator times (ms) for one paper-config call, to see which kernel bounds the total."""
    from triton.testing import do_bench

    HQ, HKV, DK, DV, p = cfg["HQ"], cfg["HKV"], cfg["DK"], cfg["DV"], cfg["p"]
    q, kc, vc, ks, vs, kw, vw, gates = make_inputs(1, T, HQ, HKV, DK, DV, p)
    cmp_geo, win_geo = (p.cmp_stride, p.cmp_block - 1, 0), (1, 0, p.window)
    o_c, lse = band.band_fwd(q, kc, vc, *cmp_geo)
    idx = select.select_blocks(q, kc, lse, p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n)
    o_s, lse_s = selected.sel_fwd(q, ks, vs, idx, p.slc_block)
    o_w, lse_w = band.band_fwd(q, kw, vw, *win_geo)
    do = torch.randn_like(o_c)
    fns = {
        "cmp_fwd": lambda: band.band_fwd(q, kc, vc, *cmp_geo),
        "cmp_bwd": lambda: band_bwd.band_bwd(do, q, kc, vc, o_c, lse, *cmp_geo),
        "select": lambda: select.select_blocks(q, kc, lse, p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n),
        "slc_fwd": lambda: selected.sel_fwd(q, ks, vs, idx, p.slc_block),
        "slc_fwd_1blk_per_step": lambda: selected.sel_fwd(q, ks, vs, idx, p.slc_block, cfg=dict(NPI=1)),
        "slc_bwd": lambda: selected_bwd.sel_bwd(do, q, ks, vs, o_s, lse_s, idx, p.slc_block),
        "win_fwd": lambda: band.band_fwd(q, kw, vw, *win_geo),
        "win_bwd": lambda: band_bwd.band_bwd(do, q, kw, vw, o_w, lse_w, *win_geo),
    }
    out = {}
    for k, f in fns.items():
        try:
            out[k] = do_bench(f, warmup=10, rep=50, return_mode="median")
        except Exception as e:
            print("breakdown", k, "FAILED", type(e).__name__, str(e)[:200], flush=True)
    print("breakdown", T, json.dumps({k: round(v, 3) for k, v in out.items()}), flush=True)
    return out


def _v(rows=None, BK=None, w=4, st=2, NPI=None, CI=None):
    d = dict(num_warps=w, num_stages=st)
    d.update({k: v for k, v in dict(rows=rows, BK=BK, NPI=NPI, CI=CI).items() if v is not None})
    return d


SWEEP = {  # first entry of each list = the heuristic default
    "band_fwd": [_v(128, 64, 8, 3), _v(128, 64, 8, 2), _v(128, 128, 8, 2), _v(64, 64, 4, 3), _v(64, 128, 4, 2),
                 _v(128, 64, 4, 3)],
    "band_dq": [_v(128, 64, 8, 3), _v(128, 64, 8, 2), _v(64, 64, 4, 3), _v(128, 32, 8, 3), _v(64, 128, 8, 2)],
    "band_dkdv": [_v(64, 64, 4, 2), _v(32, 128, 4, 2), _v(32, 128, 8, 2), _v(64, 128, 8, 2), _v(64, 64, 8, 2),
                  _v(32, 64, 4, 3), _v(16, 128, 4, 3)],
    "sel_fwd": [_v(w=4, st=2, NPI=2), _v(w=4, st=3, NPI=1), _v(w=4, st=3, NPI=2), _v(w=8, st=2, NPI=2),
                _v(w=2, st=3, NPI=1), _v(w=2, st=2, NPI=2)],
    "sel_dq": [_v(w=4, st=2, NPI=2), _v(w=4, st=3, NPI=1), _v(w=8, st=2, NPI=2), _v(w=2, st=2, NPI=2)],
    "sel_dkdv": [_v(64, w=4, st=2), _v(32, w=4, st=2), _v(128, w=8, st=2), _v(64, w=8, st=2), _v(32, w=4, st=3),
                 _v(64, w=4, st=3)],
    "select": [_v(128, w=4, st=3, CI=64), _v(128, w=8, st=3, CI=64), _v(64, w=4, st=3, CI=64),
               _v(256, w=8, st=2, CI=64), _v(128, w=8, st=2, CI=128), _v(128, w=4, st=3, CI=32)],
}


def sweep(cfg, T):
    """Time each launch variant of every kernel at one shape; keep the fastest whose results match the
    default's (bf16 rounding only); install the winners in band.TUNED for the rest of this process."""
    from triton.testing import do_bench

    from nsa_titan.kernels import band, band_bwd, select

    HQ, HKV, DK, DV, p = cfg["HQ"], cfg["HKV"], cfg["DK"], cfg["DV"], cfg["p"]
    q, kc, vc, ks, vs, kw, vw, _ = make_inputs(1, T, HQ, HKV, DK, DV, p)
    gp, dmax = 1 << (HQ // HKV - 1).bit_length(), max(DK, DV)
    do = torch.randn(1, T, HQ, DV, device=DEV, dtype=q.dtype)
    cmp_geo, win_geo = (p.cmp_stride, p.cmp_block - 1, 0), (1, 0, p.window)
    o_c, lse_c = band.band_fwd(q, kc, vc, *cmp_geo)
    o_w, lse_w = band.band_fwd(q, kw, vw, *win_geo)
    idx = select.select_blocks(q, kc, lse_c, p.cmp_block, p.cmp_stride, p.slc_block, p.slc_top_n)
    o_s, lse_s = selected.sel_fwd(q, ks, vs, idx, p.slc_block)
    jobs = []
    for geo, (k_, v_, o_, l_), win in ((cmp_geo, (kc, vc, o_c, lse_c), False),
                                       (win_geo, (kw, vw, o_w, lse_w), True)):
        jobs += [("band_fwd", win, lambda c, g=geo, k_=k_, v_=v_: band.band_fwd(q, k_, v_, *g, cfg=c)),
                 ("band_dq", win, lambda c, g=geo, a=(k_, v_, o_, l_):
                  band_bwd.band_bwd(do, q, a[0], a[1], a[2], a[3], *g, cfg_dq=c)),
                 ("band_dkdv", win, lambda c, g=geo, a=(k_, v_, o_, l_):
                  band_bwd.band_bwd(do, q, a[0], a[1], a[2], a[3], *g, cfg_dkdv=c))]
    jobs += [("sel_fwd", False, lambda c: selected.sel_fwd(q, ks, vs, idx, p.slc_block, cfg=c)),
             ("sel_dq", False, lambda c: selected_bwd.sel_bwd(do, q, ks, vs, o_s, lse_s, idx, p.slc_block, cfg_dq=c)),
             ("sel_dkdv", False, lambda c: selected_bwd.sel_bwd(do, q, ks, vs, o_s, lse_s, idx, p.slc_block,
                                                            cfg_dkdv=c)),
             ("select", False, lambda c: (select.select_blocks(q, kc, lse_c, p.cmp_block, p.cmp_stride,
                                                               p.slc_block, p.slc_top_n, cfg=c),))]
    report = {}
    for name, win, fn in jobs:
        ref = fn(SWEEP[name][0])
        times = []
        for c in SWEEP[name]:
            try:
                res = fn(c)
                outs = zip(res[:1], ref[:1]) if name.endswith("fwd") else zip(res, ref)  # lse may hold inf
                same = all((torch.equal(a, b) if a.dtype == torch.int64 else rel(a, b) < 1e-2) for a, b in outs)
                ms = do_bench(lambda: fn(c), warmup=10, rep=40, return_mode="median") if same else None
            except Exception as e:
                print("sweep", name, c, "FAILED", type(e).__name__, str(e)[:120], flush=True)
                ms = None
            times.append(ms)
        ok = [(t, c) for t, c in zip(times, SWEEP[name]) if t is not None]
        best = min(ok, key=lambda x: x[0])[1] if ok else SWEEP[name][0]
        key = (name, gp, DK if name == "select" else dmax, win)
        band.TUNED[key] = best
        report[repr(key)] = dict(best=best, default_ms=times[0], best_ms=min(t for t, _ in ok) if ok else None,
                                 all_ms=times)
        print("sweep", key, "default", fmt(times[0], ".3f"), "best", fmt(report[repr(key)]["best_ms"], ".3f"), best,
              flush=True)
    print("TUNED =", {k: v for k, v in band.TUNED.items()}, flush=True)
    return report


PEAK_TFLOPS = 790  # dense bf16 matmul measured on these H100/H200s (8192^3, docs/anchors and KINDS.md)


def host_bound(wall, kern) -> bool:
    """A row whose wall time is above HOST_BOUND x its GPU kernel time: it measures the eager op's launches."""
    return bool(wall and kern and wall > HOST_BOUND * kern)


def kernel_ratio(r) -> str:
    """For a host-bound row (wall time above HOST_BOUND x its kernels: the eager op's launches at batch 1), the
    ratio that a CUDA-graphed training step pays instead: SDPA's wall time over NSA's kernel time. The verdict
    stays on the wall times; this says how far the kernels themselves are from it."""
    wall, kern, sdpa = r.get("nsa_fwdbwd_ms"), r.get("nsa_fwdbwd_kernel_ms"), r.get("sdpa_fwdbwd_ms")
    if not (sdpa and host_bound(wall, kern)):
        return ""
    gn, gs = r.get("nsa_fwdbwd_graph_ms"), r.get("sdpa_fwdbwd_graph_ms")
    graphs = f"; both replayed from CUDA graphs {gs / gn:.2f}x ({gn:.2f} / {gs:.2f} ms)" if gn and gs else ""
    return f" (host-bound; SDPA wall / NSA kernels {sdpa / kern:.2f}x{graphs})"


def targets(rows):
    """The issue's targets (set for an H100, paper config, bf16) against the measured rows."""
    by = {(r["config"], r["T"]): r for r in rows}
    out = ["", "Targets (paper config unless named; floor = useful FLOPs / 790 TFLOP/s, bwd = 2.5x attention):"]
    r = by.get(("paper", 65536), {})
    if "nsa_fwdbwd_ms" in r:
        ms, x = r["nsa_fwdbwd_ms"], r.get("speedup_fwdbwd", float("nan"))
        floor = flops(65536, PAPER, False) / PEAK_TFLOPS / 1e9
        out.append(f"- 64k fwd+bwd {ms:.1f} ms vs <= 75 ms: " + ("met" if ms <= 75 else f"MISSED by {ms / 75:.2f}x")
                   + f"; {x:.2f}x SDPA vs >= 6.7x: " + ("met" if x >= 6.7 else f"MISSED by {6.7 / x:.2f}x")
                   + f"; FLOP floor {floor:.0f} ms, achieved {r.get('nsa_fwdbwd_TFLOPs', 0):.0f} TFLOP/s useful")
    paper = sorted((t, rr.get("speedup_fwdbwd")) for (c, t), rr in by.items() if c == "paper")
    even = next((t for t, x in paper if x is not None and x >= 1), None)
    out.append(f"- break-even with SDPA (fwd+bwd): first at T={even} vs <= 8192: "
               + ("met" if even is not None and even <= 8192 else "MISSED") + "; "
               + ", ".join(f"{t}: {x:.2f}x" for t, x in paper if x is not None))
    r = by.get(("m7c", 32768), {})
    if "speedup_fwdbwd" in r:
        x = r["speedup_fwdbwd"]
        out.append(f"- m7c 32k fwd+bwd {x:.2f}x SDPA vs >= 4x: " + ("met" if x >= 4 else f"MISSED by {4 / x:.2f}x"))
    for cname in ("m7c", "qwen7b"):
        got = {t: by.get((cname, t), {}).get("speedup_fwdbwd") for t in (8192, 32768)}
        if any(x is not None for x in got.values()):
            out.append(f"- {cname} fwd+bwd vs SDPA: " + "; ".join(
                f"{t // 1024}k {fmt(x)}x{kernel_ratio(by.get((cname, t), {}))} vs >= {goal}x: "
                + ("-" if x is None else "met" if x >= goal else f"MISSED by {goal / x:.2f}x")
                for (t, x), goal in zip(got.items(), (1, 4))))
    fla = [(c, t, rr["nsa_vs_fla_fwdbwd"]) for (c, t), rr in sorted(by.items()) if "nsa_vs_fla_fwdbwd" in rr]
    if fla:
        worst = min(x for _, _, x in fla)
        out.append(f"- >= 2x fla-core at every T: worst {worst:.2f}x (" + ("met" if worst >= 2 else "MISSED") + "); "
                   + ", ".join(f"{c} {t // 1024}k: {x:.2f}x" for c, t, x in fla))
    mem = [(t, rr.get("nsa_fwdbwd_GiB")) for t, rr in sorted((t, rr) for (c, t), rr in by.items() if c == "paper")]
    mem = [(t, g) for t, g in mem if g]
    if len(mem) > 1:
        out.append("- memory linear in T: GiB per 1k tokens " + ", ".join(f"{t}: {1024 * g / t:.3f}" for t, g in mem))
    return out


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def write(out_dir, payload):
    os.makedirs(out_dir, exist_ok=True)
    tag = payload["device"].replace(" ", "_").replace("/", "_")
    base = os.path.join(out_dir, f"attention_{tag}")
    with open(base + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    lines = [f"# NSA attention kernels: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}; B=1, bf16, "
             "median of triton.testing.do_bench; memory = peak allocated above the inputs (GiB). The targets "
             "were set for an H100; SDPA ratios are from the same run on the device named above. "
             "See benchmarks/NOTES_kernels.md for the analysis."
             + (f" {payload['note']}" if payload.get("note") else ""), ""]  # note: e.g. runs merged into one table
    if payload.get("bench"):
        lines += ["| config | T | NSA fwd ms | NSA fwd+bwd ms | NSA kernels f+b ms | SDPA fwd ms | SDPA fwd+bwd ms | "
                  "fwd x | fwd+bwd x | NSA TFLOP/s (f+b) | NSA GiB (f+b) | SDPA GiB (f+b) | fla fwd+bwd ms | "
                  "NSA vs fla |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in payload["bench"]:
            g = r.get
            fla_status = g("fla_parallel_nsa", "-").split(" (")[0]
            wall, kern = g("nsa_fwdbwd_ms"), g("nsa_fwdbwd_kernel_ms")
            host = " (host-bound)" if host_bound(wall, kern) else ""
            if host and g("nsa_fwdbwd_graph_ms"):
                host = f" (host-bound; graph {fmt(g('nsa_fwdbwd_graph_ms'))})"
            lines.append(f"| {r['config']} | {r['T']} | {fmt(g('nsa_fwd_ms'))} | {fmt(wall)} | {fmt(kern)}{host} | "
                         f"{fmt(g('sdpa_fwd_ms'))} | {fmt(g('sdpa_fwdbwd_ms'))} | {fmt(g('speedup_fwd'))} | "
                         f"{fmt(g('speedup_fwdbwd'))} | {fmt(g('nsa_fwdbwd_TFLOPs'), '.0f')} | "
                         f"{fmt(g('nsa_fwdbwd_GiB'))} | {fmt(g('sdpa_fwdbwd_GiB'))} | "
                         f"{fmt(g('fla_fwdbwd_ms')) if g('fla_fwdbwd_ms') else fla_status} | "
                         f"{fmt(g('nsa_vs_fla_fwdbwd'))} |")
        lines += ["", f"NSA kernels f+b ms: the GPU kernels of one forward+backward (torch.profiler); a row marked "
                  f"host-bound has a wall time above {HOST_BOUND}x that, so it measures the eager op's launches, not "
                  "its kernels (under CUDA graphs the kernel time is what a training step pays); graph: the same "
                  "forward+backward replayed from a CUDA graph (wall time, gaps between kernels included; runs "
                  "since the twenty-seventh session).",
                  "", "fla-core's `parallel_nsa` runs the compressed and selected branches only (its window branch "
                  "needs flash-attn) with compression blocks of l' = 64; NSA here runs all three branches. "
                  "NSA vs fla = fla ms / NSA ms. fla-core's selected kernel needs G = HQ/HKV a power of 2 >= 16 "
                  "(m7c: 6, qwen7b: 7 are not supported)."]
        lines += targets(payload["bench"])
    if payload.get("breakdown"):
        lines += ["", "Per-operator ms (paper config): " + json.dumps(
            {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in payload["breakdown"].items()})]
    if payload.get("sweep"):
        lines += ["", "Launch-shape sweep (paper config, T=65536), ms default -> best: " + "; ".join(
            f"{k}: {fmt(v['default_ms'], '.2f')} -> {fmt(v['best_ms'], '.2f')} {v['best']}"
            for k, v in payload["sweep"].items())]
    if payload.get("check"):
        lines += ["", payload["check_note"]] if payload.get("check_note") else []
        lines += ["", "| check (bf16 vs float64) | ok | worst rel err | deterministic (1 vs 2 streams) | sel gap "
                  "| sel same rows |",
                  "|---|---|---|---|---|---|"]
        for r in payload["check"]:
            note = f" ({r['note']})" if r.get("note") else ""
            lines.append(f"| B={r['B']} T={r['T']} HQ={r['HQ']} HKV={r['HKV']} Dk={r['DK']} Dv={r['DV']}{note} | "
                         f"{r['ok']} | {r['worst']:.2e} | {r['deterministic']} | {r['sel_max_gap']:.1e} | "
                         f"{r['sel_same_rows']:.4f} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--quick", action="store_true", help="check: skip the 64k case")
    ap.add_argument("--ts", default="4096,8192,16384,32768,65536", help="bench sequence lengths")
    ap.add_argument("--configs", default="paper,1b,m7c,qwen7b", help=f"bench configs, of {', '.join(CONFIGS)}")
    ap.add_argument("--sweep", action="store_true", help="tune launch shapes at paper 64k first, then use them")
    ap.add_argument("--from-json", help="only rewrite the markdown of an earlier run's JSON (no GPU needed)")
    ap.add_argument("--dq-buffer-gib", type=float, default=selected.DS_BUDGET / 2**30,
                    help="bench and check: the selected backward's dS / dQ-partials budget (the model's "
                         "dq_buffer_gib; check with 0 to hold the dQ recompute to float64)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    if a.dq_buffer_gib < 0:
        ap.error(f"--dq-buffer-gib {a.dq_buffer_gib}: use a size >= 0 (0 always recomputes dQ)")
    if a.from_json:
        with open(a.from_json) as f:
            return write(a.out, json.load(f))
    import triton

    payload = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if a.sweep:
        payload["sweep"] = sweep(PAPER, 65536)
    if a.check:
        cases = [(2, 1000, 8, 2, 64, 64, NSAParams(32, 16, 64, 16, 512), 1000),
                 (1, 1531, 6, 6, 32, 32, NSAParams(16, 8, 32, 4, 64), 1531),  # G=1, odd T
                 (1, 4099, 32, 1, 192, 128, NSAParams(32, 16, 64, 16, 512), 512),  # G=32, Dk != Dv
                 (1, 8192, 64, 4, 128, 128, PAPER["p"], 256),
                 (1, 16384, 12, 2, 64, 64, M7C["p"], 1024),
                 (8, 2048, 12, 2, 64, 64, M7C["p"], 1024),  # m7c's 2k batch 8: the selected branch's causal prefix
                 # G 7 at head dim 128 (qwen7b's group): dQ for eight tokens per program, the band dQ in one launch
                 (2, 4096, 14, 2, 128, 128, PAPER["p"], 512)]
        if not a.quick:
            cases.append((1, 65536, 16, 1, 128, 128, PAPER["p"], 512))
        budget = int(a.dq_buffer_gib * 2**30)
        if budget != selected.DS_BUDGET:
            payload["check_note"] = f"checked with dq_buffer_gib = {a.dq_buffer_gib:g}"
        payload["check"] = check(cases, budget)
    if a.bench:
        Ts = [int(t) for t in a.ts.split(",")]
        budget = int(a.dq_buffer_gib * 2**30)
        if budget != selected.DS_BUDGET:
            payload["note"] = (f"NSA with dq_buffer_gib = {a.dq_buffer_gib:g} "
                               f"(the default is {selected.DS_BUDGET / 2**30:g})")
        payload["bench"] = bench([(c, CONFIGS[c]) for c in a.configs.split(",")], Ts, budget)
    if a.breakdown:
        payload["breakdown"] = {f"paper_T{T}": breakdown(PAPER, T) for T in (8192, 65536)}
        payload["breakdown"]["m7c_T32768"] = breakdown(M7C, 32768)
    write(a.out, payload)


if __name__ == "__main__":
    main()
