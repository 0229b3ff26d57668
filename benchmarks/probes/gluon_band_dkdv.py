"""GPU check + timing of the Gluon band dK/dV against the Triton one."""
import json, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch, triton
from nsa_titan.kernels import band, band_gluon
from profile_block import ATTN_CONFIGS

out = os.environ.get("OUT", "/tmp")
res = []
def case(name, T, B, geom):
    HQ, HKV, D, _ = ATTN_CONFIGS[name]
    ks, ko, win = geom
    S = T if ks == 1 else (T - 32) // 16 + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, HQ, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, S, HKV, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, S, HKV, D, device="cuda", generator=g).bfloat16()
    do = torch.randn(B, T, HQ, D, device="cuda", generator=g).bfloat16()
    o, lse = band.band_fwd(q, k, v, ks, ko, win)
    base = band.launch_cfg("band_dkdv", band.pow2(HQ // HKV), D, win > 0, True)
    cfg_t = dict(base)
    cfg_g = dict(base, rows=64, BK=64, num_warps=4, gluon=True)
    sup = band_gluon.supported(q, k, v, None, 64, 64, 4)
    r = dict(config=name, T=T, B=B, geom="win" if win else "cmp", triton_cfg=base, supported=sup)
    _, dk_t, dv_t = band.band_bwd(do, q, k, v, o, lse, ks, ko, win, cfg_dkdv=cfg_t)
    _, dk_g, dv_g = band.band_bwd(do, q, k, v, o, lse, ks, ko, win, cfg_dkdv=cfg_g)
    _, dk_g2, dv_g2 = band.band_bwd(do, q, k, v, o, lse, ks, ko, win, cfg_dkdv=cfg_g)
    torch.cuda.synchronize()
    def relerr(a, b): return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
    r["dk_rel"], r["dv_rel"] = relerr(dk_g, dk_t), relerr(dv_g, dv_t)
    r["det"] = bool(torch.equal(dk_g, dk_g2) and torch.equal(dv_g, dv_g2))
    delta = torch.einsum("bthd,bthd->bth", do.float(), o.float())
    for lab, cfg in (("triton", cfg_t), ("gluon", cfg_g), ("triton2", cfg_t), ("gluon2", cfg_g)):
        f = lambda: band.band_bwd(do, q, k, v, o, lse, ks, ko, win, cfg_dkdv=cfg, delta=delta)
        r[lab + "_ms"] = triton.testing.do_bench(f, warmup=20, rep=100)
    # kernel-only time via profiler
    from torch.profiler import profile, ProfilerActivity
    for lab, cfg in (("triton", cfg_t), ("gluon", cfg_g)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                band.band_bwd(do, q, k, v, o, lse, ks, ko, win, cfg_dkdv=cfg, delta=delta)
            torch.cuda.synchronize()
        kt = {}
        for e in prof.key_averages():
            if "dkdv" in e.key or "band_bwd_dq" in e.key:
                kt[e.key] = e.device_time_total / 10 / 1000
        r[lab + "_kernels_ms"] = kt
    print(json.dumps(r), flush=True)
    res.append(r)

for spec in sys.argv[1].split(","):
    n, T, B, gm = spec.split(":")
    geom = {"win": (1, 0, 512), "cmp": (16, 31, 0)}[gm]
    try:
        case(n, int(T), int(B), geom)
    except Exception as e:
        import traceback; traceback.print_exc()
        res.append(dict(spec=spec, error=repr(e)[:500]))
json.dump(res, open(os.path.join(out, "gluon_dkdv_" + sys.argv[2] + ".json"), "w"), indent=1)
