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
    assert la.describe("dense", "torch", "cuda", "bf16", documents=True) == "dense attention: flex (documents)"
    assert la.describe("nsa", "torch", "cuda", "bf16", documents=True) == "window branch: flex (documents)"
    assert la.describe("dense", "torch", "cpu", "fp32", documents=True) == "dense attention: sdpa-mask (documents)"
    assert la.describe("nsa", "auto", "cpu", "fp32", documents=True) == "window branch: band (documents)"


def test_start_up_log_names_the_kernel(tmp_path):
    from _ckpt_util import args, run

    _, out = run(args(tmp_path / "nsa", "--training.steps", "2"))
    assert "attn_impl=torch, window branch: band)" in out
    _, out = run(args(tmp_path / "dense", "--training.steps", "2", "--model.attn_type", "dense"))
    assert "dense attention: sdpa)" in out
    _, out = run(args(tmp_path / "docs", "--training.steps", "2", "--data.document_mask"))
    assert "attn_impl=torch, window branch: band (documents))" in out


# --- packed documents (issue 14, item 4): FlexAttention's mask_mod on CUDA, the band or an explicit mask on CPU ---

T_DOC = 300  # three 128-blocks, documents starting inside blocks and on a block edge
DOC_STARTS = ([0, 23, 140, 256], [0, 150])


def doc_start(starts_per_row=DOC_STARTS, t=T_DOC):
    """First position of each token's document, [B, T] int32 (the dtype data/documents.py gives the model)."""
    pos = torch.arange(t)
    rows = [torch.tensor(s)[torch.searchsorted(torch.tensor(s), pos, right=True) - 1] for s in starts_per_row]
    return torch.stack(rows).to(torch.int32)


def ref_documents(q, k, v, ds, window=None):
    """reference.py's window branch; with no window (the dense baseline) a window as long as the sequence."""
    return ref_window(q, k, v, window or q.shape[1], ds)


@pytest.fixture
def eager_flex(monkeypatch):
    """The CUDA flex path with eager FlexAttention and create_block_mask: FlexAttention runs forward-only on CPU,
    and eager is exact (it materialises the scores, which is why the real path compiles them)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setattr(la, "_compiled_flex", lambda: flex_attention)
    monkeypatch.setattr(la, "_compiled_create_block_mask", lambda: create_block_mask)


@pytest.mark.parametrize("window", [None, 1, 24, 200])
def test_document_mask_mod_is_the_reference_rule(window):
    ds = doc_start()
    b, q_idx, kv_idx = (torch.arange(n).view(*[-1 if i == d else 1 for i in range(3)])
                        for d, n in enumerate((2, T_DOC, T_DOC)))
    got = la.document_mask_mod(ds, window)(b, None, q_idx, kv_idx)  # [B, T, T] on the whole grid
    s = torch.arange(T_DOC)
    want = (s[None, :] <= s[:, None]) & (s >= ds.long()[..., None])
    if window is not None:
        want = want & (s[None, :] > s[:, None] - window)
    assert torch.equal(got, want)


@pytest.mark.parametrize("window", [None, 24, 200])
def test_flex_documents_match_the_reference(eager_flex, window):
    q, k, v = (x.float() for x in qkv(T_DOC))  # Dv != Dk, GQA
    ds = doc_start()
    got = la._flex_documents(q, k, v, ds, window)
    assert (got - ref_documents(q, k, v, ds, window)).abs().max() < 1e-5
    if window is None:
        assert (got - la._sdpa_documents(q, k, v, ds)).abs().max() < 1e-5


def test_flex_document_block_mask_is_per_row_and_skips_earlier_documents():
    from torch.nn.attention.flex_attention import create_block_mask

    mask = create_block_mask(la.document_mask_mod(doc_start()), 2, None, T_DOC, T_DOC, device="cpu")
    assert tuple(mask.kv_num_blocks.shape) == (2, 1, 3)  # a table of blocks per batch row, shared by the heads
    touched = mask.kv_num_blocks + mask.full_kv_num_blocks  # key blocks each query block reads
    assert touched[0, 0].tolist() == [1, 2, 1]  # row 0: the document at 256 reads its own block only
    assert touched[1, 0].tolist() == [1, 2, 2]  # row 1: the document at 150 starts in block 1


def test_flex_documents_are_causal_and_do_not_see_the_previous_document(eager_flex):
    q, k, v = (x.float() for x in qkv(T_DOC))
    ds = doc_start()
    base = la._flex_documents(q, k, v, ds, None)
    k2, v2 = k.clone(), v.clone()
    k2[:, 200:] += 3.0  # the future of position 199
    v2[:, 200:] += 3.0
    out = la._flex_documents(q, k2, v2, ds, None)
    assert torch.equal(out[:, :200], base[:, :200]) and (out[:, 200:] - base[:, 200:]).abs().max() > 1e-2
    for row, boundary in ((0, 140), (1, 150)):
        k2, v2 = k.clone(), v.clone()
        k2[row, :boundary] += 3.0  # every key and value of the documents before the boundary
        v2[row, :boundary] += 3.0
        out = la._flex_documents(q, k2, v2, ds, None)
        assert torch.equal(out[row, boundary:], base[row, boundary:])
        assert (out[row, :boundary] - base[row, :boundary]).abs().max() > 1e-2  # (the change reached its own)


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


def test_document_dispatch(monkeypatch, eager_flex):
    # CUDA: FlexAttention whatever the dtype and flash-attn (no per-token mask there); CPU: band / explicit mask.
    monkeypatch.setattr(la, "_flash_attn_func", fake_flash_attn_func)
    assert la.document_backend("cuda", True) == la.document_backend("cuda", False) == "flex"
    assert (la.document_backend("cpu", True), la.document_backend("cpu", False)) == ("band", "sdpa-mask")
    q, k, v = qkv(T_DOC)
    ds = doc_start()
    for window in (None, 24):
        assert torch.allclose(la.document_attention(q, k, v, ds, window), ref_documents(q, k, v, ds, window),
                              atol=1e-10)
    monkeypatch.setattr(la, "document_backend", lambda device_type, windowed: "flex")  # the CUDA route, on CPU
    q, k, v = (x.float() for x in (q, k, v))
    assert (la.document_attention(q, k, v, ds, 24) - ref_documents(q, k, v, ds, 24)).abs().max() < 1e-5


def test_flex_documents_trace_in_one_graph():
    """fullgraph=True through create_block_mask and flex_attention (aot_eager: no C++ toolchain, forward only)."""
    q, k, v = (x.float() for x in qkv(T_DOC))
    ds = doc_start()
    fn = torch.compile(lambda *a: la._flex_documents(*a, 24), fullgraph=True, backend="aot_eager")
    assert (fn(q, k, v, ds) - ref_documents(q, k, v, ds, 24)).abs().max() < 1e-5
