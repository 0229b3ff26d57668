"""``StatefulLoader``: the batches of one rank, through torchdata's ``StatefulDataLoader`` when it is installed
(worker processes, pinned memory, prefetch), else inline in the training process; resumable either way.

Both datasets make a batch a pure function of where it sits in the rank's stream: ``MapBatches`` (in-memory
corpora) by its position, ``PackedStream`` (streamed HF data) by its own state. So the loader's state is small
JSON (checkpoints hold tensors and JSON only): the stream's identity (seed, rank, world size, seq_len, ...)
checked on load, the sample position, and torchdata's own ``state_dict()`` (which holds each worker's
``PackedStream`` state); inline, the stream's state itself. A resume yields exactly the batches the
interrupted run would have yielded next, with or without workers.
"""

from __future__ import annotations

import importlib.util
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .loader import MapBatches

__all__ = ["StatefulLoader", "torchdata_available"]

_IDENTITY = ("seed", "rank", "world_size", "seq_len", "split", "retrieval_mix", "chunks_per_rank", "num_workers")


def torchdata_available() -> bool:
    return importlib.util.find_spec("torchdata") is not None


class _Positions(torch.utils.data.Sampler):
    """start, start + step, ... forever: the sample positions of successive batches (``MapBatches`` keys)."""

    def __init__(self, start: int, step: int):
        self.start, self.step = int(start), int(step)

    def __iter__(self):
        return itertools.count(self.start, self.step)


class StatefulLoader:
    """Infinite iterator of batches ``{"input", "labels", "is_retrieval"}`` (see ``BatchAssembler``).

    ``num_workers`` None: inline (no torchdata; evaluation and the val batches use this). An int: torchdata's
    StatefulDataLoader with that many workers (0: in this process) when torchdata is installed, else inline
    with a line through ``log`` saying so.
    """

    def __init__(self, dataset, *, identity: dict[str, Any], num_workers: int | None = None, prefetch_factor: int = 2,
                 pin_memory: bool | None = None, log: Callable[[str], None] | None = None):
        self.dataset = dataset
        self.text = getattr(dataset, "text", dataset)  # PackedTextDataset of in-memory corpora (tests inspect it)
        self.batch_size = dataset.assembler.batch_size
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.use_torchdata = num_workers is not None and torchdata_available()
        if num_workers is not None and not self.use_torchdata and log is not None:
            log("data: torchdata is not installed: batches are built inline in the training loop, without worker "
                "processes or prefetch (pip install torchdata)")
        self.num_workers = int(num_workers or 0) if self.use_torchdata else 0
        self.prefetch_factor = int(prefetch_factor)
        self.identity = dict(identity)
        if not isinstance(dataset, MapBatches):  # a stream's order depends on how its shards split over workers
            self.identity["num_workers"] = self.num_workers
        self._start = 0  # sample position of the loader's first batch
        self._batches = 0  # batches yielded since then
        self._loader, self._iter = None, None
        self._closed = False

    # ------------------------------------------------------------------ iteration
    def _build(self, torchdata_state: dict | None = None) -> None:
        self._iter = None
        if not self.use_torchdata:
            if isinstance(self.dataset, MapBatches):
                self._loader = (self.dataset[p] for p in _Positions(self._start, self.batch_size))
            else:
                self._loader = iter(self.dataset)
            return
        from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: PLC0415 - optional dependency

        kw: dict[str, Any] = {"batch_size": None, "num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if isinstance(self.dataset, MapBatches):
            kw["sampler"] = _Positions(self._start, self.batch_size)
        if self.num_workers:
            # persistent_workers: the loader is infinite, so workers are never restarted anyway; kept explicit.
            kw.update(prefetch_factor=self.prefetch_factor, persistent_workers=True)
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API (set_vital)
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self._loader = StatefulDataLoader(self.dataset, **kw)
        if torchdata_state is not None:
            self._loader.load_state_dict(torchdata_state)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        self._check_open()
        if self._loader is None:
            self._build()
        if self._iter is None:
            with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API on each iter()
                warnings.filterwarnings("ignore", message=".*set_vital.*")
                self._iter = iter(self._loader)
        batch = next(self._iter)
        self._batches += 1
        if self.pin_memory and not self.use_torchdata:  # torchdata pins in its own thread
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch

    def close(self) -> None:
        """Stop the worker processes now (the trainer calls this when a run ends, however it ends).

        Otherwise the torchdata iterator is freed only by the cycle collector once the trainer's objects are garbage:
        the collector first stops its index queues' feeder threads, so its own shutdown then waits out a 5 s join per
        worker. A closed loader yields no more batches and has no state to save."""
        it, self._iter = self._iter, None
        # torch's multiprocessing iterator has it (torchdata's subclasses it); the inline loader has no workers
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._loader = None  # persistent workers: the loader keeps its own reference to the iterator
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this data loader was closed (its worker processes are stopped): build a new one "
                               "with nsa_titan.data.build_dataloader, and take state_dict() before close() to resume")

    # ------------------------------------------------------------------ state
    @property
    def position(self) -> int:
        """Rank-local index of the next sample."""
        return self._start + self._batches * self.batch_size

    @property
    def epoch(self) -> int:
        return self.dataset.epoch_of(self.position)

    def state_dict(self) -> dict[str, Any]:
        """JSON: the stream's identity, the position, and the resumable state of whichever loader runs."""
        self._check_open()
        state = {**self.identity, "sample_index": self.position, "epoch": self.epoch, "start": self._start,
                 "torchdata": None, "stream": None}
        if self.use_torchdata and self._loader is not None:
            state["torchdata"] = self._loader.state_dict()
        elif not isinstance(self.dataset, MapBatches):
            state["stream"] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_open()
        # A state from a different stream would silently yield other data: refuse it.
        for key in _IDENTITY:
            if key in state and key in self.identity and state[key] != self.identity[key]:
                hint = ("data.num_workers" if key == "num_workers" else
                        "the same data config, seed, seq_len and world size")
                raise ValueError(f"loader state was saved with {key}={state[key]!r} but this loader has "
                                 f"{key}={self.identity[key]!r}; resume with {hint}")
        td, stream = state.get("torchdata"), state.get("stream")
        if not isinstance(self.dataset, MapBatches) and td is None and stream is None:
            # A state without the stream's own (resharded to another world size, or saved inline with workers):
            # a stream cannot seek by sample count.
            raise ValueError("loader state has no position inside the streamed dataset (it was saved on another "
                             "number of ranks, or with/without torchdata); resume with the same data.num_workers, "
                             "ranks and packages, or start a fresh run")
        if td is not None and not self.use_torchdata:
            if isinstance(self.dataset, MapBatches):
                td = None  # the position alone resumes an in-memory corpus
            else:
                raise ValueError("this loader state was saved by torchdata's StatefulDataLoader, which is not "
                                 "installed here: pip install torchdata, then resume")
        self._start = int(state.get("start", state["sample_index"])) if td is not None else int(state["sample_index"])
        self._batches = (int(state["sample_index"]) - self._start) // self.batch_size
        if stream is not None and not self.use_torchdata:
            self.dataset.load_state_dict(stream)
        elif stream is not None and td is None:  # saved inline (0 workers), resumed through torchdata in-process
            if self.num_workers:
                raise ValueError("this loader state was saved without worker processes; resume with "
                                 "--data.num_workers 0 or start a fresh run")
            self.dataset.load_state_dict(stream)
        self._build(td)

    def reset(self) -> None:
        """Back to the first batch (e.g. to evaluate the val split identically every time)."""
        self._start, self._batches = 0, 0
        if not isinstance(self.dataset, MapBatches):
            self.dataset.load_state_dict(self.dataset._fresh())
        self._build()
