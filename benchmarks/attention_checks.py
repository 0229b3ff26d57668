"""Correctness half of bench_attention.py: the NSA Triton kernels' outputs and gradients on bf16 inputs against a
float64 computation of the spec (reference.py's rules), done in query chunks so that 64k context fits.

The selected branch of the float64 side uses the kernel's own block indices (a near-tie may legitimately flip
between bf16 and float64); the selection itself is checked separately: in float64, no unchosen candidate may
beat a chosen free block by more than a small tolerance. GPU only (``DEV``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os

import torch
import torch.nn.functional as F

from nsa_titan.kernels import nsa_attention, ops
from nsa_titan.models.nsa.torch_impl import overlap_weights

DEV = "cuda"


def run_header(**extra) -> dict:
    """The fields every results JSON of these benchmarks starts with: device, versions, UTC date."""
    import datetime

    from nsa_titan.components.runtime import device_name, software_versions

    return dict(device=device_name(torch.device(DEV)), **software_versions(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra)


@contextlib.contextmanager
def eager_fork(on: bool):
    """Within it, every eager NSA backward runs its band dK/dV on the side stream (on) or on one stream (off),
    whatever ops.EAGER_FORK_VALUES says for the shape; the threshold is restored after."""
    keep = ops.EAGER_FORK_VALUES
    ops.EAGER_FORK_VALUES = 0 if on else 1 << 62
    try:
        yield
    finally:
        ops.EAGER_FORK_VALUES = keep


def same_rows(a, b, at_least=0.9999) -> bool:
    """Index tensors [..., n] (sorted per row) equal in at least this fraction of their rows: a float64 near-tie may
    flip a few rows, a precision loss flips many (0.4 % of them with a tf32 overlap map)."""
    return float((a == b).all(-1).double().mean()) >= at_least


def time_variants(fn, variants: list[dict], ref, label=None, same_fn=None) -> tuple[list[dict], dict | None]:
    """The sweeps' measurement: every launch config ``c`` of ``variants`` as ``fn(c)`` (a tuple of tensors), its
    outputs checked against ``ref`` (``same_fn(out, ref)``, by default bf16 rounding only: rel < 1e-2) and timed
    (median of do_bench); a config that fails (e.g. does not fit shared memory) is recorded with its error.
    -> (rows, fastest row that matched)."""
    same_fn = same_fn or (lambda a, b: rel(a, b) < 1e-2)
    from triton.testing import do_bench

    res = []
    for c in variants:
        row = dict(cfg=c) if label is None else dict(cfg=c, label=label(c))
        try:
            got = fn(c)
            same = all(same_fn(a, b) for a, b in zip(got, ref))
            row.update(ms=round(do_bench(lambda: fn(c), warmup=10, rep=50, return_mode="median"), 4),  # noqa: B023
                       same=same)
        except Exception as e:  # noqa: BLE001 - record and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        res.append(row)
    ok = [r for r in res if "ms" in r and r["same"]]
    return res, (min(ok, key=lambda r: r["ms"]) if ok else None)


def write_results(out: str, stem: str, payload: dict, markdown: str) -> None:
    """<out>/<stem>.json (every number) and .md (the table a person reads); the markdown is also printed."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(markdown)
    print(markdown)


def write_table(out: str, stem: str, payload: dict, title: str, note: str, columns: list[str],
                cells: list[list[str]]) -> None:
    """write_results with the usual markdown: "# <title>: <device>", a line of versions, date and ``note``, and one
    table; the files are named <stem>_<device>."""
    lines = [f"# {title}: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date'][:10]}; {note}", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    write_results(out, f"{stem}_{payload['device'].replace(' ', '_')}", payload, "\n".join(lines) + "\n")


def sweep_parser(configs: str) -> argparse.ArgumentParser:
    """The launch-shape sweeps' (sweep_band.py, sweep_selected.py) common options."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=configs)
    ap.add_argument("--ts", default="8192,32768")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tag", default="", help="file name suffix, e.g. _blocks")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--variants", default="",
                    help="indices into each kernel's variant list to time (default all); the first is the reference")
    return ap


def picked_variants(ap: argparse.ArgumentParser, a: argparse.Namespace, variants: dict, kernels) -> list[int] | None:
    """A sweep's --variants as indices (None: all), each checked against every swept kernel's list."""
    pick = [int(i) for i in a.variants.split(",")] if a.variants else None
    for k in kernels:
        if bad := [i for i in pick or [] if not 0 <= i < len(variants[k])]:
            ap.error(f"--variants {bad} out of range for {k}: it has {len(variants[k])} variants (0-based)")
    return pick


def run_sweep(kind: str, a: argparse.Namespace, case_fn) -> None:
    """``case_fn(config, T)`` for every config and sequence length of ``a`` (a sweep_parser's); writes
    <out>/<kind><tag>_<device>.json."""
    payload = run_header(batch=a.batch, cases=[])
    for name in a.configs.split(","):
        for T in (int(t) for t in a.ts.split(",")):
            payload["cases"].append(case_fn(name, T))
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{kind}{a.tag}_" + payload["device"].replace(" ", "_") + ".json"), "w") as f:
        json.dump(payload, f, indent=1)


def make_inputs(B, T, HQ, HKV, DK, DV, p, dtype=torch.bfloat16, seed=0, q_corr: float = 0.0):
    """Random attention inputs: q, compressed K/V, selected K/V, window K/V, gates. ``q_corr``: the lag-1
    correlation of each query along T (``correlated_along_t``); 0 draws every query independently."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    tc = p.num_cmp_tokens(T)

    def r(*s):
        return torch.randn(*s, device=DEV, generator=g, dtype=torch.float32).to(dtype)

    q = r(B, T, HQ, DK) if not q_corr else correlated_along_t(
        torch.randn(B, T, HQ, DK, device=DEV, generator=g), q_corr).to(dtype)
    return [q, r(B, tc, HKV, DK), r(B, tc, HKV, DV), r(B, T, HKV, DK), r(B, T, HKV, DV),
            r(B, T, HKV, DK), r(B, T, HKV, DV), torch.rand(B, T, HQ, 3, device=DEV, generator=g)]


def correlated_along_t(x: torch.Tensor, corr: float) -> torch.Tensor:
    """x [B, T, ...] of independent N(0, 1) values -> y with y_t = corr * y_(t-1) + sqrt(1 - corr^2) * x_t along T (a
    stationary AR(1): each value still N(0, 1), lag-k correlation corr^k), as a causal convolution truncated where
    corr^k < 1e-4. Random queries make random selections, whose neighbours share fewer blocks than a model's
    (selection_overlap.py: for two tokens |union| / n 1.46 against 1.15-1.20 after training); correlated queries
    make the selections of neighbouring tokens overlap, so union kernels can be timed on inputs like a model's."""
    if not 0.0 <= corr < 1.0:
        raise ValueError(f"q_corr {corr}: use 0 <= q_corr < 1")
    if corr == 0.0:
        return x
    B, T = x.shape[:2]
    taps = max(1, math.ceil(math.log(1e-4) / math.log(corr)))
    # y_t = sum_k sqrt(1 - corr^2) corr^k x_(t-k): conv1d weights oldest first, variance 1 - corr^(2 * terms)
    w = math.sqrt(1.0 - corr * corr) * corr ** torch.arange(taps, device=x.device, dtype=torch.float64).flip(0)
    rows = x.reshape(B, T, -1).permute(0, 2, 1).reshape(-1, 1, T).float()
    y = F.conv1d(F.pad(rows, (taps - 1, 0)), w.float().view(1, 1, -1))
    # The first taps - 1 positions have fewer terms: rescale them to unit variance too.
    terms = torch.clamp(torch.arange(T, device=x.device, dtype=torch.float64) + 1, max=taps)
    y = y / (1.0 - corr ** (2 * terms)).sqrt().float().view(1, 1, -1)
    return y.reshape(B, -1, T).permute(0, 2, 1).reshape(x.shape)


def _attend(q, k, v, mask, scale):
    """q [B,C,HQ,D] float64, k/v [B,S,HKV,D], mask [B or 1, HKV or 1, C, S] -> [B,C,HQ,Dv] (0 where empty)."""
    B, C, HQ, _ = q.shape
    HKV = k.shape[2]
    qh = q.view(B, C, HKV, HQ // HKV, -1).permute(0, 2, 3, 1, 4)  # [B,HKV,G,C,D]
    s = torch.einsum("bhgcd,bshd->bhgcs", qh, k) * scale
    s = s.masked_fill(~mask[:, :, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(s - m)
    den = w.sum(-1, keepdim=True)
    pr = w / torch.where(den > 0, den, torch.ones_like(den))
    o = torch.einsum("bhgcs,bshd->bhgcd", pr, v)
    return o.permute(0, 3, 1, 2, 4).reshape(B, C, HQ, -1), pr


def reference_top_n(imp, forced, cand, p):
    """The spec's top-n of float64 importances [..., Nb]: forced candidates first, then by importance, ties to the
    lower block index (a stable sort); -1 fills rows with fewer than n candidates."""
    nb = imp.shape[-1]
    key = torch.where(forced & cand, float("inf"), torch.where(cand, imp, float("-inf")))
    if nb < p.slc_top_n:
        key = F.pad(key, (0, p.slc_top_n - nb), value=float("-inf"))
    top = torch.sort(key, dim=-1, descending=True, stable=True)
    return torch.where(top.values[..., : p.slc_top_n] > float("-inf"), top.indices[..., : p.slc_top_n], -1)


def float64_selection(q, kc, p, chunk=1024):
    """Block indices [B,HKV,T,n] of the spec's selection computed in float64 from q [B,T,HQ,Dk] and K_cmp: the
    compressed softmax, summed over the group's heads, mapped to blocks by the eq. 9 overlap weights. The
    sweeps hold every launch shape of the selection kernel to this (not to another launch shape)."""
    B, T, HQ, DK = q.shape
    tc, HKV = kc.shape[1], kc.shape[2]
    nb = p.num_slc_blocks(T)
    w_ov = overlap_weights(T, p, q.device, torch.float64)
    qd, kd = q.double(), kc.double()
    j = torch.arange(nb, device=q.device)
    out = []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        tt = torch.arange(t0, t1, device=q.device)
        qh = qd[:, t0:t1].view(B, t1 - t0, HKV, HQ // HKV, DK).permute(0, 2, 3, 1, 4)
        s = torch.einsum("bhgcd,bshd->bhgcs", qh, kd) * DK**-0.5
        vis = torch.arange(tc, device=q.device)[None, :] * p.cmp_stride + p.cmp_block - 1 <= tt[:, None]
        imp = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0).sum(2) @ w_ov
        cur = (tt // p.slc_block)[:, None]
        out.append(reference_top_n(imp, (j == 0) | (j == cur) | (j == cur - 1), j * p.slc_block <= tt[:, None], p))
    return torch.cat(out, 2)


def chunked_reference(ins, idx, dout, p, chunk):
    """Float64 outputs and gradients of the spec (with the given block indices), query chunk by chunk."""
    xs = [x.detach().double().requires_grad_(True) for x in ins]
    q, kc, vc, ks, vs, kw, vw, gates = xs
    B, T, HQ, DK = q.shape
    HKV = ks.shape[2]
    scale = DK**-0.5
    nb = p.num_slc_blocks(T)
    tc = kc.shape[1]
    w_ov = overlap_weights(T, p, q.device, torch.float64)  # [Tc, Nb]
    outs, worst_gap, same_rows = [], 0.0, 0
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        tt = torch.arange(t0, t1, device=q.device)
        qc = q[:, t0:t1]
        if tc:
            vis = (torch.arange(tc, device=q.device)[None, :] * p.cmp_stride + p.cmp_block - 1 <= tt[:, None])
            o_c, pr = _attend(qc, kc, vc, vis[None, None], scale)
            # Selection check in float64: importance of each block, summed over the group's heads.
            with torch.no_grad():
                imp = pr.sum(2) @ w_ov  # [B,HKV,C,Nb]
                sel = torch.zeros(B, HKV, t1 - t0, nb + 1, dtype=torch.bool, device=q.device)
                my = idx[:, :, t0:t1]
                sel.scatter_(-1, torch.where(my < 0, nb, my), True)
                sel = sel[..., :nb]
                j = torch.arange(nb, device=q.device)
                cur = (tt // p.slc_block)[:, None]
                forced = (j == 0) | (j == cur) | (j == cur - 1)
                cand = j * p.slc_block <= tt[:, None]
                free_min = torch.where(sel & ~forced, imp, float("inf")).amin(-1)
                other_max = torch.where(~sel & cand, imp, float("-inf")).amax(-1)
                gap = (other_max - free_min).clamp_min(0) / imp.amax(-1).clamp_min(1e-30)
                worst_gap = max(worst_gap, float(gap.max()))
                ref_idx = reference_top_n(imp, forced, cand, p)
                same_rows += int((torch.sort(ref_idx, -1).values == torch.sort(my, -1).values).all(-1).sum())
        else:
            o_c = torch.zeros(B, t1 - t0, HQ, vc.shape[-1], device=q.device, dtype=torch.float64)
        s_ar = torch.arange(T, device=q.device)
        causal = s_ar[None, :] <= tt[:, None]
        blk_sel = torch.zeros(B, HKV, t1 - t0, nb + 1, dtype=torch.bool, device=q.device)
        my = idx[:, :, t0:t1]
        blk_sel.scatter_(-1, torch.where(my < 0, nb, my), True)
        m_s = blk_sel[..., s_ar // p.slc_block] & causal
        o_s, _ = _attend(qc, ks, vs, m_s, scale)
        m_w = causal & (s_ar[None, :] > tt[:, None] - p.window)
        o_w, _ = _attend(qc, kw, vw, m_w[None, None], scale)
        g = gates[:, t0:t1].unsqueeze(-1)
        o = g[..., 0, :] * o_c + g[..., 1, :] * o_s + g[..., 2, :] * o_w
        o.backward(dout[:, t0:t1].double())
        outs.append(o.detach())
    rows = B * HKV * T
    return torch.cat(outs, 1), [x.grad for x in xs], worst_gap, same_rows / rows


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check(cases, dq_buffer_bytes: int | None = None):
    """``dq_buffer_bytes``: the selected backward's dS budget (None: the default; 0 checks the dQ recompute)."""
    names = ["q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"]
    results = []
    for case in cases:
        try:
            results.append(check_one(*case, names, dq_buffer_bytes))
        except Exception as e:  # keep going: one failing shape must not hide the others
            print(f"check {case[:6]} FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
            results.append(dict(B=case[0], T=case[1], HQ=case[2], HKV=case[3], DK=case[4], DV=case[5], ok=False,
                                worst=float("nan"), deterministic=False, sel_max_gap=float("nan"),
                                sel_same_rows=0.0, error=str(e)[:400]))
        torch.cuda.empty_cache()
    return results


def check_one(B, T, HQ, HKV, DK, DV, p, chunk, names, dq_buffer_bytes=None):
    ins = make_inputs(B, T, HQ, HKV, DK, DV, p, seed=T + HQ)
    xs = [x.detach().requires_grad_(True) for x in ins]
    dout = torch.randn(B, T, HQ, DV, device="cuda", dtype=torch.bfloat16)
    kw = {} if dq_buffer_bytes is None else dict(dq_buffer_bytes=dq_buffer_bytes)
    # Deterministic: two calls give bitwise the same gradients, the first with the eager backward on one stream and
    # the second with its band dK/dV on the side stream (ops.EAGER_FORK_VALUES), whatever the shape's own choice.
    with eager_fork(False):
        out, idx = nsa_attention(*xs, p, **kw)
        out.backward(dout)
    grads = [x.grad for x in xs]
    xs2 = [x.detach().requires_grad_(True) for x in ins]
    with eager_fork(True):
        out2, _ = nsa_attention(*xs2, p, **kw)
        out2.backward(dout)
    determ = all(torch.equal(a, b.grad) for a, b in zip(grads, xs2))
    ref, rgrads, gap, same = chunked_reference(ins, idx, dout, p, chunk)
    errs = {"out": rel(out, ref)}
    errs.update({"d" + n: rel(g, r) for n, g, r in zip(names, grads, rgrads)})
    finite = all(bool(torch.isfinite(g).all()) for g in grads) and bool(torch.isfinite(out).all())
    # Selection gap: fp32 importances leave ~1e-7 against float64 (0 to 1e-7 measured); a tf32 overlap map left
    # ~3e-4 in 0.4 % of rows and passed the old 1e-2 bound (select_precision_H100.md).
    ok = max(errs.values()) < 1e-2 and finite and determ and gap < 1e-4
    row = dict(B=B, T=T, HQ=HQ, HKV=HKV, DK=DK, DV=DV, ok=ok, worst=max(errs.values()), errs=errs,
               deterministic=determ, sel_max_gap=gap, sel_same_rows=same)
    print(f"check B={B} T={T} HQ={HQ} HKV={HKV} Dk={DK} Dv={DV}: ok={ok} worst={row['worst']:.2e} "
          f"det={determ} sel_gap={gap:.1e} sel_same={same:.4f}", flush=True)
    return row
