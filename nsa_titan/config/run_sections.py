"""Config sections for scaling and long runs: parallelism, activation checkpointing, compile, checkpoints,
faults, profiling. Split from ``job_config.py`` (which composes them into ``JobConfig``) only to keep files short;
the same conventions hold: each field's docstring sits directly below it and ``--help`` reads it back.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Literal

from nsa_titan.config.manager import check as _check


@dataclass
class Parallelism:
    """Data parallelism over the torchrun ranks (world size = dp_replicate x dp_shard). A single process ignores it."""

    data_parallel: Literal["fsdp2", "fsdp1", "ddp"] = "fsdp2"
    """'fsdp2': fully_shard (per-parameter sharding; HSDP when dp_replicate > 1); 'fsdp1':
    FullyShardedDataParallel, kept for comparison; 'ddp': DistributedDataParallel (full replicas)."""
    dp_replicate: int = 1
    """Replica groups: the outer dimension of the 2-D HSDP mesh (fsdp2, fsdp1 'hybrid'). ddp: every rank is a
    replica, so leave 1 or pass the world size."""
    dp_shard: int = -1
    """Ranks each parameter is sharded over; -1: world size / dp_replicate (ddp: 1)."""
    grad_sync: Literal["last_micro_batch", "every_micro_batch"] = "last_micro_batch"
    """With grad_accum_steps > 1: reduce gradients across ranks only after the last micro-batch (least
    communication; FSDP holds unsharded gradients meanwhile) or after every one (FSDP: reduce-scatter each
    time and keep only the shard: least memory)."""
    param_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """FSDP mixed precision: dtype of the gathered parameters that compute uses (master weights stay fp32);
    'auto': bf16 when training.mixed_precision is bf16 on CUDA, else fp32."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """FSDP mixed precision: dtype in which gradients are reduced across ranks."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] | int = "default"
    """fsdp2: free gathered parameters after forward? 'default': each block yes, the last unit (norm +
    output, which backward needs at once) no; 'always'; 'never' (no re-gather in backward, more memory);
    an int k: keep a copy sharded over k ranks (1 < k < dp_shard, k divides dp_shard)."""
    fsdp_cpu_offload: bool = False
    """fsdp2: keep sharded parameters, gradients and optimizer state in host memory (CPUOffloadPolicy)."""
    fsdp_prefetch: int = 0
    """fsdp2: 0: FSDP2's implicit prefetching; N >= 1: explicitly all-gather the next N blocks in forward
    and the previous N blocks in backward."""
    fsdp_blocks_per_unit: int = 1
    """fsdp2: consecutive transformer blocks sharded as one unit: one all-gather, one reduce-scatter and one set
    of FSDP2 hooks per unit instead of per block. A small model can be bound by FSDP2's host time per unit
    (hooks, copying the gathered buffer into each parameter): m7c at 8k, batch 2, ran at 61.6 % of one GPU on
    two H100s with 1 (docs/experiments.md). k > 1 divides that host time by k and holds k blocks unsharded at
    once (more memory)."""
    fsdp_unshard_early: bool = False
    """fsdp2: all-gather the first units of the forward (the embedding and the first block's unit) right after
    each optimizer step instead of in the next forward's first hooks. On a host-bound step (m7c at 8k on two
    GPUs) the next forward started with ~5 ms of FSDP2 host work and an idle GPU (docs/experiments.md); done
    early, that work overlaps the optimizer's kernels and the data loading. Holds those units unsharded between
    steps (more memory). Off by default: on two H100s it measured no gain for m7c (docs/experiments.md)."""
    fsdp1_sharding_strategy: Literal["full", "grad_op", "hybrid"] = "full"
    """fsdp1: FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD (needs dp_replicate > 1)."""
    fsdp1_use_orig_params: bool = True
    """fsdp1: expose the original parameters (needed by torch.compile and per-parameter weight decay)."""
    fsdp1_limit_all_gathers: bool = True
    """fsdp1: rate-limit all-gathers so that at most two blocks' parameters are unsharded at once."""
    fsdp1_forward_prefetch: bool = False
    """fsdp1: issue the next block's all-gather before the current block's forward compute."""
    fsdp1_backward_prefetch: Literal["pre", "post", "none"] = "pre"
    """fsdp1: all-gather the previous block before ('pre') or after ('post') the current block's gradient
    computation, or not at all ('none')."""
    ddp_static_graph: bool = True
    """ddp: the set of used parameters never changes between steps (true for this model), which lets DDP
    skip per-step bookkeeping. Applied only where valid: not with no_sync micro-batches (grad_accum_steps
    > 1 and grad_sync 'last_micro_batch')."""

    def validate(self) -> None:
        _check(self.dp_replicate >= 1, "parallelism.dp_replicate", f"must be >= 1, got {self.dp_replicate}")
        _check(self.dp_shard == -1 or self.dp_shard >= 1, "parallelism.dp_shard",
               f"must be -1 (the rest of the ranks) or >= 1, got {self.dp_shard}")
        _check(self.fsdp_prefetch >= 0, "parallelism.fsdp_prefetch", f"must be >= 0, got {self.fsdp_prefetch}")
        _check(self.fsdp_blocks_per_unit >= 1, "parallelism.fsdp_blocks_per_unit",
               f"must be >= 1, got {self.fsdp_blocks_per_unit}")
        _check(self.fsdp_blocks_per_unit == 1 or self.data_parallel == "fsdp2", "parallelism.fsdp_blocks_per_unit",
               f"groups FSDP2's units only: leave it at 1 with data_parallel={self.data_parallel}, or use fsdp2")
        _check(not self.fsdp_unshard_early or self.data_parallel == "fsdp2", "parallelism.fsdp_unshard_early",
               f"unshards FSDP2's units only: leave it off with data_parallel={self.data_parallel}, or use fsdp2")
        rafp = self.fsdp_reshard_after_forward
        _check(not isinstance(rafp, int) or rafp >= 2, "parallelism.fsdp_reshard_after_forward",
               f"an int must be >= 2 (a reshard world size), got {rafp}; or use default/always/never")


@dataclass
class ActivationCheckpoint:
    """Activation checkpointing (recompute activations in backward to save memory); never reentrant."""

    mode: Literal["none", "full", "selective_op", "ratio", "memory_budget"] = "none"
    """'none'; 'full': every block recomputes its forward in backward; 'selective_op': save the outputs of
    every other matmul, the attention ops and reduce-scatters, recompute the rest; 'ratio': fully checkpoint
    a fraction of the blocks (see ratio); 'memory_budget': let torch.compile choose what to recompute
    (needs compile.enable; see memory_budget)."""
    ratio: float = 0.5
    """For mode 'ratio': fraction p in [0, 1] of the blocks checkpointed, evenly spaced (0: none, 1: all)."""
    memory_budget: float = 0.5
    """For mode 'memory_budget': torch._functorch.config.activation_memory_budget in [0, 1]; 1 saves what
    compile would save anyway, 0 recomputes as much as possible."""

    def validate(self) -> None:
        _check(0.0 <= self.ratio <= 1.0, "activation_checkpoint.ratio", f"must be in [0, 1], got {self.ratio}")
        _check(0.0 <= self.memory_budget <= 1.0, "activation_checkpoint.memory_budget",
               f"must be in [0, 1], got {self.memory_budget}")


@dataclass
class Compile:
    """torch.compile of the model."""

    enable: bool = False
    """Compile the model with torch.compile."""
    fullgraph: bool = True
    """torch.compile(fullgraph=True): fail loudly on graph breaks instead of silently running eagerly."""
    mode: Literal["default", "reduce-overhead", "auto", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile mode of each block. 'reduce-overhead' replays every compiled block (forward and backward)
    as a CUDA graph: the host no longer launches each kernel, which bounds small models (an m7c NSA layer
    launches 46 kernels per forward+backward, ~2.9 ms of host time for ~3 ms of GPU time; H100: m7c 8k
    batch 2 175k -> 247k tokens/s); one GPU only (no data parallelism), and the graphs keep their own memory
    pool. 'auto': 'reduce-overhead' where it can run (one CUDA GPU, no data parallelism), else 'default', so
    one config serves one GPU and many. 'max-autotune-no-cudagraphs' lets inductor tune its generated kernels
    (much longer compile)."""

    step_graph: bool = False
    """Capture the whole optimizer step (forward, backward with data parallelism's collectives, clipping, AdamW)
    as one CUDA graph after step_graph_warmup eager steps and replay it: the host launches nothing per step. For
    host-bound runs, above all data-parallel ones, where 'reduce-overhead' cannot run (H100, m7c 8k batch 2:
    FSDP2 on 2 GPUs 93 -> 45 ms per step, one GPU 46 ms; components/step_graph.py). CUDA only; one GPU or
    data_parallel 'fsdp2' (DDP and FSDP1 cannot be captured); with compile.enable the blocks compile with mode
    'default' ('auto' resolves so); every step's batches must keep their shapes; metrics.nsa_diagnostics,
    parallelism.fsdp_unshard_early and fsdp_cpu_offload must be off. Without compile.enable the eager model is
    captured (measured on GPUs only compiled so far)."""
    step_graph_warmup: int = 3
    """Eager steps before the capture (they train as usual; the first one compiles)."""
    loss: bool = True
    """With compile.enable, compile the loss too (the fp32 cross-entropy over the vocabulary, outside the blocks).
    Eager, it keeps an fp32 log-softmax [tokens, vocabulary] for its backward, whose backward makes two more fp32
    tensors of that size: 23.4 GiB of the 1b's 48.0 GiB peak at 64k tokens per step (15 GB for a 152k vocabulary
    at 8k). Compiled, it keeps the bf16 logits and two numbers per token and writes the logits' gradient in their
    own dtype. Same values up to fp32 summation order. Ignored without compile.enable."""

    def validate(self) -> None:
        _check(self.step_graph_warmup >= 1, "compile.step_graph_warmup",
               f"must be >= 1 (the first step compiles), got {self.step_graph_warmup}")
        _check(not (self.step_graph and self.mode == "reduce-overhead"), "compile.mode",
               "'reduce-overhead' graphs each block, which cannot run inside compile.step_graph's graph of the whole "
               "step; use --compile.mode default (or auto), or drop --compile.step_graph")

    def effective_mode(self, device_type: str, data_parallel: bool) -> str:
        """The mode the blocks compile with on this run: 'auto' resolved for the device and data parallelism."""
        if self.mode != "auto":
            return self.mode
        return "reduce-overhead" if device_type == "cuda" and not data_parallel and not self.step_graph else "default"

    def uses_cudagraphs(self, device_type: str, data_parallel: bool) -> bool:
        """Whether the compiled blocks replay as CUDA graphs on this run (the trainer then marks each step)."""
        return self.enable and self.effective_mode(device_type, data_parallel) == "reduce-overhead"


@dataclass
class Checkpoint:
    """Checkpoints (torch.distributed.checkpoint) that resume exactly, and a model-only export."""

    enable: bool = False
    """Save checkpoints to job.dump_folder/<folder> and resume from the newest one there (see resume_from)."""
    folder: str = "checkpoints"
    """Checkpoint folder, relative to job.dump_folder (or an absolute path)."""
    interval: int = 500
    """Save every this many steps."""
    save_at_end: bool = True
    """Also save after the last step."""
    keep_latest_k: int = 3
    """Keep the newest k complete checkpoints and delete older ones (0: keep all)."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """'async': copy the state to host memory, then write it in a background thread while training goes
    on (costs a host copy of the model and optimizer state)."""
    resume_from: str = "latest"
    """'latest': the newest complete checkpoint in the folder, if any (needs checkpoint.enable; corrupt or
    partial ones are reported and skipped); 'none': start fresh; or a checkpoint folder (a path, or a name
    such as step-00000100 inside the folder), which must be complete."""
    keep_saved_hyperparams: bool = False
    """On resume, keep the optimizer hyper-parameters saved in the checkpoint (lr, betas, eps, weight_decay)
    instead of this run's settings. Off: this run's [optimizer] values win (a log line lists what changed),
    so e.g. a resume after the non-finite stop can lower optimizer.lr. The LR schedule's shape
    ([lr_scheduler], training.steps) is always this run's."""
    export_at_end: bool = False
    """After the last step, also write model.safetensors (Hugging Face style names) + config.json for
    inference into <folder>/export-step-N (needs the `safetensors` package)."""
    export_dtype: Literal["bf16", "fp32"] = "bf16"
    """dtype of the exported weights."""

    def validate(self) -> None:
        _check(bool(self.folder), "checkpoint.folder", "must not be empty; e.g. --checkpoint.folder checkpoints")
        _check(self.interval >= 1, "checkpoint.interval", f"must be >= 1 (steps), got {self.interval}")
        _check(self.keep_latest_k >= 0, "checkpoint.keep_latest_k",
               f"must be >= 0 (0 keeps every checkpoint), got {self.keep_latest_k}")
        _check(bool(str(self.resume_from).strip()), "checkpoint.resume_from",
               "must not be empty; use 'latest', 'none' or a checkpoint folder")
        if self.export_at_end:
            _check(importlib.util.find_spec("safetensors") is not None, "checkpoint.export_at_end",
                   "needs the `safetensors` package: pip install safetensors (or drop --checkpoint.export_at_end)")


@dataclass
class Fault:
    """Failure handling: non-finite loss / grad-norm guard, hang watchdog, heartbeats, collective timeout."""

    nonfinite: Literal["stop", "skip", "off"] = "stop"
    """Non-finite loss or grad norm: 'stop' (drop the update, then at the next log or checkpoint step save
    the last good state and exit with code 3, naming the step), 'skip' (drop that step's update and go
    on) or 'off'. Checked on device through the fused AdamW kernel (so the optimizer is fused when on)."""
    nonfinite_check_every_step: bool = False
    """Read the non-finite flag after every step, so 'stop' stops at the bad step itself; costs one host
    sync per step (the CPU can no longer run ahead of the GPU)."""
    nonfinite_max_skips: int = 10
    """With 'skip': more skipped steps than this end the run as 'stop' does (0: no limit)."""
    watchdog_timeout_s: float = 600.0
    """Dump every thread's stack (and the NCCL flight recorder) and exit with code 4 when no step finishes
    for this long (0: off). Must cover a checkpoint save and an evaluation."""
    watchdog_first_step_timeout_s: float = 1800.0
    """The same limit before the first step finishes (start-up, compilation)."""
    heartbeat_interval_s: float = 10.0
    """Each rank rewrites job.dump_folder/heartbeat/rank<r>.json this often."""
    peer_timeout_s: float = 120.0
    """A rank whose heartbeat is older than this is taken for dead, and the others exit (code 5) with a
    message naming it."""
    collective_timeout_s: float = 900.0
    """Timeout of the process group's collectives (init_process_group(timeout=...)): a collective that
    waits longer fails instead of hanging."""
    stop_grace_s: float = 25.0
    """After SIGTERM (preemption) or SIGINT, the run finishes the current step, saves a checkpoint (when
    checkpoint.enable), writes the summary and exits with code 143 (SIGTERM) or 130 (SIGINT). If that takes
    longer than this, it exits at once with the same code (the previous checkpoint stays intact). Keep it
    below the scheduler's kill delay (SLURM KillWait, Kubernetes terminationGracePeriodSeconds: 30 s)."""

    def validate(self) -> None:
        _check(self.nonfinite_max_skips >= 0, "fault.nonfinite_max_skips",
               f"must be >= 0 (0: no limit), got {self.nonfinite_max_skips}")
        for name in ("watchdog_timeout_s", "watchdog_first_step_timeout_s"):
            value = getattr(self, name)
            _check(value >= 0 and math.isfinite(value), f"fault.{name}", f"must be >= 0 seconds (0: off), got {value}")
        for name in ("heartbeat_interval_s", "peer_timeout_s", "collective_timeout_s", "stop_grace_s"):
            value = getattr(self, name)
            _check(value > 0 and math.isfinite(value), f"fault.{name}", f"must be > 0 seconds, got {value}")
        _check(self.peer_timeout_s >= 2 * self.heartbeat_interval_s, "fault.peer_timeout_s",
               f"must be at least twice fault.heartbeat_interval_s ({self.heartbeat_interval_s}), or live ranks "
               f"would be taken for dead; got {self.peer_timeout_s}")


@dataclass
class Profiling:
    """torch.profiler traces and CUDA memory snapshots (components/profiling.py)."""

    enable_profiling: bool = False
    """Record a torch.profiler trace of `profile_active` steps every `profile_freq` steps into
    job.dump_folder/<traces_folder>/iteration_<step>/rank<r>_trace.json (open in Perfetto / chrome://tracing)."""
    profile_freq: int = 100
    """Steps between traces (a trace ends at every multiple of this)."""
    profile_active: int = 1
    """Steps recorded per trace."""
    profile_warmup: int = 1
    """Steps the profiler runs untraced just before recording (its start-up overhead stays out of the trace)."""
    traces_folder: str = "profile_traces"
    """Folder for the traces, relative to job.dump_folder."""
    enable_memory_snapshot: bool = False
    """CUDA only: record the caching allocator's history (with stack traces; slows allocation) so that the
    snapshots below show who allocated what. Open them at https://pytorch.org/memory_viz."""
    memory_snapshot_steps: list[int] = field(default_factory=list)
    """Write a memory snapshot after each of these steps (on request), e.g. 1,2 for the first two steps."""
    memory_snapshot_on_oom: bool = True
    """Write a memory snapshot when a CUDA out-of-memory error ends the run (without enable_memory_snapshot
    it shows the allocator's segments only, no history)."""
    memory_snapshot_folder: str = "memory_snapshots"
    """Folder for the snapshots (rank<r>_<step|oom>.pickle), relative to job.dump_folder."""
    memory_snapshot_max_entries: int = 100000
    """Allocation events kept in the recorded history."""
    memory_snapshot_stacks: Literal["python", "all"] = "python"
    """Stack traces recorded with each allocation: "python" (the Python frames: the model's and inductor's
    lines, what benchmarks/memory_peak.py groups by) or "all" (also C++ frames, which the snapshot must symbolize
    when it is written: much slower to write)."""

    def validate(self) -> None:
        _check(self.profile_freq >= 1, "profiling.profile_freq", f"must be >= 1, got {self.profile_freq}")
        _check(self.profile_active >= 1, "profiling.profile_active", f"must be >= 1, got {self.profile_active}")
        _check(self.profile_warmup >= 0, "profiling.profile_warmup", f"must be >= 0, got {self.profile_warmup}")
        _check(self.profile_active + self.profile_warmup <= self.profile_freq, "profiling.profile_freq",
               f"must be >= profile_active + profile_warmup ({self.profile_active} + {self.profile_warmup}), got "
               f"{self.profile_freq}; raise --profiling.profile_freq or lower the others")
        _check(all(s >= 1 for s in self.memory_snapshot_steps), "profiling.memory_snapshot_steps",
               f"steps must be >= 1, got {self.memory_snapshot_steps}")
        _check(self.memory_snapshot_max_entries >= 1, "profiling.memory_snapshot_max_entries",
               f"must be >= 1, got {self.memory_snapshot_max_entries}")
