"""Bad input and bad disks are reported as such, before any model is built where that is possible (issue 16):
data files that cannot train, folders that cannot be written, a disk that fills up during a save."""

from __future__ import annotations

import errno

import pytest
import torch

from _ckpt_util import args, ckpt_args, run
from nsa_titan.checkpoint import step_dir_name
from nsa_titan.config import ConfigError


@pytest.fixture(autouse=True)
def one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: 2-thread OpenMP on a loaded 2-core box is many times slower
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_model(monkeypatch):
    import nsa_titan.train as train_mod

    def fail(*a, **k):
        raise AssertionError("the model was built before the bad input was reported")

    monkeypatch.setattr(train_mod, "build_model", fail)


def test_read_only_checkpoint_folder_fails_at_start_up(tmp_path, monkeypatch, no_model):
    import nsa_titan.checkpoint.folder as folder

    real_probe = folder._write_probe

    def read_only(path):  # the checkpoint folder is on a read-only mount; the dump folder is not
        if path.parent.name == "checkpoints":
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        real_probe(path)

    monkeypatch.setattr(folder, "_write_probe", read_only)
    with pytest.raises(ConfigError, match=r"checkpoint.folder: .*checkpoints is on a read-only file system; free space "
                                          r"or fix the folder, or pass --checkpoint.folder"):
        run(ckpt_args(tmp_path))


def test_checkpoint_folder_below_a_file_fails_at_start_up(tmp_path, no_model):
    (tmp_path / "checkpoints").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"checkpoint.folder: .*checkpoints is a file, not a folder"):
        run(ckpt_args(tmp_path))


def test_full_disk_during_a_save_is_named(tmp_path, monkeypatch):
    """torch's writer says only 'unexpected pos N vs M' when the disk fills up: the run says what happened,
    what to do, and which checkpoint is intact."""
    import collections
    import shutil

    import nsa_titan.checkpoint.manager as manager

    real_save = manager.dcp.save

    def save_until_full(state, checkpoint_id, **kw):
        if checkpoint_id.endswith(step_dir_name(4)):
            monkeypatch.setattr(shutil, "disk_usage", lambda p: collections.namedtuple("U", "total used free")(
                10 ** 9, 10 ** 9 - 4096, 4096))
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(state, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(manager.dcp, "save", save_until_full)
    with pytest.raises(manager.CheckpointWriteError, match=r"saving checkpoint step 4 failed: the disk holding "
                                                           r".*checkpoints is full \(0.004 MB free, about \d+.\d+ MB were "
                                                           r"to be written\).*checkpoint \(step 2\) is intact"):
        run(ckpt_args(tmp_path, steps=6, interval=2))
    assert not (tmp_path / "checkpoints" / f".tmp-{step_dir_name(4)}").exists()  # its partial files are gone


