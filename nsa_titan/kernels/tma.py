"""Tensor-descriptor (TMA) loads for the Triton kernels: descriptors made on the host, and a launch that falls back
to pointer loads.

On an H100 the copy engine loads a kernel's tiles from a descriptor (shape, strides, box) without the address
arithmetic and masks of pointer loads. The band kernels (band.py), bound by instruction issue, gain from it
(benchmarks/results/tma_probe_band_fwd_H100.json). A kernel takes a ``TMA`` constexpr and, with it, descriptors in
place of some pointer arguments; the interpreter runs the same code on the CPU (tests/_kernel_checks.py).
"""

from __future__ import annotations

import warnings

import torch
import triton

from nsa_titan.kernels.combine import pow2
from nsa_titan.kernels.launch import run

try:  # host-side tensor descriptors (Triton >= 3.3); without them every load is a pointer load
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


def descriptor(x: torch.Tensor, shape: list, strides: list, box: list):
    """A tensor descriptor of x's memory seen as ``shape`` / ``strides`` (elements) with ``box`` tiles, or None when
    the copy engine cannot read it: a head dim that is not its own power of two (the kernels pad those), a base or a
    stride not 16-byte aligned, no elements."""
    if TensorDescriptor is None or x.numel() == 0 or x.stride(-1) != 1 or x.data_ptr() % 16:
        return None
    if box[-1] != x.shape[-1] or box[-1] != pow2(max(box[-1], 16)):
        return None
    if any(st * x.element_size() % 16 for st in strides[:-1]):
        return None
    if min(shape) <= 0 or strides[-1] != 1:
        return None
    rank_box = (len(shape), len(strides), tuple(box))
    if rank_box not in _CHECKED_BOXES:  # the dataclass's own checks, once per box shape
        TensorDescriptor(x, shape, strides, box)
        _CHECKED_BOXES.add(rank_box)
    # What the dataclass would hold, without re-running its checks at every launch: the ones that depend on x or on
    # this call's shape and strides (alignment, a contiguous last dimension, positive sizes) are made above.
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.padding = x, shape, strides, box, "zero"
    return d


# (rank, strides' length, box) of the descriptors whose box the TensorDescriptor checks have passed once (host time:
# the checks took ~10 us per descriptor, benchmarks/results/hostprobe_head_s27_H100.json).
_CHECKED_BOXES: set = set()


def kv_specs(k: torch.Tensor, v: torch.Tensor, rows: int) -> dict:
    """K and V as kernel arguments 1 and 2, each a [B, S, HKV, D] descriptor with [1, rows, 1, D] boxes: a tile of
    ``rows`` consecutive keys of one (batch, KV head). Rows past S (and before 0) read zeros."""
    return {i: (x, list(x.shape), list(x.stride()), [1, rows, 1, x.shape[-1]]) for i, x in ((1, k), (2, v))}


# Launch shapes whose descriptor form this Triton could not compile (ptxas 12.9 crashed on some compressed-branch dQ
# shapes with 2 stages, H100, Triton 3.6): they run with pointer loads. A memo, so that a failing shape is compiled
# (and warned about) once per process rather than at every call.
TMA_REJECTED: set = set()


def _shape_key(kernel, const: dict) -> tuple:
    """A launch shape of a kernel, as TMA_REJECTED names it."""
    return (kernel.fn.__name__, *sorted(const.items()))


def launch_tma(kernel, grid, args: tuple, specs: dict, tma: bool, const: dict):
    """``kernel[grid](*args, **const, TMA=...)`` with the arguments named in ``specs`` ({index: descriptor's
    arguments}) replaced by tensor descriptors when ``tma`` is on and every one of them can be made; with pointer
    loads otherwise, and when the compiler rejects the descriptor form (warned once per launch shape)."""
    rejected = bool(TMA_REJECTED) and _shape_key(kernel, const) in TMA_REJECTED  # the key only when there are any
    descs = {i: descriptor(*spec) for i, spec in specs.items()} if tma and not rejected else {}
    if descs and all(d is not None for d in descs.values()):
        try:
            return run(kernel, grid, *(descs.get(i, a) for i, a in enumerate(args)), **const, TMA=True)
        except (triton.TritonError, RuntimeError) as e:  # a compiler failure; a real error recurs below
            TMA_REJECTED.add(_shape_key(kernel, const))
            warnings.warn(f"{kernel.fn.__name__}: Triton could not compile the tensor-descriptor loads for {const} "
                          f"({type(e).__name__}); using pointer loads for this launch shape", stacklevel=3)
    return run(kernel, grid, *args, **const, TMA=False)
