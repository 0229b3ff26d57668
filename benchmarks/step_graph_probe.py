"""Can a whole training step replay as one CUDA graph, with data parallelism too, and what does it buy? (GPU probe)

    python benchmarks/step_graph_probe.py --config train_configs/m7c_125m.toml --out DIR --tag m7c_1gpu -- \
        --training.seq_len 8192 --training.local_batch_size 2
    torchrun --nproc_per_node 2 benchmarks/step_graph_probe.py --config train_configs/m7c_125m.toml --out DIR \
        --tag m7c_fsdp2 -- --training.seq_len 8192 --training.local_batch_size 2 \
        --parallelism.fsdp_blocks_per_unit 4 --parallelism.fsdp_reshard_after_forward never

Why: without CUDA graphs the m7c NSA step is bound by the host (docs/experiments.md; benchmarks/results/
host_time_s28_H100.md: ~66-75 ms of host time for ~47 ms of GPU work per step at 8k batch 2), and FSDP2's own host
work per step (~15-20 ms) lands on top of it, so m7c FSDP2 stays at ~75-83 % of one GPU. Per-block graphs
(compile.mode reduce-overhead) cannot run under FSDP2: the unsharded parameters move between steps. One graph for
the whole step would run FSDP2's Python only while it is captured.

What it does, per rank: the configured model exactly as the trainer builds it (parallelize_nsa: AC, compile with
mode 'default', data parallelism), the configured AdamW made capturable (its lr a device tensor, constant: no
schedule), random tokens in static buffers. Phase 1 times ``--steps`` steps of the trainer's train_step without a
graph. Phase 2 warms up on a side stream, captures one whole step (forward, backward with the collectives, clipping,
optimizer step, zero_grad) and times ``--steps`` replays. Between them, one step from the same saved state both ways
(eager, then replay) checks that the replay computes what the eager step computes: loss and every local parameter
shard and optimizer state, bitwise and by the largest difference, beside a second eager step from that state (the
floor: compiled backward kernels that add with atomics are not bitwise repeatable). Any failure (capture, replay,
mismatch) is reported in the JSON rather than raised.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # profile_block's kernel categories (--profile)

from nsa_titan.components.optimizer import build_optimizer, local_shard  # noqa: E402
from nsa_titan.components.runtime import (  # noqa: E402
    autocast_context,
    software_versions,
    start_process_group,
    world_from_env,
)
from nsa_titan.components.step_graph import NoSchedule, cuda_capture  # noqa: E402
from nsa_titan.components.train_step import token_loss_sum, train_step  # noqa: E402
from nsa_titan.config import load_job_config  # noqa: E402
from nsa_titan.data import tokenizer_from_config  # noqa: E402
from nsa_titan.models import resolve_attn_impl  # noqa: E402
from nsa_titan.parallelisms import ParallelDims, compile_loss  # noqa: E402
from nsa_titan.train import build_training_model, resolve_model_args  # noqa: E402


def _state(model, optimizer) -> list[torch.Tensor]:
    """Every tensor a step changes on this rank: local parameter shards and optimizer state (in place restorable)."""
    out = [local_shard(p.detach()) for p in model.parameters()]
    for st in optimizer.state.values():
        out += [local_shard(v) for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest elementwise difference over the state (0.0: bitwise equal but for signed zeros)."""
    return max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


def _trace(fn, path: Path, shapes: bool) -> None:
    """One call of fn under torch.profiler (CPU and CUDA), exported as a chrome trace to path."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes,
                 with_stack=shapes) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per phase")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before each phase (compiles in phase 1)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", required=True)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile N replays (torch.profiler): every kernel's GPU ms per step, by name and by "
                    "profile_block.py's categories, in the JSON's 'replay_profile' (one graph: nothing but the GPU's "
                    "own time, so NSA and dense steps diff kernel by kernel)")
    ap.add_argument("--trace", action="store_true",
                    help="also write chrome traces (gzipped, beside the JSON) of one eager step with shapes and call "
                    "stacks (which op launched each kernel) and of one replay (the streams' overlap)")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the replay-vs-eager state check, which holds two copies of the parameters and optimizer "
                    "state beside the graph's memory pool: for models that fit the trainer but not the probe (the 1b "
                    "at 32k on 80 GB)")
    ap.add_argument("--cpu", action="store_true", help="a dry run of everything but the graph (CPU, gloo): the state "
                    "check then compares two eager steps from one saved state (tests)")
    args, extra = ap.parse_known_args()
    if args.cpu and (args.profile or args.trace):
        ap.error("--profile and --trace read the GPU's kernels from graph replays: leave them out with --cpu")
    if args.cpu and args.no_check:
        ap.error("--no-check leaves the CPU dry run nothing to do (it only checks the state): drop one of them")
    extra = [a for a in extra if a != "--"]
    compiled = [] if args.cpu else ["--compile.enable", "--compile.mode", "default"]  # the dry run: eager, quick
    cfg = load_job_config(["--config", args.config, *compiled, *extra])
    world = world_from_env()
    dims = ParallelDims.from_config(world.world_size, cfg.parallelism)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", world.local_rank)
    if not args.cpu:
        torch.cuda.set_device(device)
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize
    torch.manual_seed(cfg.training.seed)
    start_process_group(world, device, timeout_s=cfg.fault.collective_timeout_s)
    model_args = resolve_model_args(cfg, tokenizer_from_config(cfg.data).vocab_size)
    model_args = dataclasses.replace(model_args, attn_impl=resolve_attn_impl(model_args.attn_impl, device))
    model = build_training_model(cfg, model_args, device, world, dims)
    optimizer = build_optimizer(model, cfg.optimizer, device.type)
    for group in optimizer.param_groups:  # capturable: steps on device, lr a tensor the graph reads
        if not args.cpu:
            group["capturable"] = True
            group["lr"] = torch.tensor(float(cfg.optimizer.lr), device=device)
    tc = cfg.training
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator(device=device).manual_seed(1234 + world.rank)
    batch = {"input": torch.empty(tc.local_batch_size, tc.seq_len, dtype=torch.long, device=device),
             "labels": torch.empty(tc.local_batch_size, tc.seq_len, dtype=torch.long, device=device)}

    def next_batch() -> None:  # new data into the static buffers, outside any graph
        batch["input"].random_(0, model_args.vocab_size, generator=gen)
        batch["labels"].random_(0, model_args.vocab_size, generator=gen)

    loss_fn = compile_loss(token_loss_sum, cfg.compile)  # as the trainer

    def step() -> torch.Tensor:
        loss, _ = train_step(model, optimizer, NoSchedule(), [batch], params=params, max_norm=tc.max_norm,
                             loss_fn=loss_fn,
                             autocast=lambda: autocast_context(device, tc.mixed_precision),
                             dp_degree=dims.dp_degree,
                             grad_sync=cfg.parallelism.grad_sync, shard_local=cfg.optimizer.shard_local)
        return loss

    def timed(run) -> tuple[float, list[float]]:
        losses = []
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            next_batch()
            losses.append(run())
        sync()
        return (time.perf_counter() - t0) / args.steps, [float(x) for x in losses]

    res = dict(tag=args.tag, device="cpu" if args.cpu else torch.cuda.get_device_name(device),
               world_size=world.world_size, torch=torch.__version__, triton=software_versions()["triton"],
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               argv=sys.argv[1:], tokens_per_step_per_rank=tc.local_batch_size * tc.seq_len)
    for _ in range(args.warmup):  # compiles every block; Adam's state is made here, outside any capture
        next_batch()
        step()
    res["eager_step_s"], res["eager_losses"] = timed(step)
    replay_graph = release_graph = None
    try:
        if not args.cpu:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # capture needs warm-up on a side stream (allocator pools, NCCL)
                for _ in range(args.warmup):
                    next_batch()
                    step()
            torch.cuda.current_stream(device).wait_stream(side)
        next_batch()
        if not args.no_check:
            saved = [t.clone() for t in _state(model, optimizer)]

            def restore() -> None:
                for t, s in zip(_state(model, optimizer), saved):
                    t.copy_(s)

            eager_loss = float(step())
            eager_after = [t.clone() for t in _state(model, optimizer)]
            restore()  # a second eager step from the same state: the noise floor of the replay's comparison (atomics)
            eager2_loss = float(step())
            res["eager_repeat_loss_equal"] = eager2_loss == eager_loss
            res["eager_repeat_max_abs_diff"] = _max_diff(_state(model, optimizer), eager_after)
            restore()
        if args.cpu:  # the dry run: a second eager step stands in for the replay
            static_loss = step()
        else:
            torch.cuda.empty_cache()  # the eager steps' cached blocks: the graph's pool needs the room
            static_loss, replay_graph, release_graph = cuda_capture(step)  # the trainer's capture (not run yet)
            if not args.no_check:
                replay_graph()  # the batch is still the eager step's: same inputs, same starting state
        if not args.no_check:
            sync()
            res["replay_loss_equal"] = float(static_loss) == eager_loss
            res["replay_params_equal"] = all(torch.equal(a, b)
                                             for a, b in zip(_state(model, optimizer), eager_after))
            res["replay_max_abs_diff"] = _max_diff(_state(model, optimizer), eager_after)

        def replay() -> torch.Tensor:
            replay_graph()
            return static_loss.clone()

        if not args.cpu:
            res["graph_step_s"], res["graph_losses"] = timed(replay)
            res["speedup"] = res["eager_step_s"] / res["graph_step_s"]
            if args.profile:
                from profile_block import profile_kernels  # benchmarks/ is on sys.path (top of the file)

                res["replay_profile"] = profile_kernels(replay, iters=args.profile)
            if args.trace:
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                _trace(step, out / f"trace_{args.tag}_eager_r{world.rank}.json.gz", shapes=True)
                _trace(replay, out / f"trace_{args.tag}_replay_r{world.rank}.json.gz", shapes=False)
    except Exception as e:  # noqa: BLE001 - the probe reports why capture or replay failed
        res["graph_error"] = f"{type(e).__name__}: {e}"
        res["graph_traceback"] = traceback.format_exc()[-4000:]
    if release_graph is not None:
        release_graph()  # before destroy_process_group, which waits for graphs holding NCCL kernels (pytorch#115388)
    if world.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"step_graph_{args.tag}.json").write_text(json.dumps(res, indent=1))
        print(json.dumps({k: v for k, v in res.items() if "losses" not in k and k != "graph_traceback"}, indent=1))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
