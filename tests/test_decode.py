"""Incremental decoding: same logits as a full forward, exact read counts, no host syncs, vectorised."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nsa_titan.models import build_model, get_model_args
from nsa_titan.models.nsa.common import NSAParams
from nsa_titan.models.nsa.decode import KVCache, decode_step, nsa_tokens_read, prefill

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=96, cmp_block=8,
            cmp_stride=4, slc_block=16, slc_top_n=3, window=24, max_seq_len=256)


def tiny_model(seed=0, **kw):
    args = get_model_args("debug", **{**TINY, "attn_impl": "torch", **kw})
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    # Sharper attention than at init (weights x3), so that selection actually depends on the scores and
    # a wrong block choice changes the logits well beyond the tolerance.
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "wq" in name or "wkv" in name:
                w.mul_(3)
    return model.eval()


def decode_all(model, tokens, n_prefill):
    """Logits [B, T, V]: prefill the first n_prefill tokens (0: start from an empty cache), decode the rest."""
    cache = KVCache(model, tokens.shape[0], tokens.shape[1])
    out, reads = [], []
    if n_prefill:
        out.append(prefill(model, tokens[:, :n_prefill], cache))
    for t in range(n_prefill, tokens.shape[1]):
        out.append(decode_step(model, cache, tokens[:, t: t + 1])[:, None])
        reads.append(cache.last_reads)
    return torch.cat(out, dim=1), reads


# n > 3: with n = 3 all selected blocks are forced ones and the importance scores would go untested.
@pytest.mark.parametrize("n_prefill,kw", [
    (0, {"slc_top_n": 4}),                              # every token through the cache
    (37, {"slc_top_n": 5}),                             # prompt ends mid-block
    (64, {"slc_top_n": 4, "shared_kv": True, "compress": "mean"}),  # ends on a block edge; shared K/V
    (5, {"n_heads": 6, "n_kv_heads": 1, "cmp_block": 16, "slc_block": 8, "slc_top_n": 4}),  # l > l', G = 6
])
def test_decode_matches_full_forward(n_prefill, kw):
    model = tiny_model(**kw)
    tokens = torch.randint(0, 260, (2, 150), generator=torch.Generator().manual_seed(1))
    full = model(tokens)
    inc, _ = decode_all(model, tokens, n_prefill)
    assert (inc - full).abs().max().item() < 1e-4


def test_dense_model_decode_matches_full_forward():
    model = tiny_model(attn_type="dense")
    tokens = torch.randint(0, 260, (2, 40), generator=torch.Generator().manual_seed(2))
    inc, reads = decode_all(model, tokens, 9)
    assert (inc - model(tokens)).abs().max().item() < 1e-4
    assert [r[0]["dense"] for r in reads] == list(range(10, 41))


def test_reads_follow_formula():
    """What each step gathers equals the docstring formula, from step 0 on (fewer than n blocks too)."""
    model = tiny_model(n_layers=1)
    p = NSAParams.from_args(model.args)
    tokens = torch.randint(0, 260, (1, 130), generator=torch.Generator().manual_seed(3))
    _, reads = decode_all(model, tokens, 0)
    for t, (r,) in enumerate(reads):
        assert r["cmp"] + r["slc"] + r["win"] == nsa_tokens_read(t, p), t
        completes_block = t + 1 >= p.cmp_block and (t + 1 - p.cmp_block) % p.cmp_stride == 0
        assert r["compress"] == (p.cmp_block if completes_block else 0), t
    # Hand-checked values, l=8 d=4 l'=16 n=3 w=24: t=0 reads only itself in the slc and win branches; t=40
    # has 9 compressed tokens, blocks {0, 1} + 9 tokens of block 2, a full window; at t=129, (n-1)*l' + 2.
    assert [nsa_tokens_read(t, p) for t in (0, 7, 40, 129)] == [2, 1 + 8 + 8, 9 + 41 + 24, 31 + 34 + 24]


class _SyncDetector(TorchDispatchMode):
    """Records ops that need a device->host copy on CUDA (.item(), bool(), data-dependent shapes)."""

    SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "repeat_interleave")

    def __init__(self):
        super().__init__()
        self.syncs, self.ops = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        self.ops.append(name)
        if name.split(".")[0] in self.SYNC_OPS or (
            name.startswith("index.") and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                              for i in (args[1] or []))):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def test_decode_step_has_no_host_sync_and_no_loop_over_heads_or_blocks():
    """One step's op count does not grow with heads or selected blocks (vectorised), and no op syncs."""
    counts = []
    for kw in ({}, {"n_heads": 8, "n_kv_heads": 4, "slc_top_n": 5}):
        model = tiny_model(n_layers=1, **kw)
        tokens = torch.randint(0, 260, (1, 120), generator=torch.Generator().manual_seed(4))
        cache = KVCache(model, 1, 121)
        prefill(model, tokens, cache)
        with _SyncDetector() as det:
            decode_step(model, cache, tokens[:, :1])  # t = 120 completes a compression block
        assert det.syncs == []
        counts.append(len(det.ops))
    assert counts[0] == counts[1]
