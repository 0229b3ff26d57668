"""Tests of nsa_titan.data: tokenizers, corpora, packing, sharding, resume, retrieval."""

import sys
import types

import numpy as np
import pytest
import torch

from nsa_titan.data import (
    ByteTokenizer,
    HFTokenizer,
    PackedTextDataset,
    RetrievalTask,
    build_dataloader,
    build_tokenizer,
    query_correct,
    retrieval_accuracy,
    stdlib_documents,
    text_file_documents,
    tokenize_documents,
)

TOK = ByteTokenizer()


def cfg(**kw):
    base = dict(dataset="stdlib", path=None, tokenizer="byte", hf_split="train", hf_text_field="text",
                val_fraction=0.1, retrieval_num_pairs=4, retrieval_num_queries=3, retrieval_key_len=2,
                retrieval_value_len=2, retrieval_min_gap=8, retrieval_filler="corpus", retrieval_mix=0.0)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture
def text_dir(tmp_path):
    """40 files with unique contents (so split membership can be read back from text)."""
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(40):
        body = "".join(f"file {i:02d} line {j} éß\n" for j in range(5 + i % 7))
        (d / f"doc{i:02d}.txt").write_text(body, encoding="utf-8")
    (d / "ignored.bin").write_bytes(b"\x00\x01")
    return d


def take(loader, n):
    return [next(loader) for _ in range(n)]


# ---------------------------------------------------------------- tokenizer

def test_byte_roundtrip_non_ascii():
    s = "héllo wörld — 日本語 🚀\n"
    ids = TOK.encode(s)
    assert len(ids) == len(s.encode("utf-8")) and max(ids) < 256
    assert TOK.decode(ids) == s
    assert TOK.encode_bytes(s.encode("utf-8")).tolist() == ids
    assert TOK.vocab_size == 260 and (TOK.eos_id, TOK.bos_id, TOK.pad_id, TOK.sep_id) == (256, 257, 258, 259)


def test_byte_decode_specials_and_invalid():
    ids = [TOK.BOS] + TOK.encode("ab") + [TOK.SEP, 0xFF, TOK.EOS]
    assert TOK.decode(ids) == "<bos>ab<sep>\ufffd<eos>"
    assert TOK.decode(ids, skip_special=True) == "ab\ufffd"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([300])


def test_build_tokenizer_errors(tmp_path):
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ValueError, match=r'"byte".*\.json'):
        build_tokenizer("gpt2")
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="nope.json"):
        build_tokenizer(missing)


def test_hf_tokenizer_missing_package(tmp_path, monkeypatch):
    f = tmp_path / "tok.json"
    f.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise
    with pytest.raises(ImportError, match=r"pip install nsa_titan\[hf\]"):
        build_tokenizer(str(f))


def _word_tokenizer(path, with_eos=True):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "file": 3}
    if with_eos:
        vocab["<|endoftext|>"] = 4
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    t.save(str(path))
    return str(path)


def test_hf_tokenizer_roundtrip_and_eos(tmp_path):
    tok = build_tokenizer(_word_tokenizer(tmp_path / "t.json"))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 5 and tok.eos_id == 4 and tok.bos_id == 4
    assert tok.encode("hello world") == [1, 2]
    assert tok.decode([1, 2]) == "hello world"
    with pytest.raises(ValueError, match="eos_token"):
        build_tokenizer(_word_tokenizer(tmp_path / "noeos.json", with_eos=False))


def test_hf_tokenizer_drives_loader(tmp_path, text_dir):
    tok = build_tokenizer(_word_tokenizer(tmp_path / "t.json"))
    b = next(build_dataloader(cfg(dataset="text_files", path=str(text_dir)), tok, seq_len=16, local_batch_size=2))
    assert b["input"].shape == (2, 16) and int(b["input"].max()) < tok.vocab_size
    with pytest.raises(ValueError, match="model.vocab_size"):
        build_dataloader(cfg(), TOK, seq_len=16, local_batch_size=2, vocab_size=tok.vocab_size)
    # Retrieval keys and values are single-character tokens: a word-level tokenizer has none, and says so.
    with pytest.raises(ValueError, match="single-token letters"):
        build_dataloader(cfg(dataset="retrieval", path=str(text_dir)), tok, seq_len=64, local_batch_size=2)


# ---------------------------------------------------------------- corpora

def test_stdlib_corpus_split_disjoint_and_covering():
    train = stdlib_documents("train", 0.05)
    val = stdlib_documents("val", 0.05)
    everything = stdlib_documents("train", 0.0)
    assert len(train) > 500 and len(val) > 10
    assert len(train) + len(val) == len(everything)
    assert sum(map(len, train)) + sum(map(len, val)) == sum(map(len, everything))
    assert all(isinstance(d, bytes) for d in val)
    assert stdlib_documents("val", 0.05) == val  # deterministic order and membership


def test_text_files_split_disjoint(text_dir):
    train = text_file_documents(str(text_dir), "train", 0.25)
    val = text_file_documents(str(text_dir), "val", 0.25)
    assert val and train and not set(train) & set(val)
    assert len(train) + len(val) == 40  # the .bin file is not a text file
    assert len(text_file_documents(str(text_dir / "doc0*.txt"), "train", 0.0)) == 10  # a glob
    one = text_dir / "doc00.txt"
    tr, va = text_file_documents(str(one), "train", 0.3), text_file_documents(str(one), "val", 0.3)
    assert tr[0] + va[0] == one.read_bytes()


def test_val_loader_reads_only_val_docs(text_dir):
    c = cfg(dataset="text_files", path=str(text_dir), val_fraction=0.25)
    val_names = {d.split(b" line")[0] for d in text_file_documents(str(text_dir), "val", 0.25)}
    train_names = {d.split(b" line")[0] for d in text_file_documents(str(text_dir), "train", 0.25)}
    for split, mine, other in (("val", val_names, train_names), ("train", train_names, val_names)):
        loader = build_dataloader(c, TOK, seq_len=64, local_batch_size=4, split=split)
        seen = set()
        for b in take(loader, 10):
            text = TOK.decode(b["input"].flatten().tolist(), skip_special=True).encode()
            seen |= {n for n in mine | other if n in text}
        assert seen and seen <= mine


# ---------------------------------------------------------------- packing / sharding

def _small_corpus(n_docs=30):
    docs = [bytes([65 + i % 26]) * (3 + (7 * i) % 23) for i in range(n_docs)]
    return docs, tokenize_documents(docs, TOK)


def test_packing_eos_between_docs_and_chunks():
    docs, corpus = _small_corpus()
    ds = PackedTextDataset(corpus, seq_len=15, seed=3)
    stream = ds.epoch_stream(0)
    assert len(stream) == sum(len(d) + 1 for d in docs)
    pieces = bytes(stream.clip(max=255).astype(np.uint8)).split(b"\xff")[:-1]  # EOS (256) -> 0xff
    assert (stream == TOK.eos_id).sum() == len(docs) and stream[-1] == TOK.eos_id
    assert sorted(pieces) == sorted(docs)  # each document intact, EOS after every one
    assert pieces != docs  # order is shuffled
    ids = np.arange(ds.num_chunks)
    chunks = ds.stream_chunks(0, ids)
    assert chunks.shape == (ds.num_chunks, 16)
    assert np.array_equal(chunks.reshape(-1), stream[:ds.num_chunks * 16])


def test_loader_batches_shifted_labels(text_dir):
    loader = build_dataloader(cfg(dataset="text_files", path=str(text_dir)), TOK, seq_len=32, local_batch_size=3)
    b = next(loader)
    assert b["input"].dtype == torch.int64 and b["labels"].dtype == torch.int64
    assert b["input"].shape == b["labels"].shape == (3, 32)
    assert torch.equal(b["labels"][:, :-1], b["input"][:, 1:])
    assert not b["is_retrieval"].any() and (b["labels"] != -100).all()
    chunk = torch.cat([b["input"], b["labels"][:, -1:]], 1).numpy()
    stream = loader.text.epoch_stream(0)
    for row, i in zip(chunk, loader.text.chunk_ids(0, np.arange(3))):
        assert np.array_equal(row, stream[i * 33:(i + 1) * 33])


@pytest.mark.parametrize("world", [2, 3])
def test_rank_sharding_disjoint_and_covering(world):
    _, corpus = _small_corpus(60)
    full = PackedTextDataset(corpus, seq_len=7, seed=5)
    per_rank = [PackedTextDataset(corpus, seq_len=7, rank=r, world_size=world, seed=5) for r in range(world)]
    n = per_rank[0].chunks_per_rank
    ids = [set(ds.chunk_ids(0, np.arange(n)).tolist()) for ds in per_rank]
    for r, s in enumerate(ids):
        assert len(s) == n and all(i % world == r for i in s)
    assert set().union(*ids) == set(range(n * world))
    assert sum(map(len, ids)) == n * world  # disjoint
    # Content: the union of the ranks' chunks is the world-size-1 stream's chunks.
    got = sorted(bytes(c.astype(np.uint8)) for ds in per_rank for c in ds.samples(np.arange(n)) % 256)
    want = sorted(bytes(c.astype(np.uint8)) for c in full.stream_chunks(0, np.arange(n * world)) % 256)
    assert got == want


def test_determinism_and_seed_difference(text_dir):
    c = cfg(dataset="text_files", path=str(text_dir), retrieval_mix=0.3)
    kw = dict(seq_len=96, local_batch_size=4)
    a = take(build_dataloader(c, TOK, seed=1, **kw), 4)
    b = take(build_dataloader(c, TOK, seed=1, **kw), 4)
    d = take(build_dataloader(c, TOK, seed=2, **kw), 4)
    for x, y in zip(a, b):
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert any(not torch.equal(x["input"], y["input"]) for x, y in zip(a, d))
    text_only = cfg(dataset="text_files", path=str(text_dir))
    t1, t2 = (next(build_dataloader(text_only, TOK, seed=sd, **kw))["input"] for sd in (1, 2))
    assert not torch.equal(t1, t2)  # the document shuffle itself depends on the seed
    ds = build_dataloader(c, TOK, seed=1, **kw).text
    assert not np.array_equal(ds.epoch_stream(0), ds.epoch_stream(1))  # reshuffled per epoch


def test_exact_resume(text_dir):
    c = cfg(dataset="text_files", path=str(text_dir), retrieval_mix=0.3)
    kw = dict(seq_len=64, local_batch_size=6, rank=1, world_size=2, seed=7)
    orig = build_dataloader(c, TOK, **kw)
    assert orig.text.chunks_per_rank < 8 * 6  # the 8 batches cross an epoch boundary
    take(orig, 5)
    state = orig.state_dict()
    expected = take(orig, 3)
    fresh = build_dataloader(c, TOK, **kw)
    fresh.load_state_dict(state)
    got = take(fresh, 3)
    assert any(b["is_retrieval"].any() for b in got) and any((~b["is_retrieval"]).any() for b in got)
    for x, y in zip(expected, got):
        assert all(torch.equal(x[k], y[k]) for k in x)
    other = build_dataloader(c, TOK, **{**kw, "rank": 0})
    with pytest.raises(ValueError, match="rank"):
        other.load_state_dict(state)


# ---------------------------------------------------------------- retrieval

UPPER = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ")
DIGITS = set(b"0123456789")


def test_retrieval_every_answer_supervised_and_outside_the_window():
    filler = np.frombuffer(b"Some Filler text 123 with Capitals\n" * 40, np.uint8).astype(np.uint16)
    task = RetrievalTask(TOK, seq_len=300, num_pairs=10, num_queries=6, key_len=2, value_len=2, min_gap=40, seed=11,
                         filler_tokens=filler, filler_eos_id=256)
    for index in range(5):
        tokens, mask, layout = task.sample_with_layout(index)
        assert tokens.shape == mask.shape == (301,) and tokens[0] == TOK.bos_id
        answers = (layout.answer_pos[:, None] + [0, 1]).ravel()
        assert mask.sum() == 6 * 2 and np.array_equal(np.flatnonzero(mask), answers)
        query_start = layout.answer_pos[0] - 2
        context = tokens[:query_start].tolist()
        # The filler's capitals and digits were replaced: keys and values occur only in the 10 pairs.
        assert sum(t in UPPER for t in context) == 10 * 2 and sum(t in DIGITS for t in context) == 10 * 2
        for a, p in zip(layout.answer_pos, layout.pair_value_pos):
            key = tokens[a - 2:a].tolist()
            hits = [i for i in range(query_start - 1) if context[i:i + 2] == key]
            assert hits == [p - 2]  # the key occurs once in the context: the answer is determined
            assert np.array_equal(tokens[a:a + 2], tokens[p:p + 2]) and set(tokens[a:a + 2].tolist()) <= DIGITS
            assert a - (p + 1) > 40  # the pair's last token is more than min_gap tokens before the answer
        assert len({tuple(tokens[a - 2:a]) for a in layout.answer_pos}) == 6  # each query asks a different pair
        assert 0 <= layout.depth.min() and layout.depth.max() <= 1


def test_retrieval_deterministic_by_seed_index_and_stream():
    make = lambda seed=0, stream=0: RetrievalTask(TOK, 200, num_pairs=8, num_queries=8, min_gap=16, seed=seed,  # noqa: E731
                                                  stream=stream)
    a = make().sample(3)[0]
    assert np.array_equal(make().sample(3)[0], a)
    for other in (make().sample(4)[0], make(seed=1).sample(3)[0], make(stream=1).sample(3)[0]):
        assert not np.array_equal(other, a)


def test_retrieval_shape_errors():
    with pytest.raises(ValueError, match=r"needs 41 tokens.*seq_len \+ 1 = 40; raise training.seq_len"):
        RetrievalTask(TOK, 39, num_pairs=4, num_queries=4, key_len=2, value_len=2, min_gap=8)
    with pytest.raises(ValueError, match="num_queries=5 > data.retrieval_num_pairs=4"):
        RetrievalTask(TOK, 200, num_pairs=4, num_queries=5)
    with pytest.raises(ValueError, match="raise retrieval_key_len"):
        RetrievalTask(TOK, 400, num_pairs=27, num_queries=4, key_len=1)


def test_retrieval_loader_labels(text_dir):
    c = cfg(dataset="retrieval", path=str(text_dir), retrieval_num_pairs=5, retrieval_min_gap=None)
    with pytest.raises(ValueError, match="retrieval_min_gap is None"):
        build_dataloader(c, TOK, seq_len=128, local_batch_size=3)
    b = next(build_dataloader(c, TOK, seq_len=128, local_batch_size=3, window=20))
    assert b["is_retrieval"].all() and b["input"].shape == (3, 128)
    for inp, lab in zip(b["input"], b["labels"]):
        keep = lab != -100
        assert keep.sum() == 3 * 2  # every value token of every query, nothing else
        assert torch.equal(lab[:-1][keep[:-1]], inp[1:][keep[:-1]])
        assert set(bytes(lab[keep].tolist())) <= DIGITS
        assert "file" in TOK.decode(inp.tolist())  # filler comes from the corpus


def test_retrieval_accuracy_counts_each_query():
    labels = torch.full((3, 8), -100)
    labels[0, [2, 3, 5, 6]] = torch.tensor([5, 6, 7, 8])  # two queries of two answer tokens
    labels[1, [4, 7]] = torch.tensor([1, 2])  # two one-token queries
    labels[2] = torch.arange(8)  # a packed-text row: not a retrieval sample
    logits = torch.zeros(3, 8, 10)
    logits[0, 2, 5] = logits[0, 3, 6] = 1.0  # first query right
    logits[0, 5, 7] = logits[0, 6, 9] = 1.0  # second query wrong on its second token
    logits[1, 4, 1] = logits[1, 7, 2] = 1.0  # both right
    correct, total = retrieval_accuracy(logits, labels)
    assert isinstance(correct, torch.Tensor) and (correct.item(), total.item()) == (3, 4)
    ends, right = query_correct(logits, labels)
    assert ends[0].nonzero().flatten().tolist() == [3, 6] and right[0].nonzero().flatten().tolist() == [3]
    logits[0, 6, 8] = 2.0
    assert [t.item() for t in retrieval_accuracy(logits, labels)] == [4, 4]
    logits[0, 2, 9] = 2.0  # a wrong first token fails its own query only
    assert [t.item() for t in retrieval_accuracy(logits, labels)] == [3, 4]
    assert [t.item() for t in retrieval_accuracy(logits, labels, torch.tensor([False, True, False]))] == [2, 2]


# ---------------------------------------------------------------- HF datasets (real ones: tests/test_data_hf.py)

def test_hf_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install nsa_titan\[hf\]"):
        build_dataloader(cfg(dataset="hf", path="some/dataset"), TOK, seq_len=8, local_batch_size=1)


# ---------------------------------------------------------------- defaults and errors

def test_default_stdlib_loader():
    loader = build_dataloader(cfg(), TOK, seq_len=128, local_batch_size=2)
    b = next(loader)
    assert b["input"].shape == (2, 128) and int(b["input"].max()) < 260
    assert "def " in TOK.decode(torch.cat([x["input"] for x in take(loader, 20)]).flatten().tolist())


def test_errors(tmp_path, text_dir):
    kw = dict(seq_len=16, local_batch_size=1)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.bin").write_bytes(b"\x00")
    cases = [
        (cfg(dataset="wiki"), kw, r"data\.dataset.*'stdlib'"),
        (cfg(dataset="text_files", path=None), kw, r"data\.path is required"),
        (cfg(dataset="text_files", path=str(tmp_path / "missing")), kw, r"data\.path.*missing.*does not exist"),
        (cfg(dataset="text_files", path=str(empty)), kw, r"data\.path: no UTF-8 text"),
        (cfg(), dict(seq_len=1, local_batch_size=1), r"training\.seq_len must be an int >= 2"),
        (cfg(), dict(seq_len=16, local_batch_size=0), r"training\.local_batch_size"),
        (cfg(), dict(kw, vocab_size=200), r"model\.vocab_size >= 260"),
        (cfg(val_fraction=0.0), dict(kw, split="val"), r"data\.val_fraction > 0"),
        (cfg(val_fraction=1.5), kw, r"data\.val_fraction must be in"),
        (cfg(retrieval_mix=2.0), kw, r"data\.retrieval_mix"),
        (cfg(dataset="text_files", path=str(text_dir)), dict(seq_len=100_000, local_batch_size=1),
         r"fewer than one chunk.*training\.seq_len"),
        (cfg(), dict(kw, rank=2, world_size=2), r"rank must be in"),
    ]
    for c, k, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            build_dataloader(c, TOK, **k)
            print(c, k)  # only reached when no error was raised


def test_ids_beyond_vocab_rejected():
    class BadTok(ByteTokenizer):
        vocab_size = 100  # claims fewer ids than the bytes it emits
    with pytest.raises(ValueError, match="data.tokenizer.*vocab_size 100"):
        tokenize_documents([b"hello"], BadTok())


# ---------------------------------------------------------------- torchdata's StatefulDataLoader

def test_torchdata_workers_give_the_inline_batches_and_resume_exactly(text_dir):
    pytest.importorskip("torchdata")
    c = cfg(dataset="text_files", path=str(text_dir), retrieval_mix=0.3)
    kw = dict(seq_len=64, local_batch_size=6, rank=1, world_size=2, seed=7)
    inline = take(build_dataloader(c, TOK, **kw), 8)
    loader = build_dataloader(c, TOK, num_workers=2, **kw)
    assert loader.use_torchdata and loader.num_workers == 2
    got = take(loader, 5)
    import json

    state = json.loads(json.dumps(loader.state_dict()))  # checkpoints hold JSON, never pickles
    assert state["torchdata"] is not None
    got += take(loader, 3)
    for x, y in zip(inline, got):  # workers build batches in any order; the loader yields them in order
        assert all(torch.equal(x[k], y[k]) for k in x)
    for saved in (state, {**state, "torchdata": None}):  # torchdata's own state, or the position alone
        again = build_dataloader(c, TOK, num_workers=2, **kw)
        again.load_state_dict(saved)
        for x, y in zip(inline[5:], take(again, 3)):
            assert all(torch.equal(x[k], y[k]) for k in x)


def test_without_torchdata_the_loader_runs_inline_and_says_so(text_dir, monkeypatch):
    import nsa_titan.data.dataloader as dl

    monkeypatch.setattr(dl, "torchdata_available", lambda: False)
    lines = []
    loader = build_dataloader(cfg(dataset="text_files", path=str(text_dir)), TOK, seq_len=32, local_batch_size=2,
                              num_workers=2, log=lines.append)
    assert not loader.use_torchdata and next(loader)["input"].shape == (2, 32)
    assert len(lines) == 1 and "torchdata is not installed" in lines[0] and "pip install torchdata" in lines[0]


def test_the_key_blind_shortcut_is_what_a_model_scores_without_retrieval():
    """shortcut_accuracy against closed forms, and the 'distinct' queries' elimination effect that dense and NSA m7c
    both plateaued at on an H100 (35.9 % for 16 pairs / 16 one-digit queries: benchmarks/results/mqar_*)."""
    from nsa_titan.data.retrieval import shortcut_accuracy

    # unique values, distinct queries: the j-th of 4 queries picks among 4 - j values left -> mean of 1/4 .. 1/1
    assert shortcut_accuracy(4, 4, 10, unique_values=True, samples=2000) == pytest.approx((1/4 + 1/3 + 1/2 + 1) / 4)
    # unique values, repeated queries: nothing is eliminated -> 1 / num_pairs
    assert shortcut_accuracy(16, 16, 100, queries="repeat", unique_values=True, samples=500) == pytest.approx(1 / 16)
    distinct = shortcut_accuracy(16, 16, 10, samples=3000)
    repeat = shortcut_accuracy(16, 16, 10, queries="repeat", samples=3000)
    assert 0.34 < distinct < 0.38 and 0.21 < repeat < 0.26  # both well above 10 % chance


def test_repeat_queries_and_unique_values_change_the_samples_as_documented():
    task = RetrievalTask(TOK, 200, num_pairs=4, num_queries=12, key_len=1, value_len=2, min_gap=16, seed=3,
                         queries="repeat", unique_values=True)
    for i in range(5):
        tokens, mask, layout = task.sample_with_layout(i)
        pair_values = tokens[layout.pair_value_pos[:, None] + np.arange(2)]
        answers = tokens[layout.answer_pos[:, None] + np.arange(2)]
        assert (answers == pair_values).all()  # every query still answers its own pair
        assert len({tuple(v) for v in pair_values}) == len(set(layout.pair_value_pos.tolist()))  # unique values
        assert len(set(layout.pair_value_pos.tolist())) < 12  # 12 queries over 4 pairs: repeats
    assert task.shortcut == pytest.approx(1 / 4, abs=0.01)
    with pytest.raises(ValueError, match="retrieval_value_len"):
        RetrievalTask(TOK, 400, num_pairs=16, num_queries=4, value_len=1, unique_values=True)
    with pytest.raises(ValueError, match="retrieval_queries"):
        RetrievalTask(TOK, 200, num_pairs=4, num_queries=4, queries="sometimes")


def test_retrieval_curriculum_grows_the_pair_distance_then_matches_the_plain_task():
    """data.retrieval_curriculum_steps: early training samples keep their pairs next to the gap, the reach grows
    with the sample index, later samples (and every validation sample) are exactly the plain task's."""
    kw = dict(num_pairs=8, num_queries=16, value_len=2, unique_values=True, queries="repeat", min_gap=16, seed=5)
    plain, cur = RetrievalTask(TOK, 600, **kw), RetrievalTask(TOK, 600, **kw, curriculum_samples=100)
    free = plain.pair_region - plain.num_pairs * plain.pair_len

    def farthest_before(task, i):  # tokens after BOS before the earliest queried pair
        _, _, lay = task.sample_with_layout(i)
        return int(lay.pair_value_pos.min()) - task.key_len - 1

    reach = [free - min(farthest_before(cur, i) for i in range(j, j + 5)) for j in (0, 20, 50, 95)]
    assert reach[0] <= free * 5 // 100 + cur.pair_len * cur.num_pairs  # first samples: pairs near the gap
    assert reach[0] < reach[1] < reach[2] < reach[3]
    for i in (100, 150):  # the curriculum is over: the plain task, sample for sample
        assert all(np.array_equal(a, b) for a, b in zip(plain.sample(i), cur.sample(i)))
    val_plain = RetrievalTask(TOK, 600, **kw, stream=1)
    val_cur = RetrievalTask(TOK, 600, **kw, stream=1, curriculum_samples=100)
    assert np.array_equal(val_plain.sample(0)[0], val_cur.sample(0)[0])
    tokens, mask = cur.sample(3)  # still a valid sample: every answer supervised
    assert mask.sum() == kw["num_queries"] * kw["value_len"]


def test_retrieval_curriculum_steps_reach_the_loader(text_dir):
    """The config's steps become global sample indices: local batch x grad accumulation x ranks per step."""
    from nsa_titan.config import load_job_config

    cfg = load_job_config(["--data.dataset", "retrieval", "--data.retrieval_curriculum_steps", "3",
                           "--data.retrieval_min_gap", "64"]).data
    loader = build_dataloader(cfg, TOK, seq_len=400, local_batch_size=2, world_size=2, rank=1, grad_accum_steps=4)
    assert loader.dataset.assembler.retrieval.curriculum_samples == 3 * 2 * 4 * 2
    with pytest.raises(Exception, match="retrieval_curriculum_steps"):
        load_job_config(["--data.retrieval_curriculum_steps", "-1"])
