"""The NSA transformer: construction, causality, implementations agree, compile, FLOP counting."""

import dataclasses

import pytest
import torch

from nsa_titan.models import MODEL_FLAVORS, build_model, get_model_args
from nsa_titan.models.nsa import reference as ref
from nsa_titan.models.nsa.common import NSAParams
from nsa_titan.models.nsa.flops import count_params, mean_keys_per_query, training_flops_per_token

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=96, max_seq_len=256,
            cmp_block=8, cmp_stride=4, slc_block=16, slc_top_n=3, window=24)


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    args = get_model_args("debug", **{**TINY, **kw})
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def run_with_blocks(model, tokens):
    """The model's forward, also returning every layer's selected blocks."""
    t = tokens.shape[1]
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]
    h, blocks = model.tok_embeddings(tokens), []
    for block in model.layers.values():
        a, sel = block.attention(block.attention_norm(h), cos, sin, return_blocks=True)
        h = h + a
        h = h + block.feed_forward(block.ffn_norm(h))
        blocks.append(sel if sel.dtype == torch.bool else ref_mask(sel, t, model))
    return model.output(model.norm(h)), blocks


def ref_mask(block_idx, t, model):
    from nsa_titan.models.nsa.torch_impl import blocks_to_mask

    return blocks_to_mask(block_idx, t, NSAParams.from_args(model.args))


def test_meta_init_is_deterministic_and_finite():
    a, b = tiny_model(seed=3), tiny_model(seed=3)
    for (n, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), n
    tokens = torch.randint(0, 256, (2, 50))
    assert torch.isfinite(a(tokens)).all()
    assert not torch.equal(tiny_model(seed=4).output.weight, a.output.weight)


@pytest.mark.parametrize("kw", [{}, {"shared_kv": True}, {"compress": "mean"}, {"v_head_dim": 8}])
def test_torch_path_matches_reference_through_the_model(kw):
    fast_m = tiny_model(**kw, attn_impl="torch")
    ref_m = tiny_model(**kw, attn_impl="reference")
    tokens = torch.randint(0, 256, (2, 70))
    lf, bf = run_with_blocks(fast_m, tokens)
    lr, br = run_with_blocks(ref_m, tokens)
    assert all(torch.equal(x, y) for x, y in zip(bf, br))
    assert (lf - lr).abs().max() < 1e-5
    lf.logsumexp(-1).sum().backward()
    lr.logsumexp(-1).sum().backward()
    for (name, pf), pr in zip(fast_m.named_parameters(), ref_m.parameters()):
        assert (pf.grad - pr.grad).abs().max() < 1e-4 * max(1.0, pr.grad.abs().max().item()), name


@pytest.mark.parametrize("impl", ["torch", "reference"])
def test_model_is_causal(impl):
    model = tiny_model(attn_impl=impl)
    tokens = torch.randint(0, 256, (2, 90))
    for cut in (5, 33, 64):
        other = tokens.clone()
        other[:, cut:] = torch.randint(0, 256, other[:, cut:].shape)
        (lx, bx), (ly, by) = run_with_blocks(model, tokens), run_with_blocks(model, other)
        assert torch.equal(lx[:, :cut], ly[:, :cut])
        assert all(torch.equal(x[:, :, :cut], y[:, :, :cut]) for x, y in zip(bx, by))
        assert not torch.equal(lx[:, cut:], ly[:, cut:])


def test_dense_attention_type_is_causal_and_trains():
    model = tiny_model(attn_type="dense")
    tokens = torch.randint(0, 256, (1, 40))
    other = tokens.clone()
    other[:, 20:] = (other[:, 20:] + 1) % 256
    assert torch.equal(model(tokens)[:, :20], model(other)[:, :20])
    model(tokens).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_compile_fullgraph_forward_backward_matches_eager():
    model = tiny_model()
    tokens = torch.randint(0, 256, (2, 48))
    eager = model(tokens)
    eager.logsumexp(-1).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)  # raises on any graph break
    out = compiled(tokens)
    out.logsumexp(-1).mean().backward()
    assert (out - eager).abs().max() < 1e-4
    for g, p in zip(grads, model.parameters()):
        assert (g - p.grad).abs().max() < 1e-4


def test_mean_keys_match_the_reference_masks():
    args = get_model_args("debug", **TINY)
    p, t = NSAParams.from_args(args), 100
    vis = ref.compressed_visibility(t, p).sum(-1).double().mean()
    # Keys a query of the selection branch reads: selected blocks' tokens at or before t, taking the top
    # n with all-equal importance (any choice reads the same count: past blocks are always full).
    chosen = ref.select_blocks(torch.zeros(1, 1, t, p.num_slc_blocks(t)), p)[0, 0]
    s = torch.arange(t)
    slc = (chosen[:, s // p.slc_block] & (s[None] <= s[:, None])).sum(-1).double().mean()
    win = ((s[None] <= s[:, None]) & (s[None] > s[:, None] - p.window)).sum(-1).double().mean()
    keys = mean_keys_per_query(args, t)
    assert keys["cmp"] == pytest.approx(vis.item()) and keys["slc"] == pytest.approx(slc.item())
    assert keys["win"] == pytest.approx(win.item())
    assert mean_keys_per_query(dataclasses.replace(args, attn_type="dense"), t)["dense"] == 50.5


def test_param_count_and_flops():
    args = get_model_args("debug", **TINY)
    model = tiny_model()
    assert count_params(args, include_embedding=True) == sum(p.numel() for p in model.parameters())
    assert count_params(args) == count_params(args, True) - args.vocab_size * args.dim
    # Longer sequences cost more per token (more compressed tokens, fuller windows), never less.
    assert training_flops_per_token(args, 256) > training_flops_per_token(args, 64) > 6 * count_params(args)
    assert 0.7e9 < count_params(get_model_args("1b"), True) < 1.3e9


def test_qwen7b_flavor_has_the_study_shape_and_parameter_count():
    """The Qwen2.5-7B-shaped flavor built on the meta device (no memory): its parameters counted by hand from the
    shape, so a changed dimension, head count or NSA size shows up here."""
    args = get_model_args("qwen7b")
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim, args.ffn_hidden_dim) == \
        (3584, 28, 28, 4, 128, 18944) and args.n_rep == 7
    with torch.device("meta"):
        model = build_model(args)
    d, hd, l = 3584, 128, 32  # width, head dim, compression block
    attn = d * 28 * hd + d * 3 * 4 * (hd + hd) + 2 * (l * hd + l * hd * hd + hd * hd) + d * 28 * 3 + 28 * hd * d
    block = attn + 3 * d * 18944 + 2 * d  # wq, wkv (3 branches), phi_k/phi_v, gates, wo; SwiGLU; two norms
    assert block == 241_783_808
    assert sum(p.numel() for p in model.parameters()) == 28 * block + 2 * 152064 * d + d == 7_859_944_960


def test_flavors_and_validation_errors():
    assert {"debug", "m7c", "1b", "qwen7b"} <= set(MODEL_FLAVORS)
    for name in MODEL_FLAVORS:
        get_model_args(name).validate()
    with pytest.raises(ValueError, match="valid flavors"):
        get_model_args("7b")
    with pytest.raises(ValueError, match="n_kv_heads"):
        get_model_args("debug", n_kv_heads=3).validate()
    with pytest.raises(ValueError, match="cmp_stride"):
        get_model_args("debug", cmp_stride=5).validate()
    with pytest.raises(ValueError, match="slc_top_n"):
        get_model_args("debug", slc_top_n=2).validate()
    with pytest.raises(ValueError, match="max_seq_len"):
        get_model_args("debug").validate(seq_len=4096)
    with pytest.raises(ValueError, match="model.dq_buffer_gib: must be > 0"):
        get_model_args("debug", dq_buffer_gib=0.0).validate()
    assert get_model_args("debug") is not get_model_args("debug")  # callers get their own copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_the_rotate_half_formula_bit_for_bit(dtype):
    """apply_rope's 4-kernel form == (x1 cos - x2 sin, x2 cos + x1 sin) at angle position / theta^(2i/D),
    exactly; and rotating by position p preserves dot products between two rotated vectors up to p_q - p_k."""
    from nsa_titan.models.nsa.attention import apply_rope, rope_tables

    t, d, theta = 70, 32, 10000.0
    cos, sin_signed = rope_tables(d, t, theta)
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq
    c, s = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x = torch.randn(2, t, 3, d).to(dtype)
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2:].float()
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)
    assert torch.equal(apply_rope(x, cos, sin_signed), want)
    q, k = torch.randn(1, 1, 1, d).expand(1, t, 1, d), torch.randn(1, 1, 1, d).expand(1, t, 1, d)
    rq, rk = apply_rope(q, cos, sin_signed), apply_rope(k, cos, sin_signed)
    dots = (rq[0, 10:] * rk[0, :-10]).sum(-1)  # every pair 10 positions apart: the same relative rotation
    assert torch.allclose(dots, dots[0].expand_as(dots), atol=1e-4)


@pytest.mark.parametrize("kind,dv,t", [("mlp", 16, 37), ("mlp", 8, 37), ("mean", 16, 37), ("mlp", 16, 5)])
def test_compress_pair_is_both_compressors(kind, dv, t):
    """attention.compress_pair (the keys' and values' phi as batched matmuls) gives each Compressor's own output and
    the same gradients, and falls back to them where it cannot batch (phi = mean, Dv != Dk, fewer than l tokens)."""
    from nsa_titan.models.nsa.attention import Compressor, compress_pair

    torch.manual_seed(0)
    ck, cv = Compressor(16, 8, 4, kind), Compressor(dv, 8, 4, kind)
    ck.init_weights()
    cv.init_weights()
    k0, v0 = torch.randn(2, t, 3, 16), torch.randn(2, t, 3, dv)
    outs, grads = [], []
    for fn in (lambda k, v: compress_pair(ck, cv, k, v), lambda k, v: (ck(k), cv(v))):
        k, v = k0.clone().requires_grad_(True), v0.clone().requires_grad_(True)
        ok, ov = fn(k, v)
        params = [p for m in (ck, cv) for p in m.parameters()]
        outs.append((ok.detach(), ov.detach()))
        if not ok.requires_grad:  # fewer than l tokens: no compressed token, nothing flows back
            continue
        ((ok * torch.linspace(-1, 1, ok.numel()).view_as(ok)).sum() + (ov ** 2).sum()).backward()
        grads.append([k.grad, v.grad] + [p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    assert len(grads) == (2 if t >= 8 else 0)
    for a, b in zip(outs[0] + tuple(grads[0] if grads else ()), outs[1] + tuple(grads[1] if grads else ())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert outs[0][0].shape == (2, max(0, (t - 8) // 4 + 1), 3, 16)


def _kernel_arg_seen(monkeypatch, impl: str, kwarg: str, **model_args) -> list:
    """The value of keyword ``kwarg`` that each of a tiny model's two layers hands its attention implementation
    ``impl`` (a spy in NSA_IMPLS that runs the torch path), None where it passes none."""
    from nsa_titan.models.nsa import attention

    pytest.importorskip("triton")
    seen = []
    torch_path = attention.NSA_IMPLS["torch"]

    def spy(*a, **kw):
        seen.append(kw.get(kwarg))
        return torch_path(*a, doc_start=kw.get("doc_start"))

    monkeypatch.setitem(attention.NSA_IMPLS, impl, spy)
    tiny_model(attn_impl=impl, **model_args)(torch.randint(0, 256, (1, 40)))
    return seen


@pytest.mark.parametrize("impl,gib", [("triton", 0.25), ("triton", 2.0), ("torch", 0.25)])
def test_dq_buffer_gib_reaches_the_triton_attention_only(monkeypatch, impl, gib):
    """model.dq_buffer_gib is handed to the Triton attention as bytes (its backward's budget for stored dS; the
    kernels' own check dq_buffer follows it into the backward); the torch path takes no such argument."""
    seen = _kernel_arg_seen(monkeypatch, impl, "dq_buffer_bytes", dq_buffer_gib=gib)
    assert seen == ([int(gib * 2**30)] * 2 if impl == "triton" else [None, None])


@pytest.mark.parametrize("nkv,ng", [(768, 36), (40, 12), (48, 48)])
def test_kv_and_gate_logits_as_one_matmul_give_the_two_projections(monkeypatch, nkv, ng):
    """attention.kv_and_gate_logits (attempt 94): with multiple 8 one matmul over the stacked K/V and gate weights
    (rows padded to a multiple of 8) gives the two projections' values and weight gradients; with multiple 1 it is
    the two projections themselves. A slice off by one row, or a pad on the wrong side, fails the values. m7c's 36
    gate outputs alone ran 2-element-aligned cutlass kernels on an H100 (attempt 90). The model stacks on GPUs only
    (gate_pad_multiple): on the CPU the ops stay as they were."""
    import torch.nn.functional as F

    from nsa_titan.models.nsa import attention

    rows = []
    linear = F.linear
    monkeypatch.setattr(attention.F, "linear", lambda x, w: rows.append(w.shape[0]) or linear(x, w))
    torch.manual_seed(0)
    x = torch.randn(2, 5, 24)
    wkv, wg = torch.randn(nkv, 24, requires_grad=True), torch.randn(ng, 24, requires_grad=True)
    for multiple in (8, 1):
        rows.clear()
        kv, logits = attention.kv_and_gate_logits(x, wkv, wg, multiple)
        gkv, gg = torch.randn(kv.shape), torch.randn(logits.shape)
        ((kv * gkv).sum() + (logits * gg).sum()).backward()
        dkv, dg, wkv.grad, wg.grad = wkv.grad, wg.grad, None, None
        assert rows == ([nkv + ng + (-(nkv + ng) % 8)] if multiple == 8 else [nkv, ng])
        want_kv, want_g = linear(x, wkv), linear(x, wg)
        ((want_kv * gkv).sum() + (want_g * gg).sum()).backward()
        assert kv.shape == want_kv.shape and logits.shape == want_g.shape
        for got, want in ((kv, want_kv), (logits, want_g), (dkv, wkv.grad), (dg, wg.grad)):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        wkv.grad = wg.grad = None
    assert attention.gate_pad_multiple(torch.zeros(4, 300, 24)) == 1
