"""Train an NSA language model.

    python -m nsa_titan.train --config train_configs/debug_model.toml [--section.key value ...]
    torchrun --nproc_per_node N -m nsa_titan.train ...   (data parallel over N ranks: see [parallelism])

Precedence of settings: command line > TOML > defaults (see ``--help``). Rank 0 prints and writes files:
``dump_folder/<metrics.jsonl_file>`` (one JSON object per log / val step) and ``dump_folder/summary.json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nsa_titan.components.diagnostics import NSADiagnostics
from nsa_titan.components.garbage_collection import GarbageCollection
from nsa_titan.components.lr_scheduler import build_lr_scheduler, validate_schedule
from nsa_titan.components.metrics import MetricsLogger
from nsa_titan.components.optimizer import build_optimizer
from nsa_titan.components.profiling import TrainProfiler
from nsa_titan.components.runtime import (
    World,
    autocast_context,
    configure_cuda_allocator,
    device_name,
    resolve_device,
    seed_everything,
    software_versions,
    start_process_group,
    world_from_env,
)
from nsa_titan.components.step_graph import StepGraph, require_cuda
from nsa_titan.components.train_step import evaluate, full_param_shapes, move_batch, token_loss_sum, train_step
from nsa_titan.config import ConfigError, JobConfig, config_to_toml, job_config_to_dict, load_job_config
from nsa_titan.data import build_dataloader, retrieval_accuracy, tokenizer_from_config
from nsa_titan.data.documents import add_document_inputs
from nsa_titan.errors import EXIT_CONFIG, EXIT_INTERRUPTED, TrainingFailure
from nsa_titan.fault import Preempted, Resilience, TrainHooks, collective_failure_hint
from nsa_titan.models import NSAModelArgs, build_model, resolve_attn_impl
from nsa_titan.models.nsa.flops import count_params, training_flops_per_token
from nsa_titan.models.nsa.local_attention import describe as describe_attention
from nsa_titan.parallelisms import (
    CompileCounter,
    ParallelDims,
    compile_loss,
    describe_parallelism,
    early_unshard,
    parallelize_nsa,
)


def _print0(world: World, *args: Any) -> None:
    if world.is_main:
        print(*args, flush=True)


def resolve_model_args(job_config: JobConfig, vocab_needed: int) -> NSAModelArgs:
    """The config's model (``JobConfig.model_args``), also checked against the tokenizer's vocabulary."""
    args = job_config.model_args()
    if vocab_needed > args.vocab_size:
        raise ConfigError(
            f"model.vocab_size: the tokenizer ({job_config.data.tokenizer!r}) has {vocab_needed} tokens but the "
            f"model only {args.vocab_size} embedding rows; pass --model.vocab_size {vocab_needed} (or larger, e.g. "
            f"{-(-vocab_needed // 64) * 64}, a multiple of 64)"
        )
    return args


def build_training_model(job_config: JobConfig, model_args: NSAModelArgs, device: torch.device,
                         world: World, parallel_dims: ParallelDims | None = None) -> nn.Module:
    """The model to train (fp32 master weights): built on meta, then ``parallelize_nsa`` applies activation
    checkpointing -> per-block compile -> data parallelism and materialises it (under FSDP2 each rank
    allocates only its shard). The rest of the loop only needs ``model(tokens) -> logits`` and
    ``model.parameters()``. ``model_args.attn_impl`` should be resolved for ``device`` (``resolve_attn_impl``).
    """
    if parallel_dims is None:
        parallel_dims = ParallelDims.from_config(world.world_size, job_config.parallelism)
    with torch.device("meta"):
        model = build_model(model_args)
    return parallelize_nsa(model, parallel_dims, job_config, device)


def _fixed_val_batches(job_config: JobConfig, tokenizer, dims: ParallelDims, dp_rank: int, report,
                       window: int) -> list[dict[str, torch.Tensor]]:
    """The same ``val_steps`` batches at every evaluation, so val losses are comparable over the run."""
    tc = job_config.training
    loader = build_dataloader(job_config.data, tokenizer, seq_len=tc.seq_len, local_batch_size=tc.local_batch_size,
                              rank=dp_rank, world_size=dims.dp_degree, seed=tc.seed, split="val", report=report,
                              window=window)
    batches = [next(loader) for _ in range(job_config.metrics.val_steps)]
    if job_config.data.document_mask:
        batches = [add_document_inputs(b, tokenizer.eos_id, job_config.data.restart_positions) for b in batches]
    return batches


def _uses_retrieval(job_config: JobConfig) -> bool:
    return job_config.data.dataset == "retrieval" or job_config.data.retrieval_mix > 0


def warmup_steps(job_config: JobConfig, device: torch.device, data_parallel: bool) -> int:
    """How many first steps of a run (or of a resumed run) compile, record or capture graphs: the step graph's eager
    warm-up and its capture step; reduce-overhead's warm-up call and recording call (cudagraph trees); else the first
    step, which compiles or warms up the allocator. The summary's throughput leaves their log windows out: in a
    40-step m7c run with the step graph, steps 2-10 held the capture and the mean over them read 309k tokens/s
    against 355k in the windows after it."""
    cc = job_config.compile
    if cc.enable and cc.step_graph:
        return cc.step_graph_warmup + 1
    return 2 if cc.uses_cudagraphs(device.type, data_parallel) else 1


def write_summary(path: Path, logger: MetricsLogger, *, steps_done: int, interrupted: bool, device: torch.device,
                  job_config: JobConfig, model_args: NSAModelArgs, model_info: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    summary = {
        **logger.summary(),
        "steps": steps_done,
        "steps_planned": job_config.training.steps,
        "interrupted": interrupted,
        "note": "tokens_per_s, mfu and gpu_busy cover the log windows from steady_from_step on: after the steps that "
                "compile, record CUDA graphs or capture the step graph (or, in a run too short for that, after the "
                "first log window), less the later windows in which torch.compile compiled (compiled_windows_left_out)",
        "device": device_name(device),
        **software_versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {**model_info, "args": dataclasses.asdict(model_args)},
        "config": job_config_to_dict(job_config),
        **(extra or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def main(argv: list[str] | None = None, hooks: TrainHooks | None = None) -> dict[str, Any]:
    """Run training; returns the summary dict (rank 0; other ranks get {} or, after a stop signal, its
    ``exit_code``). ``hooks``: fault injection (tests)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    job_config = load_job_config(argv)
    try:  # a config error (exit 2, no traceback), before any GPU work; not in load_job_config, which
        # generate / eval also use with training configs whose steps do not matter to them
        validate_schedule(job_config.lr_scheduler, job_config.training.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    world = world_from_env()
    # Degrees are checked against the world size before any process group or GPU work.
    parallel_dims = ParallelDims.from_config(world.world_size, job_config.parallelism)
    tc, mc = job_config.training, job_config.metrics
    _print0(world, "# resolved config\n" + config_to_toml(job_config))

    device = resolve_device(tc.device, world.local_rank)
    if job_config.compile.step_graph:
        require_cuda(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    configure_cuda_allocator(device, tc.expandable_segments)
    seed_everything(tc.seed)
    if tc.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)

    try:  # a missing, unreadable or mis-configured tokenizer is a settings mistake (exit 2), found before the model
        tokenizer = tokenizer_from_config(job_config.data)
    except (ValueError, ImportError) as e:
        raise ConfigError(str(e)) from None
    model_args = resolve_model_args(job_config, tokenizer.vocab_size)
    # Checkpointing + failure handling; checks the resume source now, before the model is built.
    res = Resilience(job_config, rank=world.rank, world_size=world.world_size, model_args=model_args,
                     log=functools.partial(_print0, world), hooks=hooks, argv=argv)
    # Data before the model: an unusable corpus (empty, not text, too short for seq_len) is a config error
    # now, not after the model is built (and compiled) on the GPU.
    # Common seed on every rank: the loader shards by its explicit (data-parallel) rank argument, and a
    # per-rank seed would give ranks different document orders, i.e. overlapping shards.
    warn = functools.partial(_print0, world, "WARNING:")
    # The data rank is the global rank (data parallelism only); from the environment, as the process group
    # is created later, with the model's device mesh.
    dp_rank = world.rank if parallel_dims.dp_enabled else 0
    try:
        train_loader = build_dataloader(job_config.data, tokenizer, seq_len=tc.seq_len,
                                        local_batch_size=tc.local_batch_size, rank=dp_rank,
                                        world_size=parallel_dims.dp_degree, seed=tc.seed, split="train", report=warn,
                                        window=model_args.window, num_workers=job_config.data.num_workers,
                                        log=functools.partial(_print0, world), grad_accum_steps=tc.grad_accum_steps)
        val_batches = (_fixed_val_batches(job_config, tokenizer, parallel_dims, dp_rank, warn, model_args.window)
                       if mc.val_freq > 0 else [])
    except ConfigError:
        raise
    except (ValueError, ImportError) as e:  # the data package names the key (data.path, ...) and the fix
        raise ConfigError(str(e)) from None
    _print0(world, f"data: {job_config.data.dataset} | tokenizer {tokenizer!r} (eos {tokenizer.eos_id}) | "
                   + (f"torchdata StatefulDataLoader, {train_loader.num_workers} worker(s)/rank"
                      if train_loader.use_torchdata else "inline loader"))
    # The process group only now: every rank got this far, so a config or data error above fails each rank
    # alone instead of leaving the others waiting for it.
    start_process_group(world, device, timeout_s=job_config.fault.collective_timeout_s)
    # 'auto' becomes the implementation that runs on this device: the model holds it and the log names it. The
    # configured value stays in model_args (checkpoints record it: a resume on another device may differ).
    attn_impl = resolve_attn_impl(model_args.attn_impl, device)
    model = build_training_model(job_config, dataclasses.replace(model_args, attn_impl=attn_impl), device, world,
                                 parallel_dims)
    compile_counter = CompileCounter(model)  # compilation happens lazily, at each block's first call
    # parallelism.fsdp_unshard_early: the next forward's first units all-gathered right after each optimizer step
    unshard_early = early_unshard(model, job_config.parallelism)
    # NSA diagnostics, collected during the forward of log steps only (components/diagnostics.py).
    diagnostics = NSADiagnostics.attach(model) if mc.nsa_diagnostics else NSADiagnostics()
    flops_per_token = training_flops_per_token(model_args, tc.seq_len)
    model_info = {
        "flavor": job_config.model.flavor,
        "params": count_params(model_args, include_embedding=False),
        "params_with_embedding": count_params(model_args, include_embedding=True),
        "training_flops_per_token": flops_per_token,
        "attn_impl": attn_impl,
    }
    kernels = describe_attention(model_args.attn_type, attn_impl, device.type, tc.mixed_precision,
                                 documents=job_config.data.document_mask)
    impl_text = attn_impl + (f" ({model_args.attn_impl})" if attn_impl != model_args.attn_impl else "")
    _print0(world, f"model {model_info['flavor']} ({model_args.attn_type}, attn_impl={impl_text}"
                   f"{', ' + kernels if kernels else ''}): "
                   f"{model_info['params'] / 1e6:.2f}M params excl. embedding "
                   f"({model_info['params_with_embedding'] / 1e6:.2f}M total) | "
                   f"{flops_per_token / 1e9:.3f} GFLOP/token (training, seq_len {tc.seq_len}) | "
                   f"device {device_name(device)}")
    _print0(world, describe_parallelism(parallel_dims, job_config, model_args.n_layers, device.type))
    cudagraphs = job_config.compile.uses_cudagraphs(device.type, parallel_dims.dp_enabled)

    params = [p for p in model.parameters() if p.requires_grad]
    with full_param_shapes(model):  # FSDP1 flattens parameters; decay groups are chosen by their real shapes
        optimizer = build_optimizer(model, job_config.optimizer, device.type, require_fused=res.needs_fused_optimizer)
    scheduler = build_lr_scheduler(optimizer, job_config.lr_scheduler, tc.steps)
    retrieval_fn = retrieval_accuracy if _uses_retrieval(job_config) else None
    autocast = functools.partial(autocast_context, device, tc.mixed_precision)
    dc = job_config.data

    loss_fn = compile_loss(token_loss_sum, job_config.compile)  # compile.loss: no fp32 log-softmax kept

    def run_step(batches, sched):
        return train_step(model, optimizer, sched, batches, params=params, max_norm=tc.max_norm, autocast=autocast,
                          before_optimizer_step=res.before_optimizer_step, dp_degree=parallel_dims.dp_degree,
                          grad_sync=job_config.parallelism.grad_sync, shard_local=job_config.optimizer.shard_local,
                          loss_fn=loss_fn)

    def with_documents(batch):  # document starts (and restarted positions) of packed sequences, on device
        return add_document_inputs(batch, tokenizer.eos_id, dc.restart_positions) if dc.document_mask else batch

    first_step = res.start(model=model, optimizer=optimizer, scheduler=scheduler, loader=train_loader, device=device)
    step_graph = None
    if job_config.compile.step_graph:  # the whole step as one CUDA graph (components/step_graph.py)
        res.guard.use_step_graph()
        step_graph = StepGraph(run_step, optimizer, scheduler, warmup_steps=job_config.compile.step_graph_warmup,
                               device=device, after_step=res.guard.record_graphed_step)
    dump = Path(job_config.job.dump_folder)
    logger = MetricsLogger(mc, dump_folder=dump, total_steps=tc.steps, device=device, world_size=world.world_size,
                           rank=world.rank, flops_per_token=flops_per_token, tokens_seen=res.train_state.tokens_seen,
                           resumed_at_step=first_step - 1, run_config=job_config_to_dict(job_config),
                           warmup_steps=warmup_steps(job_config, device, parallel_dims.dp_enabled))
    _print0(world, f"training {tc.steps} steps x {tc.grad_accum_steps} micro-batches of "
                   f"{tc.local_batch_size} x {tc.seq_len} tokens on {world.world_size} rank(s) "
                   f"(global batch {tc.local_batch_size * tc.grad_accum_steps * parallel_dims.dp_degree} sequences)")
    profiler = TrainProfiler(job_config.profiling, dump_folder=dump, rank=world.rank, device=device,
                             log=lambda m: print(m, flush=True), start_step=first_step)
    steps_done, interrupted, error, stop = first_step - 1, False, None, {}
    evaluated = False  # whether a validation ran (its no_grad forward compiles graphs of its own)
    collector = GarbageCollection(tc.gc_freq)
    try:
        profiler.start()
        collector.start()  # closed in finally
        for step in range(first_step, tc.steps + 1):
            res.step_start(step)
            with logger.data_loading():  # host-side data work, logged as data-loading time
                micro_batches = [next(train_loader) for _ in range(tc.grad_accum_steps)]
            logger.step_start()
            micro_batches = [with_documents(move_batch(mb, device)) for mb in micro_batches]
            lr = scheduler.get_last_lr()[0]  # the lr this step uses (a host float, no sync)
            if cudagraphs:  # a new iteration: earlier graph outputs may be overwritten now
                torch.compiler.cudagraph_mark_step_begin()
            graphs_before = compile_counter.graphs()  # a dict read: a step that compiles stays out of the summary
            with diagnostics.collecting(logger.should_log(step)):  # filled during this forward on log steps
                if step_graph is None:
                    loss, grad_norm = run_step(micro_batches, scheduler)
                else:
                    loss, grad_norm = step_graph(micro_batches)
            if unshard_early is not None:
                unshard_early()
            num_tokens = sum(mb["input"].numel() for mb in micro_batches)
            collector.step(step)  # inside the step's time: its cost is part of training
            logger.step_end(step, loss, grad_norm, num_tokens=num_tokens,
                            compiled=compile_counter.graphs() != graphs_before)
            steps_done = step
            log_step = logger.should_log(step)
            if log_step:
                logger.log(step, lr)
                diag = diagnostics.read()  # host sync ok: log step
                if diag is not None:
                    logger.log_extra("nsa_diag", step, diag, line=NSADiagnostics.format_line(diag),
                                     scalars=NSADiagnostics.scalars(diag))
            with logger.paused():  # non-finite check on log steps, checkpoint saves
                res.step_end(step, num_tokens, log_step=log_step)
            if val_batches and (step % mc.val_freq == 0 or step == tc.steps):
                with logger.paused():
                    logger.log_val(step, evaluate(model, val_batches, device, autocast=autocast,
                                                  retrieval_fn=retrieval_fn, loss_fn=loss_fn))
                    evaluated = True
                    if step_graph is not None:
                        step_graph.after_eager_forward(model)
                res.progress()
            profiler.step(step)  # profiler schedule and requested memory snapshots, between steps
        res.finish()  # wait for a background save; model export
    except KeyboardInterrupt as e:  # Ctrl-C twice, or SIGTERM / SIGINT handled after a step (Preempted)
        interrupted, error = True, e
        stop = ({"stop_signal": e.signame, "checkpoint": None if e.saved is None else str(e.saved),
                 "exit_code": e.exit_code} if isinstance(e, Preempted) else {"exit_code": EXIT_INTERRUPTED})
        _print0(world, f"interrupted after {steps_done} completed step(s); writing the summary")
    except BaseException as e:
        error = e
        peer = res.peer_failure(e)  # another rank is gone: exit 5 naming it (python -m nsa_titan.train)
        if peer is not None:
            raise peer from e
        hint = collective_failure_hint(e, world.world_size)
        if hint:
            print(f"[rank {world.rank}] {hint}", file=sys.stderr, flush=True)
        raise
    finally:
        if step_graph is not None:
            step_graph.close()  # before destroy_process_group: a live graph with NCCL kernels hangs it
        collector.close()
        profiler.close(error)  # an out-of-memory error writes a memory snapshot first
        logger.close()
        try:
            res.close(error)
        finally:
            train_loader.close()  # its worker processes stop now, not when the garbage collector gets to them

    compile_stats = None
    if job_config.compile.enable:
        graphs = compile_counter.graphs()
        # Diagnostic forwards (log steps), evaluation under no_grad and the compiled loss compile graphs of their
        # own: expected, not recompiles.
        expected = compile_counter.expected(diagnostics=diagnostics.attached, evaluated=evaluated,
                                            loss=loss_fn is not token_loss_sum)
        compile_stats = {"graphs": graphs, "expected_graphs": expected, "recompiles": max(0, graphs - expected),
                         "mode": job_config.compile.effective_mode(device.type, parallel_dims.dp_enabled)}
        _print0(world, f"compile: {graphs} graph(s) compiled for {model_args.n_layers} blocks "
                       f"({compile_stats['recompiles']} recompile(s); TORCH_LOGS=recompiles says why)")
    if dist.is_initialized():
        dist.destroy_process_group()
    if not world.is_main:
        return stop
    summary = write_summary(dump / "summary.json", logger, steps_done=steps_done, interrupted=interrupted,
                            device=device, job_config=job_config, model_args=model_args, model_info=model_info,
                            extra={"compile": compile_stats, **stop})
    tps = summary["tokens_per_s"]
    _print0(world, f"done: {steps_done} steps, loss {summary['initial_loss']} -> {summary['final_loss']}, "
                   f"{'n/a' if tps is None else f'{tps:,.0f}'} tokens/s; summary in {dump / 'summary.json'}")
    return summary


if __name__ == "__main__":
    try:
        result = main()
    except ConfigError as e:  # a settings mistake: the message names the key and the fix; no traceback
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except TrainingFailure as e:  # detected by the trainer (e.g. a non-finite loss): the message says what to do
        print(f"training stopped: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    sys.exit(result.get("exit_code", 0))  # 143 after SIGTERM, 130 after SIGINT (see fault/preemption.py)
