"""Synthetic long-range key-value retrieval task.

Layout of one sample (exactly ``seq_len + 1`` tokens)::

    [BOS] k1 SEP v1 ; k2 SEP v2 ; ... kN SEP vN \\n  <filler ...>  \\nQUERY ki SEP vi [EOS]

All pairs sit at the start and the query at the very end, so answering needs attention
across (almost) the whole sequence -- exactly what NSA's compressed/selected branches
must deliver and a sliding window alone cannot. Only the answer tokens ``vi`` carry
labels; everything else is -100, so the loss measures retrieval and nothing else.

Each sample is a pure function of (seed, index): a fresh ``np.random.default_rng`` is
seeded from both, so samples can be produced in any order, on any rank, after a resume.
"""

from __future__ import annotations

import numpy as np
import torch

from .tokenizer import ByteTokenizer

__all__ = ["IGNORE_INDEX", "QUERY_MARKER", "RetrievalTask", "retrieval_accuracy"]

IGNORE_INDEX = -100
QUERY_MARKER = "\nQUERY "
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
_FILLER_CHARS = "abcdefghijklmnopqrstuvwxyz      \n"  # spaces repeated so "words" have ~5 letters


class RetrievalTask:
    """Generates retrieval samples; ``sample(i)`` -> (tokens [seq_len+1], answer_mask [seq_len+1])."""

    def __init__(self, tokenizer, seq_len: int, *, num_pairs: int = 16, key_len: int = 4, value_len: int = 4,
                 seed: int = 0, stream: int = 0, filler_tokens: np.ndarray | None = None,
                 filler_eos_id: int | None = None):
        if num_pairs < 1 or key_len < 1 or value_len < 1:
            raise ValueError(
                f"data.retrieval_num_pairs/key_len/value_len must all be >= 1, got "
                f"{num_pairs}/{key_len}/{value_len}"
            )
        if 26 ** key_len < num_pairs:
            raise ValueError(
                f"data.retrieval_key_len={key_len} allows only {26 ** key_len} distinct keys but "
                f"data.retrieval_num_pairs={num_pairs}; raise retrieval_key_len"
            )
        self.tok = tokenizer
        self.seq_len = int(seq_len)
        self.num_pairs, self.key_len, self.value_len = int(num_pairs), int(key_len), int(value_len)
        # stream separates train (0) from val (1) samples drawn with the same seed.
        self.seed, self.stream = int(seed) & ((1 << 64) - 1), int(stream)
        self._byte_level = isinstance(tokenizer, ByteTokenizer)
        enc = self._encode
        self.bos, self.eos = int(tokenizer.bos_id), int(tokenizer.eos_id)
        # Tokenizers without a separator token (HF) get a visible ":" instead (EOS if even
        # that encodes to nothing: the separator must exist to delimit the answer).
        self.sep = np.array([tokenizer.sep_id], np.int64) if tokenizer.sep_id is not None else enc(":")
        if len(self.sep) == 0:
            self.sep = np.array([self.eos], np.int64)
        self.pair_delim = enc(" ; ")
        self.newline = enc("\n")
        self.query = enc(QUERY_MARKER)
        # Whitespace pre-tokenizers encode " " or "\n" to nothing; keep the characters that do encode.
        alphabet = [ids[0] for ids in (enc(c) for c in _FILLER_CHARS) if len(ids)]
        self._alphabet = np.array(alphabet or [self.eos], np.int64)
        self._eos_sub = int(self.newline[0]) if len(self.newline) else int(self._alphabet[0])
        if filler_tokens is not None and len(filler_tokens) == 0:
            filler_tokens = None
        self.filler_tokens = filler_tokens
        self.filler_eos_id = filler_eos_id
        # Worst-case length check up front (HF tokens per letter vary, so bytes give the bound
        # only for the byte tokenizer; others are re-checked per sample).
        fixed = 1 + num_pairs * (key_len + value_len + len(self.sep) + len(self.pair_delim))
        fixed += len(self.newline) + len(self.query) + key_len + len(self.sep) + value_len + 1
        if self._byte_level and fixed > self.seq_len + 1:
            raise ValueError(
                f"retrieval sample needs {fixed} tokens without filler but training.seq_len + 1 = "
                f"{self.seq_len + 1}; raise training.seq_len or lower data.retrieval_num_pairs"
            )

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text), dtype=np.int64)

    def _strings(self, rng: np.random.Generator, n: int, length: int, unique: bool) -> np.ndarray:
        """[n, length] uint8 letter codes; rows distinct when ``unique`` (so a query is unambiguous)."""
        for _ in range(1000):
            s = _LETTERS[rng.integers(0, 26, size=(n, length))]
            if not unique or len(np.unique(s, axis=0)) == n:
                return s
        raise ValueError("could not draw distinct retrieval keys; raise data.retrieval_key_len")

    def _tokens_of(self, letters: np.ndarray) -> list[np.ndarray]:
        if self._byte_level:
            return list(letters.astype(np.int64))  # letters are their own byte ids
        return [self._encode(row.tobytes().decode("ascii")) for row in letters]

    def _filler(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if n <= 0:
            return np.zeros(0, np.int64)
        if self.filler_tokens is None:
            return self._alphabet[rng.integers(0, len(self._alphabet), size=n)]
        src = self.filler_tokens
        if len(src) >= n:
            start = int(rng.integers(0, len(src) - n + 1))
            out = src[start:start + n].astype(np.int64)
        else:
            out = np.resize(src, n).astype(np.int64)  # tiny corpus: cycle it
        if self.filler_eos_id is not None:
            # Document boundaries inside the filler would teach "forget everything at EOS",
            # the opposite of what this task trains; turn them into newlines.
            out[out == self.filler_eos_id] = self._eos_sub
        return out

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [seq_len+1] int64 and a bool mask [seq_len+1] marking the answer tokens."""
        rng = np.random.default_rng([self.seed, self.stream, int(index)])
        keys = self._tokens_of(self._strings(rng, self.num_pairs, self.key_len, unique=True))
        vals = self._tokens_of(self._strings(rng, self.num_pairs, self.value_len, unique=False))
        q = int(rng.integers(0, self.num_pairs))
        head = [np.array([self.bos], np.int64)]
        for i in range(self.num_pairs):
            head += [keys[i], self.sep, vals[i]]
            head.append(self.pair_delim if i + 1 < self.num_pairs else self.newline)
        head = np.concatenate(head)
        answer = vals[q]
        tail = np.concatenate([self.query, keys[q], self.sep, answer, np.array([self.eos], np.int64)])
        n_fill = self.seq_len + 1 - len(head) - len(tail)
        if n_fill < 0:
            raise ValueError(
                f"retrieval sample needs {len(head) + len(tail)} tokens without filler but training.seq_len + 1 = "
                f"{self.seq_len + 1}; raise training.seq_len or lower data.retrieval_num_pairs"
            )
        tokens = np.concatenate([head, self._filler(rng, n_fill), tail])
        mask = np.zeros(self.seq_len + 1, dtype=bool)
        end = self.seq_len  # position of EOS; the answer sits right before it
        mask[end - len(answer):end] = True
        return tokens, mask

    def batch(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Stacked samples: tokens [n, seq_len+1] int64, answer mask [n, seq_len+1] bool."""
        pairs = [self.sample(int(i)) for i in indices]
        if not pairs:
            return np.zeros((0, self.seq_len + 1), np.int64), np.zeros((0, self.seq_len + 1), bool)
        return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def retrieval_accuracy(logits: torch.Tensor, labels: torch.Tensor,
                       is_retrieval: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct_samples, total_samples) as 0-dim int64 tensors on ``logits.device``.

    A sample is correct when the argmax at every answer position (label != -100) equals
    the label. Which rows are retrieval samples comes from ``is_retrieval`` ([B] bool, the
    batch's "is_retrieval" entry) or, when None, is inferred: a retrieval row has both
    ignored and non-ignored labels (packed text rows have no ignored labels at all).
    Stays on device (no .item()) so callers can accumulate without a host sync.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B, T, V] and labels [B, T], got {tuple(logits.shape)} and {tuple(labels.shape)}")
    valid = labels != IGNORE_INDEX
    if is_retrieval is None:
        is_retrieval = valid.any(-1) & (~valid).any(-1)
    is_retrieval = is_retrieval.to(device=labels.device, dtype=torch.bool) & valid.any(-1)
    hit = (logits.argmax(-1) == labels) | ~valid
    correct = (hit.all(-1) & is_retrieval).sum()
    return correct, is_retrieval.sum()
