"""Window and dense attention without a T x T mask (issue 14, item 7): the banded CPU form and the FlexAttention
block mask against the reference, the flash-attn dispatch (flash-attn has no wheels here: a stand-in with its
documented semantics checks the call), and the kernel named in the start-up log."""

from __future__ import annotations

import pytest
import torch

from nsa_titan.models.nsa import local_attention as la
from nsa_titan.models.nsa.reference import masked_attention
from nsa_titan.models.nsa.reference import window_attention as ref_window


def qkv(t, hq=4, hkv=2, dk=16, dv=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, t, h, d, generator=g, dtype=torch.float64) for h, d in ((hq, dk), (hkv, dk), (hkv, dv)))
    return [x.requires_grad_(grad) for x in (q, k, v)]


@pytest.mark.parametrize("t,w", [(64, 24), (100, 24), (37, 64), (50, 1), (96, 96), (130, 17)])
def test_band_matches_the_reference_with_gradients(t, w):
    q, k, v = qkv(t, grad=True)
    got, want = la.band_window_attention(q, k, v, w), ref_window(q, k, v, w)
    assert torch.allclose(got, want, atol=1e-10)
    grads_got = torch.autograd.grad(got.square().sum(), (q, k, v))
    for a, b in zip(grads_got, torch.autograd.grad(want.square().sum(), (q, k, v))):
        assert torch.allclose(a, b, atol=1e-9)


@pytest.mark.parametrize("t,w", [(100, 24), (300, 64), (257, 200), (200, 129)])
def test_flex_block_mask_matches_the_reference(t, w):
    q, k, v = (x.float() for x in qkv(t, dv=16))  # FlexAttention: forward only on CPU, equal head dims
    mask = la.window_block_mask(t, w, q.device)
    assert mask.kv_num_blocks.shape[-1] == -(-t // 128)  # a table of blocks, not of tokens
    from torch.nn.attention.flex_attention import flex_attention

    out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                         enable_gqa=True).transpose(1, 2)
    assert torch.allclose(out, ref_window(q, k, v, w), atol=1e-5)


def fake_flash_attn_func(q, k, v, causal=False, window_size=(-1, -1)):
    """flash_attn_func's documented contract: [B, T, H, D] in and out, GQA by head groups, key j visible to
    query i iff i - left <= j <= i + right (and j <= i when causal); -1 is unbounded."""
    calls.append({"causal": causal, "window_size": window_size, "shape": tuple(q.shape)})
    t = q.shape[1]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    left, right = window_size
    mask = (j <= i) if causal else torch.ones(t, t, dtype=torch.bool)
    if left >= 0:
        mask = mask & (j >= i - left)
    if right >= 0:
        mask = mask & (j <= i + right)
    return masked_attention(q, k, v, mask)[0]


calls: list[dict] = []


def test_flash_attn_dispatch(monkeypatch):
    assert la.window_backend("cuda", torch.bfloat16) in ("flex", "flash-attn")
    monkeypatch.setattr(la, "_flash_attn_func", None)  # flash-attn missing: FlexAttention on CUDA, band on CPU
    assert (la.window_backend("cuda", torch.bfloat16), la.window_backend("cpu", torch.float32)) == ("flex", "band")
    assert la.dense_backend("cuda", torch.bfloat16) == "sdpa"
    monkeypatch.setattr(la, "_flash_attn_func", fake_flash_attn_func)
    assert la.window_backend("cuda", torch.bfloat16) == "flash-attn"
    assert la.dense_backend("cuda", torch.float16) == "flash-attn"
    assert la.window_backend("cuda", torch.float32) == "flex"  # flash-attn takes fp16/bf16 only
    assert la.window_backend("cpu", torch.bfloat16) == "band" and la.dense_backend("cpu", torch.bfloat16) == "sdpa"
    calls.clear()
    q, k, v = qkv(70)
    assert torch.allclose(la.run_window("flash-attn", q, k, v, 24), ref_window(q, k, v, 24), atol=1e-10)
    assert calls == [{"causal": True, "window_size": (23, 0), "shape": (2, 70, 4, 16)}]
    assert la.describe("dense", "torch", "cuda", "bf16") == "dense attention: flash-attn"
    assert la.describe("nsa", "torch", "cuda", "bf16") == "window branch: flash-attn"
    assert la.describe("nsa", "torch", "cuda", "fp32") == "window branch: flex"
    assert la.describe("nsa", "triton", "cuda", "bf16") == ""


def test_start_up_log_names_the_kernel(tmp_path):
    from _ckpt_util import args, run

    _, out = run(args(tmp_path / "nsa", "--training.steps", "2"))
    assert "attn_impl=torch, window branch: band)" in out
    _, out = run(args(tmp_path / "dense", "--training.steps", "2", "--model.attn_type", "dense"))
    assert "dense attention: sdpa)" in out


# --- packed documents (issue 14, item 4) ---

T_DOC = 300  # three 128-blocks, documents starting inside blocks and on a block edge
DOC_STARTS = ([0, 23, 140, 256], [0, 150])


def doc_start(starts_per_row=DOC_STARTS, t=T_DOC):
    """First position of each token's document, [B, T] int32 (the dtype data/documents.py gives the model)."""
    pos = torch.arange(t)
    rows = [torch.tensor(s)[torch.searchsorted(torch.tensor(s), pos, right=True) - 1] for s in starts_per_row]
    return torch.stack(rows).to(torch.int32)


@pytest.mark.parametrize("t,w,starts", [(77, 24, ([0, 23, 40, 64], [0, 50])), (130, 17, ([0, 17, 34], [0, 1])),
                                        (64, 64, ([0, 32], [0, 63]))])
def test_band_with_documents_matches_the_reference_with_gradients(t, w, starts):
    q, k, v = qkv(t, grad=True)
    ds = doc_start(starts, t)
    got, want = la.band_window_attention(q, k, v, w, ds), ref_window(q, k, v, w, ds)
    assert torch.allclose(got, want, atol=1e-10)
    for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v)),
                    torch.autograd.grad(want.square().sum(), (q, k, v))):
        assert torch.allclose(a, b, atol=1e-9)
