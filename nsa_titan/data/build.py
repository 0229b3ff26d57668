"""``build_dataloader``: turn the ``[data]`` config section into a StatefulLoader.

The config is taken by duck typing (getattr with defaults) so this package does not
import the config module, and tests can pass a SimpleNamespace.
"""

from __future__ import annotations

import types

from .corpus import stdlib_documents, text_file_documents, tokenize_documents
from .dataloader import StatefulLoader
from .hf_source import HFSource
from .loader import BatchAssembler, MapBatches, PackedTextDataset
from .retrieval import RetrievalTask
from .stream import PackedStream

__all__ = ["DATASETS", "DATA_DEFAULTS", "build_dataloader", "retrieval_task_kwargs"]

DATASETS = ("stdlib", "retrieval", "text_files", "hf")

# Used only for fields a config object lacks; the [data] dataclass is the real source of defaults.
DATA_DEFAULTS = types.MappingProxyType({
    "dataset": "stdlib",
    "path": None,
    "tokenizer": "byte",
    "hf_split": "train",
    "hf_text_field": "text",
    "hf_config": None,
    "val_path": None,
    "val_split": None,
    "prefetch_factor": 2,
    "val_fraction": 0.01,
    "retrieval_num_pairs": 16,
    "retrieval_num_queries": 16,
    "retrieval_queries": "repeat",
    "retrieval_unique_values": False,
    "retrieval_key_len": 1,
    "retrieval_value_len": 1,
    "retrieval_min_gap": None,
    "retrieval_filler": "corpus",
    "retrieval_curriculum_steps": 0,
    "retrieval_mix": 0.0,
    "on_error": "skip",
})


def _cfg(data_cfg, name):
    return getattr(data_cfg, name, DATA_DEFAULTS[name])


def build_dataloader(data_cfg, tokenizer, *, seq_len: int, local_batch_size: int, rank: int = 0,
                     world_size: int = 1, seed: int = 42, split: str = "train",
                     vocab_size: int | None = None, pin_memory: bool | None = None, report=None,
                     window: int | None = None, num_workers: int | None = None, log=None,
                     grad_accum_steps: int = 1) -> StatefulLoader:
    """Loader for this rank's shard of ``split`` ("train" or "val").

    Both splits are infinite: train reshuffles documents every epoch; val is read in a
    fixed order and cycles (call ``loader.reset()`` or build a fresh loader to evaluate
    the same batches each time). ``vocab_size`` (the model's) is checked against the
    tokenizer when given. ``report``: where warnings about skipped files go (default: warnings.warn).
    ``window`` (the model's sliding window) is the retrieval task's gap when ``data.retrieval_min_gap`` is None.
    In-memory corpora (stdlib, text_files) are read and tokenized here, once, and kept by the loader;
    "hf" data are streamed: only this rank's shards are read, tokenized where the batches are built.
    ``num_workers``: None builds batches inline; an int uses torchdata's StatefulDataLoader with that many
    worker processes when torchdata is installed (``log`` says when it is not). ``grad_accum_steps``: micro-batches
    per optimizer step, which turns ``data.retrieval_curriculum_steps`` into global sample indices.
    """
    dataset = _cfg(data_cfg, "dataset")
    if dataset not in DATASETS:
        raise ValueError(f"data.dataset: unknown dataset {dataset!r}; valid choices are {list(DATASETS)}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"training.seq_len must be an int >= 2 (one input and one target token at least), "
                         f"got {seq_len!r}")
    if not isinstance(local_batch_size, int) or local_batch_size < 1:
        raise ValueError(f"training.local_batch_size must be an int >= 1, got {local_batch_size!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
    if split not in ("train", "val"):
        raise ValueError(f"split must be \"train\" or \"val\", got {split!r}")
    val_fraction = float(_cfg(data_cfg, "val_fraction"))
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction!r}")
    mix = float(_cfg(data_cfg, "retrieval_mix"))
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"data.retrieval_mix must be a fraction in [0, 1], got {mix!r}")
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"data.tokenizer has vocab_size {tokenizer.vocab_size} but model.vocab_size is {vocab_size}: "
            f"token ids would index past the embedding; set model.vocab_size >= {tokenizer.vocab_size}"
        )
    path = _cfg(data_cfg, "path")
    if dataset in ("text_files", "hf") and not path:
        raise ValueError(f"data.path is required for data.dataset={dataset!r}; set it to the text to train on")
    val_path, val_split = _cfg(data_cfg, "val_path"), _cfg(data_cfg, "val_split")
    separate_val = bool(val_path or val_split)  # then nothing is held out of data.path
    text_field = _cfg(data_cfg, "hf_text_field")

    text = None
    filler = None
    # Each rank reads and tokenizes only its own documents (shard); its chunks are then all its own.
    shard = (int(rank), int(world_size))
    filler_kind = _cfg(data_cfg, "retrieval_filler")
    if dataset == "text_files" or (dataset == "retrieval" and path):
        if separate_val:  # all of data.path trains; data.val_path is the val set
            src, part, frac = (val_path if split == "val" else path), "train", 0.0
        else:
            src, part, frac = path, split, val_fraction
        corpus = tokenize_documents(text_file_documents(src, part, frac, on_error=_cfg(data_cfg, "on_error"),
                                                        report=report, text_field=text_field, shard=shard), tokenizer)
    elif dataset == "stdlib" or (dataset == "retrieval" and filler_kind == "corpus"):
        corpus = tokenize_documents(stdlib_documents(split, val_fraction, shard=shard), tokenizer)
    else:
        corpus = None
    if dataset != "retrieval" and dataset != "hf":
        text = PackedTextDataset(corpus, seq_len, rank=0, world_size=1, seed=seed, shuffle=(split == "train"))
    if corpus is not None and filler_kind == "corpus":
        filler = corpus.tokens  # retrieval filler is real text when we have it

    retrieval = None
    if dataset == "retrieval" or mix > 0.0:
        # Raises now, not mid-training, if the layout cannot fit seq_len.
        # Global sample indices per optimizer step: every rank's micro-batches (loader.py: k * world_size + rank).
        per_step = local_batch_size * int(grad_accum_steps) * world_size
        retrieval = RetrievalTask(tokenizer, seq_len, **retrieval_task_kwargs(data_cfg, window), seed=seed,
                                  stream=1 if split == "val" else 0, filler_tokens=filler,
                                  filler_eos_id=None if corpus is None else corpus.eos_id,
                                  curriculum_samples=int(_cfg(data_cfg, "retrieval_curriculum_steps")) * per_step)
    assembler = BatchAssembler(retrieval, seq_len=seq_len, batch_size=local_batch_size, retrieval_mix=mix, seed=seed,
                               rank=rank, world_size=world_size, split=split, has_text=dataset != "retrieval")
    if dataset == "hf":
        dataset_obj = PackedStream(_hf_source(data_cfg, split, rank, world_size, seed, val_fraction, log), tokenizer,
                                   assembler)
    else:
        dataset_obj = MapBatches(text, assembler)
    identity = {"seed": int(seed), "rank": int(rank), "world_size": int(world_size), "seq_len": int(seq_len),
                "split": split, "retrieval_mix": assembler.retrieval_mix,
                "chunks_per_rank": None if text is None else text.chunks_per_rank}
    return StatefulLoader(dataset_obj, identity=identity, num_workers=_workers(num_workers, dataset_obj, log),
                          prefetch_factor=int(_cfg(data_cfg, "prefetch_factor")), pin_memory=pin_memory, log=log)


def retrieval_task_kwargs(data_cfg, window: int | None) -> dict:
    """RetrievalTask's shape arguments from the ``[data]`` section; ``window``: the model's, the gap's default."""
    gap = _cfg(data_cfg, "retrieval_min_gap")
    if gap is None:
        if window is None:
            raise ValueError("data.retrieval_min_gap is None (= the model's window) but no window was given; "
                             "pass build_dataloader(..., window=model_args.window) or set data.retrieval_min_gap")
        gap = window
    return {"num_pairs": int(_cfg(data_cfg, "retrieval_num_pairs")),
            "num_queries": int(_cfg(data_cfg, "retrieval_num_queries")),
            "key_len": int(_cfg(data_cfg, "retrieval_key_len")),
            "value_len": int(_cfg(data_cfg, "retrieval_value_len")),
            "queries": str(_cfg(data_cfg, "retrieval_queries")),
            "unique_values": bool(_cfg(data_cfg, "retrieval_unique_values")),
            "min_gap": int(gap)}


def _hf_source(data_cfg, split, rank, world_size, seed, val_fraction, log) -> HFSource:
    """This rank's share of the train or val documents of an "hf" dataset."""
    path, val_path, val_split = _cfg(data_cfg, "path"), _cfg(data_cfg, "val_path"), _cfg(data_cfg, "val_split")
    hf_split, holdout = _cfg(data_cfg, "hf_split"), None
    if split == "val" and (val_path or val_split):
        path, hf_split = val_path or path, val_split or hf_split
    elif not (val_path or val_split):
        if split == "val" and val_fraction == 0.0:
            raise ValueError("split=\"val\" needs data.val_fraction > 0 (e.g. 0.01), data.val_path or data.val_split; "
                             "none is set, so there is no held-out text")
        holdout = (split, val_fraction) if val_fraction > 0 else None
    source = HFSource(path, config=_cfg(data_cfg, "hf_config"), hf_split=hf_split,
                      text_field=_cfg(data_cfg, "hf_text_field"), rank=rank, world_size=world_size, seed=seed,
                      shuffle=split == "train", holdout=holdout)
    if source.note and log is not None and split == "train":
        log(f"WARNING: {source.note}")
    return source


def _workers(num_workers: int | None, dataset_obj, log) -> int | None:
    """A stream splits its shards over the workers: more workers than shards would leave some without data."""
    if num_workers is None or isinstance(dataset_obj, MapBatches):
        return num_workers
    shards = dataset_obj.source.open(0).n_shards
    if num_workers > shards:
        if log is not None:
            log(f"data: {shards} shard(s) on this rank for data.num_workers={num_workers}: using {shards} worker(s)")
        return shards
    return num_workers
