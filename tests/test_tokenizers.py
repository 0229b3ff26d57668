"""Tokenizers (issue 14, item 3): Hugging Face tokenizer folders with their special tokens, tokenizer.json,
tiktoken files, configurable EOS/BOS, and the vocabulary checked against the model before it is built."""

from __future__ import annotations

import base64
import json
import sys

import pytest
import torch

from _ckpt_util import args, run
from nsa_titan.config import ConfigError, load_job_config
from nsa_titan.data import HFTokenizer, build_tokenizer, tokenizer_from_config


def _hf_folder(path, *, config: dict | None = None, special_map: dict | None = None, n_words: int = 0):
    """A word-level tokenizer folder: tokenizer.json (+ tokenizer_config.json / special_tokens_map.json)."""
    tokenizers = pytest.importorskip("tokenizers")
    path.mkdir(parents=True, exist_ok=True)
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<s>": 3, "</s>": 4, "<|endoftext|>": 5}
    vocab.update({f"w{i}": 6 + i for i in range(n_words)})
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    t.add_special_tokens(["<s>", "</s>", "<|endoftext|>"])
    t.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_map))
    return str(path)


def test_folder_takes_special_tokens_from_its_config(tmp_path):
    # "</s>" is named by the config (in transformers' AddedToken form): it wins over the well-known
    # "<|endoftext|>", which the bare tokenizer.json would pick.
    folder = _hf_folder(tmp_path / "tok", config={"eos_token": {"content": "</s>", "special": True}},
                        special_map={"bos_token": "<s>", "eos_token": "<|endoftext|>"})
    tok = build_tokenizer(folder)
    assert isinstance(tok, HFTokenizer) and (tok.eos_id, tok.bos_id) == (4, 3)
    assert build_tokenizer(folder + "/tokenizer.json").eos_id == 5  # the file alone: the first well-known name
    assert tok.encode("hello world") == [1, 2] and tok.decode([1, 2]) == "hello world"
    # data.eos_token / data.bos_token override the folder's choice.
    cfg = load_job_config(["--data.tokenizer", folder, "--data.eos_token", "<|endoftext|>", "--data.bos_token", "</s>"])
    assert (tokenizer_from_config(cfg.data).eos_id, tokenizer_from_config(cfg.data).bos_id) == (5, 4)


def test_tokenizer_errors_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="data.eos_token / data.bos_token: the byte tokenizer"):
        build_tokenizer("byte", eos_token="</s>")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no tokenizer.json and no \\*.tiktoken"):
        build_tokenizer(str(empty))
    with pytest.raises(ValueError, match="not an existing folder"):
        build_tokenizer(str(tmp_path / "gpt2"))
    (tmp_path / "x.tiktoken").write_text("aGk= 0\n")
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` raise
    with pytest.raises(ImportError, match="pip install tiktoken"):
        build_tokenizer(str(tmp_path / "x.tiktoken"))
    folder = _hf_folder(tmp_path / "tok")
    with pytest.raises(ValueError, match=r"data.eos_token: '<eot>' is not a token of .*leave data.eos_token unset"):
        build_tokenizer(folder, eos_token="<eot>")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer(str(bad))


def _tiktoken_file(path):
    """Every byte (ranks 0..255) plus a few merges, in the file format tiktoken.load reads."""
    merges = [b"he", b"ll", b"hell", b"hello", b" w", b"or"]
    lines = [f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)]
    lines += [f"{base64.b64encode(m).decode()} {256 + i}" for i, m in enumerate(merges)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_tiktoken_file_appends_eos_and_bos(tmp_path):
    pytest.importorskip("tiktoken")
    f = _tiktoken_file(tmp_path / "small.tiktoken")
    tok = build_tokenizer(f)
    assert tok.vocab_size == 263 and tok.eos_id == 262 and tok.bos_id == 262  # 262 ranks + <|endoftext|>
    ids = tok.encode("hello world")
    assert ids[0] == 259 and tok.decode(ids) == "hello world"  # "hello" is one merged token
    # The EOS text inside a document is text, not the EOS id: documents cannot end each other early.
    assert 262 not in tok.encode("a <|endoftext|> b")
    with_bos = build_tokenizer(str(tmp_path), eos_token="<|end_of_text|>", bos_token="<|begin_of_text|>")  # folder
    assert (with_bos.vocab_size, with_bos.eos_id, with_bos.bos_id) == (264, 262, 263)
    assert [a.tolist() for a in with_bos.encode_batch([b"hello", "or"])] == [[259], [261]]
    (tmp_path / "broken.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(ValueError, match="not a tiktoken BPE file"):
        build_tokenizer(str(tmp_path / "broken.tiktoken"))


def test_vocab_too_large_for_the_model_fails_before_the_model_is_built(tmp_path, monkeypatch):
    import nsa_titan.train as train_mod

    def fail(*a, **k):
        raise AssertionError("the model was built before the vocabulary was checked")

    monkeypatch.setattr(train_mod, "build_model", fail)
    folder = _hf_folder(tmp_path / "tok", n_words=300)  # 306 tokens > the debug model's 260 rows
    with pytest.raises(ConfigError, match=r"model.vocab_size: .* has 306 tokens .* pass --model.vocab_size 306 "
                                          r"\(or larger, e.g. 320"):
        run(args(tmp_path / "dump", "--data.tokenizer", folder))
    with pytest.raises(ConfigError, match="data.eos_token: 'nope' is not a token"):
        run(args(tmp_path / "dump", "--data.tokenizer", folder, "--data.eos_token", "nope"))


def test_a_tokenizer_folder_packs_its_configured_eos(tmp_path):
    from nsa_titan.data import build_dataloader

    folder = _hf_folder(tmp_path / "tok", config={"eos_token": "</s>"})
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"d{i}.txt").write_text(" ".join(["hello world"] * (3 + i)))
    c = load_job_config(["--data.tokenizer", folder, "--data.dataset", "text_files", "--data.path", str(docs),
                         "--data.val_fraction", "0"])
    batch = next(build_dataloader(c.data, tokenizer_from_config(c.data), seq_len=40, local_batch_size=4))
    ids = torch.cat([batch["input"], batch["labels"][:, -1:]], 1)
    assert set(ids.unique().tolist()) == {1, 2, 4}  # hello, world, and </s> between documents (not <|endoftext|>)


def test_export_at_end_carries_the_tokenizer_folder_and_its_special_ids(tmp_path):
    """--checkpoint.export_at_end with a tokenizer folder: the export holds its files and config.json its EOS/BOS
    ids (data.eos_token applied), so that the model and its tokenizer load from the export alone."""
    pytest.importorskip("safetensors")
    folder = _hf_folder(tmp_path / "tok", config={"bos_token": "<s>"}, n_words=300)
    run(args(tmp_path / "run", "--data.tokenizer", folder, "--data.eos_token", "</s>", "--checkpoint.enable",
             "--checkpoint.folder", "ck", "--checkpoint.export_at_end", "--model.vocab_size", "320", steps=2))
    out = next((tmp_path / "run" / "ck").glob("export-*"))
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (4, 3)  # </s> (asked for) and <s> (its config)
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    assert (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "nsa_tokenizer.json").read_text())["kind"] == "hf"
    assert build_tokenizer(str(out), eos_token="</s>").encode("hello world") == [1, 2]  # loads from the export
