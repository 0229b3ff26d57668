"""Subprocess entry for tests/test_checkpoint.py and tests/test_failures.py: runs nsa_titan.train.main with a
fault-injection hook object (passed in code, not through the environment).

    python tests/_fault_worker.py SCENARIO STEP [--rank-only R] [--ref STEP:FILE ...] -- --section.key value ...

Scenarios:
  sigkill_commit  SIGKILL this process after every rank wrote checkpoint STEP, before it is made visible
  sigkill_step    SIGKILL this process at the start of step STEP (with --rank-only R: only on rank R)
  stall           sleep for an hour at the start of step STEP (the watchdog must end the process)
  sigterm_step    send this process SIGTERM at the start of step STEP (with --rank-only R: only rank R)
  none            no fault
--ref STEP:FILE: at the start of step STEP (0: once the run is set up, after any resume), gather the full
unsharded model and optimizer state (collective) and let rank 0 torch.save it to FILE.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch


def full_state(model, optimizer) -> dict:
    """Unsharded model + optimizer tensors under clean names (collective when distributed)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = dist.is_initialized()
    # No cpu_offload: FSDP1 + cpu_offload segfaults on CPU-only gloo ranks (torch 2.13); tensors are on CPU here.
    opts = StateDictOptions(full_state_dict=full, flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    grab = {f"model.{k}": v for k, v in model_sd.items()}
    grab.update({f"optim.{k}": v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)})
    return {k: v.detach().clone().cpu() for k, v in grab.items()}


def dump_full_state(ctx, path) -> None:
    import torch.distributed as dist

    state = full_state(ctx["model"], ctx["optimizer"])
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(state, path)


def main() -> int:
    torch.set_num_threads(1)  # tiny ops; 2-thread OpenMP on a loaded 2-core box is many times slower
    from nsa_titan.config import ConfigError
    from nsa_titan.errors import EXIT_NONFINITE, TrainingFailure
    from nsa_titan.fault import TrainHooks
    from nsa_titan.train import main as train_main

    scenario, step = sys.argv[1], int(sys.argv[2])
    rest = sys.argv[3:]
    only_rank, refs = None, {}
    while rest and rest[0] != "--":
        if rest[0] == "--rank-only":
            only_rank = int(rest[1])
        elif rest[0] == "--ref":
            at, path = rest[1].split(":", 1)
            refs[int(at)] = path
        else:
            raise SystemExit(f"unknown worker option {rest[0]}")
        rest = rest[2:]
    rest = rest[1:]
    me = int(os.environ.get("RANK", "0"))
    armed = only_rank is None or only_rank == me

    class Hooks(TrainHooks):
        def on_train_start(self, ctx):
            self.ctx = ctx
            if 0 in refs:
                dump_full_state(ctx, refs[0])

        def before_checkpoint_commit(self, s, tmp_path):
            if armed and scenario == "sigkill_commit" and s == step:
                print(f"worker: killing myself before committing {tmp_path}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_step_start(self, s):
            if s in refs:
                dump_full_state(self.ctx, refs[s])
            if armed and scenario == "sigkill_step" and s == step:
                print(f"worker: rank {me} killing myself at step {s}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if armed and scenario == "sigterm_step" and s == step:
                print(f"worker: rank {me} sending itself SIGTERM at step {s}", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
            if armed and scenario == "stall" and s == step:
                print(f"worker: stalling at step {s}", flush=True)
                time.sleep(3600)

    try:
        result = train_main(rest, hooks=Hooks())
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except TrainingFailure as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return e.exit_code if e.exit_code else EXIT_NONFINITE
    return result.get("exit_code", 0)  # as python -m nsa_titan.train exits


if __name__ == "__main__":
    code = main()
    # The run is over and its exit code decided: skip the interpreter's teardown, where gloo's threads can abort the
    # process ("terminate called without an active exception", rc -6; seen once in CI on a loaded 2-core box after a
    # rank had saved its SIGTERM checkpoint) and replace the code the test checks. tests/_dist_worker.py does the same.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
