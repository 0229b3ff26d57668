"""The [data] config section: corpus, tokenizer, validation split and the synthetic retrieval task. Split from
``job_config.py`` (which composes it into ``JobConfig``) only to keep files short; the same conventions hold: each
field's docstring sits directly below it and ``--help`` reads it back.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Literal

from nsa_titan.config.manager import check as _check


@dataclass
class Data:
    """Training data: corpus, tokenizer, validation split and the synthetic retrieval task."""

    dataset: Literal["stdlib", "retrieval", "text_files", "hf"] = "stdlib"
    """'stdlib': the Python standard library's own source files (no network); 'retrieval': synthetic
    key-value retrieval sequences only; 'text_files': files under data.path; 'hf': a Hugging Face
    dataset named by data.path (needs the `datasets` package)."""
    path: str | None = None
    """Folder/glob for 'text_files', dataset name for 'hf'; for 'retrieval', files whose text fills the
    gap between the key-value pairs and the query (None: random letters); unused by 'stdlib'."""
    tokenizer: str = "byte"
    """'byte' (256 bytes + 4 specials, no download), a Hugging Face tokenizer.json, a tokenizer folder
    (tokenizer.json + tokenizer_config.json / special_tokens_map.json, whose special tokens are used) or a
    *.tiktoken BPE file (needs `pip install tiktoken`). Its vocabulary must fit model.vocab_size."""
    eos_token: str | None = None
    """End-of-text token packed between documents (e.g. '</s>'). None: the tokenizer folder's configured
    eos_token, else a well-known name (<|endoftext|>, </s>, ...); for a *.tiktoken file '<|endoftext|>'."""
    bos_token: str | None = None
    """Begin-of-text token (retrieval samples and `generate --prefix bos` start with it). None: the
    tokenizer's configured or a well-known one, else the EOS token."""
    hf_split: str = "train"
    """Split of the 'hf' dataset to train on (e.g. 'train')."""
    hf_text_field: str = "text"
    """Field holding the text: a column of the 'hf' dataset or of parquet/arrow files, the key of each line of
    .jsonl files (also for 'text_files')."""
    hf_config: str | None = None
    """Configuration (subset) name of a Hub dataset, e.g. 'en' for allenai/c4 (None: its default)."""
    val_path: str | None = None
    """A separate validation set: files, a folder or glob, or a Hub name (read like data.path). None: validation
    is held out of data.path by data.val_fraction (or is data.val_split, when set)."""
    val_split: str | None = None
    """Split of the 'hf' dataset (data.val_path, else data.path) used for validation, e.g. 'validation'. Set
    either val_path or val_split to train on all of data.path (data.val_fraction is then unused)."""
    num_workers: int = 2
    """Loader worker processes per rank that read, tokenize and pack batches ahead of the step (torchdata's
    StatefulDataLoader; 0: in the training process). Without torchdata the loader runs inline."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead (with num_workers > 0)."""
    val_fraction: float = 0.01
    """Fraction of the corpus held out for validation, in [0, 1)."""
    retrieval_num_pairs: int = 16
    """Retrieval task (multi-query associative recall, nsa_titan/data/retrieval.py): key-value pairs placed at
    random between distractor text in each sample."""
    retrieval_num_queries: int = 16
    """Retrieval task: queries at the end of each sample (with retrieval_queries 'distinct': <= num_pairs); every
    value token of every query is supervised."""
    retrieval_queries: Literal["repeat", "distinct"] = "repeat"
    """Retrieval task: which pairs the queries ask for. 'repeat': any pair, any number of times; 'distinct': each
    pair at most once, which lets a model answer the later queries by elimination without reading keys (16 pairs /
    16 one-digit queries: 35.9 % vs 10 % chance, where dense and NSA m7c both stopped in a GPU run). Reports give
    this key-blind 'shortcut' accuracy beside the measured one (data.retrieval.shortcut_accuracy)."""
    retrieval_unique_values: bool = False
    """Retrieval task: values distinct within a sample (needs 10^value_len >= num_pairs for digit values). With
    'repeat' queries the key-blind shortcut is then 1 / num_pairs (e.g. --data.retrieval_value_len 2
    --data.retrieval_unique_values: 6.25 % for 16 pairs, 1 % chance)."""
    retrieval_key_len: int = 1
    """Retrieval task: tokens per key (uppercase letters; keys are unique within a sample, so 26^key_len must be
    >= num_pairs). One token is the easiest to learn: longer keys need the model to match several tokens."""
    retrieval_value_len: int = 1
    """Retrieval task: tokens per value (digits); each is a supervised answer token of every query."""
    retrieval_min_gap: int | None = None
    """Retrieval task: distractor tokens at least between the last pair and the first query. None: the model's
    sliding window (model.window), so that no queried pair is inside a query's window; smaller values are
    refused for that reason."""
    retrieval_filler: Literal["corpus", "letters"] = "corpus"
    """Retrieval task: distractor text between the pairs: 'corpus' (the text of data.path when set, else the
    embedded stdlib corpus; same split as the samples) or 'letters' (random letters and spaces)."""
    retrieval_curriculum_steps: int = 0
    """Retrieval task, training samples only: over the first N optimizer steps the pairs sit in the last part of
    their region, next to the gap before the queries, a part that grows linearly to the whole region (long-range
    recall learned from short range first; validation and evaluation always use the whole region). 0: off."""
    retrieval_mix: float = 0.0
    """Fraction of training sequences that are retrieval samples when the dataset is a text corpus
    (dataset 'retrieval' is all retrieval)."""
    on_error: Literal["skip", "fail"] = "skip"
    """Files under data.path that are not UTF-8 text (or not readable): 'skip' trains without them and names
    them (with the count) in a warning at start-up; 'fail' stops with that list instead."""
    document_mask: bool = False
    """Packed sequences hold several documents separated by the tokenizer's EOS token; with this on, every token
    attends only to its own document (the token after an EOS starts a new one) in all three NSA branches and in
    dense attention. The rules are in models/nsa/reference.py."""
    restart_positions: bool = False
    """With document_mask: RoPE positions restart at 0 at each document start (the model sees every document as
    if it were alone). Off: positions count from the start of the packed sequence."""

    def validate(self) -> None:
        if self.dataset in ("text_files", "hf"):
            _check(bool(self.path), "data.path", f"is required for data.dataset={self.dataset!r}; "
                   "pass --data.path (a folder/glob of text files, or a dataset name)")
        if self.path and self.dataset in ("text_files", "retrieval"):
            # Checked here so that a typo fails at start-up, not after the model is built on the GPU.
            _check(os.path.exists(self.path) or bool(glob.glob(self.path)), "data.path",
                   f"{self.path!r} does not exist and matches no files; pass a text file, a folder or a glob")
        _check(bool(self.tokenizer), "data.tokenizer",
               "must not be empty; use 'byte', a tokenizer.json or a tokenizer folder")
        _check(self.num_workers >= 0, "data.num_workers",
               f"must be >= 0 (0: no worker processes), got {self.num_workers}")
        _check(self.prefetch_factor >= 1, "data.prefetch_factor", f"must be >= 1, got {self.prefetch_factor}")
        if self.val_path:
            _check(self.dataset in ("text_files", "hf"), "data.val_path", "is for data.dataset 'text_files' or 'hf'; "
                   f"{self.dataset!r} holds out data.val_fraction of its own text")
        if self.val_path and self.dataset == "text_files":
            _check(os.path.exists(self.val_path) or bool(glob.glob(self.val_path)), "data.val_path",
                   f"{self.val_path!r} does not exist and matches no files; pass a text file, a folder or a glob")
        _check(self.val_split is None or self.dataset == "hf", "data.val_split",
               f"is a split of an 'hf' dataset, not of data.dataset={self.dataset!r}; use data.val_path instead")
        _check(0 <= self.val_fraction < 1, "data.val_fraction",
               f"must be in [0, 1), got {self.val_fraction}; e.g. --data.val_fraction 0.01")
        for name in ("retrieval_num_pairs", "retrieval_num_queries", "retrieval_key_len", "retrieval_value_len"):
            value = getattr(self, name)
            _check(value >= 1, f"data.{name}", f"must be >= 1, got {value}")
        _check(self.retrieval_queries == "repeat" or self.retrieval_num_queries <= self.retrieval_num_pairs,
               "data.retrieval_num_queries",
               f"must be <= data.retrieval_num_pairs={self.retrieval_num_pairs} with data.retrieval_queries 'distinct' "
               f"(each query asks for a different pair), got {self.retrieval_num_queries}; lower it, raise "
               "retrieval_num_pairs or use --data.retrieval_queries repeat")
        _check(self.retrieval_min_gap is None or self.retrieval_min_gap >= 0, "data.retrieval_min_gap",
               f"must be >= 0 or None (the model's window), got {self.retrieval_min_gap}")
        _check(self.retrieval_curriculum_steps >= 0, "data.retrieval_curriculum_steps",
               f"must be >= 0 (0: off), got {self.retrieval_curriculum_steps}")
        _check(0 <= self.retrieval_mix <= 1, "data.retrieval_mix", f"must be in [0, 1], got {self.retrieval_mix}")
        _check(self.document_mask or not self.restart_positions, "data.restart_positions",
               "restarts positions at document starts, which needs --data.document_mask")
