"""Failures that end loudly: the non-finite loss / grad-norm guard, the typed training failures it and the peer
check raise (exit codes in nsa_titan/errors.py), and the hook object through which tests (and tools) inject faults.

Non-finite guard, without a host sync per step
-----------------------------------------------
Each step, on device: ``bad = !isfinite(loss) | !isfinite(grad_norm)``. The update is dropped on device
through the fused AdamW kernel's ``found_inf`` input (the mechanism GradScaler uses): when it is non-zero
the kernel leaves parameters, both moments and the step count untouched, so a skipped step is exactly as
if it never ran, except that its data and its LR-schedule slot are consumed. This needs the fused kernel
(CPU and CUDA have it), which the trainer therefore builds whenever the guard is on.

- ``skip``: drop each bad step's update and go on; the steps are named on the next log step. More than
  ``fault.nonfinite_max_skips`` skipped steps end the run like ``stop``.
- ``stop``: from the first bad step on, every update is dropped (the weights stay at the last good
  state); the next log step or checkpoint step sees the flag, rewinds the host state (data position,
  schedule, RNG, counters) to just before the bad step, saves that last good state, and raises
  NonFiniteError naming the step. ``fault.nonfinite_check_every_step`` instead reads the flag after every
  step: it stops at the bad step itself, at the cost of one host sync per step (the CPU can no longer
  queue the next step's kernels while the GPU finishes this one; a few percent on small models).
- ``off``: no check (and no fused-kernel requirement).

In data parallelism, loss and grad norm are already global (all-reduced) values, so every rank reaches
the same decision with no extra collective.
"""

from __future__ import annotations

import collections
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nsa_titan.errors import EXIT_NONFINITE, EXIT_PEER_FAILED, TrainingFailure


class PeerFailure(TrainingFailure):
    """Another rank died, hung or failed; this one stops too (exit 5, as the watchdog's peer check)."""

    exit_code = EXIT_PEER_FAILED


class NonFiniteError(TrainingFailure):
    exit_code = EXIT_NONFINITE

    def __init__(self, message: str, *, step: int, saved: Path | None = None):
        super().__init__(message)
        self.step, self.saved = step, saved


class TrainHooks:
    """Extension points for fault injection in tests and for tools; each method here does nothing.

    Passed in code (``nsa_titan.train.main(argv, hooks=...)``), never switched on by the environment.
    """

    def on_train_start(self, ctx: dict[str, Any]) -> None:
        """Once, before step 1 (after a resume): ctx holds model, optimizer, scheduler, loader, train_state."""

    def on_step_start(self, step: int) -> None:
        """Before each step's data is fetched (stall, kill or interrupt a run here)."""

    def before_optimizer_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor):
        """After backward and clipping; returns (loss, grad_norm) as the guard should see them."""
        return loss, grad_norm

    def before_checkpoint_commit(self, step: int, tmp_path: Path) -> None:
        """Rank 0, after every rank has written a checkpoint's files, before it is made visible."""


@dataclass
class NonFiniteReport:
    first_step: int
    loss: float
    grad_norm: float
    count: int


class NonFiniteGuard:
    """Device-side non-finite detection; host reads only in ``check`` (log / checkpoint steps)."""

    def __init__(self, policy: str, device: torch.device, *, check_every_step: bool = False, max_skips: int = 10,
                 history: int = 1, hooks: TrainHooks | None = None):
        self.policy, self.device = policy, device
        self.check_every_step = check_every_step
        self.max_skips = max_skips
        self.hooks = hooks or TrainHooks()
        self.step = 0
        self.skipped_steps: list[int] = []  # host record of the skipped steps read so far (skip policy)
        self._window: list[tuple[int, torch.Tensor]] = []  # (step, bad) since the last check
        self._first_step = torch.zeros((), dtype=torch.long, device=device)
        self._first_vals = torch.zeros(2, device=device)
        self._count = torch.zeros((), dtype=torch.long, device=device)
        self._any = torch.zeros((), dtype=torch.bool, device=device)
        # 'stop' rewinds the host state to just before the first bad step, which may lie up to one log
        # window back: host snapshots (data position, schedule, RNG; no device data) of that many steps.
        self._snapshots: collections.deque = collections.deque(maxlen=max(1, history) + 1)
        # Under a whole-step CUDA graph (compile.step_graph) before_optimizer_step runs once, at capture, and its
        # device ops replay every step: the step number must then be a device tensor, and the step's flag is
        # recorded after each replay (record_graphed_step), not by the captured Python.
        self._step_dev: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None

    def use_step_graph(self) -> None:
        """Switch to the graph-safe form (compile.step_graph): step number on device, flags recorded after replay.
        The fault-injection hook (``TrainHooks.before_optimizer_step``, tests) runs in the captured Python, so under
        a graph it sees the warm-up steps and the capture's step only."""
        self._step_dev = torch.zeros((), dtype=torch.long, device=self.device)

    @property
    def enabled(self) -> bool:
        return self.policy != "off"

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self.enabled and not all(g.get("fused") for g in optimizer.param_groups):
            raise ValueError(f"fault.nonfinite={self.policy!r} drops bad updates through the fused AdamW kernel, "
                             "but the optimizer is not fused; set --optimizer.fused auto (or true), or "
                             "--fault.nonfinite off")

    def step_start(self, step: int, snapshot: Any = None) -> None:
        self.step = step
        if self._step_dev is not None and self.enabled:
            self._step_dev.fill_(step)  # a kernel argument, no host-to-device copy; read by the replayed step
        if self.policy == "stop" and snapshot is not None:
            self._snapshots.append((step - 1, snapshot))

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor,
                              grad_norm: torch.Tensor) -> None:
        """Called between clipping and ``optimizer.step()``: device ops only."""
        loss, grad_norm = self.hooks.before_optimizer_step(self.step, loss, grad_norm)
        if not self.enabled:
            return
        loss, grad_norm = loss.detach().float(), grad_norm.detach().float()
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        first = bad & ~self._any
        # The state is updated in place: a replayed step graph writes the tensors it captured. torch.where with a
        # Python scalar passes the step as a kernel argument: no host-to-device copy.
        step = self.step if self._step_dev is None else self._step_dev
        self._first_step.copy_(torch.where(first, step, self._first_step))
        self._first_vals.copy_(torch.where(first, torch.stack([loss, grad_norm]), self._first_vals))
        self._count += bad
        self._any |= bad
        if self._step_dev is None:
            self._window.append((self.step, bad))
        else:
            self._pending = bad  # recorded by record_graphed_step once the step has run
        drop = self._any if self.policy == "stop" else bad
        # 0-d, like the step counters; read by fused AdamW's step (as with GradScaler).
        optimizer.found_inf = drop.float()

    def record_graphed_step(self) -> None:
        """After each step under compile.step_graph: keep this step's flag (a copy: the next replay overwrites it)."""
        if self.enabled and self._pending is not None:
            self._window.append((self.step, self._pending.clone()))

    def wants_check(self) -> bool:
        return self.enabled and self.check_every_step

    def check(self) -> NonFiniteReport | None:
        """Host sync: the first bad step since the start (None if none). In 'skip' mode also records (and
        returns, for logging) the newly skipped steps; call on log / checkpoint steps."""
        if not self.enabled or not self._window:
            return None
        flags = torch.stack([b for _, b in self._window]).tolist()  # host sync ok: log step
        new = [s for (s, _), b in zip(self._window, flags) if b]
        self._window.clear()
        if not new:
            return None
        self.skipped_steps.extend(new)
        first, (loss, gnorm) = int(self._first_step.item()), self._first_vals.tolist()  # host sync ok: log step
        return NonFiniteReport(first_step=first, loss=loss, grad_norm=gnorm, count=len(self.skipped_steps))

    def should_stop(self, report: NonFiniteReport | None) -> bool:
        if report is None:
            return False
        return self.policy == "stop" or (self.max_skips > 0 and report.count > self.max_skips)

    def snapshot_before(self, step: int) -> Any:
        """The host snapshot taken at the start of ``step`` (= state after step - 1), or None."""
        for done, snap in self._snapshots:
            if done == step - 1:
                return snap
        return None

    def describe(self, report: NonFiniteReport) -> str:
        what = f"non-finite loss or grad norm at step {report.first_step} (loss {report.loss}, grad norm " \
               f"{report.grad_norm})"
        if self.policy == "skip":
            shown = ", ".join(map(str, self.skipped_steps[-20:]))
            return f"{what}; updates skipped at {report.count} step(s): {shown}"
        return what


def suggest_command(argv: list[str], overrides: dict[str, str], world_size: int = 1) -> str:
    """The training command with ``argv`` and each ``--key value`` of ``overrides`` in place of any earlier
    setting of that key, quoted for a POSIX shell (a command to copy, e.g. in the non-finite stop's message)."""
    kept, i = [], 0
    while i < len(argv):
        tok = argv[i]
        name = tok[2:].partition("=")[0] if tok.startswith("--") else None
        if name in overrides:
            i += 1 if "=" in tok else 2  # both keys this is used for take a value
            continue
        kept.append(tok)
        i += 1
    for key, value in overrides.items():
        kept += [f"--{key}", value]
    launcher = "torchrun <same launcher options> -m nsa_titan.train" if world_size > 1 else "python -m nsa_titan.train"
    return f"{launcher} {shlex.join(kept)}"


def collective_failure_hint(exc: BaseException, world_size: int) -> str | None:
    """A sentence for errors that mean 'another rank is gone' (gloo / NCCL errors), else None."""
    if world_size <= 1:
        return None
    text = f"{type(exc).__name__}: {exc}".lower()
    keys = ("connection closed", "connection reset", "broken pipe", "nccl", "gloo", "timed out", "timeout",
            "distbackenderror", "peer")
    if any(k in text for k in keys):
        return ("a collective operation failed: another rank has most likely died or hung (see its log and the "
                "heartbeat files); this rank stops too")
    return None
