"""Session hooks and the shared one_cpu_thread fixture. The hooks: the kernel checks' children start right
after collection and the tests that read their verdicts run last, so that the interpreter checks run beside the
rest of the suite (tests/_kernel_children.py)."""

from __future__ import annotations

import pytest
import torch

import _kernel_children


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: start the children only for a run that reads them
def pytest_collection_modifyitems(config, items):
    items[:], any_cases = _kernel_children.kernel_cases_last(items)
    if any_cases and not config.option.collectonly:
        _kernel_children.start()


def pytest_sessionfinish(session, exitstatus):
    _kernel_children.stop()  # a run stopped early (-x, Ctrl-C) leaves no child running


@pytest.fixture
def one_cpu_thread():
    """One intra-op thread for the duration of a test: the tiny training runs' ops are as fast on one thread, and
    2-thread OpenMP on a loaded 2-core machine (tests running beside other work) was measured 30x slower per step
    (2.4 s vs 0.08 s). Modules of such runs use it with
    ``pytestmark = pytest.mark.usefixtures("one_cpu_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
