"""Document boundaries of packed sequences, as model inputs (on device, no host sync, static shapes).

A packed sequence is documents joined by the tokenizer's EOS token; the token after an EOS starts a new
document and the EOS belongs to the document it ends. ``doc_start[b, t]`` is the position where token t's
document begins (models/nsa/reference.py's document rules read it); ``positions`` restart at each start.
"""

from __future__ import annotations

import torch


def document_starts(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """tokens [B, T] -> doc_start [B, T] int32: a running maximum of the positions that start a document."""
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eos_id
    return torch.where(starts, pos, 0).cummax(dim=1).values.to(torch.int32)


def add_document_inputs(batch: dict, eos_id: int, restart_positions: bool) -> dict:
    """The batch with ``doc_start`` (and ``positions`` when they restart per document) for the model."""
    doc_start = document_starts(batch["input"], eos_id)
    out = dict(batch, doc_start=doc_start)
    if restart_positions:
        out["positions"] = torch.arange(doc_start.shape[1], device=doc_start.device) - doc_start
    return out
