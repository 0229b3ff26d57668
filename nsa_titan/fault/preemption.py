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

A SIGTERM is not always a preemption: torchrun's agent SIGTERMs the surviving workers when one of them died. The
handler asks ``peer_check`` (the watchdog's heartbeat reading) whether a peer is already gone; if so it says that
the launcher is stopping the job because of that rank, and the exit code is 5 (a peer failed), not 143, whichever
path ends the process: the step's failing collective (the usual one, naming the rank) or the grace timer.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from nsa_titan.errors import EXIT_INTERRUPTED, EXIT_PEER_FAILED, EXIT_TERMINATED

_CODES = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: EXIT_TERMINATED}


class Preempted(KeyboardInterrupt):
    """Raised after the step in which a stop signal arrived (and after the checkpoint it caused)."""

    def __init__(self, signame: str, exit_code: int, step: int, saved):
        super().__init__(f"{signame} received: stopped after step {step}")
        self.signame, self.exit_code, self.step, self.saved = signame, exit_code, step, saved


class StopSignals:
    def __init__(self, *, grace_s: float, rank: int, world_size: int, log: Callable[[str], None] = print,
                 exit_fn: Callable[[int], None] = os._exit, peer_check: Callable[[], str | None] | None = None):
        self.grace_s, self.rank, self.world_size = grace_s, rank, world_size
        self.log, self._exit, self.peer_check = log, exit_fn, peer_check
        self.signum: int | None = None
        self.dead_peer: str | None = None  # set when the signal came after a peer died (the launcher's SIGTERM)
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
        self.dead_peer = self.peer_check() if self.peer_check is not None else None
        if self.dead_peer is not None:
            print(f"[rank {self.rank}] {signal.Signals(signum).name} received after {self.dead_peer}: the launcher is "
                  "stopping the job because that rank died, not a preemption; exiting with code "
                  f"{EXIT_PEER_FAILED} (no checkpoint: the step cannot finish without it)", file=sys.stderr, flush=True)
        else:
            print(f"[rank {self.rank}] {signal.Signals(signum).name} received: finishing the current step, then "
                  f"saving and exiting (within fault.stop_grace_s = {self.grace_s:g}s)", file=sys.stderr, flush=True)
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        if self.dead_peer is not None:
            print(f"[rank {self.rank}] training stopped: {self.dead_peer}", file=sys.stderr, flush=True)
            self._exit(EXIT_PEER_FAILED)
            return
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
        return EXIT_PEER_FAILED if self.dead_peer is not None else _CODES[self.signum]

    def restore(self, exiting_on_failure: bool = False) -> None:
        """Put the previous handlers back and disarm the grace timer (the run ended in time).

        ``exiting_on_failure``: this rank is on its way out with its own exit code (a peer died); torchrun's agent
        SIGTERMs it about now, and the default handler would replace that code by 'killed by SIGTERM' (-15) in
        the agent's report. SIGTERM is ignored for the rest of the exit; the agent's SIGKILL still bounds it."""
        if self._timer is not None:
            self._timer.cancel()
        for signum, handler in self._previous.items():
            if exiting_on_failure and signum == signal.SIGTERM:
                handler = signal.SIG_IGN
            signal.signal(signum, handler)
        self._previous.clear()
