"""Hugging Face ``datasets`` as a document source: local files and globs (parquet, arrow, jsonl/json, txt, csv)
or a Hub name with a config name and split, streamed and split between ranks by ``split_dataset_by_node``.

Why streaming for local files too: nothing is converted or cached on disk, every rank opens only the files
it reads, and the dataset's own ``state_dict`` says where in which file a rank stopped, so a resume continues
mid-file. Each file (Hub: each shard file) is one shard; with a number of shards divisible by the data
ranks, each rank streams whole shards of its own and no shard is read by two ranks. Otherwise
``split_dataset_by_node`` has every rank read every shard and keep one example in W (correct, but each
rank reads everything): ``HFSource`` says so in its ``note``.

Order: for training, the shard order of each epoch is a permutation drawn from (seed, epoch), the same on
every rank (so the ranks' shard sets stay disjoint); examples within a shard keep their order. Local files
only: Hub shards stream in their published order (``datasets``' own buffer shuffle cannot resume exactly).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np

from .corpus import in_split

__all__ = ["BUILDERS", "HFSource", "local_data_files"]

_HF_INSTALL_HINT = "pip install nsa_titan[hf]"
# File extension -> the `datasets` builder that reads it (and its keyword arguments).
BUILDERS = {".parquet": ("parquet", {}), ".arrow": ("arrow", {}), ".jsonl": ("json", {}), ".json": ("json", {}),
            ".txt": ("text", {"sample_by": "document"}), ".md": ("text", {"sample_by": "document"}),
            ".csv": ("csv", {})}


def local_data_files(path: str) -> list[str] | None:
    """Sorted data files named by a local file, folder (recursive) or glob; None when ``path`` is no local
    path (then it is a Hub name). Raises when the files are of several kinds or of none we can read."""
    if any(c in path for c in "*?["):
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not files:
            raise ValueError(f"data.path: the glob {path!r} matches no files")
    elif os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = sorted(os.path.join(d, n) for d, dirs, names in os.walk(path) for n in names
                       if not n.startswith(".") and os.path.splitext(n)[1].lower() in BUILDERS)
        if not files:
            raise ValueError(f"data.path: folder {path!r} holds no {'/'.join(BUILDERS)} files")
    else:
        return None
    kinds = sorted({os.path.splitext(f)[1].lower() for f in files})
    unknown = [k for k in kinds if k not in BUILDERS]
    if unknown:
        raise ValueError(f"data.path: cannot read {unknown} files as a dataset ({files[0]!r}, ...); "
                         f"use {', '.join(BUILDERS)} files")
    if len({BUILDERS[k][0] for k in kinds}) > 1:
        raise ValueError(f"data.path: {path!r} mixes file kinds {kinds}; point it at one kind (e.g. a glob "
                         f"{os.path.join(path, '*' + kinds[0])!r})")
    return files


def _datasets():
    try:
        import datasets  # noqa: PLC0415 - optional (heavy)
        from datasets.distributed import split_dataset_by_node  # noqa: PLC0415 - optional
    except ImportError as e:
        raise ImportError(f"data.dataset=\"hf\" needs the `datasets` package; install it with "
                          f"`{_HF_INSTALL_HINT}`") from e
    return datasets, split_dataset_by_node


class HFSource:
    """Documents of one rank: ``open(epoch)`` -> a ``datasets.IterableDataset`` of this rank's shards;
    ``documents(ds)`` -> its texts as bytes (with the hashed train/val hold-out when ``val_fraction`` > 0)."""

    def __init__(self, path: str, *, config: str | None, hf_split: str, text_field: str, rank: int, world_size: int,
                 seed: int, shuffle: bool, holdout: tuple[str, float] | None):
        """holdout: (split, val_fraction) to keep only that side of the hashed train/val split, or None."""
        self.path, self.config, self.hf_split, self.text_field = path, config, hf_split, text_field
        self.rank, self.world_size, self.seed, self.shuffle = int(rank), int(world_size), int(seed), bool(shuffle)
        self.holdout = holdout
        self.files = local_data_files(path)
        self._datasets, self._split = _datasets()
        self._cache: dict[int, Any] = {}
        self.total_shards = 0
        ds = self.open(0)  # fail now (missing package, bad name, no such field), not at the first batch
        self.num_shards = int(ds.n_shards)
        try:
            first = next(iter(ds))
        except StopIteration:
            raise ValueError(f"data.path: {path!r} (split {hf_split!r}) holds no examples for rank {rank} of "
                             f"{world_size}; use more files or fewer ranks") from None
        if text_field not in first:
            raise ValueError(f"data.hf_text_field: examples of {path!r} have no field {text_field!r}; their fields "
                             f"are {sorted(first)}: pass --data.hf_text_field NAME")
        self.note = None
        if self.total_shards % self.world_size:
            self.note = (f"data.path has {self.total_shards} shard(s), not a multiple of {self.world_size} data ranks: "
                         "every rank reads every shard and keeps 1 example in W; a multiple of W files lets each rank "
                         "read only its own")

    def open_unsplit(self, epoch: int):
        ds_mod = self._datasets
        if self.files is None:  # a Hub name (or a dataset script / folder with its own loading code)
            return ds_mod.load_dataset(self.path, self.config, split=self.hf_split, streaming=True)
        files = list(self.files)
        if self.shuffle:
            order = np.random.default_rng([self.seed & ((1 << 64) - 1), 7, epoch]).permutation(len(files))
            files = [files[i] for i in order]
        builder, kwargs = BUILDERS[os.path.splitext(files[0])[1].lower()]
        # A local file set has a single split, which `datasets` calls "train" whatever data.hf_split says.
        return ds_mod.load_dataset(builder, data_files={"train": files}, split="train", streaming=True, **kwargs)

    def open(self, epoch: int):
        """This rank's stream of the epoch (shards assigned by ``split_dataset_by_node``); cached, since opening
        costs seconds and a worker process inherits the main process's epoch-0 object."""
        if epoch not in self._cache:
            whole = self.open_unsplit(epoch)
            self.total_shards = int(whole.n_shards)
            self._cache = {epoch: self._split(whole, rank=self.rank, world_size=self.world_size)}
        return self._cache[epoch]

    def text_of(self, example: dict) -> bytes | None:
        """The example's text as UTF-8, or None when it is empty or on the other side of the hashed hold-out."""
        text = example.get(self.text_field)
        if not isinstance(text, str):
            raise ValueError(f"data.hf_text_field: field {self.text_field!r} of {self.path!r} holds "
                             f"{type(text).__name__}, not text; pass the name of a text column with "
                             "--data.hf_text_field")
        # Hash the text, not the position: after a shard shuffle a position holds another example.
        if not text or (self.holdout is not None and not in_split(text[:4096], *self.holdout)):
            return None
        return text.encode("utf-8")
