"""The training job's configuration: one dataclass per TOML section, composed into ``JobConfig``.

Each field's docstring sits directly below it; ``--help`` reads them back from this source, so they
are the user-facing documentation. To add a section, write a dataclass here (with an optional
``validate()``) and add a field for it to ``JobConfig``; the loader in ``manager.py`` is generic. The
sections for scaling and long runs live in ``run_sections.py``, the data section in ``data_section.py``.

    from nsa_titan.config import load_job_config
    cfg = load_job_config(["--config", "train_configs/debug_model.toml", "--training.steps", "10"])
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from nsa_titan.config.data_section import Data
from nsa_titan.config.manager import ConfigError, config_to_dict, field_docs, parse_config
from nsa_titan.config.manager import check as _check
from nsa_titan.config.run_sections import ActivationCheckpoint, Checkpoint, Compile, Fault, Parallelism, Profiling
from nsa_titan.models.nsa.args import NSAModelArgs, get_model_args
from nsa_titan.models.nsa.args import field_types as model_field_types


@dataclass
class Job:
    """Where outputs go and what this run is."""

    dump_folder: str = "./outputs"
    """Folder for everything the run writes (metrics JSONL, TensorBoard events, ...)."""
    description: str = ""
    """Free-text description of the run, logged at start-up."""
    config_file: str | None = None
    """TOML file the config was loaded from (set by --config FILE; alias --job.config_file FILE)."""

    def validate(self) -> None:
        _check(bool(self.dump_folder), "job.dump_folder", "must not be empty; e.g. --job.dump_folder ./outputs")
        _check(not os.path.exists(self.dump_folder) or os.path.isdir(self.dump_folder), "job.dump_folder",
               f"{self.dump_folder!r} is a file, not a folder; pass another --job.dump_folder")


@dataclass
class ModelFlavor:
    """Which model: a named flavor plus optional overrides of its NSAModelArgs fields."""

    flavor: str = "debug"
    """Named NSAModelArgs preset from nsa_titan.models.MODEL_FLAVORS (debug, m7c, m7c_gpt2, 1b, qwen7b)."""

    def overrides(self) -> dict[str, Any]:
        """The NSAModelArgs fields set here (not None), for ``get_model_args(flavor, **overrides)``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "flavor" and getattr(self, f.name) is not None}


def _model_section() -> type:
    """``[model]``: ``flavor`` plus one optional key per NSAModelArgs field (None keeps the flavor's value).

    Generated from NSAModelArgs, so that each field's type, choices and docstring are written once, there;
    ``JobConfig.model_args`` applies the keys and NSAModelArgs.validate checks the result.
    """
    docs = field_docs(NSAModelArgs)
    fields = [(name, tp | None, field(default=None)) for name, tp in model_field_types().items()]
    return dataclasses.make_dataclass(
        "Model", fields, bases=(ModelFlavor,),
        namespace={"__module__": __name__, "__doc__": ModelFlavor.__doc__,
                   "__field_docs__": {name: f"{docs.get(name, '')} None: the flavor's.".lstrip()
                                      for name, _, _ in fields}})


Model = _model_section()


@dataclass
class Training:
    """Batch shape, length of the run, precision and device."""

    seq_len: int = 1024
    """Tokens per training sequence (must not exceed the model's max_seq_len)."""
    local_batch_size: int = 8
    """Sequences per micro-batch on each rank."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (global batch = local_batch_size x this x ranks)."""
    steps: int = 300
    """Optimizer steps to train for."""
    max_norm: float = 1.0
    """Gradient clipping: maximum global L2 norm of the gradients."""
    mixed_precision: Literal["bf16", "fp32"] = "bf16"
    """'bf16': bf16 autocast with fp32 master weights; 'fp32': everything fp32. Ignored on CPU (fp32)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto': cuda when available, else cpu."""
    seed: int = 42
    """Random seed (parameter init, data order, synthetic data)."""
    deterministic: bool = False
    """Ask torch for deterministic algorithms (slower; for debugging and reproducibility tests)."""
    expandable_segments: bool = False
    """CUDA: the caching allocator grows segments in place (expandable_segments) instead of adding fixed ones, so
    buffers of many sizes (FSDP all-gathers, activations) leave less memory reserved but unused."""
    gc_freq: int = 50
    """Python garbage collection after every gc_freq-th step, on all ranks at the same step (0: Python's automatic
    collection, which pauses each rank at its own moment and makes the other ranks wait at the next collective)."""

    def validate(self) -> None:
        _check(self.gc_freq >= 0, "training.gc_freq", f"must be >= 0 (0: Python's automatic collection), got "
               f"{self.gc_freq}; e.g. --training.gc_freq 50")
        for name in ("seq_len", "local_batch_size", "grad_accum_steps", "steps"):
            value = getattr(self, name)
            _check(value >= 1, f"training.{name}", f"must be >= 1, got {value}; pass a positive --training.{name}")
        _check(self.seq_len >= 2, "training.seq_len", f"must be >= 2 (a sequence of 1 token has nothing to predict "
               f"within it), got {self.seq_len}; e.g. --training.seq_len 512")
        _check(self.max_norm > 0 and math.isfinite(self.max_norm), "training.max_norm",
               f"must be a positive finite number, got {self.max_norm}; e.g. --training.max_norm 1.0")
        _check(self.seed >= 0, "training.seed", f"must be >= 0, got {self.seed}")


@dataclass
class Optimizer:
    """Optimizer settings."""

    name: Literal["adamw"] = "adamw"
    """Optimizer; only 'adamw' for now."""
    lr: float = 3e-4
    """Peak learning rate (reached at the end of warmup)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2); on the command line: 0.9,0.95 or [0.9, 0.95]."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    fused: Literal["auto"] | bool = "auto"
    """Fused AdamW kernel: 'auto' (on for CUDA), true or false."""
    shard_local: bool = True
    """FSDP2: clip gradients and step AdamW on each rank's local shards instead of through DTensor dispatch (the
    same arithmetic, less host time: clip + step 13.15 -> 3.58 ms at m7c's size on an H100; compiled m7c's step on
    2 H200s did not change, the optimizer was off its critical path). false: the DTensor path, for comparison.
    No effect without FSDP2."""

    def validate(self) -> None:
        _check(self.lr > 0 and math.isfinite(self.lr), "optimizer.lr",
               f"must be a positive finite number, got {self.lr}; e.g. --optimizer.lr 3e-4")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optimizer.betas",
               f"needs two values in [0, 1), got {self.betas}; e.g. --optimizer.betas 0.9,0.95")
        _check(self.eps > 0, "optimizer.eps", f"must be > 0, got {self.eps}; e.g. --optimizer.eps 1e-8")
        _check(self.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")


@dataclass
class LRScheduler:
    """Learning-rate schedule: linear warmup, then decay to lr x min_lr_ratio at the last step."""

    warmup_steps: int = 20
    """Steps of linear warmup from ~0 to optimizer.lr."""
    decay_type: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Shape after warmup; 'wsd' = warmup-stable-decay: constant, then linear decay over the last steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optimizer.lr."""
    wsd_decay_ratio: float = 0.2
    """For 'wsd': fraction of the post-warmup steps spent decaying."""

    def validate(self) -> None:
        _check(self.warmup_steps >= 0, "lr_scheduler.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        for name in ("min_lr_ratio", "wsd_decay_ratio"):
            value = getattr(self, name)
            _check(0 <= value <= 1, f"lr_scheduler.{name}", f"must be in [0, 1], got {value}")


@dataclass
class Metrics:
    """Logging and evaluation cadence."""

    log_freq: int = 10
    """Log training metrics every this many steps."""
    jsonl_file: str = "metrics.jsonl"
    """JSON-lines metrics file, relative to job.dump_folder."""
    enable_tensorboard: bool = False
    """Also write TensorBoard events (needs the `tensorboard` package)."""
    enable_wandb: bool = False
    """Also log the same scalars to Weights & Biases (needs `pip install wandb`), rank 0 only, with the resolved
    config as the run's config; files under <dump_folder>/wandb."""
    wandb_project: str = "nsa_titan"
    """wandb project name."""
    wandb_run_name: str | None = None
    """wandb run name (None: wandb picks one)."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """'offline' (default: no network needed; `wandb sync` uploads later), 'online', or 'disabled'."""
    val_freq: int = 0
    """Evaluate on the held-out split every this many steps (0: never)."""
    val_steps: int = 8
    """Batches per evaluation."""
    nsa_diagnostics: bool = True
    """On log steps, collect NSA diagnostics per layer (gate means and entropy, branch output shares, distance
    of the selected blocks, share of forced blocks) during the step's forward and log them (JSONL type
    'nsa_diag', TensorBoard nsa/*). Other steps are untouched; under compile it adds one graph per block kind."""

    def validate(self) -> None:
        _check(self.log_freq >= 1, "metrics.log_freq", f"must be >= 1, got {self.log_freq}")
        _check(bool(self.jsonl_file), "metrics.jsonl_file", "must not be empty; e.g. metrics.jsonl")
        _check(self.val_freq >= 0, "metrics.val_freq", f"must be >= 0 (0 turns validation off), got {self.val_freq}")
        _check(self.val_steps >= 1, "metrics.val_steps", f"must be >= 1, got {self.val_steps}")
        if self.enable_wandb:
            _check(importlib.util.find_spec("wandb") is not None, "metrics.enable_wandb",
                   "needs the `wandb` package: pip install wandb (or drop --metrics.enable_wandb)")


@dataclass
class JobConfig:
    """The whole job: one field per TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    data: Data = field(default_factory=Data)
    metrics: Metrics = field(default_factory=Metrics)
    compile: Compile = field(default_factory=Compile)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    fault: Fault = field(default_factory=Fault)
    profiling: Profiling = field(default_factory=Profiling)

    def validate(self, training: bool = True) -> None:
        """Each section's own checks, then the ones that span sections. ``training=False`` (inference tools, which
        set their own lengths): the model need not cover training.seq_len."""
        for f in dataclasses.fields(self):
            section_validate = getattr(getattr(self, f.name), "validate", None)
            if section_validate is not None:
                section_validate()
        # 'auto' may sit in a config file that runs compiled or not (m7c's): it only says what compiling means.
        if self.compile.mode not in ("default", "auto") and not self.compile.enable:
            raise ConfigError(f"compile.mode: '{self.compile.mode}' applies to torch.compile; add --compile.enable "
                              "or leave compile.mode at 'default' (or 'auto')")
        if self.activation_checkpoint.mode == "memory_budget" and not self.compile.enable:
            raise ConfigError("activation_checkpoint.mode: 'memory_budget' is applied by torch.compile's partitioner; "
                              "add --compile.enable or choose another mode (full, selective_op, ratio)")
        if self.compile.step_graph:
            self._check_step_graph()
        model_args = self.model_args(training=training)
        gap = self.data.retrieval_min_gap
        uses_retrieval = self.data.dataset == "retrieval" or self.data.retrieval_mix > 0
        if uses_retrieval and gap is not None and gap < model_args.window:
            raise ConfigError(f"data.retrieval_min_gap={gap} is shorter than model.window={model_args.window}: queried "
                              "pairs could sit inside a query's sliding window, which would answer them without "
                              f"long-range attention; pass --data.retrieval_min_gap {model_args.window} or more, or "
                              "drop it (None: the window)")

    def _check_step_graph(self) -> None:
        """What a captured whole step cannot hold (components/step_graph.py)."""
        if self.training.device == "cpu":
            raise ConfigError("compile.step_graph captures CUDA graphs; training.device is 'cpu': use "
                              "--training.device cuda (or auto on a GPU machine), or drop --compile.step_graph")
        if self.parallelism.data_parallel != "fsdp2":
            raise ConfigError(f"compile.step_graph runs on one GPU or with FSDP2; data_parallel="
                              f"'{self.parallelism.data_parallel}' cannot be captured (DDP's reducer invalidates the "
                              "capture): use --parallelism.data_parallel fsdp2, or drop --compile.step_graph")
        if self.parallelism.fsdp_cpu_offload:
            raise ConfigError("parallelism.fsdp_cpu_offload steps the optimizer on the CPU, which a CUDA graph cannot "
                              "capture: drop --parallelism.fsdp_cpu_offload or --compile.step_graph")
        if self.parallelism.fsdp_unshard_early:
            raise ConfigError("parallelism.fsdp_unshard_early unshards between steps, which a replayed step graph "
                              "never sees: drop it (the graph replays the all-gathers anyway) or --compile.step_graph")
        if self.metrics.nsa_diagnostics:
            raise ConfigError("metrics.nsa_diagnostics collects in the forward's Python on log steps, which a "
                              "replayed step graph skips: add --metrics.nsa_diagnostics false with "
                              "--compile.step_graph")

    def model_args(self, training: bool = True) -> NSAModelArgs:
        """The model this config describes: ``[model] flavor`` with the other ``[model]`` keys applied, checked by
        NSAModelArgs.validate (where the model's rules live), also against ``training.seq_len`` when ``training``."""
        try:
            args = get_model_args(self.model.flavor, **self.model.overrides())
            args.validate(self.training.seq_len if training else None)
        except ValueError as e:  # unknown flavor, inconsistent sizes: the message names the key and the fix
            raise ConfigError(str(e)) from None
        return args


def load_inference_config(argv: list[str]) -> JobConfig:
    """The training config flags (--config, --model.*, --data.*) for generate and the eval tools: every check but
    the training-only one that training.seq_len fits model.max_seq_len (inference sets its own lengths)."""
    return parse_config(JobConfig, list(argv), validate_kwargs={"training": False})


def load_job_config(argv: list[str] | None = None) -> JobConfig:
    """Defaults < ``--config FILE`` (TOML) < ``--section.key value`` overrides; validated.

    ``argv`` defaults to ``sys.argv[1:]``. ``--help`` and ``--print-config`` print and exit 0.
    Raises :class:`ConfigError` (a ValueError) naming the key and the fix for any bad setting.
    """
    return parse_config(JobConfig, sys.argv[1:] if argv is None else list(argv))


def job_config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """``{section: {key: value}}`` for logging (JSON-serialisable)."""
    return config_to_dict(cfg)
