"""CheckpointManager: periodic DCP checkpoints that become visible only when complete, and resume.

Layout under ``<job.dump_folder>/<checkpoint.folder>``::

    step-00000100/          a complete checkpoint: DCP files + .metadata + nsa_checkpoint.json (the manifest)
    .tmp-step-00000200/     a save in progress, or one a kill interrupted (see recovery below)
    .trash-step-...         a folder set aside for deletion; removed at start-up
    export-step-00000300/   model-only bf16 safetensors export (see export.py)

Atomicity: every rank writes into ``.tmp-step-N``; when DCP has finished (its coordinator writes
``.metadata`` after every rank reported its files), rank 0 writes ``nsa_checkpoint.json`` (step, model
args, each file's size and CRC-32), fsyncs it and renames the folder to ``step-N``: a rename is atomic,
so a reader sees either nothing or the whole checkpoint. Re-saving an existing step N (the non-finite
stop, a run restarted with resume_from none) sets the old ``step-N`` aside, renames the new one in, and
only then deletes the old one (folder.replace_dir). A SIGKILL at any moment leaves earlier ``step-*``
folders untouched (pruning by ``keep_latest_k`` runs only after the new one is committed).

Recovery at start-up (rank 0, in ``bind``): a ``.tmp-step-N`` whose manifest is written and whose files
have the listed sizes is a save that was killed between its last two renames: it is renamed into place
(replacing ``step-N``); any other ``.tmp-step-N`` is removed, and so is every ``.trash-*`` folder.

Validation on resume: a ``step-N`` folder counts only if its marker parses and every file it lists
exists with the recorded size; before it is loaded, every file's CRC-32 is checked. A checkpoint that
fails either check, or whose DCP load raises, is reported and the next older complete one is tried
('latest'). An explicitly named checkpoint must be complete: anything else is a ConfigError naming
``checkpoint.resume_from``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: not caught by `except Exception`
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from nsa_titan.checkpoint.export import export_model
from nsa_titan.checkpoint.folder import (
    TMP_PREFIX,
    TRASH_PREFIX,
    checksum_problems,
    describe_write_error,
    export_dir_name,
    inspect_checkpoint,
    list_checkpoints,
    list_unfinished,
    remove_dir,
    replace_dir,
    step_dir_name,
    writable_problem,
    write_marker,
)
from nsa_titan.checkpoint.safe_load import load_tensors, read_metadata_safely
from nsa_titan.checkpoint.state import TrainState, apply_loaded, capture_host_state, dcp_state_dict, load_template
from nsa_titan.config import ConfigError
from nsa_titan.errors import TrainingFailure


class CheckpointWriteError(TrainingFailure):
    """A save failed because the checkpoint folder cannot take it (disk full, read-only, no permission)."""


def _state_bytes(state: Any) -> int:
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


# Fields that do not change the saved tensors: a run may resume under another attention implementation.
_ARGS_FREE_TO_CHANGE = ("attn_impl",)


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every single-process save/load that it assumes single-process use, which is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def model_args_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [f"model.{k}: checkpoint {saved.get(k)!r}, this run {current.get(k)!r}"
            for k in sorted(set(saved) | set(current))
            if k not in _ARGS_FREE_TO_CHANGE and saved.get(k) != current.get(k)]


class CheckpointManager:
    """Owns the checkpoint folder of one run. Construct it early (it resolves and checks the resume source
    before any model is built), ``bind`` the live objects, ``load`` once, then ``maybe_save`` each step."""

    def __init__(self, cfg: Any, *, dump_folder: str | os.PathLike, rank: int = 0, world_size: int = 1,
                 model_args: dict[str, Any] | None = None, log: Callable[[str], None] = print,
                 hooks: Any = None, data_args: dict[str, Any] | None = None):
        """data_args: the settings that define the data stream ({"training.seq_len": 512, "data.dataset": ...}),
        saved with each checkpoint; resuming with other values is a ConfigError (the position would be wrong)."""
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.rank, self.world_size = rank, world_size
        self.model_args = model_args or {}
        self.data_args = data_args or {}
        self.log = log
        self.hooks = hooks
        self.enabled = bool(cfg.enable)
        self._live: dict[str, Any] | None = None
        self._pending: tuple[Any, int, Path, dict[str, Any]] | None = None
        self._async_pg = None
        self.last_saved_step: int | None = None
        problem = writable_problem(self.folder) if self.enabled else None
        if problem:  # found now, not at the first save (up to checkpoint.interval steps later)
            raise ConfigError(f"checkpoint.folder: {problem}; free space or fix the folder, or pass "
                              "--checkpoint.folder (an absolute path, or relative to job.dump_folder) on a writable "
                              "disk")
        self.candidates = self._resume_candidates(self.log)

    def _latest_folders(self) -> list[tuple[int, Path]]:
        """Checkpoints newest first, as start-up recovery will leave them: a complete .tmp-step-N (a save
        killed between its renames) stands for step N."""
        folders = dict(list_checkpoints(self.folder))
        for step, tmp in list_unfinished(self.folder):
            if inspect_checkpoint(tmp)[1] is None:
                folders[step] = tmp
        return sorted(folders.items(), reverse=True)

    # ---- resume source (before any GPU work) ----
    def _resume_candidates(self, log: Callable[[str], None]) -> list[Path]:
        source = str(self.cfg.resume_from).strip()
        if source.lower() in ("none", ""):
            return []
        if source.lower() == "latest":
            if not self.enabled:
                return []
            out = []
            for step, path in self._latest_folders():
                meta, problem = inspect_checkpoint(path)
                if problem:
                    log(f"WARNING: checkpoint {path} is incomplete or corrupt ({problem}); skipping it")
                    continue
                if out and (self._model_diff(meta) or self._data_diff(meta)):  # a fallback that could never load
                    log(f"WARNING: checkpoint {path} holds another model or data settings; it is not a fallback")
                    continue
                if not out:
                    self._check_model_args(path, meta)  # the newest one decides: another model is an error
                out.append(path)
            return out
        path = Path(source).expanduser()
        if not path.exists() and not path.is_absolute() and (self.folder / source).exists():
            path = self.folder / source  # a bare name such as step-00000100
        meta, problem = inspect_checkpoint(path)
        if problem:
            known = ", ".join(p.name for _, p in list_checkpoints(self.folder)) or "none"
            raise ConfigError(f"checkpoint.resume_from: {source!r} is not a complete checkpoint ({problem}); pass "
                              f"'latest', 'none', or the path of a step-NNNNNNNN folder (in {self.folder}: {known})")
        self._check_model_args(path, meta)
        return [path]

    def _data_diff(self, meta: dict[str, Any]) -> list[str]:
        saved = meta.get("data") or {}
        return [f"{k}: checkpoint {saved[k]!r}, this run {v!r}" for k, v in self.data_args.items()
                if k in saved and saved[k] != v]

    def _model_diff(self, meta: dict[str, Any]) -> list[str]:
        return model_args_mismatch(meta.get("model_args", {}), self.model_args) if self.model_args else []

    def _check_model_args(self, path: Path, meta: dict[str, Any]) -> None:
        diff = self._model_diff(meta)
        if diff:
            raise ConfigError(f"checkpoint.resume_from: {path} holds another model ({'; '.join(diff)}); resume with "
                              "the same [model] settings, or start fresh with --checkpoint.resume_from none "
                              "(or another --job.dump_folder)")
        diff = self._data_diff(meta)
        if diff:
            raise ConfigError(f"checkpoint.resume_from: {path} was saved with other data settings ({'; '.join(diff)}), "
                              "so its data position means nothing here; resume with the same settings, or start fresh "
                              "with --checkpoint.resume_from none (or another --job.dump_folder)")

    # ---- live objects ----
    def bind(self, *, model, optimizer, scheduler, loader, train_state: TrainState, device: torch.device) -> None:
        """Attach the run's objects. Collective when distributed (every rank must call it)."""
        self._live = dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
                          train_state=train_state, device=device)
        distributed = dist.is_available() and dist.is_initialized()
        if self.enabled and self.cfg.async_mode == "async" and distributed:
            # The background save runs collectives (plan gather, finish) while training runs its own: a
            # separate gloo group keeps the two streams of collectives from interleaving on one group.
            self._async_pg = dist.new_group(backend="gloo")
        if self.enabled and self.rank == 0 and self.folder.is_dir():
            self._recover()
        if distributed:
            dist.barrier()  # no rank may look at the folder (or write a .tmp) while rank 0 is repairing it
        if self.enabled:  # recovery renamed folders: resolve again (every rank now sees the same folder)
            self.candidates = self._resume_candidates(lambda _: None)

    def _recover(self) -> None:
        """Rank 0: finish saves that a kill interrupted after their manifest was written, drop the others and
        every folder that was set aside for deletion."""
        for step, tmp in list_unfinished(self.folder):
            if inspect_checkpoint(tmp)[1] is None:
                self.log(f"checkpoint: {tmp.name} is complete (a kill interrupted its commit); renaming it to "
                         f"{step_dir_name(step)}")
                replace_dir(tmp, self.folder / step_dir_name(step))
            else:
                self.log(f"checkpoint: removing {tmp.name}, a save that never completed")
                remove_dir(tmp)
        for trash in self.folder.glob(f"{TRASH_PREFIX}*"):
            self.log(f"checkpoint: removing {trash.name}, set aside by an earlier run")
            shutil.rmtree(trash, ignore_errors=True)

    def load(self) -> int | None:
        """Restore the newest usable candidate; returns its step, or None when starting fresh."""
        live = self._require_live()
        for i, path in enumerate(self.candidates):
            try:
                meta, state, rank_key = self._read(path)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - any read failure: report, try an older one
                more = i + 1 < len(self.candidates)
                self.log(f"WARNING: loading checkpoint {path} failed ({type(e).__name__}: {e})"
                         + ("; falling back to the previous complete checkpoint" if more else ""))
                if not more:
                    raise RuntimeError(f"no usable checkpoint: loading {path} failed: {e}") from e
                continue
            # Not in the try: a mismatch found here (e.g. another data seed) would recur with older checkpoints.
            apply_loaded(state, rank_key, model=live["model"], optimizer=live["optimizer"],
                         scheduler=live["scheduler"], loader=live["loader"], train_state=live["train_state"],
                         device=live["device"], saved_world_size=int(meta.get("world_size", 1)),
                         world_size=self.world_size, keep_saved_hyperparams=self.cfg.keep_saved_hyperparams,
                         log=self.log)
            self.log(f"checkpoint: resumed from {path} (step {meta['step']}, saved by {meta.get('world_size')} "
                     "rank(s))")
            self.last_saved_step = int(meta["step"])
            return self.last_saved_step
        return None

    def _read(self, path: Path) -> tuple[dict[str, Any], dict[str, Any], str]:
        """(marker, filled template, key of the rank state used). Fills the live tensors in place; a failed
        read may leave them half-written, which the next (complete) read overwrites entirely."""
        live = self._require_live()
        meta, problem = inspect_checkpoint(path)
        if problem:
            raise RuntimeError(problem)
        t0 = time.perf_counter()
        bad = self._checksum_problems(path, meta)
        if bad:
            more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
            raise RuntimeError(f"corrupt: {'; '.join(bad[:3])}{more}")
        size = sum(e["size"] for e in meta["files"].values())
        self.log(f"checkpoint: CRC-32 of {len(meta['files'])} files ({size / 1e9:.2f} GB) in {path.name} verified in "
                 f"{time.perf_counter() - t0:.2f}s")
        saved = read_metadata_safely(path).state_dict_metadata
        sizes = {k: tuple(m.size) for k, m in saved.items() if isinstance(m, TensorStorageMetadata)}
        mine = f"rank{self.rank}"
        rank_key = mine if f"rank_state.{mine}.json" in sizes else "rank0"
        state = load_template(live["model"], live["optimizer"], rank_key, sizes)
        load_tensors(state, path, no_dist=not dist.is_initialized())
        return meta, state, rank_key

    def _checksum_problems(self, path: Path, meta: dict[str, Any]) -> list[str]:
        """Every rank checks its share of the files; all ranks get every rank's findings (so that all of them
        take the same decision: one rank skipping a collective load that the others enter would hang them)."""
        if not dist.is_initialized() or self.world_size <= 1:
            return checksum_problems(path, meta)
        mine = checksum_problems(path, meta, rank=self.rank, world_size=self.world_size)
        gathered: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)  # once per resume attempt
        return [p for found in gathered for p in (found or [])]

    def _require_live(self) -> dict[str, Any]:
        if self._live is None:
            raise RuntimeError("CheckpointManager.bind(...) must be called before load/save")
        return self._live

    # ---- saving ----
    def should_save(self, step: int, last: bool) -> bool:
        if not self.enabled or step == self.last_saved_step:
            return False
        return step % self.cfg.interval == 0 or (last and self.cfg.save_at_end)

    def maybe_save(self, step: int, *, last: bool = False) -> bool:
        """Per step: finish a completed async save (no waiting), then save if this step is due."""
        self.poll()
        if not self.should_save(step, last):
            return False
        self.save(step, blocking=last)
        return True

    def save(self, step: int, *, blocking: bool = True) -> Path:
        """Save the live state as step ``step``; async mode returns once the state is staged in host memory."""
        live = self._require_live()
        self.wait()  # one save in flight at a time: DCP's stager and our commit are per checkpoint
        final = self.folder / step_dir_name(step)
        tmp = self.folder / f"{TMP_PREFIX}{final.name}"
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                remove_dir(tmp)
        if dist.is_initialized():
            dist.barrier()
        host = capture_host_state(live["train_state"], live["scheduler"], live["loader"], live["device"])
        state = dcp_state_dict(live["model"], live["optimizer"], host, self.rank)
        meta = {"step": step, "tokens_seen": live["train_state"].tokens_seen,
                "world_size": self.world_size, "model_args": self.model_args, "data": self.data_args,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        t0 = time.perf_counter()
        no_dist = not dist.is_initialized()
        if self.cfg.async_mode == "async" and not blocking:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_pg, no_dist=no_dist)
            self._pending = (future, step, tmp, meta)
            self.log(f"checkpoint: step {step} staged in {time.perf_counter() - t0:.2f}s, writing in the background")
        else:
            try:
                with _quiet_single_process():
                    dcp.save(state, checkpoint_id=str(tmp), no_dist=no_dist)
                self._commit(step, tmp, meta)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - named when it is the disk, else re-raised
                self._raise_named(step, tmp, e, _state_bytes(state) * self.world_size)
            self.log(f"checkpoint: saved step {step} to {final} in {time.perf_counter() - t0:.2f}s")
        self.last_saved_step = step
        return final

    def _raise_named(self, step: int, tmp: Path, error: BaseException, need_bytes: int) -> None:
        """A save that failed because of the disk (full, read-only, no permission) ends the run with a message
        saying so and what to do; any other error is re-raised as it is."""
        problem = describe_write_error(self.folder, error, need_bytes)
        if problem is None:
            raise error
        if self.rank == 0:
            remove_dir(tmp)  # its partial files only take space; start-up would remove them anyway
        kept = f"step {self.last_saved_step}" if self.last_saved_step is not None else "none"
        raise CheckpointWriteError(f"saving checkpoint step {step} failed: {problem}. Free space or fix the folder, "
                                   f"lower checkpoint.keep_latest_k, or pass --checkpoint.folder on another disk; the "
                                   f"last complete checkpoint ({kept}) is intact") from error

    def poll(self) -> None:
        """Commit a finished background save; never blocks (future.done() is a host flag)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until a background save has finished and is committed; its error, if any, is raised here."""
        if self._pending is None:
            return
        future, step, tmp, meta = self._pending
        self._pending = None
        try:
            future.result()
            self._commit(step, tmp, meta)
        except (Exception, CheckpointException) as e:
            self._raise_named(step, tmp, e, 0)
            raise RuntimeError(f"background checkpoint save of step {step} to {tmp} failed: {e}") from e
        self.log(f"checkpoint: saved step {step} to {self.folder / step_dir_name(step)} (background)")

    def _commit(self, step: int, tmp: Path, meta: dict[str, Any]) -> None:
        """Rank 0: marker, fsync, atomic rename, prune. The other ranks' files are complete by now: DCP's
        coordinator writes .metadata only after gathering every rank's write results."""
        if self.rank != 0:
            return
        if self.hooks is not None:
            self.hooks.before_checkpoint_commit(step, tmp)
        write_marker(tmp, meta)  # sizes and CRC-32 of every file: read back now, checked before each load
        # An existing step-N (a run restarted with resume_from none, the non-finite stop's re-save) is set
        # aside, not deleted, until the new one is in place.
        replace_dir(tmp, self.folder / step_dir_name(step))
        self._prune()

    def _prune(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        complete = [(s, p) for s, p in list_checkpoints(self.folder) if inspect_checkpoint(p)[1] is None]
        if len(complete) <= k:
            return
        oldest_kept = complete[-k][0]
        for step, path in list_checkpoints(self.folder):
            if step < oldest_kept:
                remove_dir(path)

    def close(self) -> None:
        """Finish any background save (call on every exit path that keeps the process alive)."""
        try:
            self.wait()
        finally:
            if self._async_pg is not None:
                dist.destroy_process_group(self._async_pg)
                self._async_pg = None

    def export(self, step: int, tokenizer: str | None = None, eos_token: str | None = None,
               bos_token: str | None = None) -> Path | None:
        """Model-only export (checkpoint.export_at_end); collective when sharded, rank 0 writes. ``tokenizer``:
        data.tokenizer (with data.eos_token / bos_token), whose files and special ids go into the export."""
        live = self._require_live()
        out = self.folder / export_dir_name(step_dir_name(step))
        path = export_model(live["model"], out, model_args=self.model_args, dtype=self.cfg.export_dtype,
                            rank=self.rank, tokenizer=tokenizer, eos_token=eos_token, bos_token=bos_token)
        if path is not None:
            self.log(f"checkpoint: exported the model ({self.cfg.export_dtype}, safetensors) to {path}")
        return path

