"""Data-parallel training throughput and memory: 1 GPU vs 2 GPUs with FSDP2 / FSDP1 / DDP.

Each run is ``python -m nsa_titan.train`` (1 process) or ``torchrun --standalone --nproc_per_node N -m
nsa_titan.train`` in its own process group, so memory and compile caches start clean. The steady state is
the steps after ``--warmup`` (log windows that start after it and in which torch.compile compiled nothing: the
trainer summary's own rule, metrics.windows_after), read from the run's metrics.jsonl:

    python benchmarks/bench_parallel.py --flavors m7c,1b --seq 8192 --steps 12 --warmup 4 --out OUT_DIR
    python benchmarks/bench_parallel.py --cpu ...     # the same on CPU with gloo (a smoke test of the script)

Targets checked (written into the markdown): FSDP2 per-GPU tokens/s on N GPUs >= 95% of 1 GPU; FSDP2 peak
memory <= 93% of FSDP1's at equal or better throughput; GPU-busy >= 90%.
Every process gets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (NVLink multicast off).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nsa_titan.components.metrics import windows_after  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FLAVOR_BATCH = {"m7c": 2, "1b": 1, "debug": 2}  # local sequences per micro-batch at --seq
# A run is "1gpu" or "<data_parallel>[+variant...]", e.g. "fsdp2+reshard_never"; variants add overrides.
VARIANTS = {
    "reshard_never": ["--parallelism.fsdp_reshard_after_forward", "never"],
    "prefetch2": ["--parallelism.fsdp_prefetch", "2"],
    "bf16_reduce": ["--parallelism.reduce_dtype", "bf16"],
    "compile": ["--compile.enable"],
}


def run_one(name: str, nproc: int, dp: str | None, flavor: str, a, extra: list[str], log) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        train = ["-m", "nsa_titan.train", "--model.flavor", flavor, "--training.seq_len", str(a.seq),
                 "--model.max_seq_len", str(max(a.seq, 1024)), "--training.local_batch_size",
                 str(FLAVOR_BATCH.get(flavor, 1)), "--training.steps", str(a.steps), "--metrics.log_freq",
                 str(a.warmup), "--metrics.val_freq", "0", "--lr_scheduler.warmup_steps", "2",
                 "--job.dump_folder", dump, *(["--training.device", "cpu"] if a.cpu else []), *extra]
        if dp is not None:
            train += ["--parallelism.data_parallel", dp]
        if nproc == 1:
            cmd = [sys.executable, *train]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *train]
        env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        if nproc == 1 and not a.cpu:
            env["CUDA_VISIBLE_DEVICES"] = "0"
        log.write(f"\n===== {name} ({flavor}) =====\n$ {' '.join(cmd)}\n")
        log.flush()
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=a.run_timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        row = {"run": name, "flavor": flavor, "gpus": nproc, "data_parallel": dp or "none", "wall_s": time.time() - t0}
        metrics = Path(dump) / "metrics.jsonl"
        recs = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        steady = windows_after([r for r in recs if r.get("type") == "train"], a.warmup)
        if rc != 0 or not steady:
            return {**row, "error": f"exit {rc}, {len(steady)} steady log windows (windows after --warmup {a.warmup} "
                                    "in which nothing compiled; raise --steps)"}
        wall = sum(r["window_s"] for r in steady)
        steps = sum(r["window_steps"] for r in steady)
        busy = [r for r in steady if r["gpu_busy"] is not None]
        return {**row, "steps_timed": steps,
                "tokens_per_s_per_gpu": sum(r["window_tokens"] for r in steady) / wall / nproc,
                "step_time_s": wall / steps,
                "peak_mem_gib": max(r["peak_mem_gib"] for r in steady),
                "peak_mem_reserved_gib": max((r["peak_mem_reserved_gib"] or 0) for r in steady) or None,
                "gpu_busy": sum(r["gpu_busy"] * r["window_s"] for r in busy) / sum(r["window_s"] for r in busy)
                if busy else None,
                "mfu": steady[-1]["mfu"], "final_loss": steady[-1]["loss"]}


def check_targets(rows: list[dict], ngpu: int) -> list[str]:
    lines = []
    for flavor in dict.fromkeys(r["flavor"] for r in rows):
        by = {r["run"]: r for r in rows if r["flavor"] == flavor and "error" not in r}
        one, f2, f1 = by.get("1gpu"), by.get(f"fsdp2_{ngpu}gpu"), by.get(f"fsdp1_{ngpu}gpu")
        if one and f2:
            ratio = f2["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
            lines.append(f"- {flavor}: FSDP2 per-GPU tokens/s on {ngpu} GPUs = {ratio:.1%} of 1 GPU (target >= 95%): "
                         f"{'MET' if ratio >= 0.95 else f'MISSED by {0.95 - ratio:.1%} points'}")
        if f1 and f2:
            mem = f2["peak_mem_gib"] / f1["peak_mem_gib"]
            speed = f2["tokens_per_s_per_gpu"] / f1["tokens_per_s_per_gpu"]
            ok = mem <= 0.93 and speed >= 1.0
            lines.append(f"- {flavor}: FSDP2 peak memory = {mem:.1%} of FSDP1's (target <= 93%) at {speed:.1%} of its "
                         f"throughput (target >= 100%): {'MET' if ok else 'MISSED'}")
        busy = [(n, r["gpu_busy"]) for n, r in by.items() if r.get("gpu_busy") is not None]
        if busy:
            worst = min(busy, key=lambda x: x[1])
            lines.append(f"- {flavor}: lowest GPU-busy {worst[1]:.1%} ({worst[0]}) (target >= 90%): "
                         f"{'MET' if worst[1] >= 0.9 else 'MISSED'}")
    return lines


def comm_worker(cpu: bool) -> None:
    """torchrun worker: bandwidth of the collectives FSDP/DDP use, on the default process group."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cpu") if cpu else torch.device(f"cuda:{rank}")
    if not cpu:
        torch.cuda.set_device(dev)
    results = []
    # Up to 1 GiB: an FSDP unit of a 7B-class model all-gathers ~0.5 GB (bf16) and reduce-scatters ~1 GB (fp32).
    for mib in ((0.004, 1, 16) if cpu else (0.004, 8, 64, 256, 1024)):
        n = max(1, int(mib * 2**20 / 2)) // world * world  # bf16 elements, divisible by the world size
        full = torch.ones(n, dtype=torch.bfloat16, device=dev)
        shard = torch.ones(n // world, dtype=torch.bfloat16, device=dev)
        ops = {"all_gather": lambda: dist.all_gather_into_tensor(full, shard),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
               "all_reduce": lambda: dist.all_reduce(full)}
        for name, op in ops.items():
            for _ in range(3):
                op()
            if not cpu:
                torch.cuda.synchronize()
            reps = 5 if cpu else 20
            t0 = time.perf_counter()
            for _ in range(reps):
                op()
            if not cpu:
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / reps
            factor = 2 * (world - 1) / world if name == "all_reduce" else (world - 1) / world
            results.append({"op": name, "MiB": mib, "ms": dt * 1e3, "busbw_GBps": n * 2 * factor / dt / 1e9})
    if rank == 0:
        print("COMM " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def comm_test(a, log) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.ngpu}",
           str(Path(__file__).resolve()), "--comm-worker", *(["--cpu"] if a.cpu else [])]
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    log.write(proc.stdout + proc.stderr)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("COMM ")), None)
    return json.loads(line[5:]) if line else [{"error": f"exit {proc.returncode}"}]


def environment(cpu: bool) -> dict:
    import platform

    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = not cpu and torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if gpu else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
            "gpus_visible": torch.cuda.device_count() if gpu else 0, "torch": torch.__version__,
            "triton": triton_version,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def fmt(v, f):
    return "n/a" if v is None else format(v, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavors", default="m7c,1b")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="untimed first steps (also the log window length)")
    ap.add_argument("--ngpu", type=int, default=2)
    ap.add_argument("--runs", default="1gpu,fsdp2,fsdp1,ddp")
    ap.add_argument("--run-timeout", type=float, default=150)
    ap.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (checks the script, not speed)")
    ap.add_argument("--tag", default="h200x2_seq8192")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--log", default=None, help="file for the runs' output (default: OUT/parallel_TAG.log)")
    ap.add_argument("--comm", action="store_true", help="first measure the collectives' bandwidth")
    ap.add_argument("--comm-only", action="store_true",
                    help="measure the collectives only (no training runs): the planner's --collectives input")
    ap.add_argument("--comm-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--topology", default=None, help="a file with `nvidia-smi topo -m` output, quoted in the results")
    ap.add_argument("extra", nargs="*", help="overrides for every run, e.g. -- --compile.enable")
    a = ap.parse_args()
    if a.comm_worker:
        comm_worker(a.cpu)
        return
    if a.comm_only:
        a.comm, a.flavors = True, ""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env, rows = environment(a.cpu), []
    if a.topology and Path(a.topology).exists():
        env["topology"] = Path(a.topology).read_text()
    with open(a.log or out / f"parallel_{a.tag}.log", "a") as log:
        if a.comm:
            env["collectives"] = comm_test(a, log)
            print("collectives:", json.dumps(env["collectives"]), flush=True)
            write_results(out, a, env, rows)  # --comm-only ends here
        for flavor in filter(None, a.flavors.split(",")):
            for run in a.runs.split(","):
                if run == "1gpu":
                    rows.append(run_one("1gpu", 1, None, flavor, a, a.extra, log))
                else:
                    dp, *variants = run.split("+")
                    extra = [x for v in variants for x in VARIANTS[v]] + a.extra
                    name = "+".join([f"{dp}_{a.ngpu}gpu", *variants])
                    rows.append(run_one(name, a.ngpu, dp, flavor, a, extra, log))
                print(json.dumps(rows[-1]), flush=True)
                write_results(out, a, env, rows)  # after every run: a cut-short call still leaves results
    print((out / f"parallel_{a.tag}.md").read_text())


def write_results(out: Path, a, env: dict, rows: list[dict]) -> None:
    targets = check_targets(rows, a.ngpu)
    result = {"benchmark": "parallel", "tag": a.tag, "seq_len": a.seq, "steps": a.steps, "timed_after_step": a.warmup,
              "local_batch": {f: FLAVOR_BATCH.get(f, 1) for f in filter(None, a.flavors.split(","))}, "extra": a.extra,
              **env, "rows": rows, "targets": targets}
    (out / f"parallel_{a.tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Data-parallel throughput: {a.tag}", "",
             f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; seq {a.seq}, "
             f"{a.steps} steps, timed after step {a.warmup}; local batch {result['local_batch']}; extra {a.extra}", "",
             "| flavor | run | tok/s/GPU | step s | peak GiB (alloc) | GPU busy | MFU | loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['flavor']} | {r['run']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['flavor']} | {r['run']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['step_time_s']:.3f} | "
                     f"{r['peak_mem_gib']:.1f} | {fmt(r['gpu_busy'], '.1%')} | {fmt(r['mfu'], '.1%')} | "
                     f"{r['final_loss']:.2f} |")
    if env.get("collectives"):
        lines += ["", "Collectives (bf16, NCCL busbw = bytes x (N-1)/N [x2 for all-reduce] / time):", "",
                  "| op | MiB | ms | busbw GB/s |", "|---|---|---|---|"]
        lines += [f"| {c['op']} | {c['MiB']:g} | {c['ms']:.3f} | {c['busbw_GBps']:.1f} |"
                  for c in env["collectives"] if "op" in c]
    if env.get("topology"):
        lines += ["", "GPU topology (`nvidia-smi topo -m`):", "", "```", env["topology"].strip(), "```"]
    lines += ["", "Targets:", *targets]
    (out / f"parallel_{a.tag}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
