"""The training loop's side of checkpointing and failure handling, in one object, so that ``train.py`` only
calls a handful of methods:

    res = Resilience(job_config, rank=..., world_size=..., model_args=..., log=..., hooks=...)  # before GPU work
    first = res.start(model=..., optimizer=..., scheduler=..., loader=..., device=...)      # resume, watchdog
    for step in range(first, steps + 1):
        res.step_start(step)
        ... train_step(..., before_optimizer_step=res.before_optimizer_step) ...
        res.step_end(step, num_tokens, log_step=...)   # counters, watchdog, guard check, checkpoint
    res.finish()                                       # export; then res.close(error) on every exit path

Host syncs: only in ``step_end`` on log steps and checkpoint steps (the guard's flag read), or on every step
when the user opted in with ``fault.nonfinite_check_every_step``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nsa_titan.checkpoint import (
    CheckpointManager,
    TrainState,
    capture_host_state,
    restore_host_state,
    step_dir_name,
)
from nsa_titan.checkpoint.folder import writable_problem
from nsa_titan.config import ConfigError
from nsa_titan.fault.failure import (
    NonFiniteError,
    NonFiniteGuard,
    PeerFailure,
    TrainHooks,
    collective_failure_hint,
    suggest_command,
)
from nsa_titan.fault.preemption import Preempted, StopSignals
from nsa_titan.fault.watchdog import Watchdog, describe_peers, find_dead_peer


def shared_run_id() -> str:
    """A per-run id that every rank agrees on (heartbeats of an earlier run in the same folder are ignored)."""
    run_id = [uuid.uuid4().hex]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(run_id, src=0)  # once, at start-up
    return run_id[0]


def data_identity(job_config: Any) -> dict[str, Any]:
    """The settings that define the data stream a checkpoint's loader position refers to (not the world size:
    a resume on another number of ranks reshards the position)."""
    d, tc = job_config.data, job_config.training
    path = os.path.abspath(d.path) if d.path and os.path.exists(d.path) else d.path
    out = {"training.seq_len": tc.seq_len, "training.seed": tc.seed, "data.dataset": d.dataset, "data.path": path,
           "data.tokenizer": d.tokenizer, "data.val_fraction": d.val_fraction, "data.retrieval_mix": d.retrieval_mix}
    if d.dataset == "hf":  # which examples the stream holds, and so what its saved position points into
        # num_workers too: a stream's order depends on how its shards are split over the loader workers.
        keys = ("hf_config", "hf_split", "hf_text_field", "num_workers")
        out.update({f"data.{k}": getattr(d, k, None) for k in keys})
    for k in ("val_path", "val_split", "eos_token"):  # a separate val set trains on all of data.path; EOS is packed
        if getattr(d, k, None) is not None:
            out[f"data.{k}"] = getattr(d, k)
    if d.dataset == "retrieval" or d.retrieval_mix > 0:
        out.update({f"data.{k}": getattr(d, k) for k in ("retrieval_num_pairs", "retrieval_key_len",
                                                          "retrieval_value_len")})
    return out


class Resilience:
    def __init__(self, job_config: Any, *, rank: int, world_size: int, model_args: Any,
                 log: Callable[[str], None] = print, hooks: TrainHooks | None = None, argv: list[str] | None = None):
        """argv: the command-line arguments of the run, for the commands that failure messages suggest."""
        self.cfg = job_config
        self.argv = list(argv or [])
        self.rank, self.world_size = rank, world_size
        self.log = log
        self.hooks = hooks or TrainHooks()
        self.dump = Path(job_config.job.dump_folder)
        if self.needs_fused_optimizer and job_config.optimizer.fused is False:
            raise ConfigError(f"optimizer.fused: false, but fault.nonfinite={job_config.fault.nonfinite!r} drops bad "
                              "updates on device through the fused AdamW kernel; use --optimizer.fused auto, or "
                              "--fault.nonfinite off")
        problem = writable_problem(self.dump) if rank == 0 else None
        if problem:  # metrics, summary and heartbeats go there: fail before any model is built
            raise ConfigError(f"job.dump_folder: {problem}; pass a writable --job.dump_folder")
        args = dataclasses.asdict(model_args) if dataclasses.is_dataclass(model_args) else dict(model_args)
        # Resolves (and checks) the resume source now: a bad checkpoint path fails before any model is built.
        self.ckpt = CheckpointManager(job_config.checkpoint, dump_folder=self.dump, rank=rank, world_size=world_size,
                                      model_args=args, log=log, hooks=self.hooks, data_args=data_identity(job_config))
        self.train_state = TrainState()
        self.guard: NonFiniteGuard | None = None
        self.watchdog: Watchdog | None = None
        self.signals: StopSignals | None = None
        self._live: dict[str, Any] = {}

    @property
    def needs_fused_optimizer(self) -> bool:
        return self.cfg.fault.nonfinite != "off"

    def start(self, *, model, optimizer, scheduler, loader, device: torch.device) -> int:
        """Resume if there is something to resume from, start the watchdog; returns the first step to run."""
        fc = self.cfg.fault
        self._live = dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, device=device)
        self.guard = NonFiniteGuard(fc.nonfinite, device, check_every_step=fc.nonfinite_check_every_step,
                                    max_skips=fc.nonfinite_max_skips, history=self.cfg.metrics.log_freq,
                                    hooks=self.hooks)
        self.guard.check_optimizer(optimizer)
        self.ckpt.bind(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
                       train_state=self.train_state, device=device)
        self.ckpt.load()
        self.guard.skipped_steps = list(self.train_state.skipped_steps)
        self.watchdog = Watchdog(rank=self.rank, world_size=self.world_size, heartbeat_dir=self.dump / "heartbeat",
                                 fault_dir=self.dump / "fault", timeout_s=fc.watchdog_timeout_s,
                                 first_step_timeout_s=fc.watchdog_first_step_timeout_s,
                                 heartbeat_interval_s=fc.heartbeat_interval_s, peer_timeout_s=fc.peer_timeout_s,
                                 run_id=shared_run_id()).start()
        self.signals = StopSignals(grace_s=fc.stop_grace_s, rank=self.rank, world_size=self.world_size,
                                   log=self.log, peer_check=self.dead_peer).install()
        self.hooks.on_train_start({**self._live, "train_state": self.train_state, "checkpoint": self.ckpt})
        return self.train_state.step + 1

    def _snapshot(self) -> dict[str, Any]:
        live = self._live
        return capture_host_state(self.train_state, live["scheduler"], live["loader"], live["device"])

    # ---- per step ----
    def step_start(self, step: int) -> None:
        self.hooks.on_step_start(step)
        # 'stop' may have to rewind the host state to before a bad step: a host-only snapshot, no device data.
        self.guard.step_start(step, self._snapshot() if self.guard.policy == "stop" else None)

    def before_optimizer_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.guard.before_optimizer_step(self._live["optimizer"], loss, grad_norm)

    def step_end(self, step: int, num_tokens: int, *, log_step: bool) -> None:
        """num_tokens: this rank's input tokens of the step (a host int)."""
        self.train_state.step = step
        self.train_state.tokens_seen += num_tokens * self.world_size
        self.watchdog.step_done(step)
        last = step == self.cfg.training.steps
        saving = self.ckpt.should_save(step, last)
        if log_step or saving or self.guard.wants_check():
            self._check_nonfinite()
        if self.ckpt.enabled:
            self.ckpt.maybe_save(step, last=last)  # also commits a finished background save (no waiting)
            if saving:
                self.watchdog.progress()
        if self.signals.agreed():
            self._stop_on_signal(step)

    def _stop_on_signal(self, step: int) -> None:
        """SIGTERM / SIGINT arrived during this step (on some rank): save it and end the run."""
        self._check_nonfinite()  # never save a state the guard has not vetted (raises on a bad step)
        saved = None
        if self.ckpt.enabled:
            if self.ckpt.last_saved_step != step:
                self.ckpt.save(step)
            self.ckpt.wait()
            saved = self.ckpt.folder / step_dir_name(step)
        name = signal.Signals(self.signals.signum).name
        self.log(f"{name}: stopped after step {step}" + (f"; checkpoint {saved}" if saved else
                                                         " (checkpointing is off: nothing saved)"))
        raise Preempted(name, self.signals.exit_code(), step, saved)

    def progress(self) -> None:
        """After long non-step work (evaluation)."""
        self.watchdog.progress()

    def _check_nonfinite(self) -> None:
        report = self.guard.check()  # host sync ok: log step (or checkpoint step / opted-in per-step check)
        if report is None:
            return
        self.train_state.skipped_steps = list(self.guard.skipped_steps)
        message = self.guard.describe(report)
        if not self.guard.should_stop(report):
            self.log(f"WARNING: {message}")
            return
        if self.guard.policy == "stop":
            # Updates were dropped on device from the bad step on, so the weights are those after step
            # first - 1; put the data position, schedule, RNG and counters back to that step as well.
            snap = self.guard.snapshot_before(report.first_step)
            if snap is None:  # cannot happen while checks run at least every log_freq steps; never save a guess
                raise NonFiniteError(f"{message}; the state before step {report.first_step} is no longer known, "
                                     "so nothing was saved", step=report.first_step)
            live = self._live
            restore_host_state(snap, self.train_state, live["scheduler"], live["optimizer"], live["loader"],
                               live["device"])
        saved = None
        if self.ckpt.enabled:
            saved = self.ckpt.save(self.train_state.step)
        lower = {"optimizer.lr": f"{self.cfg.optimizer.lr / 10:g}"}
        if saved:
            command = suggest_command(self.argv, {**lower, "checkpoint.resume_from": str(saved)}, self.world_size)
            advice = (f"saved the last good state (step {self.train_state.step}) to {saved}. To resume from it with a "
                      f"lower learning rate (on resume, this run's [optimizer] settings replace the saved ones): "
                      f"{command}")
        else:
            command = suggest_command(self.argv, lower, self.world_size)
            advice = ("checkpointing is off (checkpoint.enable), so nothing was saved. To start again with a lower "
                      f"learning rate: {command}")
        raise NonFiniteError(f"{message}; {advice} (or pass --fault.nonfinite skip to drop bad steps and go on)",
                             step=report.first_step, saved=saved)

    # ---- end ----
    def finish(self) -> Path | None:
        """After the last step: wait for the last save, export the model if asked."""
        self.ckpt.wait()
        if self.cfg.checkpoint.export_at_end:
            dc = self.cfg.data
            return self.ckpt.export(self.train_state.step, tokenizer=dc.tokenizer, eos_token=dc.eos_token,
                                    bos_token=dc.bos_token)
        return None

    def dead_peer(self) -> str | None:
        """A sentence naming a rank that is gone, failed or silent, from the heartbeats (None: all alive)."""
        return find_dead_peer(self.dump / "heartbeat", self.world_size, self.watchdog.run_id, self.rank,
                              self.cfg.fault.peer_timeout_s)

    def peer_failure(self, error: BaseException) -> PeerFailure | None:
        """For an error that means 'another rank is gone' (a failed collective): a PeerFailure naming that rank,
        so that every survivor exits 5 with the rank's name instead of a traceback. A killed rank on this host
        is seen at once (its pid is gone); elsewhere its heartbeat must go stale, so wait a little for it."""
        if self.watchdog is None or not collective_failure_hint(error, self.world_size):
            return None
        # From here this thread names the peer (or re-raises): the watchdog thread must not exit with its own
        # report halfway through (both exit 5, but the user would get the report without this thread's message).
        self.watchdog.main_thread_reports_peer()
        fc = self.cfg.fault
        deadline = time.monotonic() + min(fc.peer_timeout_s, 3 * fc.heartbeat_interval_s)
        while (peer := find_dead_peer(self.dump / "heartbeat", self.world_size, self.watchdog.run_id, self.rank,
                                      fc.peer_timeout_s)) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if peer is None:
            return None
        return PeerFailure(f"{peer}; this rank stops too (its collective failed: {type(error).__name__})")

    def close(self, error: BaseException | None = None) -> None:
        """Every exit path: finish a background save, leave a final heartbeat ('failed' tells the peers)."""
        if self.signals is not None:
            self.signals.restore(exiting_on_failure=error is not None
                                 and collective_failure_hint(error, self.world_size) is not None)
        try:
            if error is None or isinstance(error, (KeyboardInterrupt, NonFiniteError)):
                self.ckpt.close()
        finally:
            if self.watchdog is not None:
                if error is not None and collective_failure_hint(error, self.world_size):
                    # Which rank is gone: its heartbeat is the stale one (a SIGKILLed rank writes nothing).
                    peers = describe_peers(self.dump / "heartbeat", self.world_size, self.watchdog.run_id, self.rank)
                    print(f"[rank {self.rank}] heartbeats: {peers}", file=sys.stderr, flush=True)
                failed = error is not None and not isinstance(error, KeyboardInterrupt)
                self.watchdog.stop("failed" if failed else "done",
                                   f"{type(error).__name__}: {error}" if failed else None)
