"""kernels/launch.py's fast path and tma.py's descriptors, on the CPU.

No GPU here, so a real JITFunction gets its device cache filled by hand with a stand-in compiled kernel whose launcher
records its arguments: the tests pin the launcher's argument order (what Triton 3.6's JITFunction.run passes) and
every case that must take Triton's normal path. The GPU side (the same bits as the normal path) is
benchmarks/check_bitwise.py's digests, run against the parent tree (benchmarks/results/launch_fast_path_s27_H100.md).
"""

from __future__ import annotations

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
    hooks = triton.knobs.runtime.launch_enter_hook
    if not hasattr(hooks, "add"):
        pytest.skip("this Triton has no hook chain")
    hook = lambda metadata: None  # noqa: E731
    hooks.add(hook)
    try:
        launch.run(_stand_in, (1,), "x", 5, BLOCK=16)
    finally:
        hooks.remove(hook)
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
