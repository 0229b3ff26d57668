"""Python garbage collection at fixed steps, on every rank at once, instead of whenever Python decides.

Python's automatic collector runs when allocation counters cross a threshold: at a different moment on each rank
and mid-step. A collection pauses that rank's host thread; under data parallelism the other ranks then wait for it
at the next collective, and on a host-bound step (eager FSDP2 with activation checkpointing issues thousands of
small ops per step) the pause lands directly in the step time. torchtitan does the same for the same reason.

Setup objects (modules, compiled graphs, the dataset's index) are frozen into Python's permanent generation
(``gc.freeze``) so that the periodic full collection only walks what training allocated since: it stays cheap
and still frees reference cycles of every age (a generation-1-only scheme would leak cycles that reach
generation 2, which may hold GPU tensors).
"""

from __future__ import annotations

import gc
import time


class GarbageCollection:
    """``every`` > 0: automatic collection off, a full collection after every ``every``-th step; 0: Python's own.

    ``start()`` before the training loop, ``step(step)`` after each step, ``close()`` after the loop (always).
    """

    def __init__(self, every: int):
        if every < 0:
            raise ValueError(f"gc every must be >= 0 (0: Python's automatic collection), got {every}")
        self.every = every
        self.was_enabled = gc.isenabled()
        self.collections = 0
        self.seconds = 0.0

    def start(self) -> None:
        if self.every:
            gc.collect()  # what setup left behind, once
            gc.freeze()
            gc.disable()

    def step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            t0 = time.perf_counter()
            gc.collect()
            self.seconds += time.perf_counter() - t0
            self.collections += 1

    def close(self) -> None:
        if self.every:
            gc.unfreeze()
            if self.was_enabled:
                gc.enable()
