"""Training throughput of a flavor on this machine: tokens/s, MFU and GPU-busy share per variant.

Each variant runs ``python -m nsa_titan.train`` in its own process (clean memory, clean compile caches)
and the run's summary.json is collected into one JSON + markdown table:

    python benchmarks/bench_train.py --config train_configs/m7c_125m.toml --steps 30 \
        --variants torch,torch_compile --out benchmarks/results --tag m7c_seq2048

``--rounds R`` runs the variant list R times, every other round in reverse order (A B, B A, ...), so that a
machine whose speed drifts during the command moves every variant alike; each row names its round. (Seen on one
H100: the same dense m7c command gave 370k and 359k tokens/s minutes apart.) whole_model_table.py pairs NSA and
dense by round.

``--check-syncs`` also runs one forward+backward of the model under
``torch.cuda.set_sync_debug_mode("error")``: any host sync in the model's hot path raises.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

VARIANTS = {
    "torch": ["--model.attn_impl", "torch"],
    # compile without CUDA graphs whatever the config file's compile.mode says ('auto' would add them)
    "torch_compile": ["--model.attn_impl", "torch", "--compile.enable", "--compile.mode", "default"],
    "triton": ["--model.attn_impl", "triton"],
    "triton_compile": ["--model.attn_impl", "triton", "--compile.enable", "--compile.mode", "default"],
    "dense": ["--model.attn_type", "dense"],
    "dense_compile": ["--model.attn_type", "dense", "--compile.enable", "--compile.mode", "default"],
    # the same, each compiled block replayed as a CUDA graph (no per-kernel host launches)
    "triton_compile_cg": ["--model.attn_impl", "triton", "--compile.enable", "--compile.mode", "reduce-overhead"],
    "torch_compile_cg": ["--model.attn_impl", "torch", "--compile.enable", "--compile.mode", "reduce-overhead"],
    "dense_compile_cg": ["--model.attn_type", "dense", "--compile.enable", "--compile.mode", "reduce-overhead"],
    # the whole optimizer step replayed as one CUDA graph (compile.step_graph; diagnostics cannot run inside it)
    "triton_compile_sg": ["--model.attn_impl", "triton", "--compile.enable", "--compile.mode", "default",
                          "--compile.step_graph", "--metrics.nsa_diagnostics", "false"],
    "dense_compile_sg": ["--model.attn_type", "dense", "--compile.enable", "--compile.mode", "default",
                         "--compile.step_graph", "--metrics.nsa_diagnostics", "false"],
}


def check_syncs(config: str, impl: str, extra: list[str]) -> str:
    """One forward+backward of the configured model with host syncs turned into errors."""
    import torch

    from nsa_titan.config import load_job_config
    from nsa_titan.models import build_model

    cfg = load_job_config(["--config", config, "--model.attn_impl", impl, *extra])
    args = cfg.model_args()
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cuda")
    model.init_weights()
    tokens = torch.randint(0, 256, (cfg.training.local_batch_size, cfg.training.seq_len), device="cuda")
    for mode in ("warn", "error"):  # first pass loads kernels/handles, second must not sync
        torch.cuda.set_sync_debug_mode(mode)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return f"no host sync in forward+backward ({impl}, {args.n_layers} layers, T={cfg.training.seq_len})"


def kernel_busy(config: str, variant: str, extra: list[str], steps: int = 6) -> str:
    """Share of wall time in which some GPU kernel runs, from a torch.profiler trace.

    The trainer's GPU-busy metric (CUDA-event time over wall time) cannot see gaps inside a step where the
    GPU waits for the CPU to launch work; the union of kernel intervals can. Measured on the configured
    model's forward + backward + fused AdamW step with synthetic tokens (the profiler's own CPU overhead
    makes this a lower bound).
    """
    import torch
    import torch.nn.functional as F
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from nsa_titan.config import load_job_config
    from nsa_titan.models import build_model

    cfg = load_job_config(["--config", config, *VARIANTS[variant], *extra])
    args = cfg.model_args()
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cuda")
    model.init_weights()
    fwd = torch.compile(model, fullgraph=True) if cfg.compile.enable else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 256, (cfg.training.local_batch_size, cfg.training.seq_len), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("measured_steps"):
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    events = prof.events()
    window = next(e for e in events if e.name == "measured_steps").time_range
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in kernels:
        start, end = max(start, window.start), min(end, window.end)
        if end <= start:
            continue
        if cur_end is None or start > cur_end:
            busy += 0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += 0 if cur_end is None else cur_end - cur_start
    share = busy / (window.end - window.start)
    return f"kernel-busy (profiler, {variant}): {share:.1%} of {steps} steps' wall time"


def run_order(variants: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, variant) in the order they run: the list, then reversed, and so on (A B, B A, A B, ...)."""
    return [(r, name) for r in range(1, rounds + 1) for name in (variants if r % 2 else variants[::-1])]


def train_run(config: str, steps: int, name: str, extra: list[str]) -> dict:
    """One training run of a variant in its own process -> its result row (or the variant with an error)."""
    with tempfile.TemporaryDirectory() as dump:
        # NSA diagnostics off: on log steps they add work and, under compile, a second graph compiled at
        # the first log step after step 1, which would land inside the timed windows.
        cmd = [sys.executable, "-m", "nsa_titan.train", "--config", config, "--training.steps", str(steps),
               "--metrics.log_freq", "5", "--metrics.val_freq", "0", "--metrics.nsa_diagnostics", "false",
               "--job.dump_folder", dump, *VARIANTS[name], *extra]
        print("$", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=REPO)
        summary_file = Path(dump) / "summary.json"
        if proc.returncode != 0 or not summary_file.exists():
            return {"variant": name, "error": f"exit code {proc.returncode}"}
        s = json.loads(summary_file.read_text())
        windows = log_windows(Path(dump))
    return {"variant": name, **{k: s.get(k) for k in (
        "tokens_per_s", "tokens_per_s_per_gpu", "last_window_tokens_per_s_per_gpu", "mfu", "gpu_busy",
        "peak_mem_gib", "initial_loss", "final_loss", "steps", "device", "torch", "triton", "date")},
        "model": s.get("model"), "training": s["config"]["training"],
        "activation_checkpoint": s["config"].get("activation_checkpoint"), "windows": windows}


def log_windows(dump: Path) -> list[dict]:
    """Each training log window's last step, tokens/s per GPU and loss, from the run's metrics.jsonl (read as
    nsa_titan.plot reads it): whether a long run's speed drifts, e.g. as a model's selections cluster."""
    from nsa_titan.plot import read_curves

    try:
        train = read_curves(dump)["train"]
    except FileNotFoundError:
        return []
    return [{"step": step, "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "loss": r.get("loss")}
            for step, r in sorted(train.items()) if r.get("tokens_per_s_per_gpu") is not None]


def environment() -> dict[str, str | None]:
    import torch

    from nsa_titan.components.runtime import device_name, software_versions

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"device": device_name(device), **software_versions()}


def write_markdown(result: dict, out: Path) -> None:
    """train_<tag>.md from a run's JSON (also ``--from-json``: a device call that brought back only the JSON)."""
    rows, notes = result["rows"], result.get("notes", [])
    rounds = any(r.get("round", 1) > 1 for r in rows)  # a round column only where several ran
    lines = [f"# Training throughput: {result['tag']} ({result.get('device', '?')}, torch {result.get('torch')}, "
             f"triton {result.get('triton')}, {result['date'][:10]})", "",
             "| variant | " + ("round | " if rounds else "") + "tokens/s (summary mean) | tokens/s/GPU (last "
             "log window) | MFU | GPU busy | peak GiB | loss first -> last |",
             "|---|---|---|---|---|---|---|" + ("---|" if rounds else "")]
    for r in rows:
        name = f"{r['variant']} | {r.get('round', 1)}" if rounds else r["variant"]
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | |")
            continue
        fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
        lines.append(f"| {name} | {fmt(r['tokens_per_s'], ',.0f')} | "
                     f"{fmt(r['last_window_tokens_per_s_per_gpu'], ',.0f')} | {fmt(r['mfu'], '.1%')} | "
                     f"{fmt(r['gpu_busy'], '.1%')} | {fmt(r['peak_mem_gib'], '.1f')} | "
                     f"{fmt(r['initial_loss'], '.2f')} -> {fmt(r['final_loss'], '.2f')} |")
    lines += ["", "Summary mean: the trainer's summary.json tokens_per_s, over the log windows after the steps that "
              "compile, record CUDA graphs or capture the step graph (its steady_from_step; runs before 2026-11-28: "
              "every window after step 1), less later windows in which torch.compile compiled (since the thirty-first "
              "session).", *notes]
    (out / f"train_{result['tag']}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="train_configs/m7c_125m.toml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--variants", default="torch,torch_compile")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="m7c")
    ap.add_argument("--check-syncs", action="store_true")
    ap.add_argument("--kernel-busy", action="store_true", help="profile each variant's GPU kernel-busy share")
    ap.add_argument("--skip-train", action="store_true", help="only the in-process checks, no training runs")
    ap.add_argument("extra", nargs="*", help="overrides passed to every run, e.g. --training.seq_len 2048")
    ap.add_argument("--from-json", help="only rewrite the markdown of an earlier run's JSON (no GPU needed)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variant list this many times, every other round in reverse order")
    a = ap.parse_args()
    if a.rounds < 1:
        sys.exit(f"--rounds {a.rounds}: give 1 or more (rounds of the whole variant list)")
    if a.from_json:
        return write_markdown(json.loads(Path(a.from_json).read_text()), Path(a.from_json).parent)
    unknown = [v for v in a.variants.split(",") if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    rows, notes = [], []
    if a.check_syncs:
        notes.append(check_syncs(a.config, "torch", a.extra))
        print(notes[-1], flush=True)
    for name in a.variants.split(",") if a.kernel_busy else []:
        notes.append(kernel_busy(a.config, name, a.extra))
        print(notes[-1], flush=True)
    for rnd, name in [] if a.skip_train else run_order(a.variants.split(","), a.rounds):
        rows.append({**train_run(a.config, a.steps, name, a.extra), "round": rnd})
    meta = environment()
    result = {"benchmark": "train_throughput", "config": a.config, "tag": a.tag, "steps": a.steps,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              **meta, "overrides": a.extra, "notes": notes, "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"train_{a.tag}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    write_markdown(result, out)


if __name__ == "__main__":
    main()
