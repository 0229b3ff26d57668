"""Failures that end loudly: non-finite steps skipped or stopped on, the hang watchdog, dead peers, and bad
input reported before any model is built."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shlex
import time

import pytest
import torch

from _ckpt_util import args, ckpt_args, explain, losses, run, run_ranks, run_worker
from nsa_titan.checkpoint import inspect_checkpoint, step_dir_name
from nsa_titan.config import ConfigError
from nsa_titan.errors import EXIT_PEER_FAILED, EXIT_WATCHDOG
from nsa_titan.fault import NonFiniteError, TrainHooks
from nsa_titan.fault.watchdog import Watchdog, heartbeat_path

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py says why


class InjectNaN(TrainHooks):
    """Poisons every gradient and reports a NaN loss at the given steps; records weights and AdamW's step
    count at the start of each step."""

    def __init__(self, *bad_steps: int):
        self.bad = set(bad_steps)
        self.weights: dict[int, list[torch.Tensor]] = {}
        self.adam_steps: dict[int, float] = {}

    def on_train_start(self, ctx):
        self.model, self.optimizer = ctx["model"], ctx["optimizer"]

    def on_step_start(self, step):
        self.weights[step] = [p.detach().clone() for p in self.model.parameters()]
        state = self.optimizer.state.get(next(self.model.parameters()), {})
        self.adam_steps[step] = float(state["step"]) if "step" in state else 0.0

    def before_optimizer_step(self, step, loss, grad_norm):
        if step not in self.bad:
            return loss, grad_norm
        for p in self.model.parameters():
            p.grad.fill_(float("nan"))
        return loss * float("nan"), grad_norm * float("inf")


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_nonfinite_step_is_skipped_exactly(tmp_path):
    hooks = InjectNaN(3)
    summary, out = run(args(tmp_path, "--fault.nonfinite", "skip", steps=6), hooks=hooks)
    assert same(hooks.weights[4], hooks.weights[3])  # step 3's update was dropped...
    assert hooks.adam_steps[4] == hooks.adam_steps[3] == 2  # ...including AdamW's step count
    assert not same(hooks.weights[5], hooks.weights[4])  # and training went on
    assert "non-finite loss or grad norm at step 3" in out and "updates skipped at 1 step(s): 3" in out
    assert summary["steps"] == 6 and math.isfinite(summary["final_loss"])
    assert all(torch.isfinite(p).all() for p in hooks.model.parameters())


def test_too_many_skipped_steps_stop_the_run(tmp_path):
    with pytest.raises(NonFiniteError, match=r"updates skipped at 2 step\(s\): 2, 3; checkpointing is off"):
        run(args(tmp_path, "--fault.nonfinite", "skip", "--fault.nonfinite_max_skips", "1", steps=6),
            hooks=InjectNaN(2, 3))


def test_nonfinite_stop_saves_last_good_state_and_resume_is_exact(tmp_path):
    """NaN at step 3 found on the log step 4 (no per-step sync): the run rewinds to the state after step 2,
    saves it, exits naming step 3; resuming from it without the fault reproduces a clean run."""
    steps = 8
    clean = tmp_path / "clean"
    run(args(clean, steps=steps))
    hooks = InjectNaN(3)
    dump = tmp_path / "faulty"
    with pytest.raises(NonFiniteError, match=r"at step 3 \(loss nan, grad norm inf\); saved the last good state "
                                             r"\(step 2\)") as info:
        run(ckpt_args(dump, "--metrics.log_freq", "4", steps=steps, interval=100), hooks=hooks)
    assert info.value.step == 3 and info.value.saved == dump / "checkpoints" / step_dir_name(2)
    meta, problem = inspect_checkpoint(info.value.saved)
    assert problem is None and meta["step"] == 2 and meta["tokens_seen"] == 2 * 2 * 64
    assert same(hooks.weights[4], hooks.weights[3])  # updates were dropped from the bad step on

    class Capture(TrainHooks):
        def on_train_start(self, ctx):
            self.weights = [p.detach().clone() for p in ctx["model"].parameters()]

    cap = Capture()
    run(ckpt_args(dump, steps=steps, interval=100), hooks=cap)
    assert same(cap.weights, hooks.weights[3])  # the saved weights are those after step 2
    want, got = losses(clean), losses(dump)
    assert sorted(got) == list(range(3, steps + 1)) and all(got[s] == want[s] for s in got), (want, got)


def _lrs(dump) -> dict[int, float]:
    recs = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in recs if r["type"] == "train"}


def test_the_nonfinite_stop_names_a_resume_command_whose_lr_wins(tmp_path):
    """Exit 3's message names a command; run as given, it resumes from the saved state with the lower lr (this
    run's settings win over the saved ones, with a log line); keep_saved_hyperparams keeps the saved lr."""
    from nsa_titan.components.lr_scheduler import lr_factor

    argv = ckpt_args(tmp_path, "--optimizer.lr", "1e-2", "--metrics.log_freq", "4", steps=8, interval=100)
    with pytest.raises(NonFiniteError) as info:
        run(argv, hooks=InjectNaN(3))
    command = re.search(r"replace the saved ones\): (.*) \(or pass --fault", str(info.value)).group(1)
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "nsa_titan.train"], command
    assert words[-4:] == ["--optimizer.lr", "0.001", "--checkpoint.resume_from", str(info.value.saved)], command
    _, out = run(words[3:])
    assert "this run's settings replace the saved ones: optimizer.lr 0.01 -> 0.001" in out
    factor = lr_factor(3, warmup_steps=2, total_steps=8, decay_type="cosine", min_lr_ratio=0.1, wsd_decay_ratio=0.2)
    assert _lrs(tmp_path)[4] == 1e-3 * factor  # the lr of step 4 (a log step; index 3 of the schedule)

    _, out = run([*words[3:], "--checkpoint.keep_saved_hyperparams"])
    assert "keeping the saved hyper-parameters (checkpoint.keep_saved_hyperparams), not this run's: optimizer.lr " \
           "0.01 (this run: 0.001)" in out
    assert _lrs(tmp_path)[4] == 1e-2 * factor


def test_nonfinite_check_every_step_stops_at_the_bad_step(tmp_path):
    hooks = InjectNaN(3)
    with pytest.raises(NonFiniteError, match="at step 3 .*checkpointing is off"):
        run(args(tmp_path, "--metrics.log_freq", "10", "--fault.nonfinite_check_every_step", steps=8), hooks=hooks)
    assert max(hooks.weights) == 3  # stopped right after step 3, not at the log step 8


def test_watchdog_dumps_stacks_and_exits_on_a_stall(tmp_path):
    t0 = time.monotonic()
    proc = run_worker("stall", 3, args(tmp_path, "--fault.watchdog_timeout_s", "2", "--fault.heartbeat_interval_s",
                                       "0.5", "--fault.peer_timeout_s", "2", steps=6), timeout=180)
    assert proc.returncode == EXIT_WATCHDOG, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "WATCHDOG: no training step finished for" in proc.stderr and "after step 2" in proc.stderr
    assert "in on_step_start" in proc.stderr  # the stalled frame is in the dump
    stacks = (tmp_path / "fault" / "rank0_stacks.txt").read_text()
    assert "on_step_start" in stacks and "Thread" in stacks
    beat = json.loads(heartbeat_path(tmp_path / "heartbeat", 0).read_text())
    assert beat["status"] == "hung" and beat["step"] == 2
    print(f"stall -> exit {proc.returncode} after {time.monotonic() - t0:.1f}s (incl. start-up)")


def test_a_killed_rank_makes_the_other_exit_with_a_clear_message(tmp_path):
    """Rank 1 is SIGKILLed at step 3; rank 0 must not hang in its next collective, nor end with a traceback: it
    exits with code 5 within seconds, naming rank 1 as gone (not 'running')."""
    timeout = 30
    res = run_ranks("sigkill_step", 3, args(tmp_path / "dump", "--fault.heartbeat_interval_s", "0.5",
                                            "--fault.peer_timeout_s", "5", "--fault.collective_timeout_s",
                                            str(timeout), steps=200),
                    tmp_path=tmp_path, worker_opts=("--rank-only", "1"), timeout=240)
    r0, r1 = res
    assert r1["returncode"] == -9, explain(res)
    assert r0["returncode"] == EXIT_PEER_FAILED, explain(res)
    waited = r0["seconds"] - r1["seconds"]
    assert waited < 15, f"rank 0 needed {waited:.1f}s to notice\n" + explain(res)
    # Two threads may name it first: the main loop ("training stopped", its collective failed) or the heartbeat
    # watchdog ("PEER FAILURE", the collective still blocked; seen on a loaded 2-core CI machine). Both exit 5 and
    # print every rank's heartbeat.
    named = "training stopped: rank 1 (pid" in r0["stderr"] or "PEER FAILURE: rank 1 (pid" in r0["stderr"]
    assert named and "is gone: its process no longer exists" in r0["stderr"], explain(res)
    assert "heartbeats: rank 1: gone (process no longer exists), last step" in r0["stderr"], explain(res)
    assert "Traceback" not in r0["stderr"], explain(res)
    print(f"rank 0 exited (code {r0['returncode']}) {waited:.1f}s after rank 1 was killed")


def test_under_torchrun_a_killed_rank_makes_the_survivor_exit_5_naming_it(tmp_path):
    """torchrun's agent SIGTERMs the survivors when a worker dies. That SIGTERM is not a preemption: the survivor
    must still exit 5 naming the dead rank (not 143 after a save attempt), and torchrun's summary must show rank 0's
    code 5 beside the root cause, rank 1's SIGKILL."""
    import subprocess
    import sys

    from _ckpt_util import REPO, WORKER, subprocess_env

    dump = tmp_path / "dump"
    argv = args(dump, "--fault.heartbeat_interval_s", "0.5", "--fault.peer_timeout_s", "5",
                "--fault.collective_timeout_s", "30", steps=200)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           "sigkill_step", "3", "--rank-only", "1", "--", *argv]
    env = {k: v for k, v in subprocess_env().items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                    "MASTER_PORT")}
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-4000:]  # torchrun's own code for a failed worker
    # Two threads may name it first: the main loop ("training stopped", after the launcher's SIGTERM) or the
    # heartbeat watchdog ("PEER FAILURE", seen on a loaded 2-core CI machine); both exit 5.
    named = "training stopped: rank 1 (pid" in out or "PEER FAILURE: rank 1 (pid" in out
    assert named and "is gone: its process no longer exists" in out, out[-4000:]
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*exitcode\s*: 5 ", out), out[-4000:]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: -9 ", out), out[-4000:]
    assert "saving and exiting" not in out, "the launcher's SIGTERM was taken for a preemption\n" + out[-4000:]
    beats = {r: json.loads(heartbeat_path(dump / "heartbeat", r).read_text()) for r in (0, 1)}
    assert beats[0]["status"] in ("failed", "peer_failed") and beats[1]["status"] == "running"  # 1 died silently
    assert beats[0]["time"] - beats[1]["time"] < 15, "rank 0 took too long to stop after rank 1 died"


def test_sigterm_after_a_peer_died_names_it_and_exits_5(tmp_path):
    """The handler's decision on its own: a SIGTERM with a dead peer -> the peer's name and code 5 (also from the
    grace timer); without one -> a preemption (143)."""
    import signal

    from nsa_titan.fault.preemption import StopSignals

    codes = []
    dead = StopSignals(grace_s=0.2, rank=0, world_size=1, exit_fn=codes.append, peer_check=lambda: "rank 1 is gone")
    dead._handle(signal.SIGTERM, None)
    assert dead.exit_code() == EXIT_PEER_FAILED
    _wait_for(codes, 5.0)
    assert codes == [EXIT_PEER_FAILED]
    alive = StopSignals(grace_s=60, rank=0, world_size=1, exit_fn=codes.append, peer_check=lambda: None)
    alive._handle(signal.SIGTERM, None)
    alive._timer.cancel()
    assert alive.exit_code() == 143


def _watchdog(tmp_path, codes, **kw):
    opts = dict(rank=0, world_size=2, heartbeat_dir=tmp_path / "hb", fault_dir=tmp_path / "fault", timeout_s=30,
                first_step_timeout_s=30, heartbeat_interval_s=0.1, peer_timeout_s=1.0, run_id="run",
                exit_fn=codes.append, stream=open(os.devnull, "w"))
    opts.update(kw)
    return Watchdog(**opts)


def _wait_for(codes, seconds=10.0):
    end = time.monotonic() + seconds
    while not codes and time.monotonic() < end:
        time.sleep(0.05)
    return codes


@pytest.mark.parametrize("peer", ["silent", "failed", "other_run", "gone"])
def test_watchdog_sees_a_dead_peer(tmp_path, peer):
    """'gone': a fresh heartbeat of a process on this host that no longer exists (killed): found without waiting
    for peer_timeout_s, so a rank blocked in a collective that never fails still exits 5."""
    import socket
    import subprocess
    import sys

    codes, said = [], io.StringIO()
    wd = _watchdog(tmp_path, codes, peer_timeout_s=60.0 if peer == "gone" else 1.0, stream=said).start()
    try:
        wd.step_done(1)
        ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        beat = {"rank": 1, "pid": 123, "host": "h", "run_id": "other" if peer == "other_run" else "run", "step": 4,
                "status": "failed" if peer == "failed" else "running", "time": time.time() - 5,
                "detail": "RuntimeError: boom"}
        if peer == "gone":
            beat.update(pid=int(ended.stdout), host=socket.gethostname(), time=time.time())
        heartbeat_path(tmp_path / "hb", 1).write_text(json.dumps(beat))
        _wait_for(codes, 2.0 if peer == "other_run" else 10.0)
    finally:
        wd.stop()
    if peer == "other_run":  # a stale heartbeat of an earlier run in the same folder is ignored
        assert codes == []
        return
    assert codes == [EXIT_PEER_FAILED]
    want = {"silent": "died", "failed": "RuntimeError: boom", "gone": "is gone: its process no longer exists"}[peer]
    assert "rank 1" in wd.fired and want in wd.fired
    # ... and every rank's last heartbeat, as the training loop prints them when it names the peer itself
    status = {"silent": "running", "failed": "failed", "gone": "gone (process no longer exists)"}[peer]
    assert f"[rank 0] heartbeats: rank 1: {status}, last step 4" in said.getvalue(), said.getvalue()


def test_watchdog_fires_on_no_progress(tmp_path):
    codes = []
    wd = _watchdog(tmp_path, codes, world_size=1, timeout_s=0.3, first_step_timeout_s=0.3).start()
    try:
        assert _wait_for(codes) == [EXIT_WATCHDOG]
    finally:
        wd.stop()
    assert "before the first step" in wd.fired and "_wait_for" in (tmp_path / "fault" / "rank0_stacks.txt").read_text()


BAD_INPUT = [
    (["--training.steps", "0"], r"training.steps: must be >= 1"),
    (["--model.flavor", "gigantic"], r"model.flavor: unknown flavor 'gigantic'.*valid flavors: debug"),
    (["--data.dataset", "text_files"], r"data.path: is required for data.dataset='text_files'"),
    (["--data.dataset", "text_files", "--data.path", "/no/such/dir"], r"data.path: '/no/such/dir' does not exist"),
    (["--training.seq_len", "2048"], r"model.max_seq_len: training.seq_len=2048 exceeds"),
    (["--model.n_kv_heads", "3"], r"model.n_kv_heads: n_heads=4 must be a multiple"),
    (["--model.cmp_stride", "3"], r"model.cmp_stride: d=3 must divide l=cmp_block=8"),
    (["--lr_scheduler.warmup_steps", "50"], r"lr_scheduler.warmup_steps \(50\) exceeds training.steps \(20\)"),
    (["--training.device", "cuda"], r"training.device = 'cuda' but no CUDA device"),
    (["--optimizer.fused", "false"], r"optimizer.fused: false, but fault.nonfinite='stop'"),
    (["--checkpoint.interval", "0"], r"checkpoint.interval: must be >= 1"),
    (["--checkpoint.keep_latest_k", "-1"], r"checkpoint.keep_latest_k: must be >= 0"),
    (["--checkpoint.resume_from", "/no/ckpt"], r"checkpoint.resume_from: '/no/ckpt' is not a complete checkpoint"),
    (["--fault.watchdog_timeout_s", "-1"], r"fault.watchdog_timeout_s: must be >= 0"),
    (["--fault.heartbeat_interval_s", "10", "--fault.peer_timeout_s", "5"],
     r"fault.peer_timeout_s: must be at least twice fault.heartbeat_interval_s \(10.0\)"),
    (["--fault.nonfinite", "ignore"], r"fault.nonfinite: invalid value 'ignore'"),
]


@pytest.mark.parametrize("extra, message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_fails_before_the_model_is_built(tmp_path, monkeypatch, extra, message):
    import nsa_titan.train as train_mod

    def no_model(*a, **k):
        raise AssertionError("the model was built before the bad input was reported")

    monkeypatch.setattr(train_mod, "build_model", no_model)
    if torch.cuda.is_available() and "cuda" in extra:
        pytest.skip("this machine has a GPU")
    with pytest.raises((ConfigError, ValueError, RuntimeError), match=message):
        run(args(tmp_path, *extra))


def test_world_size_not_matching_the_mesh_fails_before_any_process_group(tmp_path, monkeypatch):
    import torch.distributed as dist

    def no_group(*a, **k):
        raise AssertionError("a process group was created before the bad degrees were reported")

    monkeypatch.setattr(dist, "init_process_group", no_group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"dp_replicate x dp_shard = 1 x 3 = 3 but the world size .* is 2"):
        run(args(tmp_path, "--parallelism.dp_shard", "3"))


def test_collective_timeout_reaches_init_process_group(tmp_path, monkeypatch):
    import datetime

    import torch.distributed as dist

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(*a, **k):
        seen.update(k)
        raise Stop

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(Stop):
        run(args(tmp_path, "--fault.collective_timeout_s", "42"))
    assert seen["timeout"] == datetime.timedelta(seconds=42)


def test_sigterm_finishes_the_step_saves_and_exits_143(tmp_path):
    """SIGTERM during step 4 (as a scheduler's preemption): step 4 completes, is saved, the summary is written
    and the run ends with exit code 143, not at once with nothing saved."""
    import signal

    class Term(TrainHooks):
        def on_step_start(self, step):
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    def unhandled(signum, frame):  # what runs if the trainer installed no handler (instead of killing pytest)
        raise AssertionError("SIGTERM reached the test's own handler: the run did not handle it")

    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        summary, out = run(ckpt_args(tmp_path, steps=50, interval=100), hooks=Term())
        assert signal.getsignal(signal.SIGTERM) is unhandled  # the run put the previous handler back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert summary["interrupted"] and summary["steps"] == 4 and summary["exit_code"] == 143
    assert summary["stop_signal"] == "SIGTERM" and summary["checkpoint"] == str(tmp_path / "checkpoints" /
                                                                                 step_dir_name(4))
    assert inspect_checkpoint(tmp_path / "checkpoints" / step_dir_name(4))[1] is None
    assert json.loads((tmp_path / "summary.json").read_text())["exit_code"] == 143
    assert "SIGTERM: stopped after step 4" in out


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    res = run_ranks("sigterm_step", 3, ckpt_args(tmp_path / "dump", steps=50, interval=100), tmp_path=tmp_path,
                    worker_opts=("--rank-only", "1"), timeout=240)
    assert [r["returncode"] for r in res] == [143, 143], explain(res)
    assert inspect_checkpoint(tmp_path / "dump" / "checkpoints" / step_dir_name(3))[1] is None, explain(res)
    assert json.loads((tmp_path / "dump" / "summary.json").read_text())["steps"] == 3


def test_stop_grace_time_bounds_the_exit(tmp_path):
    """Past fault.stop_grace_s the process exits with the signal's code even if the save has not finished; a
    second Ctrl-C interrupts at once."""
    import signal

    from nsa_titan.fault.preemption import StopSignals

    codes = []
    stop = StopSignals(grace_s=0.2, rank=0, world_size=1, exit_fn=codes.append)
    stop._handle(signal.SIGTERM, None)
    assert stop.agreed() == signal.SIGTERM and _wait_for(codes, 5.0) == [143]
    stop = StopSignals(grace_s=30, rank=0, world_size=1, exit_fn=codes.append)
    stop._handle(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)
    stop.restore()
