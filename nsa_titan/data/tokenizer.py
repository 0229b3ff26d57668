"""Tokenizers: a dependency-free byte tokenizer (the default), Hugging Face ``tokenizers`` files and folders,
and tiktoken BPE files.

``data.tokenizer`` accepts:

- ``"byte"``: 256 byte ids + 4 specials, no files, no packages;
- a ``tokenizer.json`` file (Hugging Face ``tokenizers``);
- a tokenizer *folder* as Hugging Face ships it: ``tokenizer.json`` plus ``tokenizer_config.json`` and/or
  ``special_tokens_map.json``, whose ``eos_token`` / ``bos_token`` / ``pad_token`` name the special tokens
  (so a Llama or Qwen folder packs documents with its own end-of-text token);
- a ``*.tiktoken`` BPE file (one ``base64-token rank`` per line, as OpenAI and Llama 3 ship them), or a
  folder holding exactly one; needs the ``tiktoken`` package. Such files carry no special tokens: the end
  of text (``data.eos_token``, default ``<|endoftext|>``) and begin of text (``data.bos_token``) are
  appended after the ranks, so the vocabulary is ranks + specials.

Every tokenizer exposes the same small protocol that the rest of the data package relies on:
``vocab_size``, ``eos_id``, ``bos_id``, ``pad_id``, ``sep_id`` (may be None), ``encode(str) -> list[int]``,
``encode_bytes(bytes) -> np.ndarray``, ``encode_batch(list[bytes]) -> list[np.ndarray]`` and
``decode(ids) -> str``.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "TiktokenTokenizer", "build_tokenizer", "tokenizer_from_config"]

_HF_INSTALL_HINT = "pip install nsa_titan[hf]"
_TIKTOKEN_INSTALL_HINT = "pip install tiktoken"
# The split pattern of cl100k_base, which Llama 3's tokenizer.model uses too: a *.tiktoken file holds only
# the merges, and this is what every published tiktoken vocabulary of that family was trained with.
CL100K_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                  r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def _id_list(ids: Iterable[int]) -> list[int]:
    """Token ids (a list, array or tensor) as Python ints for decoding (host sync ok: off the training path)."""
    return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]  # host sync ok: decoding


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
        ids = _id_list(ids)
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


# Tried in order when neither the caller nor the tokenizer's config names the token.
_KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[EOS]")
_KNOWN_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]")
_KNOWN_PAD = ("<pad>", "[PAD]", "<|pad|>")


def _token_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...} (AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def read_special_tokens(folder: str) -> dict[str, str]:
    """{"eos_token": ..., "bos_token": ..., "pad_token": ...} named by a tokenizer folder's config files
    (tokenizer_config.json wins over special_tokens_map.json, as in transformers)."""
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"data.tokenizer: cannot read {path} ({e}); fix or remove it") from None
        for key in ("eos_token", "bos_token", "pad_token"):
            token = _token_name(cfg.get(key))
            if token is not None:
                out[key] = token
    return out


class _SpecialTokens:
    """eos/bos/pad ids from explicit names, then the config's names, then well-known names."""

    def _resolve_specials(self, eos_token: str | None, bos_token: str | None, configured: dict[str, str]) -> None:
        where = self.path
        for role, given, known in (("eos", eos_token, _KNOWN_EOS), ("bos", bos_token, _KNOWN_BOS)):
            if given is not None and self._id_of(given) is None:
                raise ValueError(f"data.{role}_token: {given!r} is not a token of {where!r}; give one of its special "
                                 f"tokens (e.g. {self._examples()}) or leave data.{role}_token unset")
        eos = self._first_id([eos_token] if eos_token is not None else [configured.get("eos_token"), *_KNOWN_EOS])
        if eos is None:
            raise ValueError(f"data.tokenizer: {where!r} has no end-of-text token (tried its config and "
                             f"{list(_KNOWN_EOS)}); name it with --data.eos_token TOKEN (e.g. {self._examples()})")
        self.eos_id = eos
        # Missing BOS/PAD fall back to EOS, as GPT-2-style vocabularies do.
        bos = self._first_id([bos_token] if bos_token is not None else [configured.get("bos_token"), *_KNOWN_BOS])
        pad = self._first_id([configured.get("pad_token"), *_KNOWN_PAD])
        self.bos_id = eos if bos is None else bos
        self.pad_id = eos if pad is None else pad
        self.sep_id = None  # no dedicated separator; the retrieval task falls back to text

    def _first_id(self, names: Iterable[str | None]) -> int | None:
        for name in names:
            i = None if name is None else self._id_of(name)
            if i is not None:
                return int(i)
        return None

    def _examples(self) -> str:
        return ", ".join(repr(t) for t in self._special_names()[:4]) or "'<|endoftext|>'"


class HFTokenizer(_SpecialTokens):
    """A Hugging Face ``tokenizers`` tokenizer: a tokenizer.json file, or a folder holding one (whose
    tokenizer_config.json / special_tokens_map.json name the special tokens)."""

    def __init__(self, path: str, eos_token: str | None = None, bos_token: str | None = None):
        try:
            import tokenizers  # noqa: PLC0415 - optional
        except ImportError as e:
            raise ImportError(
                f"HFTokenizer needs the `tokenizers` package to read {path!r}; install it with "
                f"`{_HF_INSTALL_HINT}` (or use data.tokenizer = \"byte\")"
            ) from e
        folder = path if os.path.isdir(path) else None
        file = os.path.join(path, "tokenizer.json") if folder else path
        if not os.path.isfile(file):
            raise ValueError(
                f"data.tokenizer: {file!r} does not exist; give a tokenizer.json, a folder holding one, a "
                "*.tiktoken file or \"byte\""
            )
        self.path = path
        try:
            self._tok = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - the Rust parser raises its own exception type
            raise ValueError(f"data.tokenizer: {file!r} is not a Hugging Face tokenizer.json ({e})") from None
        # with_added_tokens=True: added specials may sit above the base vocab.
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self._resolve_specials(eos_token, bos_token, read_special_tokens(folder) if folder else {})

    def _id_of(self, name: str) -> int | None:
        return self._tok.token_to_id(name)

    def _special_names(self) -> list[str]:
        return [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]

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
        ids = _id_list(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


class TiktokenTokenizer(_SpecialTokens):
    """A tiktoken BPE file (``base64-token rank`` per line) with EOS/BOS specials appended after its ranks."""

    def __init__(self, path: str, eos_token: str | None = None, bos_token: str | None = None):
        try:
            import tiktoken  # noqa: PLC0415 - optional
            from tiktoken.load import load_tiktoken_bpe  # noqa: PLC0415 - optional
        except ImportError as e:
            raise ImportError(f"data.tokenizer {path!r} is a tiktoken file and needs the `tiktoken` package: "
                              f"`{_TIKTOKEN_INSTALL_HINT}` (or use a tokenizer.json / \"byte\")") from e
        self.path = path
        try:
            ranks = load_tiktoken_bpe(path)
        except Exception as e:  # noqa: BLE001 - a bad line raises binascii.Error / ValueError inside tiktoken
            raise ValueError(f"data.tokenizer: {path!r} is not a tiktoken BPE file ({type(e).__name__}: {e}); each "
                             "line must be '<base64 token> <rank>'") from None
        if not ranks:
            raise ValueError(f"data.tokenizer: {path!r} holds no tokens; point data.tokenizer at a tiktoken file")
        n = max(ranks.values()) + 1
        # The file has no special tokens: the configured (or conventional) EOS and BOS get the next ids.
        names = [eos_token or "<|endoftext|>"]
        if bos_token and bos_token not in names:
            names.append(bos_token)
        self._specials = {name: n + i for i, name in enumerate(names)}
        self._enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=CL100K_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self._specials)
        self.vocab_size = int(self._enc.n_vocab)
        self._resolve_specials(eos_token, bos_token, {})

    def _id_of(self, name: str) -> int | None:
        return self._specials.get(name)

    def _special_names(self) -> list[str]:
        return list(self._specials)

    def encode(self, text: str) -> list[int]:
        # disallowed_special=(): a document that contains "<|endoftext|>" as text is encoded as text, not as EOS.
        return self._enc.encode(text, disallowed_special=())

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return np.asarray(self.encode(data.decode("utf-8", errors="replace")), dtype=np.int32)

    def encode_batch(self, docs: Sequence[bytes | str]) -> list[np.ndarray]:
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
        return [np.asarray(ids, dtype=np.int32) for ids in self._enc.encode_ordinary_batch(texts)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        ids = _id_list(ids)
        if skip_special:
            ids = [i for i in ids if i not in self._specials.values()]
        return self._enc.decode(ids)

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _tiktoken_in(folder: str) -> str | None:
    found = sorted(glob.glob(os.path.join(folder, "*.tiktoken")))
    if len(found) > 1:
        raise ValueError(f"data.tokenizer: {folder!r} holds several *.tiktoken files ({found}); name one of them")
    return found[0] if found else None


def build_tokenizer(spec: str, eos_token: str | None = None, bos_token: str | None = None):
    """``"byte"``; a tokenizer.json; a Hugging Face tokenizer folder; a *.tiktoken file (or a folder with one).

    ``eos_token`` / ``bos_token`` (``data.eos_token`` / ``data.bos_token``) override the tokenizer's own.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"data.tokenizer must be \"byte\", a tokenizer.json, a tokenizer folder or a *.tiktoken "
                         f"file, got {spec!r}")
    if spec == "byte":
        if eos_token is not None or bos_token is not None:
            raise ValueError("data.eos_token / data.bos_token: the byte tokenizer has fixed specials "
                             "(EOS 256, BOS 257); "
                             "leave them unset or use a tokenizer file")
        return ByteTokenizer()
    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, "tokenizer.json")):
            return HFTokenizer(spec, eos_token=eos_token, bos_token=bos_token)
        tik = _tiktoken_in(spec)
        if tik is not None:
            return TiktokenTokenizer(tik, eos_token=eos_token, bos_token=bos_token)
        raise ValueError(f"data.tokenizer: folder {spec!r} has no tokenizer.json and no *.tiktoken file; point it at "
                         "a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json) or a tiktoken file")
    if spec.endswith(".tiktoken"):
        if not os.path.isfile(spec):
            raise ValueError(f"data.tokenizer: tiktoken file {spec!r} does not exist")
        return TiktokenTokenizer(spec, eos_token=eos_token, bos_token=bos_token)
    if spec.endswith(".json"):
        if not os.path.isfile(spec):
            raise ValueError(
                f"data.tokenizer: tokenizer file {spec!r} does not exist; give the path of a local "
                "HF tokenizer.json or use \"byte\""
            )
        return HFTokenizer(spec, eos_token=eos_token, bos_token=bos_token)
    raise ValueError(
        f"data.tokenizer: unknown tokenizer {spec!r} (not an existing folder); valid choices are \"byte\", a "
        "HuggingFace tokenizer.json, a tokenizer folder (tokenizer.json + tokenizer_config.json) or a *.tiktoken file"
    )


def tokenizer_from_config(data_cfg) -> Any:
    """The tokenizer of a ``[data]`` section (tokenizer, eos_token, bos_token; duck-typed)."""
    return build_tokenizer(data_cfg.tokenizer, eos_token=getattr(data_cfg, "eos_token", None),
                           bos_token=getattr(data_cfg, "bos_token", None))
