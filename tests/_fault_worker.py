"""Subprocess entry for tests/test_checkpoint.py and tests/test_failures.py: runs nsa_titan.train.main with a
fault-injection hook object (passed in code, not through the environment).

    python tests/_fault_worker.py SCENARIO STEP -- --section.key value ...

Scenarios:
  sigkill_commit  SIGKILL this process after every rank wrote checkpoint STEP, before it is made visible
  sigkill_step    SIGKILL this process at the start of step STEP (with --rank-only R: only on rank R)
  stall           sleep for an hour at the start of step STEP (the watchdog must end the process)
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch


def main() -> int:
    torch.set_num_threads(1)  # tiny ops; 2-thread OpenMP on a loaded 2-core box is many times slower
    from nsa_titan.components.failure import EXIT_NONFINITE, TrainHooks, TrainingFailure
    from nsa_titan.config import ConfigError
    from nsa_titan.train import main as train_main

    scenario, step = sys.argv[1], int(sys.argv[2])
    rest = sys.argv[3:]
    only_rank = None
    if rest[:1] == ["--rank-only"]:
        only_rank, rest = int(rest[1]), rest[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    me = int(os.environ.get("RANK", "0"))
    armed = only_rank is None or only_rank == me

    class Hooks(TrainHooks):
        def before_checkpoint_commit(self, s, tmp_path):
            if armed and scenario == "sigkill_commit" and s == step:
                print(f"worker: killing myself before committing {tmp_path}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_step_start(self, s):
            if armed and scenario == "sigkill_step" and s == step:
                print(f"worker: rank {me} killing myself at step {s}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if armed and scenario == "stall" and s == step:
                print(f"worker: stalling at step {s}", flush=True)
                time.sleep(3600)

    try:
        train_main(rest, hooks=Hooks())
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except TrainingFailure as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return e.exit_code if e.exit_code else EXIT_NONFINITE
    return 0


if __name__ == "__main__":
    sys.exit(main())
