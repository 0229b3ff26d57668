"""The kernel checks' child processes (tests/test_kernels.py run as a script), started as soon as pytest has
collected, so that they run beside the rest of the suite instead of after it.

The interpreter checks take ~920 s of one core (2-core dev machine, 2026-12-07) and the rest of the suite ~390 s
of wall time at ~1.3 cores busy. Started at collection, at a lower CPU priority (nice 10: the suite's own tests keep
the cores they use and the children take what is idle), with the kernel cases' tests moved to the end of the run
(tests/conftest.py), the checks use the ~0.7 idle core while the other tests run and the whole suite ends sooner.
Nothing in the checks changes: the same children, claim directory and verdicts as when the fixture started them.

Output goes to files, not pipes: nobody reads the children's output until their verdicts are needed, and a pipe's
buffer (64 KiB) filled by warnings would stall a child until then.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

KERNEL_CASE_TEST = "test_kernels.py::test_kernel_case"
NICE = 10
_RUN: dict = {}  # this pytest process's children: procs, their output files, the claim directory


def kernel_cases_last(items: list) -> tuple[list, bool]:
    """-> (items with test_kernels' per-case tests moved to the end, in their order; whether there are any)."""
    cases = [item for item in items if KERNEL_CASE_TEST in item.nodeid]
    if not cases:
        return items, False
    return [item for item in items if KERNEL_CASE_TEST not in item.nodeid] + cases, True


def _lower_priority() -> None:
    os.nice(NICE)


def start() -> None:
    """Start the children once per process (one per CPU core, at most 2); none where triton is missing (the fixture
    then skips)."""
    if _RUN or importlib.util.find_spec("triton") is None:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    shards = max(1, min(2, os.cpu_count() or 1))
    if shards > 1:
        env["OMP_NUM_THREADS"] = "1"  # one core per child
    work = tempfile.mkdtemp(prefix="kernel_checks_")
    claim_dir = os.path.join(work, "claims")  # the children share the work through it (test_kernels._claim)
    os.mkdir(claim_dir)
    procs, files = [], []
    for i in range(shards):
        out, err = (open(os.path.join(work, f"child{i}.{s}"), "w+") for s in ("out", "err"))
        procs.append(subprocess.Popen([sys.executable, os.path.join(here, "test_kernels.py"),
                                       f"--claim-dir={claim_dir}"], env=env, stdout=out, stderr=err, text=True,
                                      cwd=root, preexec_fn=_lower_priority))
        files.append((out, err))
    _RUN.update(procs=procs, files=files, work=work)


def collect(timeout_s: float) -> tuple[dict, list[str]]:
    """Wait for the children until ``timeout_s`` from now (one deadline for all: they run side by side; a hang still
    fails) -> (verdicts by case name, errors of the children that failed or were killed)."""
    found, errors = {}, []
    deadline = time.monotonic() + timeout_s
    for proc, (out, err) in zip(_RUN["procs"], _RUN["files"]):
        note = ""
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            note = f"\n(killed after {timeout_s} s: the cases it had not reached produce no verdict)"
        out.seek(0)
        err.seek(0)
        for line in out.read().splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                found[r.pop("case")] = r
        if proc.returncode:
            errors.append(f"rc={proc.returncode}: {err.read()[-2000:]}{note}")
    stop()
    return found, errors


def stop() -> None:
    """Kill any child still running and remove their files (end of session, or after collect)."""
    for proc in _RUN.get("procs", ()):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for out, err in _RUN.get("files", ()):
        out.close()
        err.close()
    if "work" in _RUN:
        shutil.rmtree(_RUN["work"], ignore_errors=True)
    _RUN.clear()
