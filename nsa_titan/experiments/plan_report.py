"""The GA/AC planner's report: recommendations, the study-layout grid (GPUs x local batch, ``AC=r, GA=g`` cells),
the long table of every cell, and the plot of step time vs AC ratio per GPU count.

Rows whose time is not a measurement of N GPUs (a fake process group: measured compute + estimated communication)
carry ``fake_process_group: true`` in the JSON and a ``†`` wherever their time or their cell appears, so that no
estimate reads like a measurement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nsa_titan.experiments.common import fmt, md_table, write_report

FAKE = "†"  # time = measured compute on one GPU + estimated communication (fake process group)
OTHER_NODE = "‡"  # more GPUs than one node holds: the estimate used one node's bandwidth

LEGEND = (f"Cells: `AC=r, GA=g` = the smallest fitting AC ratio r and the gradient accumulation g for that local "
          f"batch; **bold** = fastest per GPU count; `-` = does not fit even fully checkpointed; `n/a` = the "
          f"effective batch is not a multiple of GPUs x local batch; {FAKE} = fake process group: memory as on N "
          f"GPUs, step time = compute measured on one GPU + estimated FSDP2 communication (not a measurement); "
          f"{OTHER_NODE} = more GPUs than one node: the estimate assumes intra-node bandwidth (optimistic).")


def recommendations(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per GPU count, the fitting row with the highest tokens/s per GPU (same effective batch: shortest step)."""
    best: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["status"] == "fits" and r.get("tokens_per_s_per_gpu"):
            if r["gpus"] not in best or r["tokens_per_s_per_gpu"] > best[r["gpus"]]["tokens_per_s_per_gpu"]:
                best[r["gpus"]] = r
    return best


def describe(r: dict[str, Any]) -> str:
    gpus = f"{r['gpus']} GPU{'s' if r['gpus'] > 1 else ''}"
    return f"{gpus}: bs={r['local_batch']} AC={r['ac_ratio']:g} GA={r['grad_accum']}"


def marks(r: dict[str, Any]) -> str:
    """The labels a row's time carries: fake process group, and beyond one node."""
    return (FAKE if r.get("fake_process_group") else "") + (OTHER_NODE if r.get("beyond_one_node") else "")


def grid_cell(r: dict[str, Any] | None, best: dict[int, dict[str, Any]], value: str = "setting") -> str:
    """One grid cell: ``AC=r, GA=g`` (value 'setting') or the step time (value 'time'), with its marks."""
    if r is None:
        return ""
    status = r["status"]
    if status == "fits":
        text = f"AC={r['ac_ratio']:g}, GA={r['grad_accum']}" if value == "setting" else \
            f"{fmt(r.get('step_time_s'), '.2f')} s"
        text += marks(r)
        return f"**{text}**" if best.get(r["gpus"]) is r else text
    return {"does_not_fit": "-", "skipped": "n/a"}.get(status, status)


def study_grid(rows: list[dict[str, Any]], value: str = "setting") -> list[str]:
    """Markdown lines: one row per GPU count, one column per local batch, as in the study's table."""
    best = recommendations(rows)
    gpus = sorted({r["gpus"] for r in rows})
    batches = sorted({r["local_batch"] for r in rows})
    by = {(r["gpus"], r["local_batch"]): r for r in rows}
    lines = ["|         | " + " | ".join(f"bs={b}" for b in batches) + " |", "|---|" + "---|" * len(batches)]
    for g in gpus:
        lines.append(f"| GPUs={g} | " + " | ".join(grid_cell(by.get((g, b)), best, value) for b in batches) + " |")
    return lines


def _time_cell(key: str, spec: str):
    return lambda r: (fmt(r.get(key), spec) + marks(r)) if r.get(key) is not None else "n/a"


def _source(r: dict[str, Any]) -> str:
    if r.get("status") != "fits":
        return ""
    if r.get("fake_process_group"):
        return f"{FAKE} estimate" if r.get("comm_model") else f"{FAKE} compute only"
    return "measured"


def long_table(rows: list[dict[str, Any]]) -> list[str]:
    columns = [("GPUs", "gpus", ""), ("local batch", "local_batch", ""), ("GA", "grad_accum", ""),
               ("AC ratio", "ac_ratio", "g"), ("status", "status", ""), ("peak GiB", "mem_gib", ".1f"),
               ("budget GiB", "budget_gib", ".1f"), ("tok/s/GPU", _time_cell("tokens_per_s_per_gpu", ",.0f"), ""),
               ("step s", _time_cell("step_time_s", ".2f"), ""), ("time", _source, ""),
               ("compute s", "compute_step_s", ".2f"), ("comm exposed s", "comm_exposed_s", ".3f"),
               ("comm total s", "comm_total_s", ".3f")]
    if any(r.get("estimated_step_time_s") is not None for r in rows):
        columns += [("estimate s", "estimated_step_time_s", ".2f"), ("estimate error", "estimate_error", "+.1%")]
    columns += [("MFU", "mfu", ".1%"), ("probes", "probes", ""), ("note", "note", "")]
    return md_table(rows, columns)


def estimate_check_lines(rows: list[dict[str, Any]], tolerance: float = 0.15) -> list[str]:
    """The estimate next to real multi-GPU measurements of the same cell (target: within ``tolerance``)."""
    checked = [r for r in rows if r.get("estimate_error") is not None]
    if not checked:
        return []
    out = ["", f"Communication estimate vs real measurement (same cell, fake-process-group probe + estimate; "
               f"target within {tolerance:.0%}):", ""]
    for r in checked:
        ok = abs(r["estimate_error"]) <= tolerance
        out.append(f"- {describe(r)}: measured {r['step_time_s']:.3f} s/step, "
                   f"estimate {r['estimated_step_time_s']:.3f} "
                   f"s ({r['estimate_error']:+.1%}): {'MET' if ok else 'MISSED'}")
    return out


def write_plan_report(out: Path, tag: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    best = recommendations(rows)
    stem = f"ac_plan_{tag}"
    cap = meta.get("memory_cap_gib")
    lines = [f"# GA/AC plan: {tag}", "",
             f"{meta.get('device')}, torch {meta.get('torch')}; effective batch {meta['effective_batch']} sequences of "
             f"{meta.get('seq_len')} tokens; memory metric: peak {meta['metric']} vs budget"
             + (f" (allocator capped at {cap:g} GiB: a {cap:g} GiB GPU)" if cap else "")
             + f"; ratios {meta['ratios']}; trainer args {meta['train_args']}",
             "", "Recommendations (fastest fitting setting per GPU count):", ""]
    lines += [f"- {describe(r)}  ({fmt(r['step_time_s'], '.2f')} s/step{marks(r)}, "
              f"{fmt(r['tokens_per_s_per_gpu'], ',.0f')} tok/s/GPU; {r['time_source']})" for r in best.values()]
    if not best:
        lines.append("- none yet (nothing measured fits, or the plan is incomplete)")
    lines += ["", "## In the study's layout", "", *study_grid(rows, "setting"), "", "Time per optimizer step:", "",
              *study_grid(rows, "time"), "", LEGEND]
    if any(r.get("fake_process_group") for r in rows):
        lines += ["", f"Communication ({FAKE}): {meta.get('bandwidth_source', 'not estimated')}; model in "
                      "docs/experiments.md (FSDP2 overlap: next all-gather behind this unit's compute, reduce-scatter "
                      "behind the next unit's backward)."]
    lines += estimate_check_lines(rows)
    lines += ["", "## Every cell", "", *long_table(rows), "",
              "Step time: full optimizer step at the planned GA, extrapolated from probes with GA <= 2."]

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for g in sorted({r["gpus"] for r in rows}):
            pts = sorted((r["ac_ratio"], r["step_time_s"], r["local_batch"], bool(r.get("fake_process_group")))
                         for r in rows if r["gpus"] == g and r["status"] == "fits" and r.get("step_time_s"))
            if not pts:
                continue
            fake = any(p[3] for p in pts)
            # Estimated rows: dashed line, hollow markers (the same dagger as in the tables).
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o--" if fake else "o-", mfc="none" if fake else None,
                    label=f"{g} GPU{'s' if g > 1 else ''}" + (f" {FAKE} estimated" if fake else ""))
            for x, y, b, _ in pts:
                ax.annotate(f"bs={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            if g in best:
                ax.plot([best[g]["ac_ratio"]], [best[g]["step_time_s"]], "k*", markersize=12)
        ax.set_xlabel("AC ratio (fraction of blocks checkpointed)")
        ax.set_ylabel(f"time per optimizer step (s), effective batch {meta['effective_batch']}")
        ax.set_yscale("log")  # 1 to 16 GPUs: step times span more than a decade
        ax.set_title(f"{tag}: smallest fitting AC ratio per local batch (* = fastest)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    result = {"experiment": "ac_plan", "tag": tag, **meta, "rows": rows,
              "recommendations": {str(g): describe(r) for g, r in best.items()}}
    write_report(out, stem, result, lines, draw)
    return result
