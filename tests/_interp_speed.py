"""Five exact speed-ups of the Triton CPU interpreter for the kernel checks of tests/test_kernels.py.

None changes a value the interpreter computes (the kernel checks give bit-equal outputs with and without them,
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
3. Every int32 add, sub and mul of a kernel runs triton's overflow sanitizer
   (``binary_op_sanitize_overflow_impl``: both operands cast to int64, the op again, two compares and an and_),
   whose only effect is the ``device_assert`` it ends in; the interpreter's ``device_assert`` returns at once
   unless its options have ``debug`` on, which InterpreterOptions never does by default. So with debug off the
   sanitizer's ops are skipped (its two type asserts still run); with debug on the original runs. ~30 % of a
   selected-branch kernel's interpreter time (cProfile, 2026-12-07, 2-core dev machine).
4. ``_get_np_dtype`` (numpy dtype of a triton dtype, called at every cast and binary op) builds its 18-entry
   table anew at each call; the same answers come from one table built from the original's own answers
   (checked against it for every dtype it knows), the original for anything else.

5. Scans (``tl.associative_scan``) with a combine function the interpreter does not know run it once per element
   (``ScanOps.generic_scan``): pair_sort's ``_pair_scatter`` (a segmented count over 512-1024 sorted lanes) was
   ~8 % of all the kernel checks' time. For integer inputs the scan runs as log2(n) whole-array combine steps
   (Hillis-Steele) instead: associative_scan requires an associative combine (the GPU's tree order relies on it),
   and integer arithmetic is exact in any grouping, so the prefixes are the same bits. Float inputs (where the
   grouping would change the rounding) keep the original. Installed after a self-check against the original
   (a segmented count on sorted keys, a running max, a two-value sum; both directions).

Each is skipped, with a note on stderr, where this triton's interpreter lacks what it replaces: the checks then
run at the old speed, with the same results.
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl


# Combine functions of _fast_int_scans' self-check (pair_sort's segmented count among them).
@triton.jit
def _seg_count(b_left, n_left, b_right, n_right):
    return b_right, n_right + tl.where(b_left == b_right, n_left, 0)


@triton.jit
def _running_max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_two(a_left, c_left, a_right, c_right):
    return a_left + a_right, c_left + c_right


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


def _no_dead_overflow_checks(interp) -> None:
    sem = interp.interpreter_semantic
    original = type(sem).binary_op_sanitize_overflow_impl
    interp.InterpreterOptions.debug, sem.builder.options.debug, sem.device_assert  # noqa: B018 - else not installed

    def binary_op_sanitize_overflow_impl(lhs, rhs, binary_op):
        if sem.builder.options.debug:  # the assert would act: the whole check, as triton wrote it
            return original(sem, lhs, rhs, binary_op)
        if lhs.type.scalar.int_bitwidth >= 64 or not sem.builder.options.sanitize_overflow:
            return
        # the original's own asserts; what follows them in it only feeds device_assert, a no-op without debug
        assert lhs.type.scalar == rhs.type.scalar, f"expected matching operand types, got {lhs.type.scalar} and " \
            f"{rhs.type.scalar}"
        assert lhs.type.scalar.is_int(), f"expected integer type, got {lhs.type.scalar}"

    sem.binary_op_sanitize_overflow_impl = binary_op_sanitize_overflow_impl  # this instance only: the interpreter's


def _np_dtype_table(interp, tl) -> None:
    original = interp._get_np_dtype
    table = {}
    for name in dir(tl):
        d = getattr(tl, name)
        if isinstance(d, tl.dtype) and not isinstance(d, (tl.pointer_type, tl.block_type)):
            try:
                table[d] = original(d)
            except KeyError:  # a dtype the original has no entry for: it keeps raising (below)
                pass
    if len(table) < 13:  # int1, the ints, the floats: fewer means a different function than the one replaced
        raise AssertionError(f"_get_np_dtype knows only {len(table)} dtypes")

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return original(tt_dtype)
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return original(tt_dtype)
            tt_dtype = tt_dtype.element_ty
        got = table.get(tt_dtype)
        return original(tt_dtype) if got is None else got

    for d, want in table.items():  # self-check, scalar and block types
        if _get_np_dtype(d) != want or _get_np_dtype(tl.block_type(d, [2])) != original(tl.block_type(d, [2])):
            raise AssertionError(f"_get_np_dtype table differs for {d}")
    interp._get_np_dtype = _get_np_dtype


def _fast_int_scans(interp, tl, np) -> None:
    generic = interp.ScanOps.generic_scan

    def generic_scan(self, input):
        datas = [x.handle.data for x in input]
        shape = datas[0].shape
        if not all(d.dtype.kind in "biu" and d.shape == shape for d in datas) or len(shape) == 0:
            return generic(self, input)
        n, axis = shape[self.axis], self.axis
        out = list(datas)
        step = 1
        while step < n:  # out[i] = combine(out[i - step], out[i]) for i >= step: the prefix of 2 * step lanes
            # Whole lanes (block shapes are powers of 2): lane i's left operand is lane i - step, rolled round for
            # i < step, whose results are not kept.
            left = [self.to_tensor(np.roll(o, step, axis=axis), x.dtype) for o, x in zip(out, input)]
            right = [self.to_tensor(o, x.dtype) for o, x in zip(out, input)]
            ret = self.combine_fn.fn(*left, *right)
            ret = ret if isinstance(ret, tuple) else (ret,)
            keep = (np.arange(n) >= step).reshape([n if i == axis else 1 for i in range(len(shape))])
            new = []
            for o, r in zip(out, ret):
                got = r.handle.data if isinstance(r, tl.core.tensor) else r
                # stored in the input's dtype, as the original's element-wise stores do
                new.append(np.where(keep, np.broadcast_to(got, shape), o).astype(o.dtype))
            out = new
            step *= 2
        return [self.to_tensor(o, x.dtype) for o, x in zip(out, input)]

    # Self-check against the original, inside the interpreter's patch of triton.language (as during a launch).
    rng = np.random.default_rng(0)
    checks = [(_seg_count, [np.sort(rng.integers(0, 5, (4, 32)), 1).astype(np.int32),
                            rng.integers(-3, 9, (4, 32)).astype(np.int32)]),
              (_running_max, [rng.integers(-2**40, 2**40, (2, 16))]),
              (_sum_two, [rng.integers(-2**30, 2**30, (8, 8)).astype(np.int32), rng.integers(0, 9, (8, 8))])]
    dtypes = {np.dtype(np.int32): tl.int32, np.dtype(np.int64): tl.int64}
    for fn, arrays in checks:
        scope = interp._patch_lang(fn.fn)
        try:
            for axis in (0, 1):
                if fn is _seg_count and axis == 0:  # sorted along axis 1 only: the count is associative there
                    continue
                for reverse in (False, True):
                    xs = tuple(tl.core.tensor(interp.TensorHandle(a, dtypes[a.dtype]),
                                              tl.block_type(dtypes[a.dtype], list(a.shape))) for a in arrays)
                    ops = interp.ScanOps(axis, fn, reverse)
                    want = ops.apply(xs)
                    interp.ScanOps.generic_scan = generic_scan
                    try:
                        got = ops.apply(xs)
                    finally:
                        interp.ScanOps.generic_scan = generic
                    if not all(np.array_equal(w.handle.data, g.handle.data) and w.dtype == g.dtype
                               for w, g in zip(want, got)):
                        raise AssertionError(f"fast scan differs ({fn.fn.__name__}, axis {axis}, reverse {reverse})")
        finally:
            scope.restore()
    interp.ScanOps.generic_scan = generic_scan


def install() -> None:
    """Install the speed-ups in this (interpreter) process; each one that does not fit this triton is skipped."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    for step in (lambda: _fast_reductions(interp, tl, np), lambda: _no_nested_repatch(interp, tl),
                 lambda: _no_dead_overflow_checks(interp), lambda: _np_dtype_table(interp, tl),
                 lambda: _fast_int_scans(interp, tl, np)):
        try:
            step()
        except (AttributeError, AssertionError, TypeError, ValueError) as e:
            print(f"_interp_speed: skipped a speed-up ({type(e).__name__}: {e}); same results, slower", file=sys.stderr)
