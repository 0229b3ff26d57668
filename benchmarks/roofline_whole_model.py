"""How far the whole-model NSA / dense ratio can go: the measured rows split into attention and everything else.

    python benchmarks/roofline_whole_model.py --attention benchmarks/results/attention_NVIDIA_H100_80GB_HBM3.json \
        benchmarks/results/train_1b_seq8192_b2_cg_s17.json ... --out benchmarks/results/roofline_whole_model_H100

For each ``bench_train.py`` result (an NSA variant and a dense one from one command), with the kernel table of
``bench_attention.py`` (B = 1, the same device) for the flavor's attention shape at the row's length:

- dense attention per token ``A_d = L * (SDPA fwd+bwd [+ SDPA fwd with full AC, the recompute]) / T``, NSA's
  ``A_n`` the same way from its kernels' time (profiled kernel time: under CUDA graphs that is what a step pays);
- the rest of the step (projections, FFN, norms, loss, optimizer) per token, from either row: ``R_n = 1 / NSA tok/s
  - A_n`` and ``R_d = 1 / dense tok/s - A_d``. R_n / R_d checks the split: NSA's extra K/V projections, compressors
  and gates make it a little above 1; far from 1 means the kernel table's times do not match the run's (at 64k the
  rest is a small difference of large numbers: 5 % of SDPA time moves it by ~15 %);
- the **best case**: NSA's useful attention FLOPs (``bench_attention.flops``: the work done, causal halves
  counted, the selection's score recompute included) at SDPA's own FLOP rate in the same table (fwd+bwd and fwd
  rates separately), and at the bf16 matmul peak (790 TFLOP/s, bench_attention.PEAK_TFLOPS), on top of NSA's rest:
  ``best ratio = (1 / dense tok/s) / (R_n + A_best)``. If the target is above the best case at SDPA's rate, no NSA
  kernel as efficient as cuDNN's flash attention reaches it with this model: the rest of the step bounds it;
- the attention speed-up the target needs: ``A_n / (1 / (target * dense tok/s) - R_n)``.

Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import CONFIGS, PEAK_TFLOPS, flops  # noqa: E402
from whole_model_table import TARGETS, _median_tps, nsa_dense_pairs  # noqa: E402


def sdpa_flops(T: int, cfg: dict, fwd_only: bool) -> float:
    """Causal dense attention's useful FLOPs (half the T x T scores), the convention of ``flops`` (bwd = 2.5x)."""
    f = T * T / 2 * cfg["HQ"] * (cfg["DK"] + cfg["DV"]) * 2
    return f if fwd_only else 3.5 * f


def attention_config(model_args: dict) -> str | None:
    """The kernel table's config with this flavor's attention shape (heads, KV heads, head dims, NSA sizes)."""
    shape = (model_args["n_heads"], model_args["n_kv_heads"], model_args["head_dim"],
             model_args.get("v_head_dim") or model_args["head_dim"])
    sizes = tuple(model_args[k] for k in ("cmp_block", "cmp_stride", "slc_block", "slc_top_n", "window"))
    for name, c in CONFIGS.items():
        p = c["p"]
        if (c["HQ"], c["HKV"], c["DK"], c["DV"]) == shape and (p.cmp_block, p.cmp_stride, p.slc_block,
                                                                 p.slc_top_n, p.window) == sizes:
            return name
    return None


def ac_full(result: dict, row: dict) -> bool:
    """Full activation checkpointing: the row's own record (bench_train.py writes it since 2026-11-27), else the
    tag's 'acfull' (older files; the configs' default is no AC)."""
    ac = row.get("activation_checkpoint")
    if ac is not None:
        if ac.get("mode") not in ("none", "full"):
            raise ValueError(f"{result.get('tag')}: AC mode {ac.get('mode')!r}: only 'none' and 'full' have a "
                             "known recompute (one forward of every block)")
        return ac["mode"] == "full"
    return "acfull" in (result.get("tag") or "")


def roofline_rows(result: dict, table: dict) -> list[dict]:
    bench = {(b["config"], b["T"]): b for b in table["bench"]}
    out = []
    for name, nsa, dense in nsa_dense_pairs(result):  # several rows each where the command ran rounds: medians
        r = nsa[0]
        args, T, B = r["model"]["args"], r["training"]["seq_len"], r["training"]["local_batch_size"]
        cname = attention_config(args)
        k = bench.get((cname, T))
        row = dict(flavor=r["model"]["flavor"], seq_len=T, local_batch=B, variant=name, source_tag=result.get("tag"),
                   attention_config=cname, target=TARGETS.get((r["model"]["flavor"], T)))
        if not dense or k is None or "nsa_fwd_ms" not in k:
            row["skipped"] = "no dense run in that command" if not dense else f"no kernel-table row {cname} T={T}"
            out.append(row)
            continue
        full = ac_full(result, r)
        L, cfg = args["n_layers"], CONFIGS[cname]
        recompute = 1.0 if full else 0.0
        s_dense, s_nsa = 1.0 / _median_tps(dense), 1.0 / _median_tps(nsa)  # seconds per token
        a_dense = L * (k["sdpa_fwdbwd_ms"] + recompute * k["sdpa_fwd_ms"]) / 1e3 / T
        nsa_fb = k.get("nsa_fwdbwd_kernel_ms") or k["nsa_fwdbwd_ms"]
        a_nsa = L * (nsa_fb + recompute * k["nsa_fwd_ms"]) / 1e3 / T
        rest_d, rest = s_dense - a_dense, s_nsa - a_nsa
        rate_fb = sdpa_flops(T, cfg, False) / (k["sdpa_fwdbwd_ms"] / 1e3)  # FLOP/s
        rate_f = sdpa_flops(T, cfg, True) / (k["sdpa_fwd_ms"] / 1e3)
        best_sdpa = L * (flops(T, cfg, False) / rate_fb + recompute * flops(T, cfg, True) / rate_f) / T
        best_peak = L * (flops(T, cfg, False) + recompute * flops(T, cfg, True)) / (PEAK_TFLOPS * 1e12) / T
        row.update(ac_full=full, n_layers=L, dense_tokens_per_s=1 / s_dense, nsa_tokens_per_s=1 / s_nsa,
                   measured_ratio=s_dense / s_nsa, dense_attention_share=a_dense / s_dense,
                   nsa_attention_share=a_nsa / s_nsa, rest_us_per_token=rest * 1e6,
                   rest_from_dense_us_per_token=rest_d * 1e6, rest_nsa_over_dense=rest / rest_d,
                   sdpa_tflops_fwdbwd=rate_fb / 1e12, nsa_tflops_fwdbwd=flops(T, cfg, False) / (nsa_fb / 1e3) / 1e12,
                   best_ratio_at_sdpa_rate=s_dense / (rest + best_sdpa),
                   best_ratio_at_peak=s_dense / (rest + best_peak), needed_attention_speedup=None)
        if row["target"]:
            room = s_dense / row["target"] - rest  # the NSA attention time per token that would meet the target
            row["needed_attention_speedup"] = a_nsa / room if room > 0 else float("inf")
        out.append(row)
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    f = lambda v, s=".2f": "-" if v is None else format(v, s)  # noqa: E731
    lines = [f"# Whole-model roofline, NSA vs dense: {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}; kernel table of {meta['table_date']}. Each row: one "
             "`bench_train.py` command (NSA and dense) split with the kernel table (B = 1) into attention and the "
             "rest of the step (`benchmarks/roofline_whole_model.py` says how). *rest NSA / dense* = the rest from "
             "the NSA row over the rest from the dense row (a check of the split); *best at SDPA rate* = NSA's useful "
             "attention FLOPs at the FLOP rate SDPA reaches in the same table, plus NSA's rest; *best at peak* = at "
             "790 TFLOP/s; *attention speed-up needed* = how much faster NSA's attention kernels must get for the "
             "target.", "",
             "| flavor | seq | batch | AC | attention share dense / NSA | NSA / dense measured | rest NSA / dense "
             "| best at SDPA rate | best at peak | target | attention speed-up needed | NSA / SDPA TFLOP/s (f+b) "
             "| run tag |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["flavor"], r["seq_len"], r["local_batch"])):
        if "skipped" in r:
            lines.append(f"| {r['flavor']} | {r['seq_len']} | {r['local_batch']} | - | skipped: {r['skipped']} "
                         f"| | | | | | | | {r['source_tag']} |")
            continue
        need = r["needed_attention_speedup"]
        need_s = "-" if need is None else ("unreachable" if need == float("inf") else
                                            ("met" if need <= 1 else f"{need:.2f}x"))
        lines.append(f"| {r['flavor']} | {r['seq_len']} | {r['local_batch']} | {'full' if r['ac_full'] else 'none'} "
                     f"| {r['dense_attention_share']:.0%} / {r['nsa_attention_share']:.0%} "
                     f"| {f(r['measured_ratio'])} | {f(r['rest_nsa_over_dense'])} "
                     f"| {f(r['best_ratio_at_sdpa_rate'])} | {f(r['best_ratio_at_peak'])} | "
                     f"{'-' if r['target'] is None else f(r['target'], '.1f')} | {need_s} | "
                     f"{r['nsa_tflops_fwdbwd']:.0f} / {r['sdpa_tflops_fwdbwd']:.0f} | {r['source_tag']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench_train.py JSON files")
    ap.add_argument("--attention", required=True, help="bench_attention.py --bench JSON (same device)")
    ap.add_argument("--out", required=True, help="output path without extension")
    a = ap.parse_args()
    table = json.loads(Path(a.attention).read_text())
    rows, devices = [], set()
    for path in a.results:
        result = json.loads(Path(path).read_text())
        devices.add(result.get("device"))
        rows += roofline_rows(result, table)
    if devices != {table["device"]}:
        sys.exit(f"results from {sorted(map(str, devices))} but the kernel table is from {table['device']}: "
                 "use one device's files")
    meta = dict(device=table["device"], torch=table.get("torch"), triton=table.get("triton"),
                table_date=table.get("date"), attention=a.attention, results=a.results)
    Path(a.out + ".json").write_text(json.dumps(dict(meta, rows=rows), indent=2) + "\n")
    Path(a.out + ".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
