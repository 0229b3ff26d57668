"""Why an NSA kernel runs at the speed it does: Nsight Compute counters of one forward+backward of the attention.

    python benchmarks/ncu_attention.py --case m7c:8192:2 [--kernels _sel_bwd_dkdv,_sel_fwd_blocks] [--out DIR]

Runs ``ncu`` (needs the hardware counters: the Firecracker GPU machines have them, see the device notes) on a
child process of this script that warms the op up, then runs one forward+backward between
cudaProfilerStart/Stop, so that only that call's kernels are profiled. Sections: speed of light, occupancy,
launch statistics, memory workload and warp state statistics, in ncu's raw page (one CSV row per kernel).
Clocks are left alone (``--clock-control none``), as the device notes ask.

Writes ncu_<tag>.csv (ncu's own output, for anything the summary leaves out) and ncu_<tag>.json / .md: per
kernel its duration, SM and memory throughput (% of peak), achieved occupancy, registers per thread, and the
warp stall reasons in cycles per issued instruction, largest first: the numbers that say whether a kernel
waits on memory (long scoreboard), on shared memory or its own pipeline (MIO, short scoreboard), on barriers,
or has too few warps to hide either.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "MemoryWorkloadAnalysis", "WarpStateStats")
# Raw metric names -> summary columns (ncu 2025). A name that is absent is reported as missing, not guessed.
COLUMNS = {
    "gpu__time_duration.sum": "duration",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory_pct",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_pct",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed": "tensor_pct",
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_elapsed": "alu_pct",
    "inst_executed": "instructions",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "launch__registers_per_thread": "registers",
    "launch__grid_size": "grid",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles_per_issue",
}
STALL = "smsp__average_warps_issue_stalled_"  # ..._<reason>_per_issue_active.ratio


def run_child(case: str, warmup: int) -> None:
    """The profiled process: warm-up calls (compilation, autotuning) unprofiled, then one call profiled."""
    import torch

    sys.path.insert(0, HERE)
    from profile_block import attention_fwdbwd

    name, T, B = case.split(":")
    fwdbwd, _, _ = attention_fwdbwd(name, int(T), int(B))
    for _ in range(warmup):
        fwdbwd()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fwdbwd()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def parse_raw(text: str) -> list[dict]:
    """ncu --page raw --csv: a header row, a units row, one row per profiled kernel -> one dict per kernel."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    header, units = rows[start], rows[start + 1]
    data = [r for r in rows[start + 2:] if len(r) == len(header)]  # not ncu's ==PROF== lines or the program's
    out = []
    for r in data:
        rec = dict(zip(header, r))
        item = {"kernel": rec.get("Kernel Name", "?"), "id": rec.get("ID")}
        for metric, col in COLUMNS.items():
            if metric in rec:
                item[col] = _num(rec[metric])
                if col == "duration":
                    item["duration_unit"] = units[header.index(metric)]
        stalls = {m[len(STALL):].removesuffix("_per_issue_active.ratio"): _num(v) for m, v in rec.items()
                  if m.startswith(STALL) and m.endswith("_per_issue_active.ratio")}
        stalls.pop("selected", None)  # "selected" is the cycles spent issuing, not a stall
        item["stalls"] = dict(sorted(((k, v) for k, v in stalls.items() if v is not None), key=lambda kv: -kv[1]))
        out.append(item)
    return out


def _num(v: str) -> float | None:
    try:
        return float(v.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def to_markdown(payload: dict) -> str:
    lines = [f"# Nsight Compute: NSA attention {payload['case']} fwd+bwd ({payload['device']})", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}; `{payload['command']}`.",
             "Stalls: cycles per issued instruction by reason (ncu's warp state statistics), largest first.", "",
             "| kernel | duration | SM % | tensor % | ALU % | memory % | L2 % | DRAM % | occupancy % | regs "
             "| top stalls |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    for k in payload["kernels"]:
        top = ", ".join(f"{r} {v:.1f}" for r, v in list(k["stalls"].items())[:4])
        lines.append(f"| `{k['kernel'][:60]}` | {f(k.get('duration'))} {k.get('duration_unit', '')} | "
                     f"{f(k.get('sm_pct'))} | {f(k.get('tensor_pct'))} | {f(k.get('alu_pct'))} | "
                     f"{f(k.get('memory_pct'))} | {f(k.get('l2_pct'))} | "
                     f"{f(k.get('dram_pct'))} | {f(k.get('occupancy_pct'))} | {f(k.get('registers'))} | {top} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="m7c:8192:2", help="config:T:B (configs as in profile_block.py)")
    ap.add_argument("--kernels", default="", help="comma list of kernel names to profile (default: all)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tag", default=None, help="file name part (default: the case)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return run_child(a.case, a.warmup)
    ncu = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)
    if ncu is None:
        raise SystemExit("ncu (Nsight Compute) is not on PATH: run this on a GPU machine that has it")
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--page", "raw", "--csv",
           "--print-units", "base", *(x for s in SECTIONS for x in ("--section", s))]
    if a.kernels:
        cmd += ["--kernel-name", "regex:^(" + "|".join(a.kernels.split(",")) + ")$"]
    cmd += [sys.executable, os.path.abspath(__file__), "--child", "--case", a.case, "--warmup", str(a.warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    tag = a.tag or a.case.replace(":", "_")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"ncu_{tag}.csv"), "w") as fh:
        fh.write(proc.stdout)
    if proc.returncode != 0 or "Kernel Name" not in proc.stdout:
        raise SystemExit(f"ncu failed (rc {proc.returncode}); its output is in ncu_{tag}.csv:\n{proc.stderr[-2000:]}")
    sys.path[:0] = [HERE, os.path.dirname(HERE)]  # attention_checks imports nsa_titan from this checkout
    from attention_checks import run_header, write_results  # the benchmarks' common header and writer

    payload = dict(case=a.case, **run_header(), command=" ".join(cmd[:-7]), kernels=parse_raw(proc.stdout))
    write_results(a.out, f"ncu_{tag}", payload, to_markdown(payload))


if __name__ == "__main__":
    main()
