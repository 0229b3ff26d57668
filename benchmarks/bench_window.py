"""The sliding-window branch alone, three ways: our band kernel, FlexAttention, flash-attn (issue 11 item 4).

    python benchmarks/bench_window.py --cases m7c:8192:2,1b:8192:2,paper:8192:1,qwen7b:8192:1,m7c:32768:1 [--out DIR]
        [--paths band,torch_flash,torch_flash_det] [--tag NAME]

Per case (config:T:B, configs as in profile_block.py, window 512 as the paper's): forward+backward ms (median of
triton.testing.do_bench) and peak memory above the inputs of
- ``band``: ``band_fwd`` + ``band_bwd`` as the fused NSA op calls them for the window (kstride 1, offset 0);
- ``flex``: ``torch.compile``d flex_attention with the block mask the torch path uses
  (``local_attention.window_block_mask``: full blocks skip the mask_mod), built in every call as the torch path
  does; ``flex_mask_once`` the same with the mask built once per shape;
- ``flash``: ``flash_attn_func(causal=True, window_size=(w - 1, 0))``, only where flash-attn is installed;
- ``torch_flash``: the FlashAttention-2 kernels that ship inside torch, through ``aten._flash_attention_forward`` /
  ``_backward`` with ``window_size_left = w - 1`` (GQA native, no mask); ``torch_flash_det`` the same with the
  backward run under ``torch.use_deterministic_algorithms(True)``.
Each path's output and dQ are compared with the band kernel's (bf16 rounding: rel err ~1e-3), and its backward is
run twice on the same dO: ``<path>_det`` says whether dQ, dK and dV came out bitwise equal. The fastest path per
shape is what the NSA op should run for its window branch. Writes bench_window_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_checks import rel, run_header, write_results  # noqa: E402
from attention_timing import bench_one  # noqa: E402
from profile_block import ATTN_CONFIGS, PAPER_P  # noqa: E402

from nsa_titan.kernels import band, band_bwd  # noqa: E402
from nsa_titan.models.nsa import local_attention  # noqa: E402


class _Band(torch.autograd.Function):
    """The band kernels as the NSA op runs them for its window branch, behind autograd so that every path is
    timed the same way (forward, then backward from the same dO)."""

    @staticmethod
    def forward(ctx, q, k, v, window):
        o, lse = band.band_fwd(q, k, v, 1, 0, window)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.window = window
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = band_bwd.band_bwd(do, q, k, v, o, lse, 1, 0, ctx.window)
        return dq, dk, dv, None


def _flash(q, k, v, window):
    from flash_attn import flash_attn_func  # noqa: PLC0415 - optional

    return flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0))


class _TorchFlash(torch.autograd.Function):
    """torch's own FlashAttention-2 with a sliding window (causal, keys (t - w, t]): the aten ops SDPA's flash
    backend calls, which take the window that SDPA does not expose."""

    @staticmethod
    def forward(ctx, q, k, v, window, deterministic):
        T, scale = q.shape[1], q.shape[-1] ** -0.5
        o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, T, T, 0.0, True, False, scale=scale, window_size_left=window - 1,
            window_size_right=0)
        ctx.save_for_backward(q, k, v, o, lse, rng, unused)
        ctx.window, ctx.deterministic = window, deterministic
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, rng, unused = ctx.saved_tensors
        T, scale = q.shape[1], q.shape[-1] ** -0.5
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(ctx.deterministic or before)
        try:
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                do.contiguous(), q, k, v, o, lse, None, None, T, T, 0.0, True, rng, unused, scale=scale,
                window_size_left=ctx.window - 1, window_size_right=0)
        finally:
            torch.use_deterministic_algorithms(before)
        return dq, dk, dv, None, None


_MASKS: dict = {}


def _flex_mask_once(q, k, v, window):
    """FlexAttention with the block mask built once per shape: how fast Flex is when a caller caches its mask
    (the torch path builds it in every call, a few small GPU ops that the "flex" column includes)."""
    key = (q.shape[1], window, q.device)
    if key not in _MASKS:
        _MASKS[key] = local_attention.window_block_mask(q.shape[1], window, q.device)
    out = local_attention._compiled_flex()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           block_mask=_MASKS[key], enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def paths() -> dict:
    found = {"band": lambda q, k, v, w: _Band.apply(q, k, v, w), "flex": local_attention._flex_window,
             "flex_mask_once": _flex_mask_once,
             "torch_flash": lambda q, k, v, w: _TorchFlash.apply(q, k, v, w, False),
             "torch_flash_det": lambda q, k, v, w: _TorchFlash.apply(q, k, v, w, True)}
    try:
        import flash_attn  # noqa: F401, PLC0415 - optional: used when installed, never required

        found["flash"] = _flash
    except ImportError:
        pass
    return found


def case(name: str, T: int, B: int, window: int, only: list[str] | None = None) -> dict:
    HQ, HKV, DK, DV = ATTN_CONFIGS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, h, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
               for h, d in ((HQ, DK), (HKV, DK), (HKV, DV)))
    dout = torch.randn(B, T, HQ, DV, device="cuda", generator=g).to(torch.bfloat16)
    row, ref = dict(config=name, T=T, B=B, window=window), None
    chosen = {lb: fn for lb, fn in paths().items() if only is None or lb in only}
    for label, fn in chosen.items():
        try:
            out = fn(q, k, v, window)
            (dq,) = torch.autograd.grad(out, q, dout)
            again = [torch.autograd.grad(fn(q, k, v, window), (q, k, v), dout) for _ in range(2)]
            row[f"{label}_det"] = all(torch.equal(a, b) for a, b in zip(*again))
            if ref is None:
                ref = out.detach(), dq
            row[f"{label}_err"] = max(rel(out.detach(), ref[0]), rel(dq, ref[1]))
            row[f"{label}_ms"], row[f"{label}_GiB"] = bench_one(lambda: fn(q, k, v, window), [q, k, v], dout,  # noqa: B023
                                                                bwd=True)
        except Exception as e:  # noqa: BLE001 - a path that cannot run this shape: record it, time the others
            row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        torch.cuda.empty_cache()
    timed = {lb: row[f"{lb}_ms"] for lb in chosen if f"{lb}_ms" in row and row.get(f"{lb}_err", 1) < 1e-2}
    row["fastest"] = min(timed, key=timed.get) if timed else None
    return row


def to_markdown(payload: dict) -> str:
    labels = [lb for lb in paths() if any(f"{lb}_ms" in r or f"{lb}_error" in r for r in payload["rows"])]
    lines = [f"# Sliding-window branch, fwd+bwd: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}; bf16, window "
             f"{payload['window']}; ms (median of do_bench), relative error of output/dQ vs the band kernel, and "
             "whether two backward runs gave bitwise equal dQ/dK/dV (det).", "",
             "| config | T | B | " + " | ".join(f"{lb} ms" for lb in labels) + " | " +
             " | ".join(f"{lb} err" for lb in labels) + " | " + " | ".join(f"{lb} det" for lb in labels) +
             " | fastest |",
             "|---|---|---|" + "---|" * (3 * len(labels)) + "---|"]
    for r in payload["rows"]:
        ms = [f"{r[f'{lb}_ms']:.3f}" if f"{lb}_ms" in r else "error" for lb in labels]
        err = [f"{r[f'{lb}_err']:.1e}" if f"{lb}_err" in r else "-" for lb in labels]
        det = [("yes" if r[f"{lb}_det"] else "no") if f"{lb}_det" in r else "-" for lb in labels]
        lines.append(f"| {r['config']} | {r['T']} | {r['B']} | " + " | ".join(ms + err + det) +
                     f" | {r['fastest']} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="m7c:8192:2,1b:8192:2,paper:8192:1,qwen7b:8192:1,m7c:32768:1,1b:32768:1")
    ap.add_argument("--window", type=int, default=PAPER_P.window)
    ap.add_argument("--tag", default="", help="results file name: bench_window[_TAG]_<device>")
    ap.add_argument("--paths", default=None, help="comma-separated subset of the paths (default: all that run; "
                    "the first one given is the reference for the error column)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    payload = run_header(window=a.window, paths=list(paths()), rows=[])
    for spec in a.cases.split(","):
        name, T, B = spec.split(":")
        payload["rows"].append(case(name, int(T), int(B), a.window, a.paths.split(",") if a.paths else None))
        print(json.dumps(payload["rows"][-1]), flush=True)
    tag = f"_{a.tag.lstrip('_')}" if a.tag else ""
    write_results(a.out, f"bench_window{tag}_" + payload["device"].replace(" ", "_"), payload, to_markdown(payload))


if __name__ == "__main__":
    main()
