"""Session hooks: the kernel checks' children start right after collection and the tests that read their
verdicts run last, so that the interpreter checks run beside the rest of the suite (tests/_kernel_children.py)."""

from __future__ import annotations

import pytest

import _kernel_children


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: start the children only for a run that reads them
def pytest_collection_modifyitems(config, items):
    items[:], any_cases = _kernel_children.kernel_cases_last(items)
    if any_cases and not config.option.collectonly:
        _kernel_children.start()


def pytest_sessionfinish(session, exitstatus):
    _kernel_children.stop()  # a run stopped early (-x, Ctrl-C) leaves no child running
