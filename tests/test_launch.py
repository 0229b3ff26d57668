"""kernels/launch.py's fast path and tma.py's descriptors, on the CPU.

No GPU here, so a real JITFunction gets its device cache filled by hand with a stand-in compiled kernel whose launcher
records its arguments: the tests pin the launcher's argument order (what Triton 3.6's JITFunction.run passes) and
every case that must take Triton's normal path. The GPU side (the same bits as the normal path) is
benchmarks/check_bitwise.py's digests, run against the parent tree (benchmarks/results/launch_fast_path_s27_H100.md).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from nsa_titan.kernels import launch  # noqa: E402
from nsa_titan.kernels.tma import descriptor  # noqa: E402


@triton.jit
def _stand_in(X, n, BLOCK: tl.constexpr):
    pass


class _Launcher:
    """Triton's CudaLauncher as far as the fast path reads it."""

    def __init__(self, scratch: int = 0):
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)


class _Compiled:
    def __init__(self, launcher):
        self.run = launcher
        self.function = 77
        self.packed_metadata = ("meta",)


@pytest.fixture
def kernel(monkeypatch):
    """-> (fill(BLOCK): a compiled kernel in the cache, its launcher, the binder's calls, normal-path calls, state:
    compile=True makes the normal path fill the cache as Triton's compile does)."""
    if launch.JITFunction is None or not isinstance(_stand_in, launch.JITFunction):
        pytest.skip("needs a compiled-mode Triton (TRITON_INTERPRET unset)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(_stand_in, "_nsa_no_fast", False, raising=False)
    monkeypatch.setattr(_stand_in, "_nsa_memo", None, raising=False)  # launch.run's memo starts empty
    binds, normal, state = [], [], dict(compile=False)

    def binder(X, n, BLOCK, **options):
        binds.append(dict(options))
        return dict(X=X, n=n, BLOCK=BLOCK), [("*fp32", "D"), ("i32", ""), ("constexpr", BLOCK)], options

    launcher = _Launcher()
    cache, key_cache = {}, {}
    monkeypatch.setitem(_stand_in.device_caches, 0, (cache, key_cache, None, None, binder))

    def fill(block=16):
        _, spec, options = binder(None, 0, block, **launch._run_options(_stand_in, {}))
        binds.pop()
        cache[launch.compute_cache_key(key_cache, spec, options)] = _Compiled(launcher)

    def normal_run(*a, grid, warmup, **kw):
        normal.append((grid, a, kw))
        if state["compile"]:
            fill(kw["BLOCK"])

    monkeypatch.setattr(_stand_in, "run", normal_run, raising=False)
    return fill, launcher, binds, normal, state


@contextlib.contextmanager
def _launch_hook():
    """A launch-enter hook installed for the block (a profiler such as proton installs one)."""
    hooks = triton.knobs.runtime.launch_enter_hook
    if not hasattr(hooks, "add"):
        pytest.skip("this Triton has no hook chain")
    hook = lambda metadata: None  # noqa: E731
    hooks.add(hook)
    try:
        yield
    finally:
        hooks.remove(hook)


def test_fast_path_launches_with_jit_runs_arguments(kernel):
    fill, launcher, binds, normal, _ = kernel
    fill()
    x = object()
    launch.run(_stand_in, (3, 2), x, 5, BLOCK=16)
    assert normal == []
    # grid padded to 3, the stream, the function, the launcher's flags, no scratch, metadata, no launch hooks, then
    # every bound argument (the constexpr too) in signature order: what JITFunction.run hands its launcher
    assert launcher.calls == [(3, 2, 1, 1234, 77, False, True, None, None, ("meta",), None, None, None, x, 5, 16)]
    assert "debug" in binds[0]  # the option JITFunction.run binds with (and instrumentation_mode from Triton 3.6)
    assert ("instrumentation_mode" in binds[0]) == hasattr(triton.knobs.compilation, "instrumentation_mode")


def test_first_launch_compiles_through_the_normal_path(kernel):
    _, launcher, _, normal, state = kernel
    state["compile"] = True
    launch.run(_stand_in, (4,), "x", 5, BLOCK=16)  # empty cache: Triton compiles and launches it
    assert normal == [((4,), ("x", 5), {"BLOCK": 16})] and launcher.calls == []
    launch.run(_stand_in, (4,), "x", 5, BLOCK=16)
    assert len(normal) == 1 and len(launcher.calls) == 1
    launch.run(_stand_in, (4,), "x", 5, BLOCK=32)  # another constexpr: another cache key, compiled first
    assert len(normal) == 2 and len(launcher.calls) == 1


def test_a_triton_that_binds_other_options_keeps_the_normal_path(kernel):
    """If the normal path's compile leaves our key missing, this Triton keys its cache differently: from then on the
    kernel is launched the normal way without binding its arguments twice."""
    fill, launcher, binds, normal, _ = kernel
    launch.run(_stand_in, (1,), "x", 5, BLOCK=16)  # the stand-in compile fills nothing under our key
    fill()  # even a binary under our key is not used any more
    launch.run(_stand_in, (1,), "x", 5, BLOCK=16)
    assert len(normal) == 2 and launcher.calls == [] and len(binds) == 1


def test_launch_hooks_and_scratch_take_the_normal_path(kernel):
    fill, launcher, _, normal, _ = kernel
    fill()
    with _launch_hook():
        launch.run(_stand_in, (1,), "x", 5, BLOCK=16)
    assert len(normal) == 1 and launcher.calls == []
    launch.run(_stand_in, (1,), "x", 5, BLOCK=16)
    assert len(launcher.calls) == 1
    launcher.global_scratch_size = 64  # a kernel that needs scratch memory: memoised per compiled kernel
    for compiled in _stand_in.device_caches[0][0].values():
        del compiled._nsa_fast
    launch.run(_stand_in, (1,), "x", 5, BLOCK=16)
    assert len(normal) == 2 and len(launcher.calls) == 1


def test_a_plain_callable_is_launched_as_kernel_grid():
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((grid, a, kw))

    launch.run(Kernel(), (2, 3), 1, 2, BLOCK=8)
    assert seen == [((2, 3), (1, 2), {"BLOCK": 8})]


def test_descriptor_equals_the_checked_dataclass():
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.zeros(2, 64, 3, 32, dtype=torch.bfloat16)
    shape, strides, box = list(x.shape), list(x.stride()), [1, 16, 1, 32]
    for _ in range(2):  # the second call skips the dataclass's box checks
        assert descriptor(x, shape, strides, box) == TensorDescriptor(x, shape, strides, box)
    with pytest.raises((AssertionError, ValueError)):  # a box the dataclass rejects fails the first time it is seen
        descriptor(x, shape, strides, [1, 24, 1, 32])
    assert descriptor(x[:, :, :, :16], [2, 64, 3, 16], strides, [1, 16, 1, 32]) is None  # box wider than the head


def test_a_repeated_launch_skips_the_binder(kernel):
    """The memo: a launch like one seen before (dtypes, 16-byte alignment, integer values, constants) reuses its
    compiled kernel without binding again, and hands the launcher this call's arguments in the same layout."""
    fill, launcher, binds, normal, _ = kernel
    fill()
    x, y = torch.zeros(64), torch.ones(64)
    launch.run(_stand_in, (2,), x, 5, BLOCK=16)
    launch.run(_stand_in, (3,), y, 5, BLOCK=16)
    assert len(binds) == 1 and normal == []
    head = (1, 1, 1234, 77, False, True, None, None, ("meta",), None, None, None)
    assert launcher.calls == [(2, *head, x, 5, 16), (3, *head, y, 5, 16)]
    assert launcher.calls[1][-3] is y


@pytest.mark.parametrize("change", ["alignment", "dtype", "integer", "wide_integer", "one", "constant", "debug"])
def test_a_launch_unlike_the_memos_binds_again(kernel, monkeypatch, change):
    """Each part of Triton's specialisation is in the memo key: changing one binds again (the binder's result, not
    the memo's, picks the compiled kernel)."""
    fill, launcher, binds, normal, _ = kernel
    fill()
    x = torch.zeros(64)
    launch.run(_stand_in, (1,), x, 5, BLOCK=16)
    args, const = [x, 5], dict(BLOCK=16)
    if change == "alignment":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "integer":
        args[1] = 16  # divisible by 16
    elif change == "wide_integer":
        args[1] = 2**40 + 5  # past 32 bits
    elif change == "one":
        args[1] = 1
    elif change == "constant":
        const["BLOCK"] = 32
    else:
        monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    launch.run(_stand_in, (1,), *args, **const)
    assert len(binds) == 2


def test_an_integer_of_the_same_class_finds_the_memo(kernel):
    """A position that changes every call (decode) keeps its memo entry: Triton specialises an integer by its class
    (equal to 1, divisible by 16, 32 or 64 bits), not by its value, and the launcher gets this call's value."""
    fill, launcher, binds, _, _ = kernel
    fill()
    x = torch.zeros(64)
    for n in (5, 7, 2**31 - 1):
        launch.run(_stand_in, (1,), x, n, BLOCK=16)
    assert len(binds) == 1 and [c[-2] for c in launcher.calls] == [5, 7, 2**31 - 1]


def test_the_memo_takes_only_plain_arguments_and_stays_bounded(kernel, monkeypatch):
    fill, launcher, binds, normal, _ = kernel
    fill()
    x = torch.zeros(64)
    for _ in range(2):  # an argument of another kind (a stand-in object): no memo, bound every time
        launch.run(_stand_in, (1,), object(), 5, BLOCK=16)
    assert len(binds) == 2 and not getattr(_stand_in, "_nsa_memo", {})
    monkeypatch.setattr(launch, "MEMO_SIZE", 2)
    for n in (1, 16, 3, 5):  # three integer classes: the memo empties when full, the last call is a hit
        launch.run(_stand_in, (1,), x, n, BLOCK=16)
    assert len(binds) == 5 and len(_stand_in._nsa_memo) == 1 and len(launcher.calls) == 6


def test_launch_hooks_take_the_normal_path_even_after_a_memo_hit(kernel):
    fill, launcher, _, normal, _ = kernel
    fill()
    x = torch.zeros(64)
    launch.run(_stand_in, (1,), x, 5, BLOCK=16)
    with _launch_hook():
        launch.run(_stand_in, (1,), x, 5, BLOCK=16)
    assert len(normal) == 1 and len(launcher.calls) == 1
