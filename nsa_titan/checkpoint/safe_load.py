"""Read DCP checkpoints without running code stored in them.

``torch.distributed.checkpoint`` itself unpickles in two places when it loads:

- ``.metadata`` (the index of every tensor) is read with plain ``pickle.load``: a crafted file runs any
  code it likes while it is being read;
- every non-tensor value ("bytes" entries) is read with ``torch.load(weights_only=False)``: the same.

nsa_titan's own checkpoints hold tensors only (the host state is JSON bytes in a uint8 tensor, see
``state.py``), so loading can refuse both: ``SafeFileSystemReader`` unpickles ``.metadata`` with an
allow-list of the handful of classes DCP writes there (metadata dataclasses, ``torch.Size``, dtypes,
paths) and ``TensorOnlyLoadPlanner`` refuses any "bytes" entry before it is read. Tensor data are read by
DCP with ``torch.load(weights_only=True)``, torch's own restricted unpickler.

A checkpoint that needs anything else (e.g. one written by another tool with pickled objects) fails with
``UnsafeCheckpointError`` naming the class or entry, instead of executing it.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

# (module, name) pairs that DCP's .metadata may reference (torch 2.9 - 2.13); torch dtypes are allowed by type.
_ALLOWED_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
})


class UnsafeCheckpointError(RuntimeError):
    """The checkpoint asks for something whose loading could run code; it is refused, not loaded."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f".metadata references {module}.{name}, which is not one of the classes DCP writes there; refusing to "
            "unpickle it (a crafted checkpoint could run code this way). Only load checkpoints from sources you "
            "trust like code; for weights from elsewhere use a safetensors export")


def read_metadata_safely(path: str | os.PathLike) -> Metadata:
    """DCP's ``.metadata`` of a checkpoint folder, unpickled with the allow-list above."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        data = f.read()
    meta = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(meta, Metadata):
        raise UnsafeCheckpointError(f"{path}/.metadata does not hold DCP Metadata (got {type(meta).__name__})")
    for info in (meta.storage_data or {}).values():
        # Load-time transforms (e.g. decompression) are plug-ins chosen by name in the file; we never write any.
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(f"{path}: entries use load-time transforms {info.transform_descriptors}, "
                                        "which nsa_titan never writes; refusing to apply them")
    return meta


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` is unpickled with an allow-list (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: not written by nsa_titan
            raise UnsafeCheckpointError(f"{self.path}: per-rank .metadata files are not supported")
        meta = read_metadata_safely(self.path)
        meta.storage_meta = meta.storage_meta or StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """Refuses non-tensor entries: DCP would read them with ``torch.load(weights_only=False)``."""

    def create_local_plan(self):
        for fqn in self.state_dict:
            if isinstance(self.metadata.state_dict_metadata.get(fqn), BytesStorageMetadata):
                raise UnsafeCheckpointError(
                    f"checkpoint entry {fqn!r} is a pickled object, not a tensor; nsa_titan checkpoints hold tensors "
                    "only, so this one was written by something else; refusing to unpickle it")
        return super().create_local_plan()

    def load_bytes(self, read_item, value) -> None:
        raise UnsafeCheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; refusing it")


def load_tensors(state: dict[str, Any], path: str | os.PathLike, *, no_dist: bool = True) -> None:
    """``dcp.load`` of a tensors-only ``state`` (filled in place) from ``path``, without unpickling code."""
    with warnings.catch_warnings():  # DCP warns that it assumes single-process use when no_dist: the intent
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=TensorOnlyLoadPlanner(),
                     no_dist=no_dist)
        except CheckpointException as e:  # DCP wraps every rank's error: report a refusal as itself
            refusals = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeCheckpointError)]
            if refusals:
                raise refusals[0] from None
            raise
