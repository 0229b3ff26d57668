"""Two exact speed-ups of the Triton CPU interpreter for the kernel checks of tests/test_kernels.py.

Neither changes a value the interpreter computes (the kernel checks give bit-equal outputs with and without them,
checked when this was written: every case's output, block indices and gradients); they only remove Python
overhead that the interpreter pays where a compiled kernel pays nothing:

1. Reductions with a combine function the interpreter does not know run one Python call per element
   (``ReduceOps.generic_reduce``). tl.sort / tl.topk / tl.bitonic_merge call ``xor_sum`` at every
   compare-and-swap stage, so the selection kernel spent ~90 % of its time there. XOR and OR of integers are
   exact and order-free: numpy's ``bitwise_xor.reduce`` / ``bitwise_or.reduce`` give the same bits. Only
   reductions along one axis (what the sort calls), installed only after a self-check against the original.
2. Every call of a @triton.jit helper from inside a kernel re-runs ``_patch_lang`` (an ``inspect.getmembers``
   scan of triton.language, ~1 ms), although the launch already patched those modules and nested patches are
   never undone. The call is skipped when every triton.language module the helper's globals name is patched
   already (its ``arange`` is no longer the builtin); otherwise the original runs.

Each is skipped, with a note on stderr, where this triton's interpreter lacks what it replaces: the checks then
run at the old speed, with the same results.
"""

from __future__ import annotations

import sys


def _fast_reductions(interp, tl, np) -> None:
    fast = {getattr(tl.standard, "_xor_combine", None): np.bitwise_xor,
            getattr(tl.standard, "_or_combine", None): np.bitwise_or}
    fast.pop(None, None)
    generic = interp.ReduceOps.generic_reduce

    def generic_reduce(self, input):
        op = fast.get(self.combine_fn)
        if op is None or len(input) != 1 or self.axis is None:  # axis None: the original's own output shapes
            return generic(self, input)
        data = op.reduce(input[0].handle.data, axis=self.axis, keepdims=self.keep_dims)
        return [self.to_tensor(data, input[0].dtype)]

    # Self-check against the original (which runs the combine function on interpreter tensors, so inside the
    # interpreter's patch of triton.language, as during a launch): whole-tensor and per-axis, with and without
    # keep_dims, 32 and 64 bits.
    rng = np.random.default_rng(0)
    scope = interp._patch_lang(tl.standard.xor_sum.fn)
    try:
        for dtype, np_dtype in ((tl.int32, np.int32), (tl.int64, np.int64)):
            data = rng.integers(-2**62, 2**62, size=(4, 2, 8)).astype(np_dtype)
            x = tl.core.tensor(interp.TensorHandle(data, dtype), tl.block_type(dtype, list(data.shape)))
            for combine in fast:
                for axis in (None, 0, 1, 2):
                    for keep in (False, True):
                        ops = interp.ReduceOps(axis, combine, keep)
                        want, got = generic(ops, (x,))[0], generic_reduce(ops, (x,))[0]
                        if not (np.array_equal(want.handle.data, got.handle.data) and want.type == got.type):
                            raise AssertionError(f"fast {combine} differs (axis {axis}, keep_dims {keep})")
    finally:
        scope.restore()
    interp.ReduceOps.generic_reduce = generic_reduce


def _no_nested_repatch(interp, tl) -> None:
    call = interp.InterpretedFunction.__call__
    interp.InterpretedFunction.rewrite, interp.InterpreterError  # noqa: B018 - AttributeError here: not installed

    def patched(lang) -> bool:
        return not tl.core.is_builtin(getattr(lang, "arange", None))

    def __call__(self, *args, **kwargs):
        langs = [v for v in self.fn.__globals__.values() if v is tl or v is tl.core]
        if not langs or not all(patched(lang) for lang in langs):
            return call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.InterpretedFunction.__call__ = __call__


def install() -> None:
    """Install both speed-ups in this (interpreter) process; each one that does not fit this triton is skipped."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    for step in (lambda: _fast_reductions(interp, tl, np), lambda: _no_nested_repatch(interp, tl)):
        try:
            step()
        except (AttributeError, AssertionError, TypeError) as e:
            print(f"_interp_speed: skipped a speed-up ({type(e).__name__}: {e}); same results, slower", file=sys.stderr)
