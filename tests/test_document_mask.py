"""Document masking (packed sequences): each document sees only itself in every NSA branch.

The reference defines it (reference.py's module doc); the portable path is held to it, and the reference is
held to what document masking means: a document placed on the block grids gives the same outputs as the
document alone, and nothing of one document reaches another.
"""

import pytest
import torch

from nsa_titan.models.nsa import reference as ref
from nsa_titan.models.nsa import torch_impl as fast
from test_nsa_attention import P, make_inputs

T = 77


def starts_to_doc_start(starts_per_row, t=T):
    """[[0, 23, 40], [0, 50]] -> doc_start [B, T]: the first position of each token's document."""
    rows = []
    for starts in starts_per_row:
        pos = torch.arange(t)
        rows.append(torch.tensor(starts)[torch.searchsorted(torch.tensor(starts), pos, right=True) - 1])
    return torch.stack(rows)


DOCS = starts_to_doc_start([[0, 23, 40, 64], [0, 50]])  # starts inside blocks and on block edges


@pytest.mark.parametrize("hq,hkv", [(4, 2), (16, 1)])
def test_fast_matches_reference_with_documents(hq, hkv):
    x = {k: v.requires_grad_() for k, v in make_inputs(t=T, hq=hq, hkv=hkv).items()}
    out_ref, chosen_ref = ref.nsa_attention(**x, p=P, doc_start=DOCS)
    grads_ref = torch.autograd.grad(out_ref.square().sum(), list(x.values()))
    out_fast, block_idx = fast.nsa_attention(**x, p=P, doc_start=DOCS)
    grads_fast = torch.autograd.grad(out_fast.square().sum(), list(x.values()))
    assert torch.equal(fast.blocks_to_mask(block_idx, T, P), chosen_ref)
    assert (out_fast - out_ref).abs().max() < 1e-5
    for name, a, b in zip(x, grads_fast, grads_ref):
        assert (a - b).abs().max() < 1e-4, name


@pytest.mark.parametrize("impl", [ref.nsa_attention, fast.nsa_attention])
def test_one_document_is_the_unmasked_attention(impl):
    x = make_inputs(t=T)
    out, sel = impl(**x, p=P)
    out_doc, sel_doc = impl(**x, p=P, doc_start=torch.zeros(2, T, dtype=torch.long))
    assert torch.equal(out, out_doc) and torch.equal(sel, sel_doc)


def test_selection_stays_inside_the_document():
    x = make_inputs(t=T)
    _, p_cmp = ref.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], P, DOCS)
    chosen = ref.select_blocks(ref.block_importance(p_cmp, 2, P), P, DOCS)  # [B, HKV, T, Nb]
    j = torch.arange(chosen.shape[-1])
    block_end = (j + 1) * P.slc_block - 1
    ds = DOCS[:, None, :, None]
    assert not (chosen & (block_end < ds)).any()  # no block that ends before the document
    first = ds // P.slc_block
    assert chosen.gather(-1, first.expand(-1, 2, -1, -1)).all()  # the document's first block is forced
    # Compressed probabilities put no mass outside the document.
    i = torch.arange(p_cmp.shape[-1])
    assert p_cmp.masked_select(i * P.cmp_stride < DOCS[:, None, :, None]).abs().max() == 0


@pytest.mark.parametrize("impl", [ref.nsa_attention, fast.nsa_attention])
def test_nothing_crosses_a_document_boundary(impl):
    x = make_inputs(t=T)
    base, _ = impl(**x, p=P, doc_start=DOCS)
    for b, boundary in ((0, 40), (1, 50)):
        y = {k: v.clone() for k, v in x.items()}
        for name in ("q", "k_slc", "v_slc", "k_win", "v_win"):
            y[name][b, :boundary] += 3.0  # every input of the documents before the boundary
        tc_before = -(-boundary // P.cmp_stride)  # compressed tokens starting before it
        y["k_cmp"][b, :tc_before] += 3.0
        y["v_cmp"][b, :tc_before] += 3.0
        out, _ = impl(**y, p=P, doc_start=DOCS)
        assert (out[b, boundary:] - base[b, boundary:]).abs().max() < 1e-6  # later documents: untouched
        assert (out[b, :boundary] - base[b, :boundary]).abs().max() > 1e-2  # (the change did reach its own)


@pytest.mark.parametrize("impl", [ref.nsa_attention, fast.nsa_attention])
def test_a_document_on_the_block_grids_is_computed_as_if_alone(impl):
    start = 32  # a multiple of d = 4 and l' = 16: the compressed tokens and blocks of the document align
    x = make_inputs(b=1, t=T)
    doc_start = starts_to_doc_start([[0, start]])
    packed, _ = impl(**x, p=P, doc_start=doc_start)
    ic = start // P.cmp_stride
    alone_inputs = {k: (v[:, ic:] if k in ("k_cmp", "v_cmp") else v[:, start:]) for k, v in x.items()}
    alone, _ = impl(**alone_inputs, p=P)
    assert (packed[:, start:] - alone).abs().max() < 1e-5


# --- the model and the trainer's inputs ------------------------------------------------------------------------


def test_document_starts_from_eos():
    from nsa_titan.data.documents import add_document_inputs, document_starts

    eos = 9
    tokens = torch.tensor([[1, 2, eos, 3, eos, eos, 4, 5], [eos, 1, 2, 3, 4, 5, 6, 7]])
    assert document_starts(tokens, eos).tolist() == [[0, 0, 0, 3, 3, 5, 6, 6], [0, 1, 1, 1, 1, 1, 1, 1]]
    batch = add_document_inputs({"input": tokens}, eos, restart_positions=True)
    assert batch["positions"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert "positions" not in add_document_inputs({"input": tokens}, eos, restart_positions=False)


@pytest.mark.parametrize("attn_type", ["nsa", "dense"])
def test_packed_document_logits_equal_the_document_alone(attn_type):
    """Whole model, documents masked and positions restarted: the second document of a packed row (starting
    on the block grids) gets the logits it gets alone; without the mask it does not."""
    from _dist_worker import tiny_args
    from nsa_titan.data.documents import add_document_inputs
    from nsa_titan.models import build_model

    torch.manual_seed(0)
    args = tiny_args(2)
    args.attn_type = attn_type
    model = build_model(args)
    model.init_weights()
    eos, start = 255, 32
    doc_a = torch.randint(0, 200, (1, start))
    doc_a[0, -1] = eos
    doc_b = torch.randint(0, 200, (1, 45))
    packed = torch.cat([doc_a, doc_b], dim=1)
    batch = add_document_inputs({"input": packed}, eos, restart_positions=True)
    with torch.no_grad():
        got = model(packed, doc_start=batch["doc_start"], positions=batch["positions"])[:, start:]
        alone = model(doc_b)
        unmasked = model(packed)[:, start:]
    assert (got - alone).abs().max() < 1e-4
    assert (unmasked - alone).abs().max() > 1e-2  # the test can tell masked from unmasked
