"""Decode speed of NSA vs dense attention at long context: time per decode step and K/V bytes read.

    python benchmarks/bench_decode.py                      # GPU: m7c, contexts 8k..64k, batches 1 and 16
    python benchmarks/bench_decode.py --device cpu --flavor debug --contexts 256,512 --batches 1 \
        --iters 3 --dtype fp32 --tag decode_cpu_smoke      # CPU smoke run

For each context T, batch B and variant (``nsa``: the flavor with attn_type nsa, its decode attention two fused
Triton launches per layer on CUDA; ``nsa_torch``: the same through the torch decode path; ``dense``: dense attention):
- ``model``: one ``decode_step`` of the whole model (all layers, output head) with T tokens in the cache;
- ``attention``: layer 0's attention alone (projections, cache append, attention, output projection).
Each is timed eagerly and, on CUDA, replayed from CUDA graphs (launch overhead removed). The cache holds
random K/V (decode cost does not depend on the values) and the step cycles over the d positions
T - d .. T - 1 so that the compression of a completed block, due once every d steps, is averaged in.
K/V bytes per step: NSA reads(t) tokens (models/nsa/decode.py) per row, layer and KV head, dense t + 1, each
(dk + dv) * element size; NSA's compressor also re-reads l tokens every d steps (reported apart).
A sync check runs one NSA step under ``torch.cuda.set_sync_debug_mode("error")``.
Writes ``<out>/<tag>.json`` and ``<out>/<tag>.md`` (device, torch / triton versions, date).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

from nsa_titan.components.runtime import device_name, software_versions  # noqa: E402
from nsa_titan.models import build_model, get_model_args  # noqa: E402
from nsa_titan.models.nsa.common import NSAParams  # noqa: E402
from nsa_titan.models.nsa.decode import KVCache, decode_step, nsa_tokens_read  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# variant -> KVCache(fused=...): NSA through the fused Triton kernels where it runs (CUDA), NSA through the torch
# decode path (the kernel's spec), dense SDPA.
VARIANTS = {"nsa": None, "nsa_torch": False, "dense": None}


def build(flavor: str, attn_type: str, max_len: int, device, dtype):
    args = get_model_args(flavor, attn_type=attn_type, max_seq_len=max_len, attn_impl="torch")
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device)
    model.init_weights()
    return model.to(dtype).eval(), args  # rope tables are cast too: values only, speed is what is measured


def fill_cache(cache: KVCache, length: int, device) -> None:
    """Random K/V for ``length`` tokens everywhere a real prefill would have written."""
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in cache.layers:
        for t in vars(layer).values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32))
    cache.pos = length


def make_step(model, cache: KVCache, mode: str, batch: int, device):
    """A no-argument function running one decode step at the cache's current position (then restoring it)."""
    tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
    attn, layer = model.layers["0"].attention, cache.layers[0]
    x = torch.randn(batch, 1, model.args.dim, device=device).to(model.output.weight.dtype)

    def step():
        t = cache.pos
        if mode == "model":
            out = decode_step(model, cache, tok)
        else:  # one attention module (projections, the cached attention, output projection)
            out = attn(x, model.rope_cos[t: t + 1], model.rope_sin[t: t + 1], cache=layer)
        cache.pos = t  # every timed step runs at the same set of positions
        return out

    return step


def time_steps(steps: list, iters: int, device) -> float:
    """Median ms per step over ``iters`` rounds of the cyclic positions (CUDA events on GPU)."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for s in steps:
                s()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / len(steps))
        else:
            t0 = time.perf_counter()
            for s in steps:
                s()
            times.append(1e3 * (time.perf_counter() - t0) / len(steps))
    return statistics.median(times)


def positional_steps(step, cache: KVCache, positions: list[int]) -> list:
    def at(pos):
        def run():
            cache.pos = pos
            return step()
        return run
    return [at(p) for p in positions]


def graphed(steps: list) -> list:
    """One CUDA graph per step (each position has its own shapes); replays need no host work beyond launch."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in steps:  # warm-up on a side stream, as graph capture requires
            s()
    torch.cuda.current_stream().wait_stream(side)
    pool, graphs = torch.cuda.graph_pool_handle(), []
    for s in steps:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            s()
        graphs.append(g.replay)
    return graphs


def kv_bytes(args, variant: str, positions: list[int], batch: int, esize: int) -> dict:
    p = NSAParams.from_args(args)
    per_token = args.n_kv_heads * (args.head_dim + args.dv) * esize * batch
    if variant == "dense":
        reads = statistics.mean(t + 1 for t in positions)
        return {"kv_bytes_per_step": per_token * reads * args.n_layers, "compress_bytes_per_step": 0}
    reads = statistics.mean(nsa_tokens_read(t, p) for t in positions)
    compress = p.cmp_block / p.cmp_stride  # l tokens every d steps, averaged
    return {"kv_bytes_per_step": per_token * reads * args.n_layers,
            "compress_bytes_per_step": per_token * compress * args.n_layers}


_METADATA_OPS = (torch.ops.aten._unsafe_view.default,)  # a view that its schema does not declare as one


class _ComputeOpCounter(TorchDispatchMode):
    """Counts the aten ops of a step that compute or write (a view or a metadata query launches no kernel):
    on a GPU each is at least one kernel, so this count bounds a CUDA-graph replay from below on any device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        rets = func._schema.returns
        is_view = rets[0].alias_info is not None and not rets[0].alias_info.is_write if rets else True
        returns_tensor = bool(rets) and str(rets[0].type) in ("Tensor", "Tensor[]")
        if returns_tensor and not is_view and func not in _METADATA_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def compute_ops_per_step(steps: list) -> float:
    """Mean compute ops per step over the cyclic positions (the compression, every d steps, averaged in)."""
    counter = _ComputeOpCounter()
    with counter:
        for s in steps:
            s()
    return counter.count / len(steps)


def sync_check(step) -> str:
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return "ok: no host sync in an NSA decode step"
    except RuntimeError as e:
        return f"host sync: {e}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run(ns) -> dict:
    device = torch.device(ns.device if ns.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[ns.dtype]
    esize = torch.finfo(dtype).bits // 8
    rows, notes = [], []
    max_len = max(ns.contexts)
    for variant in ns.variants:
        model, args = build(ns.flavor, "dense" if variant == "dense" else "nsa", max_len, device, dtype)
        d = args.cmp_stride
        for batch in ns.batches:
            for ctx in ns.contexts:
                positions = list(range(ctx - d, ctx))  # the step at t reads a cache of t + 1 tokens (<= ctx)
                cache = KVCache(model, batch, ctx, device=device, dtype=dtype, fused=VARIANTS[variant])
                fill_cache(cache, ctx, device)
                for mode in ns.modes:
                    steps = positional_steps(make_step(model, cache, mode, batch, device), cache, positions)
                    for s in steps:  # warm-up (allocator, kernels, autotuning)
                        s()
                    row = {"variant": variant, "mode": mode, "context": ctx, "batch": batch,
                           **kv_bytes(args, variant, positions, batch, esize)}
                    if mode == "attention":
                        row = {k: (v / args.n_layers if k.endswith("bytes_per_step") else v) for k, v in row.items()}
                    row["eager_ms"] = time_steps(steps, ns.iters, device)
                    row["compute_ops"] = compute_ops_per_step(steps)
                    if device.type == "cuda" and not ns.no_graphs:
                        try:
                            row["graph_ms"] = time_steps(graphed(steps), ns.iters, device)
                        except Exception as e:  # noqa: BLE001 - record, keep benchmarking the rest
                            row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if device.type == "cuda" and variant == "nsa" and not notes:
                    notes.append(sync_check(positional_steps(make_step(model, cache, "model", batch, device),
                                                             cache, positions[-1:])[0]))
                del cache
                gc.collect()  # the cache's layers point back to it: a cycle that only the collector frees
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del model
    for r in rows:  # speedup of NSA over dense at the same (mode, context, batch)
        if r["variant"] != "dense":
            same = ("mode", "context", "batch")
            dense = [x for x in rows if x["variant"] == "dense" and all(x[k] == r[k] for k in same)]
            for key in ("eager_ms", "graph_ms"):
                if dense and key in r and key in dense[0]:
                    r[f"speedup_{key[:-3]}"] = dense[0][key] / r[key]
    return {"device": device_name(device), **software_versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "flavor": ns.flavor, "dtype": ns.dtype, "iters": ns.iters, "notes": notes,
            "model_args": dataclasses.asdict(get_model_args(ns.flavor)), "rows": rows}


def markdown(res: dict) -> str:
    lines = [f"# Decode speed: NSA vs dense ({res['flavor']}, {res['dtype']})", "",
             f"{res['device']}, torch {res['torch']}, triton {res['triton']}, {res['date']}. Median ms per decode "
             "step (one token per row); graph = CUDA-graph replay; KV MB = K/V bytes read per step; ops = aten "
             "ops per step that compute or write (each at least one GPU kernel; NSA's fused attention is two Triton "
             "launches, not aten ops: two more per layer). NSA torch = the torch decode path (`nsa_torch`), when "
             "measured.", ""]
    lines += [f"- {n}" for n in res["notes"]] + [""]
    lines += ["| mode | batch | context | dense eager ms | NSA eager ms | speedup | dense graph ms | NSA graph ms "
              "| speedup | NSA torch graph ms | dense KV MB | NSA KV MB | dense ops | NSA ops |", "|---" * 14 + "|"]
    nsa = [r for r in res["rows"] if r["variant"] == "nsa"]
    for r in nsa:
        dense = next((x for x in res["rows"] if x["variant"] == "dense"
                      and all(x[k] == r[k] for k in ("mode", "context", "batch"))), {})
        slow = next((x for x in res["rows"] if x["variant"] == "nsa_torch"
                     and all(x[k] == r[k] for k in ("mode", "context", "batch"))), {})
        f = lambda x, k, s="{:.3f}": s.format(x[k]) if k in x else "-"  # noqa: E731
        lines.append(f"| {r['mode']} | {r['batch']} | {r['context']} | {f(dense, 'eager_ms')} | {f(r, 'eager_ms')} "
                     f"| {f(r, 'speedup_eager', '{:.2f}x')} | {f(dense, 'graph_ms')} | {f(r, 'graph_ms')} "
                     f"| {f(r, 'speedup_graph', '{:.2f}x')} | {f(slow, 'graph_ms')} "
                     f"| {dense.get('kv_bytes_per_step', 0) / 1e6:.1f} "
                     f"| {r['kv_bytes_per_step'] / 1e6:.1f} | {f(dense, 'compute_ops', '{:.1f}')} "
                     f"| {f(r, 'compute_ops', '{:.1f}')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavor", default="m7c")
    parser.add_argument("--contexts", type=ints, default=[8192, 16384, 32768, 65536])
    parser.add_argument("--batches", type=ints, default=[1, 16])
    parser.add_argument("--variants", type=lambda s: s.split(","), default=["nsa", "dense"],
                        help=f"comma-separated, of {sorted(VARIANTS)}")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["model", "attention"])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=20, help="timed rounds over the d cyclic positions")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--tag", default="decode_m7c")
    ns = parser.parse_args(argv)
    if bad := [v for v in ns.variants if v not in VARIANTS]:
        parser.error(f"unknown variant(s) {bad}; choose from {sorted(VARIANTS)}")
    res = run(ns)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{ns.tag}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{ns.tag}.md").write_text(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
