"""The portable torch path against the dense reference, and the reference against NSA's rules."""

import pytest
import torch

from nsa_titan.models.nsa import reference as ref
from nsa_titan.models.nsa import torch_impl as fast
from nsa_titan.models.nsa.common import NSAParams

# l=8, d=4, l'=16, n=4, w=24: T=77 is a multiple of none of them.
P = NSAParams(cmp_block=8, cmp_stride=4, slc_block=16, slc_top_n=4, window=24)


def make_inputs(b=2, t=77, hq=4, hkv=2, dk=16, dv=12, p=P, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    tc = p.num_cmp_tokens(t)
    return dict(
        q=r(b, t, hq, dk), k_cmp=r(b, tc, hkv, dk), v_cmp=r(b, tc, hkv, dv),
        k_slc=r(b, t, hkv, dk), v_slc=r(b, t, hkv, dv), k_win=r(b, t, hkv, dk), v_win=r(b, t, hkv, dv),
        gates=torch.rand(b, t, hq, 3, generator=g, dtype=dtype),
    )


def ref_chosen(x, p=P):
    _, p_cmp = ref.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], p)
    return ref.select_blocks(ref.block_importance(p_cmp, x["k_slc"].shape[2], p), p)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (12, 2), (16, 1)])  # G = 1, 2, 6, 16
@pytest.mark.parametrize("t", [77, 5, 130])
def test_fast_matches_reference(hq, hkv, t):
    x = make_inputs(t=t, hq=hq, hkv=hkv)
    out_ref, chosen_ref = ref.nsa_attention(**x, p=P)
    out_fast, block_idx = fast.nsa_attention(**x, p=P)
    assert torch.equal(fast.blocks_to_mask(block_idx, t, P), chosen_ref)
    assert (out_fast - out_ref).abs().max() < 1e-5


def test_branches_match_reference():
    x = make_inputs(hq=6, hkv=2)
    o_r, p_r = ref.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], P)
    o_f, gp_f = fast.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], P)
    assert (o_r - o_f).abs().max() < 1e-5
    assert (p_r.reshape(2, 2, 3, 77, -1).sum(2) - gp_f).abs().max() < 1e-5
    assert torch.equal(ref.overlap_weights(77, P).float(), fast.overlap_weights(77, P))
    chosen = ref_chosen(x)
    idx = torch.where(chosen, torch.arange(chosen.shape[-1]), -1).sort(-1, descending=True).values[..., :4]
    o_r = ref.selected_attention(x["q"], x["k_slc"], x["v_slc"], chosen, P)
    o_f = fast.selected_attention(x["q"], x["k_slc"], x["v_slc"], idx, P)
    assert (o_r - o_f).abs().max() < 1e-5
    o_r = ref.window_attention(x["q"], x["k_win"], x["v_win"], P.window)
    o_f = fast.window_attention(x["q"], x["k_win"], x["v_win"], P.window)
    assert (o_r - o_f).abs().max() < 1e-5


def test_gradients_match_reference():
    x = {k: v.requires_grad_() for k, v in make_inputs(t=40, hq=4, hkv=2).items()}
    grads = []
    for impl in (ref.nsa_attention, fast.nsa_attention):
        out, _ = impl(**x, p=P)
        grads.append(torch.autograd.grad((out * torch.cos(out)).sum(), list(x.values())))
    for g_ref, g_fast in zip(*grads):
        assert (g_ref - g_fast).abs().max() < 1e-5


def test_gradcheck_float64():
    p = NSAParams(cmp_block=4, cmp_stride=2, slc_block=4, slc_top_n=3, window=5)
    x = make_inputs(b=1, t=11, hq=2, hkv=1, dk=4, dv=3, p=p, dtype=torch.float64)
    names = list(x)
    for impl in (ref.nsa_attention, fast.nsa_attention):
        def f(*args, impl=impl):
            return impl(**dict(zip(names, args)), p=p)[0]
        assert torch.autograd.gradcheck(f, [v.requires_grad_() for v in x.values()], eps=1e-6, atol=1e-5)


def test_nothing_visible_gives_zero_not_nan():
    x = make_inputs(t=40)
    out, probs = fast.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], P)
    assert torch.isfinite(out).all()
    # Compressed token 0 covers [0, 8): queries 0..6 see nothing.
    assert out[:, : P.cmp_block - 1].abs().max() == 0
    assert out[:, P.cmp_block - 1].abs().min() > 0
    q = x["q"].requires_grad_()
    fast.compressed_attention(q, x["k_cmp"], x["v_cmp"], P)[0].sum().backward()
    assert torch.isfinite(q.grad).all()
    # Shorter than one compression block: no compressed tokens at all.
    y = make_inputs(t=5)
    assert y["k_cmp"].shape[1] == 0
    assert torch.isfinite(fast.nsa_attention(**y, p=P)[0]).all()


def test_forced_blocks_always_selected_and_count_towards_n():
    x = make_inputs(t=130, hq=4, hkv=2)
    chosen = ref_chosen(x)
    t = torch.arange(130)
    cur = t // P.slc_block
    assert chosen[..., t, 0].all() and chosen[..., t, cur].all()
    assert chosen[..., t[cur >= 1], cur[cur >= 1] - 1].all()
    n_candidates = torch.clamp(cur + 1, max=P.slc_top_n)
    assert torch.equal(chosen.sum(-1), n_candidates.expand_as(chosen.sum(-1)))


def test_ties_go_to_lower_index():
    imp = torch.zeros(1, 1, 100, P.num_slc_blocks(100))  # all equal: only forced ones + lowest indices
    chosen = ref.select_blocks(imp, P)
    gp = torch.zeros(1, 1, 100, P.num_cmp_tokens(100))
    idx = fast.select_blocks(gp, P)
    assert torch.equal(fast.blocks_to_mask(idx, 100, P), chosen)
    # t = 99: blocks 0..6 are candidates; forced 0, 5, 6; the tie among 1..4 goes to block 1.
    assert chosen[0, 0, 99].nonzero().flatten().tolist() == [0, 1, 5, 6]


def test_overlap_is_identity_when_block_sizes_agree():
    p = NSAParams(cmp_block=8, cmp_stride=8, slc_block=8, slc_top_n=3, window=8)
    assert torch.equal(fast.overlap_weights(64, p), torch.eye(8))
    assert torch.equal(ref.overlap_weights(64, p), torch.eye(8, dtype=torch.float64))
    # Paper sizes (l=32, d=16, l'=64): compressed tokens 4j-1 .. 4j+3 feed block j with weights 1,2,2,2,1.
    w = fast.overlap_weights(512, NSAParams(32, 16, 64, 16, 512))
    assert w[7:12, 2].tolist() == [1, 2, 2, 2, 1] and w[:7, 2].sum() == 0 and w[12:, 2].sum() == 0


def test_selection_covering_everything_is_full_causal_attention():
    x = make_inputs(t=60, hq=4, hkv=2)
    p = NSAParams(cmp_block=8, cmp_stride=4, slc_block=16, slc_top_n=4, window=60)  # n*l' = 64 >= T
    full = ref.masked_attention(x["q"], x["k_slc"], x["v_slc"], torch.ones(60, 60).tril().bool())[0]
    _, gp = fast.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], p)
    o_slc = fast.selected_attention(x["q"], x["k_slc"], x["v_slc"], fast.select_blocks(gp, p), p)
    assert (o_slc - full).abs().max() < 1e-5
    full_w = ref.masked_attention(x["q"], x["k_win"], x["v_win"], torch.ones(60, 60).tril().bool())[0]
    assert (fast.window_attention(x["q"], x["k_win"], x["v_win"], 60) - full_w).abs().max() < 1e-5


@pytest.mark.parametrize("impl", [ref.nsa_attention, fast.nsa_attention])
@pytest.mark.parametrize("p_cut", [1, 17, 40, 64])
def test_causality_black_box(impl, p_cut):
    """Changing inputs at positions >= p_cut changes nothing (outputs, selections) before p_cut."""
    x = make_inputs(t=77, hq=4, hkv=2)
    y = {k: v.clone() for k, v in x.items()}
    for name in ("q", "k_slc", "v_slc", "k_win", "v_win", "gates"):
        y[name][:, p_cut:] = torch.randn_like(y[name][:, p_cut:]) * 3
    # Compressed token i depends on positions up to i*d + l - 1.
    first_touched = max(0, -(-(p_cut - P.cmp_block + 1) // P.cmp_stride))
    for name in ("k_cmp", "v_cmp"):
        y[name][:, first_touched:] = torch.randn_like(y[name][:, first_touched:]) * 3
    out_x, sel_x = impl(**x, p=P)
    out_y, sel_y = impl(**y, p=P)
    assert torch.equal(out_x[:, :p_cut], out_y[:, :p_cut])
    assert torch.equal(sel_x[:, :, :p_cut], sel_y[:, :, :p_cut])
    assert not torch.equal(out_x[:, p_cut:], out_y[:, p_cut:])  # the perturbation did reach the output
