"""Packing data loader with per-rank sharding and exact resume.

Everything a batch contains is a pure function of (seed, split, rank, world_size,
sample position): document order of epoch e comes from ``default_rng([seed, e])``,
retrieval mixing from a counter-based hash of the global sample index, retrieval samples
from ``default_rng([seed, stream, index])``. The loader's whole state is therefore its
sample position (epoch is derived from it); no RNG object needs saving, and a resumed
loader reproduces exactly the batches the original would have produced.

Sharding: the packed stream of an epoch is cut into chunks of ``seq_len + 1`` tokens;
rank r of W owns chunks i with ``i % W == r``. Every rank gets the same number of chunks
per epoch (the < W leftover chunks and the < seq_len+1 tail tokens are dropped), so ranks
stay in lockstep and never hang a collective at an epoch boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from .corpus import TokenCorpus
from .retrieval import IGNORE_INDEX, RetrievalTask

__all__ = ["PackedTextDataset", "StatefulLoader", "StreamingPackedDataset"]

_M64 = (1 << 64) - 1


def _u64(x: int) -> int:
    """Any Python int (e.g. a negative seed) -> a valid non-negative SeedSequence entropy."""
    return int(x) & _M64


def _uniform(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """Counter-based U[0,1) per index (splitmix64): vectorised and independent of call order."""
    with np.errstate(over="ignore"):
        x = np.asarray(index, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= np.uint64(_u64(seed * 0xD1B54A32D192ED03 + stream * 0x8CB92BA72F3D8DD7))
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class PackedTextDataset:
    """Random access to one rank's fixed-length chunks of an in-memory token corpus.

    ``samples(idx)`` maps rank-local sample positions (any epoch) to token chunks
    ``[n, seq_len + 1]``. With ``shuffle`` the document order and this rank's chunk visiting
    order are re-drawn every epoch; without it (val) both are the identity, so the val
    split is read in a fixed order and cycles forever.
    """

    def __init__(self, corpus: TokenCorpus, seq_len: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 42, shuffle: bool = True):
        self.corpus = corpus
        self.seq_len = int(seq_len)
        self.chunk_len = self.seq_len + 1
        self.rank, self.world_size = int(rank), int(world_size)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.num_chunks = corpus.num_tokens // self.chunk_len  # per epoch, all ranks together
        self.chunks_per_rank = self.num_chunks // self.world_size
        if self.chunks_per_rank == 0:
            raise ValueError(
                f"corpus has {corpus.num_tokens} tokens, fewer than one chunk of seq_len + 1 = {self.chunk_len} "
                f"per rank for {self.world_size} rank(s); use more text (data.path / data.val_fraction) "
                "or a smaller training.seq_len"
            )
        self._layout: tuple | None = None  # last epoch's layout; batches rarely straddle epochs

    def epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(doc_order, stream end offset of each ordered doc, this rank's chunk visiting order)."""
        if self._layout is not None and self._layout[0] == epoch:
            return self._layout[1:]
        if self.shuffle:
            rng = np.random.default_rng([_u64(self.seed), int(epoch)])
            doc_order = rng.permutation(self.corpus.num_docs)
            # Same permutation on every rank (same seed): ranks keep disjoint residues mod W.
            chunk_order = rng.permutation(self.chunks_per_rank)
        else:
            doc_order = np.arange(self.corpus.num_docs)
            chunk_order = np.arange(self.chunks_per_rank)
        ends = np.cumsum(self.corpus.doc_lens[doc_order])
        self._layout = (epoch, doc_order, ends, chunk_order)
        return doc_order, ends, chunk_order

    def epoch_stream(self, epoch: int) -> np.ndarray:
        """The whole packed stream of an epoch (for inspection/tests; training never builds it)."""
        doc_order, _, _ = self.epoch_layout(epoch)
        c = self.corpus
        return np.concatenate([c.tokens[c.doc_starts[d]:c.doc_starts[d] + c.doc_lens[d]] for d in doc_order])

    def chunk_ids(self, epoch: int, local: np.ndarray) -> np.ndarray:
        """Stream chunk index i (i % world_size == rank) of rank-local positions within an epoch."""
        _, _, chunk_order = self.epoch_layout(epoch)
        return chunk_order[np.asarray(local, dtype=np.int64)] * self.world_size + self.rank

    def stream_chunks(self, epoch: int, chunk_ids: np.ndarray) -> np.ndarray:
        """Chunks [n, seq_len+1] of the epoch's packed stream, gathered without building it."""
        doc_order, ends, _ = self.epoch_layout(epoch)
        pos = np.asarray(chunk_ids, dtype=np.int64)[:, None] * self.chunk_len + np.arange(self.chunk_len)
        k = np.searchsorted(ends, pos, side="right")  # which ordered document holds each position
        doc = doc_order[k]
        src = self.corpus.doc_starts[doc] + (pos - (ends[k] - self.corpus.doc_lens[doc]))
        return self.corpus.tokens[src]

    def samples(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        epochs, local = np.divmod(indices, self.chunks_per_rank)
        out = np.empty((len(indices), self.chunk_len), dtype=self.corpus.tokens.dtype)
        for e in np.unique(epochs).tolist():  # host sync ok: numpy host data
            m = epochs == e
            out[m] = self.stream_chunks(e, self.chunk_ids(e, local[m]))
        return out

    def epoch_of(self, position: int) -> int:
        return int(position) // self.chunks_per_rank


class StreamingPackedDataset:
    """Sequential packing of a document stream too large to hold (HF ``streaming=True``).

    ``doc_factory(epoch)`` returns that epoch's documents; the stream simply continues into
    the next epoch when one ends (no dropped tail). Random access is emulated: asking for a
    position behind the cursor replays the stream from the start, so resume costs time
    proportional to the position (exact, but slow for huge positions).
    """

    def __init__(self, doc_factory: Callable[[int], Iterable[bytes]], tokenizer, seq_len: int, *,
                 rank: int = 0, world_size: int = 1, docs_per_read: int = 64):
        self.doc_factory, self.tok = doc_factory, tokenizer
        self.chunk_len = int(seq_len) + 1
        self.rank, self.world_size = int(rank), int(world_size)
        self.docs_per_read = docs_per_read
        self.chunks_per_rank = None  # unknown for a stream
        self._restart()

    def _restart(self) -> None:
        self.epoch = 0
        self._docs = iter(self.doc_factory(0))
        self._epoch_tokens = 0
        self._buf = np.zeros(0, np.int64)
        self._next_chunk = 0  # global chunk index (all ranks) the buffer head corresponds to

    def _fill(self) -> None:
        pieces = [self._buf]
        have = len(self._buf)
        while have < self.chunk_len:
            docs = []
            for d in self._docs:
                docs.append(d)
                if len(docs) == self.docs_per_read:
                    break
            if not docs:  # epoch exhausted: continue with the next one
                if self._epoch_tokens == 0:
                    raise ValueError("data.path: the HF dataset yielded no text; check data.path, "
                                     "data.hf_split and data.hf_text_field")
                self.epoch += 1
                self._epoch_tokens = 0
                self._docs = iter(self.doc_factory(self.epoch))
                continue
            for ids in self.tok.encode_batch(docs):
                if len(ids) and (int(np.max(ids)) >= self.tok.vocab_size or int(np.min(ids)) < 0):
                    raise ValueError(f"data.tokenizer produced an id outside its vocab_size {self.tok.vocab_size}")
                pieces += [np.asarray(ids, np.int64), np.array([self.tok.eos_id], np.int64)]
                have += len(ids) + 1
                self._epoch_tokens += len(ids) + 1
        self._buf = np.concatenate(pieces)

    def _take(self) -> np.ndarray:
        self._fill()
        chunk, self._buf = self._buf[:self.chunk_len], self._buf[self.chunk_len:]
        self._next_chunk += 1
        return chunk

    def samples(self, indices: np.ndarray) -> np.ndarray:
        out = []
        for g in np.asarray(indices, dtype=np.int64).tolist():  # host sync ok: numpy host data
            target = g * self.world_size + self.rank
            if target < self._next_chunk:
                self._restart()
            while self._next_chunk < target:
                self._take()
            out.append(self._take())
        return np.stack(out) if out else np.zeros((0, self.chunk_len), np.int64)

    def epoch_of(self, position: int) -> int:
        return self.epoch


class StatefulLoader:
    """Infinite iterator of batches ``{"input", "labels", "is_retrieval"}`` with exact resume.

    input: LongTensor [B, T]; labels: LongTensor [B, T], next-token targets with -100
    where no loss applies (everything but the answer in retrieval rows); is_retrieval:
    BoolTensor [B]. Sample k of this rank's stream is retrieval when ``retrieval_mix``'s
    coin for its global index (k * world_size + rank) says so; that sample's text chunk
    is then skipped, which keeps positions (and resume) independent of earlier coins.
    """

    def __init__(self, text, retrieval: RetrievalTask | None, *, seq_len: int, batch_size: int,
                 retrieval_mix: float = 0.0, seed: int = 42, rank: int = 0, world_size: int = 1,
                 split: str = "train", pin_memory: bool | None = None):
        if text is None and retrieval is None:
            raise ValueError("StatefulLoader needs a text source, a retrieval task, or both")
        self.text, self.retrieval = text, retrieval
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.retrieval_mix = 1.0 if text is None else float(retrieval_mix)
        self.seed, self.rank, self.world_size, self.split = int(seed), int(rank), int(world_size), split
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._pos = 0  # rank-local index of the next sample

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        local = np.arange(self._pos, self._pos + self.batch_size, dtype=np.int64)
        self._pos += self.batch_size
        gid = local * self.world_size + self.rank
        stream = 1 if self.split == "val" else 0
        if self.retrieval_mix >= 1.0:
            is_ret = np.ones(len(local), bool)
        elif self.retrieval_mix <= 0.0 or self.retrieval is None:
            is_ret = np.zeros(len(local), bool)
        else:
            is_ret = _uniform(self.seed, 100 + stream, gid) < self.retrieval_mix
        tokens = np.empty((len(local), self.seq_len + 1), np.int64)
        labels_keep = np.ones((len(local), self.seq_len), bool)
        if (~is_ret).any():
            tokens[~is_ret] = self.text.samples(local[~is_ret])
        if is_ret.any():
            toks, answer = self.retrieval.batch(gid[is_ret])
            tokens[is_ret] = toks
            labels_keep[is_ret] = answer[:, 1:]  # label t predicts token t+1
        inp = torch.from_numpy(np.ascontiguousarray(tokens[:, :-1]))
        labels = torch.from_numpy(np.where(labels_keep, tokens[:, 1:], IGNORE_INDEX))
        batch = {"input": inp, "labels": labels, "is_retrieval": torch.from_numpy(is_ret)}
        if self.pin_memory:  # pinned host memory lets .to(device, non_blocking=True) overlap compute
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch

    @property
    def epoch(self) -> int:
        return 0 if self.text is None else self.text.epoch_of(self._pos)

    def state_dict(self) -> dict:
        """Position plus the identity of the stream; RNG state is a function of these."""
        return {
            "sample_index": self._pos,
            "epoch": self.epoch,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "seq_len": self.seq_len,
            "split": self.split,
            "retrieval_mix": self.retrieval_mix,
            "chunks_per_rank": None if self.text is None else self.text.chunks_per_rank,
        }

    def load_state_dict(self, state: dict) -> None:
        # A state from a different stream would silently yield other data: refuse it.
        mine = self.state_dict()
        for key in ("seed", "rank", "world_size", "seq_len", "split", "retrieval_mix", "chunks_per_rank"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"loader state was saved with {key}={state[key]!r} but this loader has {key}={mine[key]!r}; "
                    "resume with the same data config, seed, seq_len and world size"
                )
        self._pos = int(state["sample_index"])

    def reset(self) -> None:
        """Back to the first batch (e.g. to evaluate the val split identically every time)."""
        self._pos = 0
