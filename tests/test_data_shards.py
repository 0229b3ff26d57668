"""In-memory corpora are split between ranks by document before tokenization (issue 14, item 2): each rank reads
and tokenizes only its own files (or its piece of a single file), and the ranks' documents are disjoint and
cover the split."""

from __future__ import annotations

import json
import types

import pytest

from nsa_titan.data import ByteTokenizer, build_dataloader, stdlib_documents, text_file_documents


class CountingTokenizer(ByteTokenizer):
    def __init__(self):
        self.seen: list[bytes] = []

    def encode_batch(self, docs):
        self.seen += [bytes(d) for d in docs]
        return super().encode_batch(docs)


def cfg(**kw):
    return types.SimpleNamespace(**{"dataset": "text_files", "val_fraction": 0.0, "retrieval_mix": 0.0, **kw})


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_tokenize_disjoint_documents_that_cover_the_corpus(tmp_path, world):
    d = tmp_path / "c"
    d.mkdir()
    for i in range(30):
        (d / f"f{i:02d}.txt").write_text(f"document {i} " + "x" * (20 + i))
    toks = [CountingTokenizer() for _ in range(world)]
    for r, tok in enumerate(toks):
        build_dataloader(cfg(path=str(d)), tok, seq_len=15, local_batch_size=2, rank=r, world_size=world)
    per_rank = [set(t.seen) for t in toks]
    assert all(len(s) in (30 // world, 30 // world + 1) for s in per_rank)
    assert sum(map(len, per_rank)) == 30 and set().union(*per_rank) == {p.read_bytes() for p in d.iterdir()}
    shards = [stdlib_documents("val", 0.05, shard=(r, world)) for r in range(world)]  # the stdlib corpus too
    everything = stdlib_documents("val", 0.05)
    assert sum(map(len, shards)) == len(everything) and sorted(sum(shards, [])) == sorted(everything)


def test_a_single_file_and_jsonl_lines_are_split_between_ranks(tmp_path):
    one = tmp_path / "book.txt"
    one.write_text("".join(f"line {i}\n" for i in range(100)))
    parts = [text_file_documents(str(one), "train", 0.0, shard=(r, 2))[0] for r in range(2)]
    assert parts[0] + parts[1] == one.read_bytes() and parts[0].endswith(b"\n")
    assert abs(len(parts[0]) - len(parts[1])) < 20
    lines = tmp_path / "docs.jsonl"
    lines.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(9)))
    got = [text_file_documents(str(lines), "train", 0.0, shard=(r, 3)) for r in range(3)]
    assert sorted(sum(got, [])) == sorted(f"doc {i}".encode() for i in range(9)) and all(len(g) == 3 for g in got)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a\nb\n")  # two lines cannot make five pieces
    with pytest.raises(ValueError, match=r"on rank 4 of 5 \(each rank reads 1/5 of the documents: use fewer ranks\)"):
        text_file_documents(str(tiny), "train", 0.0, shard=(4, 5))
