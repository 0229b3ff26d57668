"""The checkpoint folder on disk: names, the manifest (marker) with a checksum per file, and the renames that
make a save appear all at once. The one home of the layout (``MARKER``, ``step-N``, ``.tmp-``, ``.trash-``,
``export-``): the manager and the exporter both read it from here.

A complete checkpoint ``step-N`` holds DCP's files plus ``nsa_checkpoint.json`` (the marker), which lists
every file with its size and CRC-32. Checking sizes is instant (it catches truncated and missing files);
checking the CRCs reads every byte (it catches same-size damage: zeroed or overwritten blocks) and runs when
a checkpoint is about to be loaded. The CRC guards against disk and copy faults only: whoever can write the
files can rewrite the marker too (see safe_load.py for what loading refuses to trust).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MARKER = "nsa_checkpoint.json"
# 2: host state as JSON in uint8 tensors (no pickled entries) and a CRC-32 per file. Format 1 (pickled host
# state, sizes only) is refused: loading it would unpickle data from the file.
FORMAT_VERSION = 2
TMP_PREFIX = ".tmp-"  # a save in progress: .tmp-step-N
TRASH_PREFIX = ".trash-"  # a folder set aside to be deleted: .trash-step-N-<pid>-<ns>
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 16 << 20
# zlib.crc32 releases the GIL on large buffers, so files are checksummed in parallel threads.
_CHECKSUM_THREADS = 8


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def export_dir_name(checkpoint_name: str) -> str:
    """The model-only export of checkpoint ``step-N`` goes beside it, into ``export-step-N``."""
    return f"export-{checkpoint_name}"


def file_checksum(path: str | os.PathLike) -> str:
    """CRC-32 of a file's bytes as 8 hex digits (zlib: several GB/s per core)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _checksums(folder: Path, names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(_CHECKSUM_THREADS, len(names))) as pool:
        return dict(zip(names, pool.map(lambda n: file_checksum(folder / n), names)))


def write_marker(folder: Path, meta: dict[str, Any]) -> None:
    """Write the marker listing every file of ``folder`` with its size and CRC-32; fsync it."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MARKER)
    crcs = _checksums(folder, names)
    files = {n: {"size": (folder / n).stat().st_size, "crc32": crcs[n]} for n in names}
    with open(folder / MARKER, "w") as f:
        json.dump({**meta, "format": FORMAT_VERSION, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(folder)


def inspect_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any] | None, str | None]:
    """(marker, None) for a complete checkpoint folder, else (None, what is wrong). Sizes only: instant."""
    path = Path(path)
    if not path.is_dir():
        return None, "not a folder" if path.exists() else "does not exist"
    try:
        meta = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return None, f"no {MARKER}: the save did not finish"
    except (OSError, ValueError) as e:
        return None, f"unreadable {MARKER} ({e})"
    if isinstance(meta, dict) and meta.get("format") != FORMAT_VERSION:
        return None, (f"{MARKER} says format {meta.get('format')!r}; this nsa_titan reads format {FORMAT_VERSION} "
                      "(format 1 stored pickled state, which is never loaded: it could run code)")
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or ".metadata" not in files or not isinstance(meta.get("step"), int):
        return None, f"{MARKER} lacks the step or file list"
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
            return None, f"{MARKER} has no size for {name}"
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return None, f"file {name} is missing"
        if actual != entry["size"]:
            return None, f"file {name} has {actual} bytes, {entry['size']} were written"
    return meta, None


def checksum_problems(path: str | os.PathLike, meta: dict[str, Any], *, rank: int = 0,
                      world_size: int = 1) -> list[str]:
    """Files of a checkpoint whose CRC-32 differs from its marker. Rank r reads the files i % world_size == r,
    so ranks that share the folder split the work (combine their answers before acting on them)."""
    names = sorted(meta["files"])[rank::world_size]
    got = _checksums(Path(path), names)
    return [f"file {n}: CRC-32 {got[n]}, {meta['files'][n].get('crc32')} was written" for n in names
            if got[n] != meta["files"][n].get("crc32")]


def list_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """``step-N`` folders (complete or not) in ascending step order."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def list_unfinished(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """``.tmp-step-N`` folders (saves that were interrupted, complete or not) in ascending step order."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if p.name.startswith(TMP_PREFIX) and (m := _STEP_DIR.match(p.name[len(TMP_PREFIX):])) and p.is_dir()]
    return sorted(found)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def set_aside(path: Path) -> Path | None:
    """Rename ``path`` to a hidden .trash folder beside it (atomic); None if it did not exist."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return None
    return trash


def remove_dir(path: Path) -> None:
    """Rename, then delete: a kill mid-delete leaves a hidden .trash folder, never a half-deleted step-N."""
    trash = set_aside(path)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def replace_dir(new: Path, final: Path) -> None:
    """Make ``new`` visible as ``final``. An existing ``final`` is set aside first and deleted only after
    ``new`` is in place, so at every moment a complete copy exists under ``final`` or ``new``'s name (the
    start-up recovery of CheckpointManager finishes a replace that a kill interrupted)."""
    old = set_aside(final) if final.exists() else None
    os.rename(new, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_probe(path: Path) -> None:
    with open(path, "xb") as f:
        f.write(b"\0" * 4096)
        f.flush()
        os.fsync(f.fileno())
    os.unlink(path)


def _errors(exc: BaseException):
    """exc, its causes, and (for DCP's CheckpointException) every rank's error and their causes."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        todo += [pair[0] for pair in (getattr(e, "failures", None) or {}).values()]


def describe_write_error(folder: Path, exc: BaseException, need_bytes: int = 0) -> str | None:
    """What keeps ``folder`` from being written, in words (disk full, read-only, no permission, a file in the
    way), or None when the error is something else. torch's writer reports a full disk only as
    "unexpected pos N vs M", so a full disk is also recognised by the free space left."""
    codes = {getattr(e, "errno", None) for e in _errors(exc)} - {None}
    base = _existing_parent(folder)
    if codes & {errno.EROFS}:
        return f"{folder} is on a read-only file system"
    if codes & {errno.EACCES, errno.EPERM}:
        return f"{folder} is not writable by this user (permission denied)"
    if codes & {errno.ENOTDIR, errno.EEXIST} and base.is_file():
        return f"{base} is a file, not a folder"
    try:
        free = shutil.disk_usage(base).free
    except OSError:
        return None
    if not codes & {errno.ENOSPC, errno.EDQUOT} and (codes or free >= max(need_bytes, 1 << 20)):
        return None  # another OS error (reported as it is), or enough space: not a full disk
    need = f", about {_size(need_bytes)} were to be written" if need_bytes else ""
    return f"the disk holding {folder} is full ({_size(free)} free{need})"


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def _existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable_problem(folder: str | os.PathLike) -> str | None:
    """None when a file can be created, written, fsynced and removed in ``folder`` (created if missing), else
    what is wrong: checked at start-up so that a read-only or full disk fails now, not at the first save."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_probe(folder / f".write-test-{os.getpid()}-{time.monotonic_ns()}")
    except OSError as e:
        return describe_write_error(folder, e) or f"{folder} cannot be written ({e.strerror or e})"
    return None
