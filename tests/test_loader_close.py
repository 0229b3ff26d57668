"""A training run stops its data loader's worker processes when it ends, and a closed loader says it is closed.

Without that, a run called in-process (a notebook, a sweep, these tests) left torchdata's workers to the garbage
collector, which freed them only at the next collection and then waited out a 5 s join per worker.
"""

from __future__ import annotations

import multiprocessing

import pytest

from nsa_titan.data import ByteTokenizer, build_dataloader
from nsa_titan.train import main


def _cfg(**kw):
    from types import SimpleNamespace

    base = dict(dataset="stdlib", path=None, tokenizer="byte", hf_split="train", hf_text_field="text",
                val_fraction=0.1, retrieval_num_pairs=4, retrieval_num_queries=3, retrieval_key_len=2,
                retrieval_value_len=2, retrieval_min_gap=8, retrieval_filler="corpus", retrieval_mix=0.0)
    return SimpleNamespace(**{**base, **kw})


def _loader(num_workers):
    return build_dataloader(_cfg(), ByteTokenizer(), seq_len=32, local_batch_size=2, num_workers=num_workers)


def test_close_stops_the_workers_at_once():
    pytest.importorskip("torchdata")
    loader = _loader(2)
    next(loader)
    assert len(multiprocessing.active_children()) >= 2  # the workers run
    loader.close()
    assert multiprocessing.active_children() == []  # joined by close(), not left to the garbage collector


@pytest.mark.parametrize("workers", [None, 2])
def test_a_closed_loader_refuses_batches_and_state(workers):
    loader = _loader(workers)
    next(loader)
    loader.close()
    for use in (lambda: next(loader), loader.state_dict):
        with pytest.raises(RuntimeError, match="closed.*build_dataloader"):
            use()


def test_a_training_run_leaves_no_loader_workers(tmp_path):
    pytest.importorskip("torchdata")
    main(["--training.device", "cpu", "--training.seq_len", "64", "--training.local_batch_size", "2",
          "--training.steps", "2", "--lr_scheduler.warmup_steps", "1", "--metrics.val_freq", "0",
          "--data.num_workers", "2", "--job.dump_folder", str(tmp_path)])
    assert multiprocessing.active_children() == []
