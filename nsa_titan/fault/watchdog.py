"""Hang watchdog and per-rank heartbeats.

One daemon thread per rank:

- writes ``<dump_folder>/heartbeat/rank<r>.json`` every ``heartbeat_interval_s`` (rank, pid, host, last
  finished step, status, wall time; written to a temp file and renamed, so readers never see half a file);
- when no step finished within ``timeout_s`` (``first_step_timeout_s`` before the first one: compilation
  and start-up), dumps every thread's Python stack (faulthandler) to stderr and to
  ``<dump_folder>/fault/rank<r>_stacks.txt``, dumps the collective flight recorder where torch has one
  (NCCL's needs ``TORCH_NCCL_TRACE_BUFFER_SIZE`` set by the launcher), marks the heartbeat 'hung' and ends
  the process with EXIT_WATCHDOG. The main thread is stuck by definition, so the exit is ``os._exit``;
- reads the other ranks' heartbeats: a peer whose status is 'failed' / 'hung', or whose heartbeat is older
  than ``peer_timeout_s`` (a SIGKILLed rank stops writing), ends this rank with EXIT_PEER_FAILED and a
  message naming the peer, instead of waiting in a collective for the (long) NCCL timeout.

The thread reads only host values that the training loop sets (``step_done``): it never syncs the device.
Note that on GPU the host runs ahead of the device, so 'step finished' means 'step enqueued'; a device hang
still surfaces, because the host blocks at the next sync (log step, allocator, collective) within a step or so.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist

from nsa_titan.errors import EXIT_PEER_FAILED, EXIT_WATCHDOG

FAILED_STATUSES = ("failed", "hung", "peer_failed")


def heartbeat_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.json"


def read_heartbeats(folder: Path, world_size: int, run_id: str | None = None) -> dict[int, dict[str, Any]]:
    """rank -> its last heartbeat (only this run's when ``run_id`` is given)."""
    out = {}
    for r in range(world_size):
        try:
            hb = json.loads(heartbeat_path(folder, r).read_text())
        except (OSError, ValueError):
            continue
        if run_id is None or hb.get("run_id") == run_id:
            out[r] = hb
    return out


def process_gone(hb: dict[str, Any]) -> bool:
    """True when the heartbeat's process ran on this host and no longer exists (or is a zombie): a rank that
    was killed. Ranks on other hosts cannot be checked this way (their heartbeat goes stale instead)."""
    if hb.get("host") != socket.gethostname() or not isinstance(hb.get("pid"), int):
        return False
    pid = hb["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, owned by someone else
        return False
    try:  # a killed child that its launcher has not reaped yet
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def find_dead_peer(folder: Path, world_size: int, run_id: str | None, me: int, peer_timeout_s: float) -> str | None:
    """A sentence naming a peer that failed, hung or died (see the module docstring), else None."""
    now = time.time()
    for r, hb in read_heartbeats(folder, world_size, run_id).items():
        if r == me:
            continue
        if hb.get("status") in FAILED_STATUSES:
            why = f": {hb['detail']}" if hb.get("detail") else ""
            return f"rank {r} reported '{hb['status']}' at step {hb.get('step')}{why}"
        if hb.get("status") == "running" and process_gone(hb):
            return (f"rank {r} (pid {hb.get('pid')} on {hb.get('host')}) is gone: its process no longer exists "
                    f"(last step {hb.get('step')})")
        age = now - float(hb.get("time", now))
        if hb.get("status") == "running" and age > peer_timeout_s:
            return (f"rank {r} (pid {hb.get('pid')} on {hb.get('host')}) stopped sending heartbeats "
                    f"{age:.1f}s ago, after step {hb.get('step')}: it has most likely died")
    return None


def describe_peers(folder: Path, world_size: int, run_id: str | None, me: int) -> str:
    now = time.time()
    beats = read_heartbeats(folder, world_size, run_id)
    parts = []
    for r in range(world_size):
        if r == me:
            continue
        hb = beats.get(r)
        if hb is None:
            parts.append(f"rank {r}: no heartbeat")
            continue
        status = "gone (process no longer exists)" if hb.get("status") == "running" and process_gone(hb) else \
            hb.get("status")
        parts.append(f"rank {r}: {status}, last step {hb.get('step')}, heartbeat "
                     f"{now - hb.get('time', now):.1f}s old (pid {hb.get('pid')} on {hb.get('host')})")
    return "; ".join(parts)


def dump_flight_recorder(folder: Path, rank: int) -> Path | None:
    """Write the collective flight recorder's trace, when this torch build and backend have one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:  # the C++ side of torch.distributed; builds without it have no recorder
        from torch._C import _distributed_c10d as c10d  # noqa: PLC0415 - optional
    except ImportError:
        return None
    fn = getattr(c10d, "_dump_nccl_trace", None) if dist.get_backend() == "nccl" else None
    fn = fn or getattr(c10d, "_dump_fr_trace", None)
    if fn is None:
        return None
    try:
        data = fn()
    except Exception:  # noqa: BLE001 - recorder off or unsupported: the stacks are still dumped
        return None
    path = Path(folder) / f"rank{rank}_flight_recorder.pkl"
    path.write_bytes(data)
    return path


class Watchdog:
    """See the module docstring. ``exit_fn`` / ``clock`` are injectable for tests; ``timeout_s <= 0``
    turns the hang check off (heartbeats and the peer check still run)."""

    def __init__(self, *, rank: int, world_size: int, heartbeat_dir: str | os.PathLike,
                 fault_dir: str | os.PathLike, timeout_s: float, first_step_timeout_s: float,
                 heartbeat_interval_s: float = 10.0, peer_timeout_s: float = 60.0, run_id: str = "",
                 exit_fn: Callable[[int], None] = os._exit, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.rank, self.world_size = rank, world_size
        self.heartbeat_dir, self.fault_dir = Path(heartbeat_dir), Path(fault_dir)
        self.timeout_s, self.first_step_timeout_s = timeout_s, first_step_timeout_s
        self.interval = heartbeat_interval_s
        self.peer_timeout_s = peer_timeout_s
        self.run_id = run_id
        self._exit, self._stream, self._clock = exit_fn, stream, clock
        self.step: int | None = None
        self.status = "starting"
        self._last_progress = clock()
        self._stop = threading.Event()
        # Set by the main thread once it reports a dead peer itself (its collective failed); under the lock, so
        # that exactly one of the two reports the peer and the run ends with one message.
        self._peer_reported = False
        self._peer_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None

    # ---- called by the training loop (host values only) ----
    def start(self) -> Watchdog:
        self.heartbeat_dir.mkdir(parents=True, exist_ok=True)
        self.status = "running"
        self._last_progress = self._clock()
        self._write_heartbeat()
        self._thread = threading.Thread(target=self._run, name=f"nsa-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()
        return self

    def step_done(self, step: int) -> None:
        self.step = step
        self._last_progress = self._clock()

    def progress(self) -> None:
        """Long non-step work finished (a checkpoint save, an evaluation): restart the clock."""
        self._last_progress = self._clock()

    def main_thread_reports_peer(self) -> None:
        """The training loop's collective failed and it names the dead peer itself: the thread's peer check
        stands down (the hang check stays)."""
        with self._peer_lock:
            self._peer_reported = True

    def stop(self, status: str = "done", detail: str | None = None) -> None:
        """End the thread and leave a final heartbeat ('done', or 'failed' with the error for the peers)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.status = status
        self._write_heartbeat(detail)

    # ---- the thread ----
    def _run(self) -> None:
        tick = max(0.05, min(self.interval, (self.timeout_s or self.interval) / 4, self.peer_timeout_s / 4))
        last_beat = self._clock()
        while not self._stop.wait(tick):
            now = self._clock()
            if now - last_beat >= self.interval:
                self._write_heartbeat()
                last_beat = now
            limit = self.first_step_timeout_s if self.step is None else self.timeout_s
            if self.timeout_s > 0 and now - self._last_progress > limit:
                self._fire_hang(now - self._last_progress)
                return
            peer = None if self._peer_reported else self._dead_peer()
            if peer is not None and self._fire_peer(peer):
                return

    def _dead_peer(self) -> str | None:
        if self.world_size <= 1:
            return None
        return find_dead_peer(self.heartbeat_dir, self.world_size, self.run_id, self.rank, self.peer_timeout_s)

    def _say(self, text: str) -> None:
        stream = self._stream or sys.stderr
        print(text, file=stream, flush=True)

    def _fire_hang(self, idle: float) -> None:
        where = "before the first step" if self.step is None else f"after step {self.step}"
        self.fired = f"no training step finished for {idle:.1f}s {where} (fault.watchdog_timeout_s)"
        self._say(f"[rank {self.rank}] WATCHDOG: {self.fired}; dumping all thread stacks and exiting")
        self.fault_dir.mkdir(parents=True, exist_ok=True)
        stacks = self.fault_dir / f"rank{self.rank}_stacks.txt"
        with open(stacks, "w") as f:
            f.write(f"{self.fired}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        try:  # also to stderr, where the launcher's log collects it
            faulthandler.dump_traceback(file=self._stream or sys.stderr, all_threads=True)
        except (ValueError, OSError, AttributeError):  # a stream without a file descriptor
            (self._stream or sys.stderr).write(stacks.read_text())
        recorder = dump_flight_recorder(self.fault_dir, self.rank)
        self._say(f"[rank {self.rank}] WATCHDOG: stacks in {stacks}"
                  + (f", flight recorder in {recorder}" if recorder else "")
                  + (f"; peers: {describe_peers(self.heartbeat_dir, self.world_size, self.run_id, self.rank)}"
                     if self.world_size > 1 else ""))
        self.status = "hung"
        self._write_heartbeat(self.fired)
        self._exit(EXIT_WATCHDOG)

    def _fire_peer(self, what: str) -> bool:
        """Exit naming the peer, unless the main thread reports it; True when this thread reported it."""
        with self._peer_lock:  # held until the exit: the main thread cannot start its own report meanwhile
            if self._peer_reported:
                return False
            self._exit_on_peer(what)
            return True

    def _exit_on_peer(self, what: str) -> None:
        self.fired = what
        self._say(f"[rank {self.rank}] PEER FAILURE: {what}; exiting instead of waiting in a collective")
        # Every rank's last heartbeat, as the training loop prints them when it names the peer itself: which of the
        # two threads reports first is a race (a collective that fails at once, or one that blocks).
        self._say(f"[rank {self.rank}] heartbeats: "
                  f"{describe_peers(self.heartbeat_dir, self.world_size, self.run_id, self.rank)}")
        self.status = "peer_failed"
        self._write_heartbeat(what)
        self._exit(EXIT_PEER_FAILED)

    def _write_heartbeat(self, detail: str | None = None) -> None:
        hb = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "run_id": self.run_id,
              "step": self.step, "status": self.status, "time": time.time()}
        if detail:
            hb["detail"] = detail
        path = heartbeat_path(self.heartbeat_dir, self.rank)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(hb) + "\n")
            os.replace(tmp, path)
        except OSError:  # a full or vanished disk must not kill training through its watchdog
            pass
