"""The compressed branch's dQ by atomics inside its dK/dV kernel against the deterministic dQ pass, paired, one GPU.

    python benchmarks/ab_band_dq_atomic.py --cases paper:65536:1,1b:65536:1 [--tag _x] [--out DIR]

Attempt 116. The band backward as the model runs it (ops.nsa_bwd) does the compressed branch in seven matmul
units: its dK/dV kernel (S, dP, dV, dK) and, inside band_dq2 beside the window's, a dQ pass that recomputes S and dP
before dQ = dS K. With ``band_bwd(..., dq_atomic=buf)`` the dK/dV kernel adds dS K into an fp32 buffer by atomics
(FlashAttention's five units); the order of those additions varies from run to run. Timed here, each in
alternating pairs (ab_eager_fork.paired_samples: L2 flushed, order swapped every pair, median of per-pair ratios):

- ``deterministic``: compressed dK/dV, then band_dq2 over the window's and the compressed keys (today's calls);
- ``atomic``: zero the fp32 buffer, compressed dK/dV with atomic dQ, the window's dQ pass, and the buffer added
  into dQ (a torch add: a model would fold the buffer into the window's dQ store instead, so this is the upper
  bound of its cost);
- ``atomic_nofold``: the same without the final add (the lower bound);
- ``atomic_r128``, ``atomic_r32``: ``atomic`` with the compressed dK/dV at 128 query rows x 64 keys, or 32 x 128
  (VARIANTS says why);
- ``attention``: the whole NSA attention's eager forward+backward with the model's ``deterministic_backward`` on
  and off (``nsa_attention(..., dq_atomic=)``: the buffer folded into the window's dQ pass, which waits for the
  side stream's dK/dV); its "same bits" column covers every gradient but dQ; ``attention_r32`` the same with the
  compressed dK/dV at 32 rows x 128 keys when the atomics are on (tuned.py's entry swapped in-process).

It checks that dK/dV are the same bits both ways and reports dQ's relative difference. Inputs: make_inputs' random
tensors with each branch's LSE from band_fwd. Writes ab_band_dq_atomic<tag>_<device>.json and .md.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

# variant -> (fold the buffer into dQ, the compressed dK/dV's launch shape: None = tuned.py's). The tuned G 16 shape
# (64 rows, 128-key tiles, 8 warps, keys as MMA rows) spills with the fifth MMA (sm_90 offline, Triton 3.6: stack
# 64 -> 368 B at the 1b, 176 -> 328 at the paper's two KV heads); 128 rows x 64 keys with queries as MMA rows spills
# least (0 -> 232 / 160 B) but adds twice the atomic traffic per FLOP of 128-key tiles.
# 32 rows x 128 keys with keys as MMA rows spills nowhere (242 registers at the 1b, 255 at the paper), its dQ MMA
# (M = 32) as mma.sync, and keeps the 128-key tiles' atomic traffic.
R128 = dict(rows=128, BK=64, num_warps=8, num_stages=2, split=False, keys_rows=False, balanced=True, balanced_cap=True)
R32 = dict(rows=32, BK=128, num_warps=8, num_stages=3, split=False, keys_rows=True, balanced=True, balanced_cap=True)
VARIANTS = {"atomic": (True, None), "atomic_nofold": (False, None), "atomic_r128": (True, R128),
            "atomic_r32": (True, R32)}


def switch() -> tuple[dict, object]:
    """-> (mode, choice): ``choice(on)`` (paired_samples' context manager) sets ``mode["on"]`` for a call to read."""
    mode = {"on": False}

    @contextlib.contextmanager
    def choice(on: bool):
        mode["on"] = on
        yield

    return mode, choice


def band_backward_calls(name: str, T: int, B: int) -> tuple[dict, dict]:
    """-> (calls, outputs): ``calls[variant]()`` runs the compressed and window branches' backward of ``name``'s
    shape one way ("deterministic" or one of VARIANTS), writing into ``outputs`` (dq, dk, dv)."""
    import torch
    from attention_checks import make_inputs
    from profile_block import ATTN_CONFIGS, PAPER_P

    from nsa_titan.kernels import band, band_bwd, band_dq2
    from nsa_titan.kernels.combine import rowdot

    torch.manual_seed(0)
    HQ, HKV, DK, DV = ATTN_CONFIGS[name]
    p = PAPER_P
    q, kc, vc, _ks, _vs, kw, vw, _g = make_inputs(B, T, HQ, HKV, DK, DV, p)
    do = torch.randn(B, T, HQ, DV, device=q.device, dtype=q.dtype)
    cmp = (p.cmp_stride, p.cmp_block - 1, 0)
    win = (1, 0, p.window)
    oc, lc = band.band_fwd(q, kc, vc, *cmp)
    ow, lw = band.band_fwd(q, kw, vw, *win)
    dc, dw = rowdot(do, oc), rowdot(do, ow)
    out = dict(dq=torch.empty_like(q), dk=torch.empty_like(kc), dv=torch.empty_like(vc))
    buf = torch.empty(q.shape, dtype=torch.float32, device=q.device)

    def deterministic():
        band_bwd.band_bwd(do, q, kc, vc, oc, lc, *cmp, delta=dc, parts="dkdv", dkv_out=(out["dk"], out["dv"]))
        band_dq2.band_dq2(do, q, (kw, vw, lw, dw, *win), (kc, vc, lc, dc, *cmp), out["dq"], acc=False)

    def atomic(fold: bool, cfg: dict | None):
        buf.zero_()
        band_bwd.band_bwd(do, q, kc, vc, oc, lc, *cmp, delta=dc, parts="dkdv", dkv_out=(out["dk"], out["dv"]),
                          dq_atomic=buf, cfg_dkdv=cfg)
        dq, _, _ = band_bwd.band_bwd(do, q, kw, vw, ow, lw, *win, delta=dw, parts="dq")
        if fold:
            out["dq"] = dq.add_(buf)

    calls = {name: functools.partial(atomic, fold, cfg) for name, (fold, cfg) in VARIANTS.items()}
    return dict(deterministic=deterministic, **calls), out


def measure(name: str, T: int, B: int, budget_ms: float = 4000.0) -> list[dict]:
    import torch
    from ab_eager_fork import paired_samples, summarize
    from attention_checks import rel

    calls, out = band_backward_calls(name, T, B)
    calls["deterministic"]()
    want = {k: v.clone() for k, v in out.items()}
    rows = []
    for variant, (fold, cfg) in VARIANTS.items():
        calls[variant]()  # dK/dV of the tuned shape: the same bits as the deterministic call's
        same_dkdv = torch.equal(want["dk"], out["dk"]) and torch.equal(want["dv"], out["dv"]) if cfg is None else None
        dq_diff = rel(out["dq"], want["dq"]) if fold else None
        mode, choice = switch()

        def call(variant=variant, mode=mode):
            calls[variant if mode["on"] else "deterministic"]()

        base, other, reps = paired_samples(call, choice, budget_ms)
        row = dict(config=name, T=T, B=B, variant=variant, dkdv_same_bits=same_dkdv, dq_rel_diff=dq_diff,
                   reps_per_sample=reps, **summarize(base, other, ("deterministic", "atomic")))
        print(f"{name} T={T} B={B}: deterministic {row['deterministic_ms']:.3f} -> {variant} {row['atomic_ms']:.3f} "
              f"ms; speed-up {row['speedup_median']:.3f} (IQR {row['speedup_q1']:.3f}-{row['speedup_q3']:.3f}); "
              f"dK/dV same bits {same_dkdv}, dQ rel. diff {dq_diff}", flush=True)
        rows.append(row)
    del want
    calls.clear()  # the band inputs go before the whole attention allocates its own
    out.clear()
    torch.cuda.empty_cache()
    for variant, shape in (("attention", None), ("attention_r32", R32)):
        rows.append(measure_attention(name, T, B, budget_ms, variant, shape))
    return rows


@contextlib.contextmanager
def compressed_dkdv_shape(G: int, dmax: int, shape: dict | None):
    """tuned.py's compressed dK/dV entry for this shape replaced by ``shape`` (merged into it) while inside; None
    leaves it. The model reads that entry for its compressed dK/dV, with or without the atomic dQ."""
    from nsa_titan.kernels.combine import pow2
    from nsa_titan.kernels.tuned import TUNED

    key = ("band_dkdv", pow2(G), dmax, False)
    before = TUNED.get(key)
    if shape is not None:
        TUNED[key] = {**(before or {}), **shape}
    try:
        yield
    finally:
        if before is None:
            TUNED.pop(key, None)
        else:
            TUNED[key] = before


def measure_attention(name: str, T: int, B: int, budget_ms: float = 4000.0, variant: str = "attention",
                      shape: dict | None = None) -> dict:
    """The whole NSA attention, eager forward+backward, with the model's deterministic_backward on and off (ops.
    nsa_bwd: the buffer folded into the window's dQ pass, band_dq2 waiting for the side stream's dK/dV); ``shape``:
    the compressed dK/dV's launch shape with the atomics (compressed_dkdv_shape), the tuned one without."""
    import torch
    from ab_eager_fork import paired_samples, summarize
    from attention_checks import make_inputs, rel
    from profile_block import ATTN_CONFIGS, PAPER_P

    from nsa_titan.kernels import nsa_attention

    torch.manual_seed(0)
    HQ, HKV, DK, DV = ATTN_CONFIGS[name]
    ins = [x.requires_grad_(True) for x in make_inputs(B, T, HQ, HKV, DK, DV, PAPER_P)]
    dout = torch.randn(B, T, HQ, DV, device="cuda", dtype=torch.bfloat16)
    mode, choice = switch()

    def call():
        for x in ins:
            x.grad = None
        with compressed_dkdv_shape(HQ // HKV, max(DK, DV), shape if mode["on"] else None):
            nsa_attention(*ins, PAPER_P, dq_atomic=mode["on"])[0].backward(dout)

    grads = []
    for on in (False, True):
        with choice(on):
            call()
        grads.append([x.grad.clone() for x in ins])
    same = all(a.equal(b) for a, b in zip(grads[0][1:], grads[1][1:]))
    dq_diff = rel(grads[1][0], grads[0][0])
    del grads
    base, other, reps = paired_samples(call, choice, budget_ms)
    row = dict(config=name, T=T, B=B, variant=variant, dkdv_same_bits=same if shape is None else None,
               dq_rel_diff=dq_diff,
               reps_per_sample=reps, **summarize(base, other, ("deterministic", "atomic")))
    print(f"{name} T={T} B={B}: NSA {variant} deterministic {row['deterministic_ms']:.3f} -> atomic "
          f"{row['atomic_ms']:.3f} ms; speed-up {row['speedup_median']:.3f} (IQR {row['speedup_q1']:.3f}-"
          f"{row['speedup_q3']:.3f}); other gradients same bits {same}, dQ rel. diff {dq_diff:.1e}", flush=True)
    return row


def _or_dash(x, fmt: str = "{}") -> str:
    return "-" if x is None else fmt.format(x)


def to_markdown(payload: dict) -> str:
    lines = [f"# Compressed dQ by atomics in its dK/dV kernel against the dQ pass: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}; "
             "`benchmarks/ab_band_dq_atomic.py` (attempt 116): the compressed and window branches' backward, median "
             "of per-pair speed-ups (deterministic / atomic) over alternating pairs of samples. `atomic` adds the fp32 "
             "buffer into dQ with a torch add (upper bound), `atomic_nofold` leaves it (lower bound), `atomic_r128` / "
             "`atomic_r32` run the compressed dK/dV at 128 query rows x 64 keys / 32 x 128; dK/dV's bits compared for "
             "the tuned shape only.",
             "",
             "| case | variant | deterministic ms | atomic ms | speed-up (IQR) | pairs x calls | dK/dV same bits | "
             "dQ rel. diff |", "|---|---|---|---|---|---|---|---|"]
    for r in payload["cases"]:
        lines.append(f"| {r['config']} {r['T']} B={r['B']} | {r['variant']} | {r['deterministic_ms']:.3f} | "
                     f"{r['atomic_ms']:.3f} | {r['speedup_median']:.3f} ({r['speedup_q1']:.3f}-{r['speedup_q3']:.3f}) "
                     f"| {r['pairs']} x {r['reps_per_sample']} | {_or_dash(r['dkdv_same_bits'])} | "
                     f"{_or_dash(r['dq_rel_diff'], '{:.1e}')} |")
    return "\n".join(lines) + "\n"


def main():
    from ab_eager_fork import ab_parser, parse_cases, run_cases
    from profile_block import ATTN_CONFIGS

    a = ab_parser(__doc__, "paper:65536:1,1b:65536:1").parse_args()
    run_cases(a, "ab_band_dq_atomic", parse_cases(a.cases, ATTN_CONFIGS), measure, to_markdown)


if __name__ == "__main__":
    main()
