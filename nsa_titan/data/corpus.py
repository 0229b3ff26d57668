"""Document sources and in-memory tokenized corpora.

The default corpus is the Python standard library's own source: it exists on every
machine with Python, needs no network, and is ~30 MB of real text, enough to train
and validate small models. Each source returns documents as ``bytes`` for one split.

Train/val split is decided per document by a stable hash (zlib.crc32 of the relative
path, or of the first 4 KiB of the text for streamed HF data), so it never depends on file-system
listing order or on ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
import warnings
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "TEXT_EXTENSIONS",
    "TokenCorpus",
    "in_split",
    "stdlib_documents",
    "text_file_documents",
    "tokenize_documents",
]

# Extensions picked up when data.path is a directory.
TEXT_EXTENSIONS = (".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".rs", ".go", ".js", ".ts",
                   ".java", ".tex", ".html", ".css", ".toml", ".yaml", ".yml", ".json", ".jsonl", ".csv")
_HASH_BUCKETS = 1_000_000


def in_split(key: str, split: str, val_fraction: float) -> bool:
    """Stable train/val assignment of one document by its key."""
    is_val = zlib.crc32(key.encode("utf-8")) % _HASH_BUCKETS < val_fraction * _HASH_BUCKETS
    return is_val if split == "val" else not is_val


def _check_split(split: str, val_fraction: float) -> None:
    if split not in ("train", "val"):
        raise ValueError(f"split must be \"train\" or \"val\", got {split!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction!r}")
    if split == "val" and val_fraction == 0.0:
        raise ValueError("split=\"val\" needs data.val_fraction > 0 (e.g. 0.01); it is 0, so there is no held-out text")


def _read_utf8(path: str) -> bytes | None:
    """File bytes, or None when unreadable or not valid UTF-8 (a few stdlib test files are latin-1)."""
    data, _ = _read_text_file(path)
    return data


def _read_text_file(path: str) -> tuple[bytes | None, str | None]:
    """(bytes, None), or (None, why the file cannot be used as UTF-8 text)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return None, f"unreadable: {e.strerror or e}"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8: byte 0x{data[e.start]:02x} at offset {e.start}"
    return data, None


def _report_bad_files(path: str, bad: list[tuple[str, str]], total: int, on_error: str, report) -> None:
    """Never drop files silently: name them (and why) with a warning, or fail when data.on_error = "fail"."""
    if not bad:
        return
    shown = "; ".join(f"{f} ({why})" for f, why in bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
    if on_error == "fail":
        raise ValueError(f"data.path: {len(bad)} of {total} files under {path!r} cannot be read as UTF-8 text: "
                         f"{shown}; fix or remove them, or set data.on_error = \"skip\" to train without them")
    report(f"data.path: skipped {len(bad)} of {total} files under {path!r} that cannot be read as UTF-8 text: "
           f"{shown} (data.on_error = \"fail\" stops on such files instead)")


def stdlib_documents(split: str = "train", val_fraction: float = 0.01, *,
                     shard: tuple[int, int] = (0, 1)) -> list[bytes]:
    """All UTF-8 ``*.py`` files of this interpreter's standard library, sorted by relative path (``shard`` =
    (rank, ranks): every ranks-th of the split's files from the rank-th, so a rank reads only its own)."""
    _check_split(split, val_fraction)
    root = sysconfig.get_paths()["stdlib"]
    rels: list[str] = []
    # os.walk is several times faster than Path.rglob here; prune site-packages so the
    # corpus does not depend on which third-party packages happen to be installed.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                rels.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    rels.sort()
    docs = []
    for rel in _shard([r for r in rels if in_split(r, split, val_fraction)], shard):
        data = _read_utf8(os.path.join(root, rel))
        if data:
            docs.append(data)
    if not docs:
        raise ValueError(f"data.dataset=\"stdlib\": no UTF-8 .py files found under {root!r} for split={split!r}"
                         f"{_rank_note(shard)}")
    return docs


def _shard(items: list, shard: tuple[int, int]) -> list:
    rank, ranks = shard
    return items[rank::ranks]


def _rank_note(shard: tuple[int, int]) -> str:
    return f" on rank {shard[0]} of {shard[1]} (each rank reads 1/{shard[1]} of the documents: use fewer ranks)" \
        if shard[1] > 1 else ""


def _split_at_newlines(data: bytes, parts: int) -> list[bytes]:
    """``data`` cut into ``parts`` pieces of about equal size, each cut just after a newline where there is one."""
    cuts = [0]
    for i in range(1, parts):
        want = max(cuts[-1], len(data) * i // parts)
        nl = data.find(b"\n", want)
        cuts.append(len(data) if nl < 0 else nl + 1)
    cuts.append(len(data))
    return [data[a:b] for a, b in zip(cuts, cuts[1:])]


def _list_text_files(path: str) -> list[str]:
    if any(c in path for c in "*?["):
        return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        out = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
            out.extend(os.path.join(dirpath, n) for n in filenames if n.lower().endswith(TEXT_EXTENSIONS))
        return sorted(out)
    raise ValueError(f"data.path: {path!r} does not exist; set data.path to a text file, a directory or a glob")


def _jsonl_documents(path: str, key: str, split: str, val_fraction: float, text_field: str
                     ) -> tuple[list[bytes], str | None]:
    """(documents, None) of a JSON-lines file: the ``text_field`` string of each line, each line split into
    train/val by a hash of "<key>:<line number>"; or ([], why) when the file is not such a file."""
    data, why = _read_text_file(path)
    if why:
        return [], why
    docs = []
    for n, line in enumerate(data.splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            return [], f"line {n + 1} is not JSON ({e.msg})"
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            fields = sorted(record) if isinstance(record, dict) else type(record).__name__
            return [], f"line {n + 1} has no text field {text_field!r} (it has {fields}; set data.hf_text_field)"
        if text and in_split(f"{key}:{n}", split, val_fraction):
            docs.append(text.encode("utf-8"))
    return docs, None


def text_file_documents(path: str, split: str = "train", val_fraction: float = 0.01, *, on_error: str = "skip",
                        report=None, text_field: str = "text", shard: tuple[int, int] = (0, 1)) -> list[bytes]:
    """Documents from a directory (recursive, TEXT_EXTENSIONS), a glob, or a single file.

    Several files are split by a hash of their path relative to ``path``. A single file
    cannot be split that way, so its last ``val_fraction`` of bytes (cut at a newline)
    is the val split and the rest is train. A ``.jsonl`` file is a file of documents: the ``text_field`` of
    each line, split line by line. Files of the split that are not UTF-8 (or not
    readable, or JSON lines without the field) are named through ``report`` (default: ``warnings.warn``) and
    skipped, or raise a ValueError with ``on_error="fail"``; a single such file is always an error.
    ``shard`` = (rank, ranks): this rank's documents only (every ranks-th file of the split, or of the
    documents of .jsonl files; a single text file is cut into ranks pieces at newlines), so that no rank
    reads or tokenizes the whole corpus.
    """
    if on_error not in ("skip", "fail"):
        raise ValueError(f"data.on_error must be \"skip\" or \"fail\", got {on_error!r}")
    report = report or (lambda message: warnings.warn(message, stacklevel=3))
    _check_split(split, val_fraction)
    if not path:
        raise ValueError("data.path is required for data.dataset=\"text_files\"; set it to a file, directory or glob")
    files = _list_text_files(path)
    base = path if os.path.isdir(path) else os.path.dirname(path)
    if any(f.lower().endswith(".jsonl") for f in files):  # documents are lines: split per line, not per file
        docs, bad = [], []
        for f in files:
            rel = os.path.relpath(f, base).replace(os.sep, "/")
            if f.lower().endswith(".jsonl"):
                got, why = _jsonl_documents(f, rel, split, val_fraction, text_field)
            elif in_split(rel, split, val_fraction):
                data, why = _read_text_file(f)
                got = [data] if data else []
            else:
                got, why = [], None
            if why:
                bad.append((rel, why))
            docs.extend(got)
        if len(files) == 1 and bad:
            raise ValueError(f"data.path: {files[0]} cannot be read as JSON lines ({bad[0][1]})")
        _report_bad_files(path, bad, len(files), on_error, report)
        docs = _shard(docs, shard)
    elif len(files) == 1:
        data, why = _read_text_file(files[0])
        if why:
            raise ValueError(f"data.path: {files[0]} cannot be read as UTF-8 text ({why}); "
                             "point data.path at text files")
        cut = len(data) - int(len(data) * val_fraction)
        nl = data.rfind(b"\n", 0, cut)
        cut = nl + 1 if nl > 0 else cut
        part = data[cut:] if split == "val" else data[:cut]
        part = _split_at_newlines(part, shard[1])[shard[0]]
        docs = [part] if part else []
    else:
        docs, bad = [], []
        mine = _shard([f for f in files
                       if in_split(os.path.relpath(f, base).replace(os.sep, "/"), split, val_fraction)], shard)
        for f in mine:
            data, why = _read_text_file(f)
            if why:
                bad.append((os.path.relpath(f, base), why))
            elif data:
                docs.append(data)
        _report_bad_files(path, bad, len(mine), on_error, report)
    if not docs:
        raise ValueError(
            f"data.path: no UTF-8 text found in {path!r} for split={split!r}{_rank_note(shard)} "
            f"({len(files)} candidate files); "
            f"point data.path at text files ({', '.join(TEXT_EXTENSIONS[:4])}, ...) or lower/raise data.val_fraction"
        )
    return docs


@dataclass
class TokenCorpus:
    """Documents tokenized into one flat array, each document followed by EOS.

    ``tokens[doc_starts[d] : doc_starts[d] + doc_lens[d]]`` is document d *including* its
    trailing EOS, so any permutation of documents packs into a stream with EOS between them.
    """

    tokens: np.ndarray  # uint16 when the vocab fits (halves memory), else int32
    doc_starts: np.ndarray  # int64 [num_docs]
    doc_lens: np.ndarray  # int64 [num_docs], includes the EOS
    eos_id: int

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.doc_starts.shape[0])


def tokenize_documents(docs: Iterable[bytes], tokenizer) -> TokenCorpus:
    """Tokenize all documents into a TokenCorpus; rejects ids outside the tokenizer's vocab."""
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError("no non-empty documents to tokenize; check data.dataset / data.path")
    encoded = tokenizer.encode_batch(docs)
    lens = np.fromiter((len(e) + 1 for e in encoded), dtype=np.int64, count=len(encoded))
    starts = np.zeros_like(lens)
    np.cumsum(lens[:-1], out=starts[1:])
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    tokens = np.empty(int(lens.sum()), dtype=dtype)
    # One slice copy per document, not per token. host sync ok: numpy host data.
    for s, e in zip(starts.tolist(), encoded):
        tokens[s:s + len(e)] = e
        tokens[s + len(e)] = tokenizer.eos_id
    top = int(tokens.max())
    if top >= tokenizer.vocab_size or min(int(tokens.min()), 0) < 0:
        raise ValueError(
            f"data.tokenizer: produced id {top} outside its vocab_size {tokenizer.vocab_size}; "
            "use a tokenizer.json whose vocab covers all its ids (added tokens included)"
        )
    return TokenCorpus(tokens=tokens, doc_starts=starts, doc_lens=lens, eos_id=int(tokenizer.eos_id))
