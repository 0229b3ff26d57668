"""Build a real-data example on a machine without a network: a folder of parquet shards and a BPE tokenizer folder.

    python benchmarks/make_parquet_corpus.py OUT_DIR [--source DIR] [--shards 8] [--vocab 4096]

Documents are the UTF-8 files under ``--source`` (default: this Python's standard library, real text found on
every machine), one per row of a ``text`` column (plus ``path``), spread over ``--shards`` parquet files, with
2 % of them in ``OUT_DIR/val/``. The tokenizer is a byte-level BPE trained on the train shards and saved as a
Hugging Face tokenizer folder: ``tokenizer.json`` + ``tokenizer_config.json`` (whose ``eos_token`` nsa_titan
packs between documents). Needs ``pyarrow`` and ``tokenizers`` (``pip install nsa_titan[hf] pyarrow``).
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import zlib
from pathlib import Path


def documents(source: str, suffixes=(".py", ".txt", ".rst", ".md")) -> list[tuple[str, str]]:
    out = []
    for d, dirs, names in os.walk(source):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__") and not x.startswith("."))
        for n in sorted(names):
            if n.endswith(suffixes):
                p = os.path.join(d, n)
                try:
                    out.append((os.path.relpath(p, source), Path(p).read_text(encoding="utf-8")))
                except (UnicodeDecodeError, OSError):
                    continue
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--source", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    a = ap.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tokenizers

    docs = documents(a.source)
    out = Path(a.out_dir)
    (out / "train").mkdir(parents=True, exist_ok=True)
    (out / "val").mkdir(exist_ok=True)
    val = [d for d in docs if zlib.crc32(d[0].encode()) % 50 == 0]
    train = [d for d in docs if zlib.crc32(d[0].encode()) % 50 != 0]
    for s in range(a.shards):
        part = train[s::a.shards]
        pq.write_table(pa.table({"path": [p for p, _ in part], "text": [t for _, t in part]}),
                       out / "train" / f"part-{s:05d}.parquet")
    pq.write_table(pa.table({"path": [p for p, _ in val], "text": [t for _, t in val]}),
                   out / "val" / "part-00000.parquet")

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=["<|endoftext|>", "<|pad|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((t for _, t in train), trainer=trainer)
    (out / "tokenizer").mkdir(exist_ok=True)
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
        "pad_token": "<|pad|>", "model_max_length": 1 << 20}, indent=1) + "\n")
    n_tokens = sum(len(e.ids) for e in tok.encode_batch([t for _, t in train]))
    print(f"{len(train)} train documents in {a.shards} shards ({n_tokens:,} tokens), {len(val)} val documents, "
          f"tokenizer with {tok.get_vocab_size()} tokens in {out / 'tokenizer'}")


if __name__ == "__main__":
    main()
