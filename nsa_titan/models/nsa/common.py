"""Static NSA geometry shared by every attention implementation (no tensors, no state)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NSAParams:
    """The sizes that define NSA's three branches (paper notation in brackets)."""

    cmp_block: int  # l
    cmp_stride: int  # d
    slc_block: int  # l'
    slc_top_n: int  # n
    window: int  # w

    def num_cmp_tokens(self, seq_len: int) -> int:
        """Compressed token i covers [i*d, i*d + l); only blocks that fit inside the sequence exist."""
        if seq_len < self.cmp_block:
            return 0
        return (seq_len - self.cmp_block) // self.cmp_stride + 1

    def num_slc_blocks(self, seq_len: int) -> int:
        """Selection block j covers [j*l', (j+1)*l'); the last block may be partial."""
        return -(-seq_len // self.slc_block)

    @classmethod
    def from_args(cls, args) -> NSAParams:
        return cls(args.cmp_block, args.cmp_stride, args.slc_block, args.slc_top_n, args.window)
