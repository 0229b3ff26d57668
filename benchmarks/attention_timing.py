"""Timing helpers of the kernel table (bench_attention.py --bench): do_bench wall time and peak memory of one call,
its GPU kernel time, and fla-core's ``parallel_nsa`` on the same inputs when that wheel is importable."""

from __future__ import annotations

import torch

MIN_REPS = 5  # do_bench repetitions at least, however long one call takes


def bench_one(fn, grad_inputs, dout, bwd):
    from triton.testing import do_bench

    def run():
        out = fn()
        if bwd:
            out.backward(dout)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    # do_bench repeats within a 100 ms budget, so a call above it ran once, right after a device sync: at the paper
    # config's 64k fwd+bwd such single calls took 117-134 ms where back-to-back calls took 118-120 and the GPU was
    # idle 0.4 ms per call (twenty-fifth session's gap probe, NOTES_kernels). At least MIN_REPS repetitions instead.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    rep = max(100.0, MIN_REPS * start.elapsed_time(end))
    ms = do_bench(run, warmup=25, rep=rep, grad_to_none=grad_inputs if bwd else None, return_mode="median")
    return ms, peak


def _fwdbwd(fn, grad_inputs, dout):
    """-> a call of one forward+backward of ``fn`` (gradients cleared first, so they do not accumulate)."""

    def run():
        for x in grad_inputs:
            x.grad = None
        fn().backward(dout)

    return run


def kernel_ms(fn, grad_inputs, dout) -> float:
    """GPU kernel time of one forward+backward (torch.profiler), beside do_bench's wall time: a row whose wall time
    is well above it measures the host's launches (an eager op at a small size), not the kernels."""
    from profile_block import profile_kernels

    return profile_kernels(_fwdbwd(fn, grad_inputs, dout), iters=3)["kernel_ms"]


def graph_ms(fn, grad_inputs, dout) -> float:
    """Wall time of one forward+backward replayed from a CUDA graph (do_bench median): no host launches, as in a
    training step whose compiled blocks replay graphs (compile.mode reduce-overhead), the gaps between kernels
    included. For host-bound rows, where the eager wall time measures the launches instead. Warm-up on a side
    stream before capture, as torch.cuda.graph asks; the NSA op runs its side-stream fork under capture, as in the
    model."""
    from triton.testing import do_bench

    run = _fwdbwd(fn, grad_inputs, dout)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
    del graph
    return ms


HOST_BOUND = 1.2  # wall / kernel time above which a row is marked host-bound


def load_fla():
    """fla-core's parallel_nsa (pure-Python wheel), or None when it is not importable."""
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception as e:  # not installed, or an incompatible triton/torch: the row says so
        print("fla-core parallel_nsa not available:", type(e).__name__, str(e)[:200], flush=True)
        return None
    return parallel_nsa


def fla_unsupported(cfg) -> str | None:
    """Why fla-core's kernel cannot run this shape (its selected kernel tiles the GQA group: G = 2^k >= 16)."""
    G = cfg["HQ"] // cfg["HKV"]
    if G < 16 or G & (G - 1):
        return f"not supported (needs G = HQ/HKV a power of 2 >= 16, here {G})"
    if cfg["DK"] != cfg["DV"]:
        return "not supported (needs Dk == Dv)"
    return None


def bench_fla(fla_nsa, row, cfg, q, k, v, dout):
    """fla-core's parallel_nsa on the same q and selected-branch K/V: compressed + selected branches only
    (its window branch needs flash-attn), compression by mean pooling over l' = 64 (its only geometry)."""
    if fla_nsa is None:
        row["fla_parallel_nsa"] = "not installed"
        return
    why = fla_unsupported(cfg)
    if why:
        row["fla_parallel_nsa"] = why
        return
    p, T, HQ = cfg["p"], q.shape[1], cfg["HQ"]
    g_cmp, g_slc = (torch.rand(1, T, HQ, device=q.device, dtype=q.dtype).requires_grad_(True) for _ in range(2))

    def fla():
        return fla_nsa(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=p.slc_top_n, block_size=p.slc_block,
                       window_size=0)

    try:
        for bwd in (False, True):
            ms, mem = bench_one(fla, [q, k, v, g_cmp, g_slc], dout, bwd)
            row["fla_fwdbwd_ms" if bwd else "fla_fwd_ms"] = ms
            row["fla_fwdbwd_GiB" if bwd else "fla_fwd_GiB"] = mem
        row["fla_parallel_nsa"] = "cmp+slc, no window"
        if "nsa_fwdbwd_ms" in row:
            row["nsa_vs_fla_fwdbwd"] = row["fla_fwdbwd_ms"] / row["nsa_fwdbwd_ms"]
    except Exception as e:
        row["fla_parallel_nsa"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
