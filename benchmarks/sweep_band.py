"""Launch-shape sweep and mask A/B of the band kernels (compressed and window branches), per config and length.

    python benchmarks/sweep_band.py --configs 1b,m7c --ts 8192,32768 [--batch 2] [--tag _x] [--out DIR]

For each (config, T) and each geometry (compressed: stride d, offset l - 1; window: w), every variant of
``VARIANTS`` is timed (median of triton.testing.do_bench): the forward alone, and the whole band backward with
the variant applied to its dQ or to its dK/dV kernel (the other kernel at its default, so differences between
rows of one kernel are that kernel's). A variant is a partial launch config over the default of
band.launch_cfg: ``{}`` is the default itself, ``{"split": False}`` the default with every tile masked (the
A/B of the mask-free interior tiles); a shape with ``"split": False`` is labelled ``/masked``. Outputs are
checked against the default's (bf16 rounding only). Writes sweep_band<tag>_<device>.json.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_checks import make_inputs, picked_variants, run_sweep, sweep_parser, time_variants  # noqa: E402
from profile_block import ATTN_CONFIGS, PAPER_P  # noqa: E402

from nsa_titan.kernels import band, band_bwd, band_dq2  # noqa: E402
from nsa_titan.kernels.combine import rowdot  # noqa: E402


def _v(rows, BK, w, st):
    return dict(rows=rows, BK=BK, num_warps=w, num_stages=st)


VARIANTS = {  # first: the default; then without the mask-free interior; then (fwd, dQ) with pointer loads of K/V
    "band_fwd": [{}, {"split": False}, {"tma": False}, _v(128, 64, 4, 2), _v(64, 64, 4, 3), _v(128, 64, 8, 3),
                 _v(128, 64, 8, 2), _v(64, 128, 4, 2), _v(128, 128, 8, 2), _v(64, 64, 4, 4), _v(128, 64, 4, 3),
                 dict(_v(128, 64, 8, 3), split=False)],
    "band_dq": [{}, {"split": False}, {"tma": False}, _v(128, 64, 4, 2), _v(128, 64, 8, 3), _v(64, 64, 4, 3),
                _v(128, 64, 8, 2), _v(128, 32, 8, 3), _v(64, 128, 4, 2), _v(128, 128, 8, 2), _v(64, 64, 4, 4)],
    "band_dkdv": [{}, {"split": False}, _v(64, 64, 4, 2), _v(32, 128, 4, 2), _v(64, 128, 8, 2), _v(128, 64, 8, 2),
                  _v(64, 64, 8, 2), _v(64, 32, 4, 3), _v(128, 128, 8, 1), _v(64, 64, 4, 3),
                  # no register spills at head dim 128 (kernel_resources.py, notes attempt 19)
                  dict(_v(128, 64, 8, 2), split=False),
                  # the keys as the MMA rows (band_bwd KT, attempt 72; TUNED's G 16 default since, which the shapes
                  # above inherit unless they say keys_rows=False): no register tile transposed before the dV and dK
                  # MMAs. Offline sm_90, 1b compressed: 64/64/4/3 255 registers, 16 B of stack, 132 KB of shared memory
                  # (140 KB without); 64 rows / 128 keys / 8 warps (a warpgroup per 64 keys) 64 B of stack against 424
                  dict(keys_rows=True), dict(keys_rows=True, **_v(64, 128, 8, 2)),
                  dict(keys_rows=True, **_v(64, 64, 4, 2)), dict(keys_rows=True, **_v(128, 64, 8, 2)),
                  dict(keys_rows=True, **_v(64, 128, 8, 3)), dict(keys_rows=True, **_v(32, 128, 8, 2))],
    # The window's and the compressed branch's dQ in one launch (band_dq2.band_dq2, attempt 82) against the two
    # band_bwd dQ calls (the first variant), both adding into a dQ buffer. Offline sm_90 at G 16 / head dim 128 with
    # descriptors: 64/64/4/3 219 registers, 128/32/8/3 171, 128/64/8/4 229, 64/64/8/3 186, 64/32/4/3 171, no spills;
    # ptxas crashes at 128/64/8/3 (the single-branch default) and at 2 stages
    "band_dq2": [{"two": True}, _v(64, 64, 4, 3), _v(128, 32, 8, 3), _v(128, 64, 8, 4), _v(64, 64, 8, 3),
                 _v(64, 32, 4, 3)],
}


def _label(c: dict) -> str:
    if c.get("two"):
        return "two calls"
    masked = ("/masked" if c.get("split", True) is False else "") + ("/pointers" if c.get("tma", True) is False else "")
    kt = "kt:" if c.get("keys_rows") else ""  # band_bwd's dK/dV with the keys as MMA rows
    if set(c) <= {"split", "tma", "keys_rows"}:
        return kt + "default" + masked
    return kt + f"{c['rows']}/{c['BK']}/{c['num_warps']}/{c['num_stages']}" + masked


def case(name: str, T: int, B: int, kernels=tuple(VARIANTS), pick: list[int] | None = None) -> dict:

    HQ, HKV, DK, DV = ATTN_CONFIGS[name]
    p = PAPER_P
    q, kc, vc, _, _, kw, vw, _ = make_inputs(B, T, HQ, HKV, DK, DV, p)
    do = torch.randn(B, T, HQ, DV, device=q.device, dtype=q.dtype)
    out = dict(config=name, T=T, B=B, G=HQ // HKV, D=max(DK, DV))
    geos = {"cmp": (kc, vc, (p.cmp_stride, p.cmp_block - 1, 0)), "win": (kw, vw, (1, 0, p.window))}
    for geo_name, (k, v, geo) in geos.items():
        o, lse = band.band_fwd(q, k, v, *geo)
        jobs = {
            "band_fwd": lambda c, k=k, v=v, geo=geo: band.band_fwd(q, k, v, *geo, cfg=c)[:1],
            "band_dq": lambda c, k=k, v=v, geo=geo, o=o, lse=lse: band_bwd.band_bwd(do, q, k, v, o, lse, *geo,
                                                                                cfg_dq=c)[:1],
            "band_dkdv": lambda c, k=k, v=v, geo=geo, o=o, lse=lse: band_bwd.band_bwd(do, q, k, v, o, lse, *geo,
                                                                                  cfg_dkdv=c)[1:],
        }
        for kname, fn in jobs.items():
            if kname not in kernels:
                continue
            variants = [VARIANTS[kname][i] for i in pick] if pick else VARIANTS[kname]
            res, best = time_variants(fn, variants, fn({}), label=_label)
            out[f"{geo_name}:{kname}"] = res
            _report(f"{name} T={T} B={B} {geo_name} {kname}", res, best)
    if "band_dq2" in kernels:
        branches = []
        for k, v, geo in (geos["win"], geos["cmp"]):
            o, lse = band.band_fwd(q, k, v, *geo)
            branches.append((k, v, o, lse, rowdot(do, o), geo))

        def dq2(c):
            dq = torch.zeros_like(q)
            if c.get("two"):
                for k, v, o, lse, delta, geo in branches:
                    band_bwd.band_bwd(do, q, k, v, o, lse, *geo, delta=delta, dq_acc=dq, parts="dq")
            else:
                band_dq2.band_dq2(do, q, *[(k, v, lse, delta, *geo) for k, v, _, lse, delta, geo in branches], dq,
                                  cfg=c)
            return (dq,)

        variants = [VARIANTS["band_dq2"][i] for i in pick] if pick else VARIANTS["band_dq2"]
        res, best = time_variants(dq2, variants, dq2({"two": True}), label=_label)
        out["band_dq2"] = res
        _report(f"{name} T={T} B={B} win+cmp band_dq2", res, best)
    return out


def _report(head, res, best):
    print(f"{head}: " + ", ".join(f"{r['label']}={r.get('ms', 'ERR')}{'' if r.get('same', True) else '!'}" for r in res)
          + f"  -> best {best and best['label']} {best and best['ms']}", flush=True)


def main():
    ap = sweep_parser("1b,m7c,paper,qwen7b")
    ap.add_argument("--kernels", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    a = ap.parse_args()
    kernels = tuple(a.kernels.split(","))
    if unknown := set(kernels) - set(VARIANTS):
        ap.error(f"--kernels: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    pick = picked_variants(ap, a, VARIANTS, kernels)
    run_sweep("sweep_band", a, lambda name, T: case(name, T, a.batch, kernels, pick))


if __name__ == "__main__":
    main()
