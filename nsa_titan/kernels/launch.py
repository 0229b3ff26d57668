"""Kernel launches with less host time: ``run(kernel, grid, *args, **const)`` is ``kernel[grid](*args, **const)``.

Why: an eager NSA forward+backward launches ~20 Triton kernels, and at m7c's 8k tokens (batch 2) the host needed
3.1 ms to enqueue what the GPU runs in 1.9 ms (benchmarks/results/host_overhead_s27_*). Per launch, Triton 3.6's
``JITFunction.run`` spent ~37 us of Python and its launcher ~22 us more (hostprobe_head_s27_H100.json), and every
model that does not replay CUDA graphs (data parallelism, eager) runs at that pace: the whole m7c at 8k batch 2,
compiled without graphs, 233k tokens/s against 355k with them (launch_fast_path_s27_H100.md: 1.14x with this path).

What the fast path keeps, so that it launches exactly the kernel ``JITFunction.run`` would: Triton's own binder
(the arguments' specialisation: dtypes, 16-byte alignment, integers equal to 1 or divisible by 16) and its cache
key, looked up in the kernel's own cache. What it skips: the per-call option and hook look-ups, the check that
globals the kernel reads have not changed (ours are module constants), the launch metadata (built only for launch
hooks) and the launcher's scratch allocation closures (our kernels need no scratch).
Anything else takes the normal path: the first call of a specialisation (Triton compiles it and fills its cache),
the CPU interpreter, launch hooks (a profiler such as proton), kernels that need scratch memory, and any Triton
whose internals differ from those this was written against (3.5-3.6, checked by attribute, not by version; a
Triton whose run() binds other options than ours is seen at the first compile, when our key still names nothing,
and its kernel keeps the normal path from then on).
"""

from __future__ import annotations

import torch

try:
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction, compute_cache_key
except ImportError:  # pragma: no cover - an older Triton: every launch takes the normal path
    _knobs = JITFunction = compute_cache_key = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover
    _TensorDescriptor = None


def _fast_launcher(kernel):
    """(C launch function, cooperative-grid flag, PDL flag, CUDA function, packed metadata, the kernel itself) of a
    compiled kernel, or None when the fast path cannot call it (scratch memory, another launcher class). Memoised on
    the kernel."""
    fast = getattr(kernel, "_nsa_fast", False)
    if fast is not False:
        return fast
    fast = None
    try:
        runner = kernel.run  # loads the binary on first use (CompiledKernel._init_handles)
        if (getattr(runner, "global_scratch_size", 1) == 0 and getattr(runner, "profile_scratch_size", 1) == 0
                and callable(getattr(runner, "launch", None))):
            fast = (runner.launch, runner.launch_cooperative_grid, runner.launch_pdl, kernel.function,
                    kernel.packed_metadata, kernel)
    except Exception:  # noqa: BLE001 - anything unexpected: the normal path, which raises real errors itself
        fast = None
    kernel._nsa_fast = fast
    return fast


def _hook_set(hook) -> bool:
    """A launch hook is installed (Triton 3.6 keeps an always-present HookChain; older ones None or a function)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _debug_options(kernel, const: dict) -> tuple:
    """(debug, instrumentation_mode): the options JITFunction.run binds besides ``const`` (part of its cache key);
    the mode since Triton 3.6 (the knob exists from that version on), else None."""
    return (const.get("debug", kernel.debug) or _knobs.runtime.debug,
            getattr(_knobs.compilation, "instrumentation_mode", None))


def _run_options(kernel, const: dict) -> dict:
    """The keyword arguments JITFunction.run binds with: ``const`` plus ``_debug_options``."""
    debug, mode = _debug_options(kernel, const)
    options = dict(const, debug=debug)
    if mode is not None:
        options["instrumentation_mode"] = mode
    return options


# What a memo key may hold of a launch's keyword arguments: values that compare by value.
_PLAIN = (int, float, bool, str, type(None))


def _arg_key(a):
    """An argument's part of a memo key: at least as fine as Triton's specialisation of it (a tensor's dtype and
    16-byte alignment; an integer's class: equal to 1, divisible by 16, its 32-bit / 64-bit / unsigned range, so that
    a position that changes every call, as in decode, still finds its entry; a descriptor's dtype, shape, strides, box
    and padding). Any other kind of argument: a TypeError (no memo)."""
    t = type(a)
    if t is int:
        return a == 1, a % 16 == 0, -0x80000000 <= a <= 0x7FFFFFFF, a > 0x7FFFFFFFFFFFFFFF
    if t is bool or a is None:
        return t, a
    if t is float:
        return float
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if _TensorDescriptor is not None and t is _TensorDescriptor:
        base = a.base
        return base.dtype, base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides), tuple(a.block_shape), a.padding
    raise TypeError(t)


def _memo_key(device: int, args: tuple, const: dict, options: tuple):
    """The key under which ``kernel._nsa_memo`` keeps a launch's compiled kernel, or None (no memo for it)."""
    try:
        argk = tuple(map(_arg_key, args))
    except TypeError:
        return None
    for v in const.values():
        if type(v) not in _PLAIN:
            return None
    return device, argk, tuple(const.items()), options


# Entries a kernel's memo holds at most (a few per launch shape; emptied when full, so that no mix of arguments can
# grow it without bound).
MEMO_SIZE = 1024


def run(kernel, grid, *args, **const):
    """``kernel[grid](*args, **const)`` (grid a tuple of 1-3 ints), through the fast path where it applies.

    A launch whose arguments match one seen before (the memo key: dtypes, alignment, integer classes, constants,
    Triton's debug options) skips Triton's binder and cache key too (~27 us per launch on an H100 host at m7c's
    shapes, benchmarks/results/host_time_s28_H100.md): the same compiled kernel, its arguments in signature order."""
    if (compute_cache_key is None or not isinstance(kernel, JITFunction) or getattr(kernel, "_nsa_no_fast", False)
            or not torch.cuda.is_available()):
        return kernel[grid](*args, **const)
    device = torch.cuda.current_device()
    caches = kernel.device_caches.get(device)  # a defaultdict: .get makes no entry
    if caches is None or len(caches) != 5 or _hook_set(_knobs.runtime.launch_enter_hook) or _hook_set(
            _knobs.runtime.launch_exit_hook):
        return kernel[grid](*args, **const)
    memo_key = _memo_key(device, args, const, _debug_options(kernel, const))
    memo = getattr(kernel, "_nsa_memo", None)
    hit = None if memo is None or memo_key is None else memo.get(memo_key)
    if hit is not None:
        fast, tail = hit
        values = (*args, *tail)
    else:
        kernel_cache, key_cache, _target, _backend, binder = caches
        bound, specialization, run_options = binder(*args, **_run_options(kernel, const))
        key = compute_cache_key(key_cache, specialization, run_options)
        compiled = kernel_cache.get(key)
        if compiled is None:  # Triton compiles it; if our key still names nothing, this Triton binds differently
            out = kernel[grid](*args, **const)
            if key not in kernel_cache:
                kernel._nsa_no_fast = True  # every later launch of this kernel: the normal path, no second binding
            return out
        fast = None if hasattr(compiled, "result") else _fast_launcher(compiled)
        if fast is None:
            return kernel[grid](*args, **const)
        values = tuple(bound.values())
        if memo_key is not None:
            if memo is None or len(memo) >= MEMO_SIZE:
                memo = kernel._nsa_memo = {}
            # the parameters after the positional ones: constants and defaults, fixed by the key
            memo[memo_key] = (fast, values[len(args):])
    launch, cooperative, pdl, function, packed_metadata, compiled = fast
    n = len(grid)
    launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, torch._C._cuda_getCurrentRawStream(device),
           function, cooperative, pdl, None, None, packed_metadata, None, None, None, *values)
    return compiled
