"""GPU check + timing of the Gluon selected dK/dV walk against the Triton one."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch, triton
from torch.profiler import profile, ProfilerActivity
from nsa_titan.kernels import band, select, selected, selected_bwd
from profile_block import ATTN_CONFIGS

out = os.environ.get("OUT", "/tmp")
res = []
def relerr(a, b): return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

def case(name, T, B):
    HQ, HKV, D, _ = ATTN_CONFIGS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    S = (T - 32) // 16 + 1
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()
    q, k, v, do = mk(B, T, HQ, D), mk(B, T, HKV, D), mk(B, T, HKV, D), mk(B, T, HQ, D)
    kc, vc = mk(B, S, HKV, D), mk(B, S, HKV, D)
    _, lse_c = band.band_fwd(q, kc, vc, 16, 31, 0)
    bi = select.select_blocks(q, kc, lse_c, 32, 16, 64, 16)
    o, lse, keys = selected.sel_fwd(q, k, v, bi, 64, with_pairs=True)
    r = dict(config=name, T=T, B=B)
    outs = {}
    global V
    V = {"triton": None, "t_r168": {"maxnreg": 168}, "t_r128": {"maxnreg": 128}, "t128w8": {"rows": 128, "num_warps": 8}, "t128w8_r128": {"rows": 128, "num_warps": 8, "maxnreg": 128}}
    for lab, cfg in (("triton", None), ("gluon", {"gluon": True}), ("gluon_rep", {"gluon": True})):
        outs[lab] = selected_bwd.sel_bwd(do, q, k, v, o, lse, bi, 64, cfg_dkdv=cfg, keys=keys)
    torch.cuda.synchronize()
    for i, nm in enumerate(("dq", "dk", "dv")):
        r[nm + "_rel"] = relerr(outs["gluon"][i], outs["triton"][i])
    r["det"] = all(torch.equal(a, b) for a, b in zip(outs["gluon"], outs["gluon_rep"]))
    if os.environ.get("NCU"):
        for lab in ("triton", "g4", "g8"):
            selected_bwd.sel_bwd(do, q, k, v, o, lse, bi, 64, cfg_dkdv=V[lab], keys=keys)
        torch.cuda.synchronize()
        print(json.dumps(r)); return
    delta = torch.einsum("bthd,bthd->bth", do.float(), o.float())
    for lab in list(V) * 2:
        cfg = V[lab]
        f = lambda: selected_bwd.sel_bwd(do, q, k, v, o, lse, bi, 64, cfg_dkdv=cfg, keys=keys, delta=delta)
        r.setdefault(lab + "_ms", []).append(triton.testing.do_bench(f, warmup=20, rep=100))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                f()
            torch.cuda.synchronize()
        kt = {e.key[:40]: round(e.device_time_total / 10 / 1000, 4) for e in prof.key_averages() if e.device_time_total > 0}
        r[lab + "_kernels"] = kt
    print(json.dumps(r), flush=True)
    res.append(r)

for spec in sys.argv[1].split(","):
    n, T, B = spec.split(":")
    try:
        case(n, int(T), int(B))
    except Exception as e:
        import traceback; traceback.print_exc()
        res.append(dict(spec=spec, error=repr(e)[:800]))
json.dump(res, open(os.path.join(out, "gluon_walk_" + sys.argv[2] + ".json"), "w"), indent=1)
