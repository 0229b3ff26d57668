"""The compressed branch as square causal attention over token groups, through torch's SDPA backends, against our
band kernel (attempt 104, thirty-first session; not adopted: the band kernel is faster at every shape tried).

Query t sees compressed key i iff i*d + l - 1 <= t. With t' = t - (l - 1) and the group g = t' // d, that is
i <= g: plain causal attention between Tc groups and Tc keys, once each group's d tokens (times the G heads of a KV
head) become extra query heads of that KV head (``fold_q``; tokens t < l - 1 see nothing and come back as zeros).
So cuDNN or FlashAttention could run the branch at their FLOP rate, for the price of folding Q and unfolding O, dQ.

    python benchmarks/cmp_fold_sdpa.py OUT.json     (GPU; writes OUT.json and OUT.md)
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys

import torch
import torch.nn.functional as F

L, D_STRIDE = 32, 16  # the paper's compression block and stride
CONFIGS = {"m7c": (12, 2, 64), "1b": (16, 1, 128), "paper": (64, 4, 128), "qwen7b": (28, 4, 128)}  # HQ, HKV, D
SHAPES = [("m7c", 8192, 2), ("m7c", 32768, 1), ("1b", 32768, 1), ("1b", 65536, 1), ("paper", 65536, 1),
          ("qwen7b", 8192, 2), ("paper", 8192, 1)]


def fold_q(q: torch.Tensor, hkv: int, l: int = L, d: int = D_STRIDE) -> torch.Tensor:  # noqa: E741 - the paper's l
    """[B, T, HQ, D] -> [B, HKV * d * G, Tc, D]: query head (kv, r, j) of group g is token (l-1) + g*d + r, head
    kv*G + j, so that SDPA's GQA maps it to KV head kv."""
    b, t, hq, dim = q.shape
    g = hq // hkv
    n = t - l + 1
    groups = -(-n // d)
    x = F.pad(q[:, l - 1:], (0, 0, 0, 0, 0, groups * d - n))
    return x.reshape(b, groups, d, hkv, g, dim).permute(0, 3, 2, 4, 1, 5).reshape(b, hkv * d * g, groups, dim)


def unfold(o: torch.Tensor, t: int, hq: int, hkv: int, l: int = L, d: int = D_STRIDE) -> torch.Tensor:  # noqa: E741
    """fold_q's inverse for [B, HQ', Tc, Dv] -> [B, T, HQ, Dv]; rows t < l - 1 are zeros."""
    b, _, groups, dv = o.shape
    x = o.reshape(b, hkv, d, hq // hkv, groups, dv).permute(0, 4, 2, 1, 3, 5).reshape(b, groups * d, hq, dv)
    return F.pad(x[:, :t - l + 1], (0, 0, 0, 0, l - 1, 0))


def folded_attention(q, k, v, hkv: int, backend=None) -> torch.Tensor:
    """The compressed branch's output through SDPA over folded groups (k, v [B, Tc, HKV, D])."""
    from torch.nn.attention import sdpa_kernel  # noqa: PLC0415 - optional

    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
        of = F.scaled_dot_product_attention(fold_q(q, hkv), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                            enable_gqa=True)
    return unfold(of, q.shape[1], q.shape[2], hkv)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def measure(name: str, t: int, batch: int) -> dict:
    import triton  # noqa: PLC0415 - GPU only
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415 - optional

    from nsa_titan.kernels import band, band_bwd  # noqa: PLC0415 - GPU only

    hq, hkv, dim = CONFIGS[name]
    torch.manual_seed(0)
    tc = (t - L) // D_STRIDE + 1
    q = torch.randn(batch, t, hq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, tc, hkv, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    do = torch.randn(batch, t, hq, dim, device="cuda", dtype=torch.bfloat16)
    qd, kd, vd = q.detach(), k.detach(), v.detach()

    def band_fb():
        o, lse = band.band_fwd(qd, kd, vd, D_STRIDE, L - 1, 0)
        return band_bwd.band_bwd(do, qd, kd, vd, o, lse, D_STRIDE, L - 1, 0)

    o_ref, _ = band.band_fwd(qd, kd, vd, D_STRIDE, L - 1, 0)
    dq_ref, dk_ref, dv_ref = band_fb()
    bench = lambda fn: triton.testing.do_bench(fn, return_mode="median")  # noqa: E731
    row = dict(cfg=name, T=t, B=batch, band_fwd_ms=bench(lambda: band.band_fwd(qd, kd, vd, D_STRIDE, L - 1, 0)),
               band_fwdbwd_ms=bench(band_fb))
    for key, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            o = folded_attention(q, k, v, hkv, backend)
            o.backward(do)
            row[key + "_err"] = {"o": rel(o, o_ref), "dq": rel(q.grad, dq_ref), "dk": rel(k.grad, dk_ref),
                                 "dv": rel(v.grad, dv_ref)}
            with torch.no_grad():
                row[key + "_fwd_ms"] = bench(lambda: folded_attention(qd, kd, vd, hkv, backend))  # noqa: B023

            def fb():
                q.grad = k.grad = v.grad = None
                folded_attention(q, k, v, hkv, backend).backward(do)  # noqa: B023
            row[key + "_fwdbwd_ms"] = bench(fb)
        except RuntimeError as e:  # a backend that does not take this shape
            row[key + "_error"] = repr(e)[:300]
        q.grad = k.grad = v.grad = None
    # SDPA alone on inputs folded beforehand: what the branch would cost where the fold is free (a view when
    # HKV = 1 and T - l + 1 is a multiple of d), and whether cuDNN's backward repeats itself bitwise.
    qf = fold_q(qd, hkv).contiguous().requires_grad_()
    kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (kd, vd))
    dof = fold_q(do, hkv).contiguous()

    def sdpa_fb():
        qf.grad = kt.grad = vt.grad = None
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qf, kt, vt, is_causal=True, enable_gqa=True).backward(dof)
        return qf.grad, kt.grad, vt.grad
    try:
        first = [g.clone() for g in sdpa_fb()]
        row["cudnn_bwd_bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip(first, sdpa_fb()))
        row["cudnn_nocopy_fwdbwd_ms"] = bench(sdpa_fb)
    except RuntimeError as e:
        row["cudnn_nocopy_error"] = repr(e)[:300]
    row["fold_copies_ms"] = bench(lambda: unfold(fold_q(qd, hkv).contiguous(), t, hq, hkv).contiguous())
    return row


def main(path: str) -> None:
    import triton  # noqa: PLC0415 - GPU only

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.date.today().isoformat(), "rows": []}
    for shape in SHAPES:
        out["rows"].append(measure(*shape))
        print(json.dumps(out["rows"][-1]), flush=True)
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    nan = float("nan")
    md = [f"# Compressed branch: band kernel vs SDPA over folded token groups ({out['device']}, torch {out['torch']}, "
          f"triton {out['triton']}, {out['date']})", "",
          "ms (do_bench median), bf16, l=32 d=16. SDPA columns include the fold / unfold copies (autograd through "
          "them); `copies` is the forward's fold + unfold alone.", "",
          "| config | T | B | band fwd | band fwd+bwd | cuDNN fwd | cuDNN fwd+bwd | flash fwd+bwd | copies | "
          "cuDNN fwd+bwd, folded beforehand | cuDNN backward repeatable |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        md.append(f"| {r['cfg']} | {r['T']} | {r['B']} | {r['band_fwd_ms']:.3f} | {r['band_fwdbwd_ms']:.3f} | "
                  f"{r.get('cudnn_fwd_ms', nan):.3f} | {r.get('cudnn_fwdbwd_ms', nan):.3f} | "
                  f"{r.get('flash_fwdbwd_ms', nan):.3f} | {r['fold_copies_ms']:.3f} | "
                  f"{r.get('cudnn_nocopy_fwdbwd_ms', nan):.3f} | {r.get('cudnn_bwd_bitwise_repeatable', 'n/a')} |")
    with open(path.removesuffix(".json") + ".md", "w") as f:
        f.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
