"""Failure handling around the training loop: checkpoint-backed resilience, the non-finite guard, the hang
watchdog with per-rank heartbeats, and stop signals (preemption).

    res = Resilience(job_config, rank=r, world_size=w, model_args=args, log=print, hooks=None)  # before GPU work
    first = res.start(model=..., optimizer=..., scheduler=..., loader=..., device=...)         # resume, watchdog

Above ``nsa_titan.checkpoint`` (Resilience saves and resumes through it); the exit codes and the
TrainingFailure base class sit below both, in ``nsa_titan/errors.py``.
"""

from nsa_titan.fault.failure import NonFiniteError, NonFiniteGuard, PeerFailure, TrainHooks, collective_failure_hint
from nsa_titan.fault.preemption import Preempted, StopSignals
from nsa_titan.fault.resilience import Resilience
from nsa_titan.fault.watchdog import Watchdog

__all__ = [
    "NonFiniteError",
    "NonFiniteGuard",
    "PeerFailure",
    "Preempted",
    "Resilience",
    "StopSignals",
    "TrainHooks",
    "Watchdog",
    "collective_failure_hint",
]
