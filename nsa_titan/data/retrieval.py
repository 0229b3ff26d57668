"""Synthetic long-range retrieval: multi-query associative recall (MQAR) over distractor text.

Layout of one sample (exactly ``seq_len + 1`` tokens; K = key tokens, v = value tokens)::

    [BOS] filler K1 v1 filler K2 v2 ... filler KN vN filler (>= min_gap tokens) Ka va Kb vb ... Kz vz
          '--------------- pair region ---------------'                         '-- M queries --'

N key-value pairs sit at random places of the pair region, between slices of distractor text (the corpus, or
random letters). After at least ``min_gap`` filler tokens come M queries, each repeating the key of a
different pair followed by its value; the sample ends with the last query's value. Every value token of every
query is supervised (``answer_mask``) and nothing else is, so the loss measures retrieval only, with M x V
answer tokens per sample (the single-query layout this replaced had 4 per 4k-token sample: too little signal
for any model to learn from).

Why it needs long-range attention: the gap between the last pair and the first query is at least ``min_gap``
tokens (the trainer's default: the model's sliding window w), so no queried pair lies within the window of
its query. Keys are unique in a sample, so every answer is determined. Keys are uppercase letters and values
digits, each a single token for the usual tokenizers; the filler's uppercase letters are lowercased and its
digits replaced, so a key or value occurs only where the task put it (a filler "key" would be a false match
that no model could resolve). No markers or separators: the two alphabets delimit pairs and queries, and
every token spent on markers would be a token without supervision.

Each sample is a pure function of (seed, stream, index): a fresh ``np.random.default_rng`` is seeded from
them, so samples can be produced in any order, on any rank, after a resume.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["IGNORE_INDEX", "RetrievalLayout", "RetrievalTask", "query_correct", "retrieval_accuracy",
           "shortcut_accuracy"]

IGNORE_INDEX = -100
_FILLER_CHARS = "abcdefghijklmnopqrstuvwxyz      \n"  # spaces repeated so "words" have ~5 letters


@dataclass
class RetrievalLayout:
    """Where the queries of one sample are: arrays of length M (number of queries), token positions."""

    answer_pos: np.ndarray  # first value token of each query
    pair_value_pos: np.ndarray  # first value token of the pair each query asks for
    depth: np.ndarray  # that pair's place in the pair region: 0 = its start, 1 = its end (nearest the queries)


def _single_token_ids(tokenizer, chars: str) -> np.ndarray:
    """Distinct ids of the characters that encode to exactly one token (HF tokenizers may merge or drop some)."""
    ids = [tokenizer.encode(c) for c in chars]
    return np.unique(np.array([i[0] for i in ids if len(i) == 1], np.int64))


class RetrievalTask:
    """Generates MQAR samples: ``sample(i)`` -> (tokens [seq_len+1] int64, answer_mask [seq_len+1] bool)."""

    def __init__(self, tokenizer, seq_len: int, *, num_pairs: int = 16, num_queries: int = 16, key_len: int = 1,
                 value_len: int = 1, min_gap: int = 64, seed: int = 0, stream: int = 0,
                 filler_tokens: np.ndarray | None = None, filler_eos_id: int | None = None,
                 queries: str = "distinct", unique_values: bool = False, curriculum_samples: int = 0):
        if min(num_pairs, num_queries, key_len, value_len) < 1 or min_gap < 0:
            raise ValueError(f"data.retrieval_num_pairs/num_queries/key_len/value_len must be >= 1 and "
                             f"data.retrieval_min_gap >= 0, got {num_pairs}/{num_queries}/{key_len}/{value_len} "
                             f"and {min_gap}")
        if queries not in ("distinct", "repeat"):
            raise ValueError(f"data.retrieval_queries must be 'distinct' or 'repeat', got {queries!r}")
        if queries == "distinct" and num_queries > num_pairs:
            raise ValueError(f"data.retrieval_num_queries={num_queries} > data.retrieval_num_pairs={num_pairs}: each "
                             "query asks for a different pair; lower num_queries or raise num_pairs")
        self.tok = tokenizer
        self.seq_len = int(seq_len)
        self.num_pairs, self.num_queries = int(num_pairs), int(num_queries)
        self.key_len, self.value_len, self.min_gap = int(key_len), int(value_len), int(min_gap)
        self.queries, self.unique_values = queries, bool(unique_values)
        if curriculum_samples < 0:
            raise ValueError(f"data.retrieval_curriculum_steps must be >= 0, got {curriculum_samples} samples")
        # Training stream only: sample i places its pairs in the last (i + 1) / curriculum_samples of the free
        # filler before the gap (data.retrieval_curriculum_steps); from then on, the whole region.
        self.curriculum_samples = int(curriculum_samples) if stream == 0 else 0
        # stream separates train (0) from val (1) and evaluation (2) samples drawn with the same seed.
        self.seed, self.stream = int(seed) & ((1 << 64) - 1), int(stream)
        self.key_alphabet = _single_token_ids(tokenizer, string.ascii_uppercase)
        self.value_alphabet = _single_token_ids(tokenizer, string.digits)
        if len(self.key_alphabet) < 2 or len(self.value_alphabet) < 2:
            raise ValueError(f"data.tokenizer: retrieval keys and values are drawn from single-token letters, but "
                             f"this tokenizer has only {len(self.key_alphabet)} uppercase / {len(self.value_alphabet)} "
                             "lowercase ones; use a tokenizer with single-character tokens (e.g. the byte tokenizer)")
        if len(self.key_alphabet) ** key_len < num_pairs:
            raise ValueError(f"data.retrieval_key_len={key_len} allows only {len(self.key_alphabet) ** key_len} "
                             f"distinct keys but data.retrieval_num_pairs={num_pairs}; raise retrieval_key_len")
        if self.unique_values and len(self.value_alphabet) ** value_len < num_pairs:
            raise ValueError(f"data.retrieval_unique_values: data.retrieval_value_len={value_len} allows only "
                             f"{len(self.value_alphabet) ** value_len} distinct values but data.retrieval_num_pairs="
                             f"{num_pairs}; raise retrieval_value_len")
        self.bos = int(tokenizer.bos_id)
        self.pair_len = key_len + value_len  # a query has the same tokens as its pair
        # Whitespace pre-tokenizers encode " " or "\n" to nothing; keep the characters that do encode.
        self._letters = _single_token_ids(tokenizer, _FILLER_CHARS)
        newline = tokenizer.encode("\n")
        self._eos_sub = int(newline[0]) if len(newline) else int(self._letters[0])  # EOS/digits in filler -> this
        # A key token inside the filler would be a false match for a query, so the filler's key tokens (uppercase
        # letters) are mapped to their lowercase: keys occur in a sample only where the task put them.
        self._filler_map = np.arange(tokenizer.vocab_size, dtype=np.int64)
        for c in string.ascii_uppercase:
            upper, lower = tokenizer.encode(c), tokenizer.encode(c.lower())
            if len(upper) == 1:
                self._filler_map[upper[0]] = lower[0] if len(lower) == 1 else self._eos_sub
        self._filler_map[self.value_alphabet] = self._eos_sub
        self.filler_tokens = None if filler_tokens is None or len(filler_tokens) == 0 else filler_tokens
        self.filler_eos_id = filler_eos_id
        self.pair_region = self.seq_len - self.min_gap - self.num_queries * self.pair_len  # after BOS
        if self.pair_region < self.num_pairs * self.pair_len:
            need = 1 + self.num_pairs * self.pair_len + self.min_gap + self.num_queries * self.pair_len
            raise ValueError(
                f"a retrieval sample needs {need} tokens ({num_pairs} pairs x {self.pair_len} + min_gap {min_gap} + "
                f"{num_queries} queries x {self.pair_len} + BOS) but training.seq_len + 1 = {self.seq_len + 1}; "
                "raise training.seq_len or lower data.retrieval_num_pairs / retrieval_num_queries / retrieval_min_gap")

    @property
    def answer_tokens_per_sample(self) -> int:
        return self.num_queries * self.value_len

    def _filler(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.filler_tokens is None:
            return self._letters[rng.integers(0, len(self._letters), size=n)]
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
        return self._filler_map[out]

    def _keys(self, rng: np.random.Generator) -> np.ndarray:
        """[N, key_len] distinct keys: N distinct codes < a^K written in base a (a = alphabet size)."""
        return _distinct_words(rng, self.key_alphabet, self.key_len, self.num_pairs)

    @property
    def shortcut(self) -> float:
        """Accuracy reachable without reading keys (see ``shortcut_accuracy``): what a model that learned only the
        task's statistics scores. Retrieval is shown only by accuracy above it."""
        return shortcut_accuracy(self.num_pairs, self.num_queries, len(self.value_alphabet) ** self.value_len,
                                 queries=self.queries, unique_values=self.unique_values)

    def sample_with_layout(self, index: int) -> tuple[np.ndarray, np.ndarray, RetrievalLayout]:
        """Tokens [seq_len+1] int64, answer mask [seq_len+1] bool and where the queries and their pairs are."""
        rng = np.random.default_rng([self.seed, self.stream, int(index)])
        n, m, total = self.num_pairs, self.num_queries, self.seq_len + 1
        keys = self._keys(rng)
        if self.unique_values:
            values = _distinct_words(rng, self.value_alphabet, self.value_len, n)
        else:
            values = self.value_alphabet[rng.integers(0, len(self.value_alphabet), size=(n, self.value_len))]
        if self.queries == "distinct":  # a random subset of the pairs, each asked once
            asked = rng.choice(n, size=m, replace=False)
        else:  # any pair, any number of times: answers seen so far say nothing about the next one
            asked = rng.integers(0, n, size=m)
        free = self.pair_region - n * self.pair_len  # filler tokens between the pairs
        filler = self._filler(rng, free + self.min_gap)
        reach = free  # the pairs lie in the last `reach` filler tokens (curriculum: fewer early in training)
        if self.curriculum_samples and index < self.curriculum_samples:
            reach = (free * (int(index) + 1)) // self.curriculum_samples
        before = free - reach + np.sort(rng.integers(0, reach + 1, size=n))  # filler tokens before pair i
        pair_start = 1 + before + np.arange(n) * self.pair_len
        pairs = np.concatenate([keys, values], axis=1)  # [N, key_len + value_len]
        tokens = np.empty(total, np.int64)
        tokens[0] = self.bos
        covered = np.zeros(total, bool)
        span = pair_start[:, None] + np.arange(self.pair_len)
        tokens[span] = pairs
        covered[span] = True
        query_start = 1 + self.pair_region + self.min_gap
        filler_pos = np.flatnonzero(~covered[:query_start])[1:]  # every position but BOS before the queries
        tokens[filler_pos] = filler
        tokens[query_start:] = pairs[asked].reshape(-1)
        answer_pos = query_start + np.arange(m) * self.pair_len + self.key_len
        mask = np.zeros(total, bool)
        mask[answer_pos[:, None] + np.arange(self.value_len)] = True
        pair_value_pos = pair_start[asked] + self.key_len
        depth = before[asked] / max(free, 1)
        return tokens, mask, RetrievalLayout(answer_pos=answer_pos, pair_value_pos=pair_value_pos, depth=depth)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [seq_len+1] int64 and a bool mask [seq_len+1] marking the answer tokens."""
        tokens, mask, _ = self.sample_with_layout(index)
        return tokens, mask

    def batch(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Stacked samples: tokens [n, seq_len+1] int64, answer mask [n, seq_len+1] bool."""
        pairs = [self.sample(int(i)) for i in indices]
        if not pairs:
            return np.zeros((0, self.seq_len + 1), np.int64), np.zeros((0, self.seq_len + 1), bool)
        return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def _distinct_words(rng: np.random.Generator, alphabet: np.ndarray, length: int, count: int) -> np.ndarray:
    """[count, length] distinct words over ``alphabet``: distinct codes < a^length written in base a."""
    a = len(alphabet)
    codes = rng.choice(a ** length, size=count, replace=False)
    return alphabet[(codes[:, None] // a ** np.arange(length - 1, -1, -1)) % a]


def shortcut_accuracy(num_pairs: int, num_queries: int, num_values: int, *, queries: str = "distinct",
                      unique_values: bool = False, samples: int = 20_000, seed: int = 0) -> float:
    """Expected accuracy of the best predictor that never matches a query's key: it sees which values the pairs
    hold and the answers of the earlier queries (they are in its input), and answers with the most likely value.

    Monte Carlo over ``samples`` samples (+-0.3 points at 20k). With ``queries='distinct'`` every answered pair
    leaves the pool, so the last queries are nearly determined by elimination: 16 pairs / 16 queries of one digit
    give 35.9 %, against 10 % chance. With ``'repeat'`` the pool never shrinks and the best guess is the most
    frequent value; with unique values that is 1 / num_pairs.
    """
    rng = np.random.default_rng(seed)
    correct = 0.0
    for _ in range(samples):
        if unique_values:
            vals = rng.choice(num_values, size=num_pairs, replace=False)
        else:
            vals = rng.integers(0, num_values, size=num_pairs)
        if queries == "distinct":
            asked = rng.choice(num_pairs, size=num_queries, replace=False)
        else:
            asked = rng.integers(0, num_pairs, size=num_queries)
        left = dict(zip(*np.unique(vals, return_counts=True)))  # value -> pairs holding it still in the pool
        for value in vals[asked]:
            best = max(left.values())
            correct += left.get(value, 0) == best and 1.0 / sum(c == best for c in left.values())
            if queries == "distinct":
                left[value] -= 1
                if left[value] == 0:
                    del left[value]
    return correct / (samples * num_queries)


def query_correct(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per answer: (ends [B, T] bool, correct [B, T] bool). An answer is a maximal run of labelled positions
    (label != -100; one query's value); ``ends`` marks the last position of each run, ``correct`` is True there
    when the argmax is right at every position of the run. Vectorised, no host sync: the number of wrong tokens
    since the run's start is a difference of running counts (the count before the latest run start, carried
    forward by cummax since running counts never decrease)."""
    valid = labels != IGNORE_INDEX
    wrong = (valid & (logits.argmax(-1) != labels)).long()
    before = torch.nn.functional.pad(valid[:, :-1], (1, 0))  # valid[t - 1], False at t = 0
    after = torch.nn.functional.pad(valid[:, 1:], (0, 1))    # valid[t + 1], False at t = T - 1
    starts, ends = valid & ~before, valid & ~after
    wrong_so_far = wrong.cumsum(-1)
    wrong_before_run = torch.where(starts, wrong_so_far - wrong, 0).cummax(-1).values
    return ends, ends & (wrong_so_far == wrong_before_run)


def retrieval_accuracy(logits: torch.Tensor, labels: torch.Tensor,
                       is_retrieval: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct_answers, total_answers) as 0-dim int64 tensors on ``logits.device``.

    An answer (one query's value: a run of labelled positions) is correct when the argmax at each of its
    positions equals the label (``query_correct``). Which rows are retrieval samples comes from
    ``is_retrieval`` ([B] bool, the batch's "is_retrieval" entry) or, when None, is inferred: a retrieval row
    has both ignored and non-ignored labels (packed text rows have no ignored labels at all).
    Stays on device (no .item()) so callers can accumulate without a host sync.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B, T, V] and labels [B, T], got {tuple(logits.shape)} and {tuple(labels.shape)}")
    valid = labels != IGNORE_INDEX
    if is_retrieval is None:
        is_retrieval = valid.any(-1) & (~valid).any(-1)
    rows = is_retrieval.to(device=labels.device, dtype=torch.bool)[:, None]
    ends, correct = query_correct(logits, labels)
    return (correct & rows).sum(), (ends & rows).sum()
