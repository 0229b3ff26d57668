"""Session-wide test set-up: torchdata loader workers that a finished training run left behind stop at once.

A training run's ``StatefulDataLoader`` iterator (data.num_workers > 0, where torchdata is installed) is reachable
only from reference cycles of the trainer's objects once ``main()`` returns, so inside the pytest process it is
freed by a later ``gc.collect()`` (the next run calls one at start-up). The cycle collector runs the weakref
finalizers of the garbage first, among them those of the iterator's index queues, which stop their feeder threads;
the iterator's ``__del__`` then puts each worker's shutdown message into a queue that no thread sends any more, and
``_shutdown_workers`` waits out its 5 s join timeout per worker before terminating it: 10 s inside whichever test
triggers the collection (five times per run, twice inside test_eval's compare smoke test, which trains two models).

Here a weakref callback on each iterator keeps its index queues alive and, when the iterator is collected, sends the
shutdown messages through them first, so the workers exit as they do when an iterator is freed by reference count
(callbacks run before ``__del__``, which then finds the workers gone). Nothing a test checks depends on it.
"""

from __future__ import annotations

import importlib.util
import weakref

_PENDING: dict[int, tuple] = {}


def _stop_workers(key: int) -> None:
    _, done_event, index_queues, workers = _PENDING.pop(key)
    try:
        if done_event.is_set():  # the iterator shut its workers down itself (exhausted, or an error)
            return
        done_event.set()
        for q in index_queues:
            q.put(None)
        for w in workers:
            w.join(timeout=5)
    except (OSError, ValueError):  # a queue already closed: the iterator's own shutdown takes over
        pass


def _track_loader_iterators() -> None:
    if importlib.util.find_spec("torchdata") is None:
        return
    from torchdata.stateful_dataloader import stateful_dataloader  # optional dependency

    cls = getattr(stateful_dataloader, "_StatefulMultiProcessingDataLoaderIter", None)
    if cls is None:
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        try:
            parts = (self._workers_done_event, list(self._index_queues), list(self._workers))
        except AttributeError:  # another torchdata: left to its own shutdown
            return
        key = id(self)
        _PENDING[key] = (weakref.ref(self, lambda _, key=key: _stop_workers(key)), *parts)

    cls.__init__ = __init__


_track_loader_iterators()
