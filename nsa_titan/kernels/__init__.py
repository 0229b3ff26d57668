"""Triton kernels for NSA attention (CUDA; CPU only under TRITON_INTERPRET=1, for tests).

Public entry point: ``nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, p)`` with the
contract of ``nsa_titan.models.nsa.torch_impl.nsa_attention``. The kernels are registered as two torch
operators, so that torch.compile(fullgraph=True) traces through them and an activation-checkpoint policy
can name them: ``torch.ops.nsa_titan.nsa_fwd`` (all three branches, the block selection and the gate
combination) and ``torch.ops.nsa_titan.nsa_bwd`` (see ``OPS``).

Nothing from ``nsa_titan.models`` is imported here: models/nsa/attention.py imports this package.
Importing raises ImportError when triton is unavailable, so that the model falls back to the torch path.
"""

try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except ImportError:
    raise
except Exception as e:  # a broken triton install must read as "no kernels", not crash the model import
    raise ImportError(f"triton is unusable: {e}") from e

from nsa_titan.kernels.ops import OPS, nsa_attention  # noqa: E402

__all__ = ["OPS", "nsa_attention"]
