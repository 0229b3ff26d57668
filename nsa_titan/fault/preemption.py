"""SIGTERM / SIGINT as a request to stop cleanly: finish the current step, save a checkpoint, write the summary,
exit with a documented code (143 for SIGTERM, 130 for SIGINT: the shell's 128 + signal number).

Schedulers (SLURM, Kubernetes, torchrun's agent) send SIGTERM on preemption and SIGKILL a while later. The
handler only records the signal; the training loop looks at it after each step (``StopSignals.agreed``).
Every rank must stop after the same step (one rank saving while another runs the next step's collectives
would hang both), so with several ranks the flag is combined with an all-reduce over a gloo group, on the
host: one tiny collective per step, no device sync.

``fault.stop_grace_s`` bounds the time from the signal to the exit: past it a timer thread ends the process
(same exit code) with a message saying that the save did not finish; the previous checkpoint is intact.
A second SIGINT (Ctrl-C twice) interrupts at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from nsa_titan.errors import EXIT_INTERRUPTED, EXIT_TERMINATED

_CODES = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: EXIT_TERMINATED}


class Preempted(KeyboardInterrupt):
    """Raised after the step in which a stop signal arrived (and after the checkpoint it caused)."""

    def __init__(self, signame: str, exit_code: int, step: int, saved):
        super().__init__(f"{signame} received: stopped after step {step}")
        self.signame, self.exit_code, self.step, self.saved = signame, exit_code, step, saved


class StopSignals:
    def __init__(self, *, grace_s: float, rank: int, world_size: int, log: Callable[[str], None] = print,
                 exit_fn: Callable[[int], None] = os._exit):
        self.grace_s, self.rank, self.world_size = grace_s, rank, world_size
        self.log, self._exit = log, exit_fn
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._group = None

    def install(self) -> StopSignals:
        """Collective when distributed (creates the gloo group). Handlers only from the main thread (Python's rule);
        elsewhere (e.g. a test calling main() in a thread) the signals keep their previous behaviour."""
        if self.world_size > 1 and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            for signum in _CODES:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now
            return
        self.signum = signum
        print(f"[rank {self.rank}] {signal.Signals(signum).name} received: finishing the current step, then saving "
              f"and exiting (within fault.stop_grace_s = {self.grace_s:g}s)", file=sys.stderr, flush=True)
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        print(f"[rank {self.rank}] {signal.Signals(self.signum).name}: fault.stop_grace_s ({self.grace_s:g}s) passed "
              "before the step, the checkpoint and the summary were done; exiting now. The previous complete "
              "checkpoint is intact and is the one a rerun resumes from", file=sys.stderr, flush=True)
        self._exit(_CODES[self.signum])

    def agreed(self) -> int | None:
        """The signal to stop on, if any rank got one (collective when distributed: call after every step)."""
        if self._group is None:
            return self.signum
        flag = torch.tensor([0 if self.signum is None else int(self.signum)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        signum = int(flag.item())  # host sync ok: a CPU tensor of a gloo group, no device involved
        if signum and self.signum is None:
            self.signum = signum  # another rank got it: stop with the same code
        return signum or None

    def exit_code(self) -> int:
        return _CODES[self.signum]

    def restore(self) -> None:
        """Put the previous handlers back and disarm the grace timer (the run ended in time)."""
        if self._timer is not None:
            self._timer.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
