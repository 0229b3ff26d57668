"""Packing a document stream into batches, resumable mid-document: the loader dataset of ``data.dataset = "hf"``.

``PackedStream`` is a ``torch.utils.data.IterableDataset``: in each loader worker (or in the training
process) it pulls this rank's documents from an ``HFSource``, tokenizes them there, packs them with EOS
between documents into chunks of ``seq_len + 1`` tokens and yields whole batches. With W workers,
``datasets`` gives each worker its own shards, and worker w builds the rank's batches w, w + W, ...; the
loader yields them round-robin, so the order is fixed by (data, seed, ranks, workers).

State (``state_dict``), per worker: the epoch, the batches built, and where the current document starts:
the dataset's own ``state_dict()`` taken just before that document was pulled, plus how many of its tokens
are already packed. The tokens left over after a chunk always come from the last document pulled (a
document is only pulled while fewer than a chunk's tokens are buffered), so these two numbers restore the
buffer exactly: a resume re-reads that one document and continues mid-document, mid-shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .hf_source import HFSource
from .loader import BatchAssembler

__all__ = ["PackedStream"]


class PackedStream(torch.utils.data.IterableDataset):
    def __init__(self, source: HFSource, tokenizer, assembler: BatchAssembler):
        self.source, self.tok, self.assembler = source, tokenizer, assembler
        self.chunk_len = assembler.seq_len + 1
        self._pending: dict[str, Any] | None = None  # a loaded state, applied when iteration (re)starts
        self._state: dict[str, Any] = self._fresh()

    @staticmethod
    def _fresh() -> dict[str, Any]:
        # in_doc: a document has been pulled this epoch; doc_state: the dataset's state just before it (None:
        # it was the epoch's first); offset: its tokens already packed.
        return {"epoch": 0, "batches": 0, "in_doc": False, "doc_state": None, "offset": 0}

    # ------------------------------------------------------------------ torchdata's Stateful protocol
    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state)
        self._state = dict(state)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        state = self._pending or self._fresh()
        self._pending = None
        self._state = dict(state)
        self._buf = np.zeros(0, np.int64)
        self._open(state["epoch"], state["doc_state"])
        if state["in_doc"]:  # re-read the document the saved buffer came from
            self._pull()
            self._buf = self._buf[state["offset"]:]
            self._state["offset"] = state["offset"]
        asm, b = self.assembler, self.assembler.batch_size
        while True:
            k = self._state["batches"] * workers + worker  # this rank's batch index
            local = np.arange(k * b, (k + 1) * b, dtype=np.int64)
            is_ret = asm.is_retrieval(local)
            rows = np.stack([self._take() for _ in range(int((~is_ret).sum()))]) if (~is_ret).any() else None
            batch = asm.assemble(local, is_ret, rows)
            self._state["batches"] += 1  # before the yield: torchdata reads the state right after it
            yield batch

    def _open(self, epoch: int, doc_state: dict | None) -> None:
        ds = self.source.open(epoch)
        if doc_state is not None:
            ds.load_state_dict(doc_state)
        self._ds, self._it, self._epoch_docs = ds, iter(ds), 0
        # A dataset's state_dict() is defined once its iterator has started: the state before the first
        # example pulled after opening is the one it was opened from (None: the start of the epoch).
        self._opened_from, self._started = doc_state, False
        self._state.update(epoch=epoch, in_doc=False, doc_state=None, offset=0)

    def _pull(self) -> None:
        """Append the next document (and its EOS) of this worker's shards to the buffer; next epoch at the end."""
        while True:
            before = self._ds.state_dict() if self._started else self._opened_from  # where this document starts
            try:
                example = next(self._it)
                self._started = True
            except StopIteration:
                if self._epoch_docs == 0:
                    raise ValueError(f"data.path: {self.source.path!r} yielded no text for this rank/worker; check "
                                     "data.path, data.hf_split and data.hf_text_field, or lower "
                                     "data.num_workers") from None
                self._open(self._state["epoch"] + 1, None)
                continue
            data = self.source.text_of(example)
            if data is None:
                continue
            self._epoch_docs += 1
            ids = np.asarray(self.tok.encode_batch([data])[0], np.int64)
            if len(ids) and (int(ids.max()) >= self.tok.vocab_size or int(ids.min()) < 0):
                raise ValueError(f"data.tokenizer produced an id outside its vocab_size {self.tok.vocab_size}")
            self._buf = np.concatenate([self._buf, ids, np.array([self.tok.eos_id], np.int64)])
            self._state.update(in_doc=True, doc_state=before, offset=0)
            self._doc_len = len(ids) + 1
            return

    def _take(self) -> np.ndarray:
        while len(self._buf) < self.chunk_len:
            self._pull()
        chunk, self._buf = self._buf[:self.chunk_len], self._buf[self.chunk_len:]
        self._state["offset"] = self._doc_len - len(self._buf)
        return chunk

    def epoch_of(self, position: int) -> int:
        return int(self._state["epoch"])

    @property
    def chunks_per_rank(self) -> None:
        return None  # unknown for a stream
