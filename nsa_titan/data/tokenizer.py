"""Tokenizers: a dependency-free byte tokenizer (the default) and a thin wrapper
around a local HuggingFace ``tokenizers`` JSON file.

Both expose the same small protocol that the rest of the data package relies on:
``vocab_size``, ``eos_id``, ``bos_id``, ``pad_id``, ``sep_id`` (may be None),
``encode(str) -> list[int]``, ``encode_bytes(bytes) -> np.ndarray``,
``encode_batch(list[bytes]) -> list[np.ndarray]`` and ``decode(ids) -> str``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "build_tokenizer"]

_HF_INSTALL_HINT = "pip install nsa_titan[hf]"


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; four specials follow them.

    Needs no files and no network, so the default config trains anywhere.
    """

    EOS = 256
    BOS = 257
    PAD = 258
    SEP = 259
    vocab_size = 260
    eos_id = EOS
    bos_id = BOS
    pad_id = PAD
    sep_id = SEP
    _SPECIAL_NAMES = {EOS: "<eos>", BOS: "<bos>", PAD: "<pad>", SEP: "<sep>"}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Zero-copy view of the bytes as uint8 ids (read-only); callers widen it
        into their own buffer, which is what makes corpus loading fast."""
        return np.frombuffer(data, dtype=np.uint8)

    def encode_batch(self, docs: Sequence[bytes | str]) -> list[np.ndarray]:
        return [self.encode_bytes(d.encode("utf-8") if isinstance(d, str) else d) for d in docs]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        # host sync ok: decoding runs off the training path
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            if i not in self._SPECIAL_NAMES:
                raise ValueError(f"ByteTokenizer.decode: id {i} is outside the vocabulary [0, {self.vocab_size})")
            # Flush the byte run first so a multi-byte character split by a special
            # is replaced rather than silently glued to the next run.
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special:
                out.append(self._SPECIAL_NAMES[i])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=260)"


# Tried in order when the caller does not name the EOS token explicitly.
_KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[EOS]")
_KNOWN_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]")
_KNOWN_PAD = ("<pad>", "[PAD]", "<|pad|>")


class HFTokenizer:
    """Wraps ``tokenizers.Tokenizer.from_file(path)`` (a local tokenizer.json)."""

    def __init__(self, path: str, eos_token: str | None = None):
        try:
            import tokenizers  # noqa: PLC0415 - optional
        except ImportError as e:
            raise ImportError(
                f"HFTokenizer needs the `tokenizers` package to read {path!r}; install it with "
                f"`{_HF_INSTALL_HINT}` (or use data.tokenizer = \"byte\")"
            ) from e
        if not os.path.isfile(path):
            raise ValueError(
                f"data.tokenizer: tokenizer file {path!r} does not exist; give the path of a local "
                "HF tokenizer.json or use \"byte\""
            )
        self.path = path
        self._tok = tokenizers.Tokenizer.from_file(path)
        # with_added_tokens=True: added specials may sit above the base vocab.
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        candidates = (eos_token,) if eos_token is not None else _KNOWN_EOS
        self.eos_id = self._first_id(candidates)
        if self.eos_id is None:
            raise ValueError(
                f"data.tokenizer: {path!r} has no end-of-text token (tried {list(candidates)}); "
                "pass eos_token=<token> to HFTokenizer / build_tokenizer"
            )
        # Missing BOS/PAD fall back to EOS, as GPT-2-style vocabularies do.
        bos = self._first_id(_KNOWN_BOS)
        pad = self._first_id(_KNOWN_PAD)
        self.bos_id = self.eos_id if bos is None else bos
        self.pad_id = self.eos_id if pad is None else pad
        self.sep_id = None  # no dedicated separator; the retrieval task falls back to text

    def _first_id(self, names: Iterable[str]) -> int | None:
        for name in names:
            i = self._tok.token_to_id(name)
            if i is not None:
                return int(i)
        return None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return np.asarray(self.encode(data.decode("utf-8", errors="replace")), dtype=np.int32)

    def encode_batch(self, docs: Sequence[bytes | str]) -> list[np.ndarray]:
        # encode_batch runs in Rust threads: much faster than a Python loop on big corpora.
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        # host sync ok: decoding runs off the training path
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def build_tokenizer(spec: str, eos_token: str | None = None):
    """``"byte"`` -> ByteTokenizer; a path ending in ``.json`` -> HFTokenizer."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"data.tokenizer must be \"byte\" or a path to a tokenizer.json, got {spec!r}")
    if spec == "byte":
        return ByteTokenizer()
    if spec.endswith(".json"):
        if not os.path.isfile(spec):
            raise ValueError(
                f"data.tokenizer: tokenizer file {spec!r} does not exist; give the path of a local "
                "HF tokenizer.json or use \"byte\""
            )
        return HFTokenizer(spec, eos_token=eos_token)
    raise ValueError(
        f"data.tokenizer: unknown tokenizer {spec!r}; valid choices are \"byte\" or a path to a local "
        "HuggingFace tokenizer file ending in .json"
    )
