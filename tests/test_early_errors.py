"""Bad input and bad disks are reported as such, before any model is built where that is possible (issue 16):
data files that cannot train, folders that cannot be written, a disk that fills up during a save."""

from __future__ import annotations

import errno

import pytest

from _ckpt_util import args, ckpt_args, run
from nsa_titan.checkpoint import step_dir_name
from nsa_titan.config import ConfigError

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py says why


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
                                                           r".*checkpoints is full \(0.004 MB free, about \d+.\d+ MB "
                                                           r"were to be written\).*checkpoint \(step 2\) is intact"):
        run(ckpt_args(tmp_path, steps=6, interval=2))
    assert not (tmp_path / "checkpoints" / f".tmp-{step_dir_name(4)}").exists()  # its partial files are gone




def _text_dir(tmp_path, files: dict[str, bytes]):
    folder = tmp_path / "data"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


GOOD = ("def f(x):\n    return x + 1\n" * 200).encode()
DATA_PROBLEMS = {
    "empty file": ({"a.txt": b""}, [], r"data.path: no UTF-8 text found"),
    "binary file": ({"a.txt": bytes(range(256)) * 40}, [], r"a.txt cannot be read as UTF-8 text \(not UTF-8: byte "
                                                           r"0x80 at offset 128\)"),
    "too short for seq_len": ({"a.txt": b"hello\n"}, [], r"corpus has \d+ tokens, fewer than one chunk of seq_len \+ 1 "
                                                        r"= 65"),
    "undecodable file, on_error fail": ({"a.txt": GOOD, "b.txt": GOOD, "c.md": GOOD[:50] + b"\xff" + GOOD},
                                        ["--data.on_error", "fail", "--data.val_fraction", "0"],
                                        r"data.path: 1 of 3 files under .* cannot be read as UTF-8 text: c.md \(not "
                                        r"UTF-8: byte 0xff at offset 50\)"),
}


@pytest.mark.parametrize("case", list(DATA_PROBLEMS))
def test_data_problems_are_config_errors_before_the_model_is_built(tmp_path, no_model, case):
    files, extra, message = DATA_PROBLEMS[case]
    folder = _text_dir(tmp_path, files)
    path = folder if len(files) > 1 else folder / "a.txt"
    with pytest.raises(ConfigError, match=message):
        run(args(tmp_path / "out", "--data.dataset", "text_files", "--data.path", str(path), *extra))


def test_undecodable_files_are_named_and_counted_when_skipped(tmp_path):
    folder = _text_dir(tmp_path, {"a.txt": GOOD, "b.txt": GOOD, "c.md": GOOD[:50] + b"\xff" + GOOD})
    summary, out = run(args(tmp_path / "out", "--data.dataset", "text_files", "--data.path", str(folder),
                            "--data.val_fraction", "0", steps=2))
    assert "WARNING: data.path: skipped 1 of 3 files under" in out and "c.md (not UTF-8: byte 0xff at offset 50)" in out
    assert summary["steps"] == 2


BAD_SETTINGS = [
    (["--training.seq_len", "1"], r"training.seq_len: must be >= 2"),
    (["--config", "train_configs/debug_model.toml", "--training.steps", "3"],
     r"lr_scheduler.warmup_steps \(15\) exceeds training.steps \(3\)"),
]


@pytest.mark.parametrize("extra, message", BAD_SETTINGS, ids=[" ".join(a) for a, _ in BAD_SETTINGS])
def test_bad_settings_are_config_errors(tmp_path, no_model, extra, message):
    base = [] if "--config" in extra else args(tmp_path)  # the shipped config as it is: its warm-up is 15
    with pytest.raises(ConfigError, match=message):
        run([*base, *extra, "--job.dump_folder", str(tmp_path)])


def test_dump_folder_that_is_a_file(tmp_path, no_model):
    (tmp_path / "out").write_text("a file")
    with pytest.raises(ConfigError, match=r"job.dump_folder: .*out' is a file, not a folder"):
        run(args(tmp_path / "out"))


@pytest.mark.parametrize("change, message", [
    (["--training.seq_len", "32"], r"training.seq_len: checkpoint 64, this run 32"),
    (["--data.dataset", "retrieval"], r"data.dataset: checkpoint 'stdlib', this run 'retrieval'"),
])
def test_resume_with_other_data_settings_fails_before_the_model_is_built(tmp_path, monkeypatch, change, message):
    run(ckpt_args(tmp_path, steps=2, interval=2))
    import nsa_titan.train as train_mod

    monkeypatch.setattr(train_mod, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ConfigError, match=r"checkpoint.resume_from: .*step-00000002 was saved with other data "
                                          r"settings \(" + message):
        run(ckpt_args(tmp_path, *change, steps=4, interval=2))
