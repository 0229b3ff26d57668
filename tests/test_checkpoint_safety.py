"""Checkpoints that trust nothing and lose nothing: loading runs no code from the files, corruption is found by
checksums, and an interrupted re-save of a step is finished rather than thrown away (issue 16)."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch

from _ckpt_util import StopAt, ckpt_args, run
from nsa_titan.checkpoint import list_checkpoints, step_dir_name

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py says why


class CreatesFile:
    """Unpickling this calls open(path, "w"): proof that loading ran code named by the file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def tamper(folder, name: str, data: bytes) -> None:
    """Replace a checkpoint file and fix up its marker, as a deliberate attacker (not a disk fault) would."""
    (folder / name).write_bytes(data)
    marker = folder / "nsa_checkpoint.json"
    meta = json.loads(marker.read_text())
    entry = meta["files"][name]
    if isinstance(entry, dict):
        from nsa_titan.checkpoint.folder import file_checksum

        entry.update(size=len(data), crc32=file_checksum(folder / name))
    else:
        meta["files"][name] = len(data)
    marker.write_text(json.dumps(meta))


def test_resume_never_unpickles_code_from_the_metadata(tmp_path):
    run(ckpt_args(tmp_path), hooks=StopAt(11))
    folder = tmp_path / "checkpoints"
    pwned = tmp_path / "pwned"
    tamper(folder / step_dir_name(10), ".metadata", pickle.dumps(CreatesFile(pwned)))
    _, out = run(ckpt_args(tmp_path, steps=12))
    assert not pwned.exists(), "loading the checkpoint ran code stored in its .metadata"
    assert "refusing to unpickle" in out and "io.open, which is not one of the classes" in out
    assert f"resumed from {folder / step_dir_name(5)}" in out  # the next good checkpoint


def test_inference_loading_refuses_pickled_entries_and_metadata(tmp_path):
    import torch.distributed.checkpoint as dcp

    from nsa_titan.checkpoint.load import load_weights
    from nsa_titan.checkpoint.safe_load import UnsafeCheckpointError, load_tensors

    pwned = tmp_path / "pwned"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"weight": torch.ones(3), "extra": CreatesFile(pwned)}, checkpoint_id=str(tmp_path / "a"),
                 no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match="'extra' is a pickled object"):
        load_tensors({"weight": torch.zeros(3), "extra": torch.zeros(0)}, tmp_path / "a")
    got = {"weight": torch.zeros(3)}
    load_tensors(got, tmp_path / "a")  # tensors alone load
    assert torch.equal(got["weight"], torch.ones(3))

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / ".metadata").write_bytes(pickle.dumps(CreatesFile(pwned)))
    with pytest.raises(UnsafeCheckpointError, match=r"references io.open"):
        load_weights(torch.nn.Linear(3, 1), tmp_path / "b")  # what generate / eval call
    assert not pwned.exists()


def test_checkpoints_hold_no_pickled_entries(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from nsa_titan.checkpoint.safe_load import read_metadata_safely

    run(ckpt_args(tmp_path, steps=2, interval=2))
    entries = read_metadata_safely(tmp_path / "checkpoints" / step_dir_name(2)).state_dict_metadata
    pickled = [k for k, m in entries.items() if isinstance(m, BytesStorageMetadata)]
    assert not pickled and "trainer" in entries and "rank_state.rank0.json" in entries
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [2]


@pytest.mark.parametrize("fill", [0x00, 0x7F])
def test_same_size_damage_is_caught_by_the_checksums(tmp_path, fill):
    """64 KiB overwritten inside the newest checkpoint (sizes unchanged): resume warns and falls back instead of
    loading other weights (zeros) or NaNs (0x7f bytes), which the non-finite stop would then save as good."""
    run(ckpt_args(tmp_path), hooks=StopAt(11))
    folder = tmp_path / "checkpoints"
    data = max((folder / step_dir_name(10)).glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 65536] = bytes([fill]) * len(raw[middle:middle + 65536])
    data.write_bytes(bytes(raw))
    _, out = run(ckpt_args(tmp_path, steps=12))
    assert f"loading checkpoint {folder / step_dir_name(10)} failed" in out and f"file {data.name}: CRC-32" in out
    assert f"resumed from {folder / step_dir_name(5)}" in out
    meta = json.loads((folder / step_dir_name(12) / "nsa_checkpoint.json").read_text())
    assert all(len(e["crc32"]) == 8 for e in meta["files"].values())  # the new saves carry checksums again


def test_a_resave_killed_between_its_renames_is_finished_at_start_up(tmp_path):
    """A re-save of step 10 was killed after the old step-10 was set aside and before the new one was renamed
    in: the complete .tmp-step-10 is used (not deleted, which would silently restart from an older step), and
    the .trash folders are removed."""
    run(ckpt_args(tmp_path), hooks=StopAt(11))
    folder = tmp_path / "checkpoints"
    name = step_dir_name(10)
    shutil.copytree(folder / name, folder / f".tmp-{name}")
    (folder / name).rename(folder / f".trash-{name}-123-456")
    shutil.copytree(folder / step_dir_name(5), folder / f".trash-{step_dir_name(5)}-1-2")
    (folder / f".tmp-{step_dir_name(15)}").mkdir()  # a save that never finished: still removed
    _, out = run(ckpt_args(tmp_path, steps=12))
    assert f"renaming it to {name}" in out and f"resumed from {folder / name}" in out
    assert sorted(p.name for p in folder.iterdir()) == [step_dir_name(5), name, step_dir_name(12)]

