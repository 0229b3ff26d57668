"""training.gc_freq: automatic collection off during training, full collections at the chosen steps, Python's
collector restored afterwards, and reference cycles still freed."""

import gc
import weakref

import pytest

from nsa_titan.components.garbage_collection import GarbageCollection
from nsa_titan.config import ConfigError, load_job_config


class _Node:
    pass


def _make_cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_periodic_collection_frees_cycles_only_at_its_steps():
    assert gc.isenabled()
    collector = GarbageCollection(every=3)
    collector.start()
    try:
        assert not gc.isenabled()
        ref = _make_cycle()
        for _ in range(1000):  # enough allocations to trigger Python's own collector, were it on
            _Node()
        collector.step(1)
        collector.step(2)
        assert ref() is not None, "collected outside the chosen steps"
        collector.step(3)
        assert ref() is None, "a reference cycle survived the periodic collection"
        assert collector.collections == 1
    finally:
        collector.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_zero_keeps_pythons_collector():
    collector = GarbageCollection(every=0)
    collector.start()
    assert gc.isenabled()
    collector.step(50)
    collector.close()
    assert collector.collections == 0 and gc.isenabled()


def test_negative_gc_freq_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match="training.gc_freq"):
        load_job_config(["--training.gc_freq", "-1"])
