"""Fingerprint of the NSA op's outputs and gradients, to show that a refactor changed no bit (GPU).

    python benchmarks/check_bitwise.py [TREE] [--via-op]   # TREE: a checkout to import nsa_titan from (default: here)

Runs ``nsa_attention`` forward and backward on seeded random bf16 inputs at m7c's shape (8k, batch 2) and the 1b's
(8k, batch 1) and prints one SHA-256 per shape over the output and all eight gradients. Run it in two trees (e.g. a
``git archive`` of the parent) in one device call: equal digests mean bitwise equal results, and two runs of one
tree give equal digests when the op is deterministic. ``--via-op``: through the custom op's dispatch, as a compiled
model calls it (eager calls skip it since the twenty-eighth session: ops._Direct); the digests must not change.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

VIA_OP = "--via-op" in sys.argv
_TREE = [a for a in sys.argv[1:] if a != "--via-op"]
sys.path.insert(0, os.path.abspath(_TREE[0]) if _TREE else os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nsa_titan.kernels.ops import nsa_attention  # noqa: E402
from nsa_titan.models.nsa.common import NSAParams  # noqa: E402

SHAPES = {"m7c": (2, 8192, 12, 2, 64), "1b": (1, 8192, 16, 1, 128)}  # B, T, HQ, HKV, D


def digest(B: int, T: int, HQ: int, HKV: int, D: int) -> str:
    g = torch.Generator(device="cuda").manual_seed(0)
    p = NSAParams(32, 16, 64, 16, 512)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).bfloat16().requires_grad_(True)

    q = rand(B, T, HQ, D)
    kv = [rand(B, p.num_cmp_tokens(T), HKV, D) for _ in range(2)] + [rand(B, T, HKV, D) for _ in range(4)]
    gates = torch.rand(B, T, HQ, 3, device="cuda", generator=g).requires_grad_(True)
    o, _ = nsa_attention(q, *kv, gates, p, **({"via_op": True} if VIA_OP else {}))
    grads = torch.autograd.grad(o, (q, *kv, gates), torch.randn(o.shape, device="cuda", generator=g).to(o.dtype))
    h = hashlib.sha256()
    for x in (o, *grads):
        h.update(x.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    print(json.dumps({name: digest(*shape) for name, shape in SHAPES.items()}))
