"""In-memory packing with per-rank sharding, and the batch layout every data path shares.

Everything a batch contains is a pure function of (seed, split, rank, world_size,
sample position): document order of epoch e comes from ``default_rng([seed, e])``,
retrieval mixing from a counter-based hash of the global sample index, retrieval samples
from ``default_rng([seed, stream, index])``. The loader's whole state is therefore its
sample position (epoch is derived from it); no RNG object needs saving, and a resumed
loader reproduces exactly the batches the original would have produced.

Sharding: ``build_dataloader`` gives each rank its own documents (every W-th file, read and tokenized by
that rank only) and a PackedTextDataset of rank 0 of 1 over them, so no rank holds the whole corpus. The
class can also deal one corpus's chunks round-robin (rank r of W owns chunks i with ``i % W == r``, the same
number per rank; the < W leftover chunks and the < seq_len+1 tail tokens are dropped).
"""

from __future__ import annotations

import numpy as np
import torch

from .corpus import TokenCorpus
from .retrieval import IGNORE_INDEX, RetrievalTask

__all__ = ["BatchAssembler", "MapBatches", "PackedTextDataset"]

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


class BatchAssembler:
    """Turns rank-local sample positions into a batch ``{"input", "labels", "is_retrieval"}``.

    input: LongTensor [B, T]; labels: LongTensor [B, T], next-token targets with -100 where no loss applies
    (everything but the answer in retrieval rows); is_retrieval: BoolTensor [B]. Sample k of this rank is a
    retrieval sample when ``retrieval_mix``'s coin for its global index (k * world_size + rank) says so; its
    text chunk is then not taken, which keeps positions (and resume) independent of earlier coins. Pure: the
    same positions and text rows give the same batch in any process (loader workers included).
    """

    def __init__(self, retrieval: RetrievalTask | None, *, seq_len: int, batch_size: int, retrieval_mix: float,
                 seed: int, rank: int, world_size: int, split: str, has_text: bool):
        self.retrieval = retrieval
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.retrieval_mix = 1.0 if not has_text else float(retrieval_mix)
        self.seed, self.rank, self.world_size, self.split = int(seed), int(rank), int(world_size), split

    def is_retrieval(self, local: np.ndarray) -> np.ndarray:
        if self.retrieval_mix >= 1.0:
            return np.ones(len(local), bool)
        if self.retrieval_mix <= 0.0 or self.retrieval is None:
            return np.zeros(len(local), bool)
        stream = 1 if self.split == "val" else 0
        return _uniform(self.seed, 100 + stream, local * self.world_size + self.rank) < self.retrieval_mix

    def assemble(self, local: np.ndarray, is_ret: np.ndarray, text_rows: np.ndarray | None) -> dict[str, torch.Tensor]:
        """``text_rows``: [(~is_ret).sum(), seq_len + 1] token chunks for the text rows, in order."""
        gid = local * self.world_size + self.rank
        tokens = np.empty((len(local), self.seq_len + 1), np.int64)
        labels_keep = np.ones((len(local), self.seq_len), bool)
        if (~is_ret).any():
            tokens[~is_ret] = text_rows
        if is_ret.any():
            toks, answer = self.retrieval.batch(gid[is_ret])
            tokens[is_ret] = toks
            labels_keep[is_ret] = answer[:, 1:]  # label t predicts token t+1
        inp = torch.from_numpy(np.ascontiguousarray(tokens[:, :-1]))
        labels = torch.from_numpy(np.where(labels_keep, tokens[:, 1:], IGNORE_INDEX))
        return {"input": inp, "labels": labels, "is_retrieval": torch.from_numpy(is_ret)}


class MapBatches(torch.utils.data.Dataset):
    """Random access to the batches of an in-memory corpus: ``self[pos]`` is the batch of the ``batch_size``
    samples at rank-local positions pos, pos + 1, ... (a pure function of pos, so loader workers can build
    batches in any order and the loader yields them in order)."""

    def __init__(self, text: PackedTextDataset | None, assembler: BatchAssembler):
        self.text, self.assembler = text, assembler

    def __len__(self) -> int:  # the loader is infinite; the sampler, not len(), bounds it
        return 1 << 62

    def __getitem__(self, pos: int) -> dict[str, torch.Tensor]:
        local = np.arange(int(pos), int(pos) + self.assembler.batch_size, dtype=np.int64)
        is_ret = self.assembler.is_retrieval(local)
        rows = self.text.samples(local[~is_ret]) if (~is_ret).any() else None
        return self.assembler.assemble(local, is_ret, rows)

    def epoch_of(self, position: int) -> int:
        return 0 if self.text is None else self.text.epoch_of(position)

    @property
    def chunks_per_rank(self) -> int | None:
        return None if self.text is None else self.text.chunks_per_rank
