"""KV cache and incremental (one token per step) attention for NSA and dense models.

``prefill(model, tokens, cache)`` is ``model(tokens, cache=cache)`` on an empty cache: the training forward,
which also fills the cache; ``decode_step(model, cache, token)`` is ``model(token, cache=cache)`` for one token
per row, and returns its logits. Both run the model's own blocks and attention modules (embedding, norms,
projections, compression, gates, output projection, residuals): for a single new token (a decode step, or a
one-token prompt) the attention module hands its projections to the layer cache's ``attend`` below, the one
part decoding adds.
Step by step, the logits equal those of a full forward over the same prefix (tests/test_decode.py): every rule
is the one of ``reference.py``, restricted to the newest query.

Cache of one NSA layer (heads first, [B, HKV, S, D], so one index per (row, KV head) gathers a block):
- selection branch: raw rotated K/V of every position (selected blocks can lie anywhere in the past);
- window branch: a ring of the last w raw K/V (slot = position mod w; attention ignores key order);
- compression branch: a ring of the last l raw K/V, and the compressed K/V. When position t completes a
  block (t + 1 >= l and (t + 1 - l) mod d == 0, i.e. every d tokens), compressed token (t + 1 - l) / d is
  phi of the l ring entries put back in time order, the same phi training applies to the same l keys.
- the position is a host int shared by all rows (equal-length prompts): slicing by it is no host sync.

Per step, for the query at position t (0-based; the cache then holds t + 1 tokens), each row and KV head
gathers exactly

    reads(t) = C(t) + S(t) + W(t)   tokens (each branch has its own K and V: bytes = reads * (dk + dv) * size)
    C(t) = 0 if t + 1 < l else (t + 1 - l) // d + 1            visible compressed tokens
    S(t) = (min(n, t // l' + 1) - 1) * l' + (t mod l') + 1     the tokens <= t of the selected blocks
    W(t) = min(w, t + 1)                                      the sliding window

S: the blocks that start at or before t are the t // l' + 1 candidates, min(n, that) of them are selected,
the current block (always selected) holds t mod l' + 1 tokens <= t and every other selected block is whole
and in the past. So S(t) = t + 1 while fewer than n blocks exist, and (n - 1) l' + (t mod l') + 1 <= n l'
after. The compressor also re-reads the l ring entries on the steps that complete a block (l every d
steps); ``cache.last_reads`` reports that separately as "compress".

Vectorised over rows, heads and blocks: the selected blocks are gathered by one advanced index; the only
Python loop is over the l/d offsets of a compression block (2 at paper sizes), as in torch_impl.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nsa_titan.models.nsa.attention import NSAAttention
from nsa_titan.models.nsa.common import NSAParams


def nsa_branch_reads(t: int, p: NSAParams) -> dict[str, int]:
    """C(t), S(t), W(t) of the module docstring, by branch: the K/V tokens one row and KV head attends to."""
    return {"cmp": p.num_cmp_tokens(t + 1),
            "slc": (min(p.slc_top_n, t // p.slc_block + 1) - 1) * p.slc_block + t % p.slc_block + 1,
            "win": min(p.window, t + 1)}


def nsa_tokens_read(t: int, p: NSAParams) -> int:
    """reads(t) of the module docstring: K/V tokens one row and KV head attends to at query position t."""
    return sum(nsa_branch_reads(t, p).values())


class NSALayerCache:
    """One NSA layer's cache (see the module docstring); ``attend`` is its attention for one new token."""

    def __init__(self, kv: KVCache, attn: NSAAttention, batch: int, capacity: int, device, dtype, fused=None):
        p = attn.params
        self.kv, self.p, self.attn = kv, p, attn
        self.last_reads: dict[str, int] = {}
        hkv, dk, dv = attn.n_kv_heads, attn.head_dim, attn.v_head_dim
        blocks = -(-capacity // p.slc_block)  # whole blocks, so the cache views as [.., blocks, l', D]
        new = lambda s, d: torch.zeros(batch, hkv, s, d, device=device, dtype=dtype)  # noqa: E731
        self.k_slc, self.v_slc = new(blocks * p.slc_block, dk), new(blocks * p.slc_block, dv)
        self.k_win, self.v_win = new(p.window, dk), new(p.window, dv)
        self.k_raw, self.v_raw = new(p.cmp_block, dk), new(p.cmp_block, dv)
        tc = p.num_cmp_tokens(capacity)
        self.k_cmp, self.v_cmp = new(tc, dk), new(tc, dv)
        # Index grids for gathering [B, HKV, n] blocks at once (made once: no per-step allocations).
        self.rows = torch.arange(batch, device=device)[:, None, None]
        self.heads = torch.arange(hkv, device=device)[None, :, None]
        self.fused = fused_kernel(fused, device, attn)
        # The fused kernels' tile choices and scratch (made once: no per-step allocations but the output).
        self.workspace = None if self.fused is None else self.fused.DecodeWorkspace(
            batch, hkv, attn.n_heads // hkv, dv, capacity, p, device)

    @property
    def pos(self) -> int:
        """Positions stored so far (shared by every layer: the KVCache's)."""
        return self.kv.pos

    def fill(self, raw, slc, win, cmp) -> None:
        """Store a prompt's K/V as the projections give them ([B, T, H, D]) and its compressed K/V."""
        dev, length = self.k_slc.device, raw[0].shape[1]
        self.k_slc[:, :, :length] = slc[0].transpose(1, 2)
        self.v_slc[:, :, :length] = slc[1].transpose(1, 2)
        for ring_k, ring_v, (k, v) in ((self.k_win, self.v_win, win), (self.k_raw, self.v_raw, raw)):
            size = ring_k.shape[2]
            start = max(0, length - size)
            slots = torch.arange(start, length, device=dev) % size  # position s lives in slot s mod size
            ring_k.index_copy_(2, slots, k[:, start:].transpose(1, 2).to(ring_k.dtype))
            ring_v.index_copy_(2, slots, v[:, start:].transpose(1, 2).to(ring_v.dtype))
        tc = cmp[0].shape[1]
        self.k_cmp[:, :, :tc] = cmp[0].transpose(1, 2)
        self.v_cmp[:, :, :tc] = cmp[1].transpose(1, 2)

    def append(self, raw, slc, win, t: int) -> int:
        """Store position t's K/V ([B, 1, H, D] each); compress a completed block. Returns tokens re-read."""
        p = self.p
        self.k_slc[:, :, t] = slc[0][:, 0]
        self.v_slc[:, :, t] = slc[1][:, 0]
        self.k_win[:, :, t % p.window] = win[0][:, 0]
        self.v_win[:, :, t % p.window] = win[1][:, 0]
        return self.compress_if_due(raw, t, store_raw=True)

    def compress_if_due(self, raw, t: int, store_raw: bool) -> int:
        """Store position t's compression-branch K/V in the ring (``store_raw``, or when a block completes at t:
        the fused kernel stores it otherwise) and compress the block that t completes. Returns tokens re-read."""
        p = self.p
        done = t + 1 - p.cmp_block
        due = done >= 0 and done % p.cmp_stride == 0
        if store_raw or due:
            self.k_raw[:, :, t % p.cmp_block] = raw[0][:, 0]
            self.v_raw[:, :, t % p.cmp_block] = raw[1][:, 0]
        if not due:
            return 0
        shift = -((t + 1) % p.cmp_block)  # slot (t + 1) mod l holds the block's oldest position, t + 1 - l
        for ring, phi, out in ((self.k_raw, self.attn.compress_k, self.k_cmp),
                               (self.v_raw, self.attn.compress_v, self.v_cmp)):
            block = torch.roll(ring, shift, dims=2).transpose(1, 2)  # [B, l, HKV, D], time order
            out[:, :, done // p.cmp_stride] = phi(block)[:, 0]
        return p.cmp_block


    def attend(self, q, raw, slc, win, gates) -> torch.Tensor:
        """Attention of the token at position ``pos`` (the projections of NSAAttention.project, [B, 1, H, D]);
        stores its K/V first. Returns the gated branch mix [B, HKV, G, Dv] (query head kv * G + g), which the
        module's output projection takes as [B, 1, HQ * Dv]."""
        p, attn, t = self.p, self.attn, self.pos
        b = q.shape[0]
        hkv, g = attn.n_kv_heads, attn.n_heads // attn.n_kv_heads
        if self.fused is not None:  # two Triton launches, which also store the K/V (kernels/decode.py)
            compress_reads = self.compress_if_due(raw, t, store_raw=False)
            self.last_reads = {**nsa_branch_reads(t, p), "compress": compress_reads}
            caches = (self.k_cmp, self.v_cmp, self.k_slc, self.v_slc, self.k_win, self.v_win, self.k_raw, self.v_raw)
            return self.fused.nsa_decode_attend(q, (raw, slc, win), caches, gates, self.workspace, t, p)
        compress_reads = self.append(raw, slc, win, t)
        qg = q.view(b, hkv, g, attn.head_dim)  # query head h = kv * G + g reads KV head kv, as in training

        # Compressed branch over the visible compressed tokens, softmax in fp32 as in torch_impl.
        nc = p.num_cmp_tokens(t + 1)
        cur = t // p.slc_block
        if nc:
            kc, vc = self.k_cmp[:, :, :nc], self.v_cmp[:, :, :nc]
            scores = torch.matmul(qg, kc.transpose(-1, -2))
            scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * attn.head_dim**-0.5
            probs = torch.softmax(scores, dim=-1)  # [B, HKV, G, nc]
            o_cmp = torch.matmul(probs.to(vc.dtype), vc)
            importance = block_importance(probs.sum(2).float(), cur + 1, p)[..., :cur]
        else:
            o_cmp = qg.new_zeros(b, hkv, g, attn.v_head_dim)
            importance = qg.new_zeros(b, hkv, cur, dtype=torch.float32)

        # Selection: the current block is always taken (its tokens <= t are a plain slice); the other n - 1
        # slots go to the top blocks before it, with block 0 and block cur - 1 forced, ties to the lower index.
        cur_k = self.k_slc[:, :, cur * p.slc_block: t + 1]
        cur_v = self.v_slc[:, :, cur * p.slc_block: t + 1]
        k_sel = min(p.slc_top_n - 1, cur)
        if k_sel:
            importance[..., 0] = float("inf")  # forced blocks (a fresh tensor: written in place, two fills)
            importance[..., cur - 1] = float("inf")
            top = torch.sort(importance, dim=-1, descending=True, stable=True).indices[..., :k_sel]  # [B, HKV, k]
            blocks_k = self.k_slc.unflatten(2, (-1, p.slc_block))[self.rows, self.heads, top]
            blocks_v = self.v_slc.unflatten(2, (-1, p.slc_block))[self.rows, self.heads, top]
            cur_k = torch.cat([blocks_k.flatten(2, 3), cur_k], dim=2)
            cur_v = torch.cat([blocks_v.flatten(2, 3), cur_v], dim=2)
        # The G query heads of a KV head are the "query length" of one non-causal SDPA: no mask needed,
        # every gathered key is visible.
        o_slc = F.scaled_dot_product_attention(qg, cur_k, cur_v)
        m = min(p.window, t + 1)
        o_win = F.scaled_dot_product_attention(qg, self.k_win[:, :, :m], self.v_win[:, :, :m])

        gt = gates.view(b, hkv, g, 3, 1).to(o_cmp.dtype)
        out = (gt[..., 0, :] * o_cmp).addcmul_(gt[..., 1, :], o_slc.to(o_cmp.dtype)).addcmul_(gt[..., 2, :],
                                                                                           o_win.to(o_cmp.dtype))
        self.last_reads = {"cmp": nc, "slc": cur_k.shape[2], "win": m, "compress": compress_reads}
        return out


def fused_kernel(want: bool | None, device, attn: NSAAttention):
    """The fused Triton decode module (kernels/decode.py) or None for the torch path above, which is its spec.
    ``want`` None: the kernel on CUDA when triton imports and the head dims suit it; True: the kernel or a clear
    error (tests run it on CPU under TRITON_INTERPRET=1); False: the torch path."""
    if want is False or (want is None and torch.device(device).type != "cuda"):
        return None
    try:
        from nsa_titan.kernels import decode as kernel  # noqa: PLC0415 - optional (triton)
    except ImportError as e:
        if want:
            raise ValueError(f"fused NSA decoding needs triton ({e}); build the KVCache with fused=False") from e
        return None
    if not kernel.supported(attn.head_dim, attn.v_head_dim, attn.params.slc_block):
        if want:
            raise ValueError(f"fused NSA decoding needs head dims and slc_block that are powers of 2 >= 16 (got "
                             f"{attn.head_dim}, {attn.v_head_dim}, {attn.params.slc_block}); use fused=False")
        return None
    return kernel


def block_importance(group_probs: torch.Tensor, num_blocks: int, p: NSAParams) -> torch.Tensor:
    """[B, HKV, C] group-summed compressed probabilities -> importance of blocks 0 .. num_blocks-1.

    Eq. 9 as in training: block j gets sum_i p[i] * |[i*d, i*d + l) ∩ block j| / d. Compressed token i
    covers sub-blocks u = i .. i + l/d - 1 of d positions and sub-block u lies in block u // (l'/d), so
    sub-block u collects S[u] = sum_{r < l/d} p[u - r]: pad p once with l/d - 1 zeros on the left, add the
    l/d shifted windows, then sum groups of l'/d sub-blocks. Every visible u is < num_blocks * l'/d (it
    ends at or before t), so the right padding is never negative. Few kernels: decode runs this every step.
    """
    b, h, c = group_probs.shape
    subs = p.slc_block // p.cmp_stride
    width = num_blocks * subs
    taps = p.cmp_block // p.cmp_stride
    padded = F.pad(group_probs, (taps - 1, width - c))  # padded[u + taps - 1] = p[u]
    per_sub = padded[..., taps - 1:]
    for r in range(1, taps):  # the l/d offsets of a compression block (2 at paper sizes: one add)
        per_sub = per_sub + padded[..., taps - 1 - r: taps - 1 - r + width]
    return per_sub.reshape(b, h, num_blocks, subs).sum(-1)


class DenseLayerCache:
    """One dense-attention layer's cache: K/V of every position, heads first."""

    def __init__(self, kv: KVCache, attn, batch: int, capacity: int, device, dtype):
        new = lambda d: torch.zeros(batch, attn.n_kv_heads, capacity, d, device=device, dtype=dtype)  # noqa: E731
        self.kv, self.attn = kv, attn
        self.k, self.v = new(attn.head_dim), new(attn.v_head_dim)
        self.last_reads: dict[str, int] = {}

    @property
    def pos(self) -> int:
        return self.kv.pos

    def fill(self, k, v) -> None:
        """Store a prompt's K/V ([B, T, HKV, D], as DenseAttention projects them)."""
        t = k.shape[1]
        self.k[:, :, :t], self.v[:, :, :t] = k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q, k, v) -> torch.Tensor:
        """Attention of the token at position ``pos`` ([B, 1, H, D] projections) over every cached position;
        stores its K/V first. Returns [B, HKV, G, Dv] (query head kv * G + g)."""
        attn, t = self.attn, self.pos
        self.k[:, :, t] = k[:, 0]
        self.v[:, :, t] = v[:, 0]
        qg = q.view(q.shape[0], attn.n_kv_heads, attn.n_heads // attn.n_kv_heads, attn.head_dim)
        self.last_reads = {"dense": t + 1}
        return F.scaled_dot_product_attention(qg, self.k[:, :, : t + 1], self.v[:, :, : t + 1])


class KVCache:
    """Every layer's cache plus the shared position ``pos`` (tokens stored so far, a host int).

    ``capacity``: the most tokens prompt + generation will hold (<= the model's RoPE table). ``dtype``:
    that of the K/V the projections produce (the parameters' dtype, or bf16 under bf16 autocast).
    ``last_reads``: per layer, the tokens the last decode step gathered per row and KV head, by branch.
    ``fused``: NSA layers attend through two Triton launches per layer and step (None: on CUDA when available;
    True: required; False: the torch path, the kernel's spec).
    """

    def __init__(self, model, batch_size: int, capacity: int, device=None, dtype=None, fused: bool | None = None):
        rope_len = model.rope_cos.shape[0]
        if capacity > rope_len:
            raise ValueError(f"cache capacity {capacity} exceeds the model's RoPE table ({rope_len} positions); "
                             f"rebuild the model with model.max_seq_len >= {capacity}")
        weight = model.output.weight
        device, dtype = device or weight.device, dtype or weight.dtype
        self.capacity, self.batch_size, self.pos = int(capacity), int(batch_size), 0
        self.layers = []
        for block in model.layers.values():
            if isinstance(block.attention, NSAAttention):
                layer = NSALayerCache(self, block.attention, batch_size, capacity, device, dtype, fused)
            else:
                layer = DenseLayerCache(self, block.attention, batch_size, capacity, device, dtype)
            self.layers.append(layer)
        self.last_reads: list[dict[str, int]] = []

    def _check_room(self, tokens: torch.Tensor) -> None:
        if tokens.dim() != 2 or tokens.shape[0] != self.batch_size:
            raise ValueError(f"tokens must be [{self.batch_size}, T], got {tuple(tokens.shape)}")
        if self.pos + tokens.shape[1] > self.capacity:
            raise ValueError(f"KV cache full: {self.pos} + {tokens.shape[1]} tokens > capacity {self.capacity}; "
                             "build the cache with a larger capacity")


@torch.no_grad()
def prefill(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Full forward of the prompt ``tokens`` [B, T] into an empty cache; returns logits [B, T, vocab]."""
    if cache.pos:
        raise ValueError(f"prefill needs an empty cache (it holds {cache.pos} tokens); use decode_step to extend it")
    cache._check_room(tokens)
    logits = model(tokens, cache=cache)
    cache.pos = tokens.shape[1]
    return logits


@torch.no_grad()
def decode_step(model, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
    """Append one token per row (``tokens`` [B, 1], at position ``cache.pos``); returns its logits [B, vocab].

    No host syncs: every shape and index below comes from the host int ``cache.pos``.
    """
    cache._check_room(tokens)
    if tokens.shape[1] != 1:
        raise ValueError(f"decode_step takes one token per row, got {tokens.shape[1]}; use prefill for prompts")
    logits = model(tokens, cache=cache)
    cache.pos += 1
    cache.last_reads = [layer.last_reads for layer in cache.layers]
    return logits[:, 0]
