"""The whole optimizer step as one CUDA graph (compile.step_graph): capture it once, then replay it every step.

Why: a small NSA model's step is bound by the host, not the GPU. Without graphs the compiled m7c step at 8k batch 2
takes 56-59 ms on an H100 for ~46 ms of GPU work, and under FSDP2 on two GPUs 93 ms, FSDP2's own Python landing
on top (benchmarks/results/step_graph_s29_H100.md). The per-block graphs of compile.mode 'reduce-overhead' cannot
run under data parallelism (FSDP2's unsharded parameters move between steps); one graph of the whole step can: the
all-gathers, reduce-scatters and all-reduces are captured with everything else, so the host runs FSDP2's Python
once, while capturing. Measured: m7c FSDP2 93.3 -> 45.1 ms per step against one GPU's 46.0, a replay bitwise equal
to an eager FSDP2 step from the same state (benchmarks/step_graph_probe.py).

How, per step after ``warmup_steps`` eager ones (which train as usual; compiling happens there):
- The micro-batches are copied into static buffers (the captured step reads those addresses); every step must keep
  the captured keys, shapes and dtypes.
- AdamW reads its learning rate from one device tensor per parameter group, filled from the scheduler's float
  before each replay. The tensors (and ``capturable``) are in the param groups only while capturing: outside it
  the optimizer looks as it always does (checkpoints keep float learning rates).
- The scheduler steps here, outside the graph, once per step.
- The step's outputs (loss, grad norm) are copied out: the next replay overwrites the captured ones.

Not captured, so not allowed with it (the config says so): the per-log-step NSA diagnostics (Python in the forward),
parallelism.fsdp_unshard_early (an unshard between steps), DDP and FSDP1 (DDP's reducer breaks the capture:
cudaErrorStreamCaptureInvalidated). Validation runs eagerly between replays; afterwards ``after_eager_forward``
reshards FSDP2's units, whose Python state a replay never updates (an unsharded unit left by validation would be
reused, stale, by the next validation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from nsa_titan.config import ConfigError

Batch = dict[str, torch.Tensor]
Outputs = tuple[torch.Tensor, ...]
StepFn = Callable[[Sequence[Batch], object], Outputs]


def require_cuda(device: torch.device) -> None:
    """The trainer's check before any model is built: training.device 'auto' may have found no GPU."""
    if device.type != "cuda":
        raise ConfigError(f"compile.step_graph captures CUDA graphs; this run's device is {device.type}: drop "
                          "--compile.step_graph or run on a GPU")


class NoSchedule:
    """The scheduler handed to the captured step: none (StepGraph steps the real one outside the graph)."""

    def step(self) -> None:
        pass


def cuda_capture(fn: Callable[[], Outputs]) -> tuple[Outputs, Callable[[], None], Callable[[], None]]:
    """Capture ``fn`` as a CUDA graph without running it -> (its static outputs, replay, release)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return outputs, graph.replay, graph.reset


class StepGraph:
    """``step_fn(micro_batches, scheduler) -> (loss, grad_norm, ...)``: one optimizer step (nsa_titan's train_step).
    Call the StepGraph with each step's micro-batches (on the device) instead of ``step_fn``.

    ``capture``: how to capture (``cuda_capture``; tests pass an eager stand-in with the same contract)."""

    def __init__(self, step_fn: StepFn, optimizer: torch.optim.Optimizer, scheduler, *, warmup_steps: int,
                 device: torch.device, after_step: Callable[[], None] | None = None,
                 capture: Callable = cuda_capture):
        if warmup_steps < 1:
            raise ValueError(f"compile.step_graph_warmup must be >= 1 (the first step compiles), got {warmup_steps}")
        self.step_fn, self.optimizer, self.scheduler, self.device = step_fn, optimizer, scheduler, device
        self.warmup_left = warmup_steps
        self.after_step = after_step
        self._capture_fn = capture
        self._static: list[Batch] | None = None
        self._outputs: Outputs = ()
        self._lr: list[torch.Tensor] = []
        self._replay: Callable[[], None] | None = None
        self._release: Callable[[], None] | None = None
        self._side: torch.cuda.Stream | None = None

    @property
    def captured(self) -> bool:
        return self._replay is not None

    def __call__(self, micro_batches: Sequence[Batch]) -> Outputs:
        if self._replay is None and self.warmup_left > 0:
            self.warmup_left -= 1
            out = self._eager(micro_batches)
        else:
            if self._replay is None:
                self._capture(micro_batches)  # records without running: the replay below runs this step
            else:
                self._load(micro_batches)
            for group, lr in zip(self.optimizer.param_groups, self._lr):
                lr.fill_(float(group["lr"]))  # the scheduler's value for this step, read by the replayed AdamW
            self._replay()
            out = tuple(t.clone() for t in self._outputs)
        self.scheduler.step()
        if self.after_step is not None:
            self.after_step()
        return out

    def close(self) -> None:
        """Release the graph. Before destroy_process_group: NCCL's communicator destroy waits for every graph that
        captured its collectives (pytorch/pytorch#115388), so a live graph hangs the exit."""
        if self._release is not None:
            self._release()
        self._replay = self._release = None
        self._outputs, self._static = (), None

    def _eager(self, micro_batches: Sequence[Batch]) -> Outputs:
        if self.device.type != "cuda":
            return self.step_fn(micro_batches, NoSchedule())
        # On a side stream, as torch.cuda.graph asks of the steps before a capture (lazy inits happen off the
        # default stream: NCCL, cuBLAS workspaces, autograd's stream bookkeeping).
        if self._side is None:  # one stream for every warm-up step: the caching allocator keeps blocks per stream,
            self._side = torch.cuda.Stream(self.device)  # so a new stream per step would cache a new set of activations
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            out = self.step_fn(micro_batches, NoSchedule())
        torch.cuda.current_stream(self.device).wait_stream(side)
        return out

    def _capture(self, micro_batches: Sequence[Batch]) -> None:
        self._static = [{k: v.clone() for k, v in mb.items()} for mb in micro_batches]
        groups = self.optimizer.param_groups
        self._lr = [torch.tensor(float(g["lr"]), dtype=torch.float32, device=self.device) for g in groups]
        saved = [(g["lr"], g.get("capturable", False)) for g in groups]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._side = None
            torch.cuda.empty_cache()  # the warm-up's cached blocks back to the device: the graph gets its own pool
        for g, lr in zip(groups, self._lr):
            g["lr"], g["capturable"] = lr, True
        try:
            self._outputs, self._replay, self._release = self._capture_fn(
                lambda: self.step_fn(self._static, NoSchedule()))
        finally:
            for g, (lr, capturable) in zip(groups, saved):
                g["lr"], g["capturable"] = lr, capturable

    def _load(self, micro_batches: Sequence[Batch]) -> None:
        static = self._static
        same = len(micro_batches) == len(static) and all(
            mb.keys() == st.keys() and all(mb[k].shape == st[k].shape and mb[k].dtype == st[k].dtype for k in st)
            for mb, st in zip(micro_batches, static))
        if not same:
            raise ValueError(
                "compile.step_graph replays the step it captured, so every step needs micro-batches of the captured "
                f"keys, shapes and dtypes: captured {_describe(static)}, got {_describe(micro_batches)}; keep "
                "training.seq_len, local_batch_size and grad_accum_steps fixed, or run without --compile.step_graph")
        for mb, st in zip(micro_batches, static):
            for k, v in mb.items():
                st[k].copy_(v, non_blocking=True)

    @staticmethod
    def after_eager_forward(model: nn.Module) -> None:
        """After an eager forward between replays (validation): reshard every FSDP2 unit it left unsharded."""
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _describe(batches: Sequence[Batch]) -> str:
    return f"{len(batches)} x " + (
        "{" + ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in batches[0].items()) + "}" if batches else "{}")
