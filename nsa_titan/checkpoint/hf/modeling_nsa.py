"""Native Sparse Attention language model for Hugging Face ``transformers`` (``trust_remote_code=True``).

Written by nsa_titan's exporter next to ``model.safetensors`` and ``config.json`` (whose ``auto_map`` names
the classes below), so that

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

loads an NSA checkpoint. Self-contained: plain PyTorch, no nsa_titan import. The attention math is a copy
of nsa_titan's portable path (``nsa_titan/models/nsa/torch_impl.py``, itself held to the dense spec in
``reference.py``) and the layer stack mirrors ``nsa_titan/models/nsa/model.py``; nsa_titan's test
``tests/test_hf_export.py`` compares this file's logits with nsa_titan's model for NSA and dense layers, so a
change to either side that is not mirrored fails there. No KV cache: each generated token re-runs the
prefix (exact, O(T) forwards per token; nsa_titan's own ``generate`` decodes incrementally).

The classes for ``transformers`` are defined when it is importable; the modules above them need only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------------------------- NSA math


def _rope(x, theta: float):
    """Rotate-half RoPE over positions 0..T-1; x [B, T, H, D], computed in fp32."""
    t, d = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)[None, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = ang.cos(), ang.sin()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _heads_first(x, n_rep: int):
    x = x.transpose(1, 2)
    return x.repeat_interleave(n_rep, dim=1) if n_rep > 1 else x


def compressed_attention(q, kc, vc, cmp_block: int, cmp_stride: int):
    """(o [B, T, HQ, Dv], group-summed probabilities [B, HKV, T, Tc]); rows that see nothing give 0."""
    b, t, hq, dk = q.shape
    tc, hkv = kc.shape[1], kc.shape[2]
    if tc == 0:
        return q.new_zeros(b, t, hq, vc.shape[-1]), q.new_zeros(b, hkv, t, 0)
    qg = q.reshape(b, t, hkv, hq // hkv, dk).permute(0, 2, 3, 1, 4)
    scores = torch.matmul(qg, kc.permute(0, 2, 3, 1).unsqueeze(2)).float() * dk**-0.5
    visible = (torch.arange(tc, device=q.device)[None, :] * cmp_stride + cmp_block - 1
               <= torch.arange(t, device=q.device)[:, None])
    probs = torch.softmax(scores.masked_fill(~visible, torch.finfo(scores.dtype).min), dim=-1) * visible
    out = torch.matmul(probs.to(vc.dtype), vc.transpose(1, 2).unsqueeze(2))
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, hq, vc.shape[-1]), probs.sum(dim=2)


def select_blocks(group_probs, t: int, cmp_block: int, cmp_stride: int, slc_block: int, top_n: int):
    """Per (token, KV head) the top-n selection blocks [B, HKV, T, n] (-1: unused); block 0 and the two local
    blocks are forced, blocks starting after t are not candidates, ties go to the lower block index."""
    nb = -(-t // slc_block)
    i = torch.arange(group_probs.shape[-1], device=group_probs.device)[:, None]
    j = torch.arange(nb, device=group_probs.device)[None, :]
    overlap = torch.zeros(i.shape[0], nb, device=group_probs.device)
    for r in range(cmp_block // cmp_stride):  # |[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / d, per sub-block of d
        overlap = overlap + ((i + r) // (slc_block // cmp_stride) == j).float()
    importance = group_probs.float() @ overlap
    tt = torch.arange(t, device=group_probs.device)[:, None]
    forced = (j == 0) | (j == tt // slc_block) | (j == tt // slc_block - 1)
    key = torch.where(forced, float("inf"), importance)
    key = torch.where(j * slc_block <= tt, key, float("-inf"))
    if nb < top_n:
        key = F.pad(key, (0, top_n - nb), value=float("-inf"))
    sorted_key, order = torch.sort(key, dim=-1, descending=True, stable=True)
    return torch.where(sorted_key[..., :top_n] > float("-inf"), order[..., :top_n], -1)


def selected_attention(q, k, v, block_idx, slc_block: int):
    b, t, hq, _ = q.shape
    n_rep = hq // k.shape[2]
    nb = -(-t // slc_block)
    onehot = torch.zeros(*block_idx.shape[:-1], nb + 1, dtype=torch.bool, device=q.device)
    chosen = onehot.scatter_(-1, torch.where(block_idx < 0, nb, block_idx), True)[..., :nb]
    s = torch.arange(t, device=q.device)
    mask = chosen[..., s // slc_block] & (s[None, :] <= s[:, None])
    mask = mask.repeat_interleave(n_rep, dim=1) if n_rep > 1 else mask
    out = F.scaled_dot_product_attention(q.transpose(1, 2), _heads_first(k, n_rep), _heads_first(v, n_rep),
                                         attn_mask=mask)
    return out.transpose(1, 2)


def window_attention(q, k, v, window: int):
    t, n_rep = q.shape[1], q.shape[2] // k.shape[2]
    s = torch.arange(t, device=q.device)
    mask = (s[None, :] <= s[:, None]) & (s[None, :] > s[:, None] - window)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), _heads_first(k, n_rep), _heads_first(v, n_rep),
                                         attn_mask=mask)
    return out.transpose(1, 2)


# ----------------------------------------------------------------------------------------------- modules


class Compressor(nn.Module):
    """phi: one key or value per block of cmp_block positions (stride cmp_stride): an MLP or the mean."""

    def __init__(self, head_dim: int, block: int, stride: int, kind: str):
        super().__init__()
        self.block, self.stride, self.kind = block, stride, kind
        if kind == "mlp":
            self.pos_emb = nn.Parameter(torch.zeros(block, head_dim))
            self.fc1 = nn.Linear(block * head_dim, head_dim, bias=False)
            self.fc2 = nn.Linear(head_dim, head_dim, bias=False)

    def forward(self, x):
        b, t, h, d = x.shape
        if t < self.block:
            return x.new_zeros(b, 0, h, d)
        blocks = x.unfold(1, self.block, self.stride)
        if self.kind == "mean":
            return blocks.mean(dim=-1)
        blocks = blocks.transpose(-1, -2) + self.pos_emb.to(x.dtype)
        return self.fc2(F.silu(self.fc1(blocks.flatten(-2))))


class Attention(nn.Module):
    def __init__(self, a: dict):
        super().__init__()
        self.a, self.nsa = a, a["attn_type"] == "nsa"
        self.hq, self.hkv, self.dk = a["n_heads"], a["n_kv_heads"], a["head_dim"]
        self.dv = a.get("v_head_dim") or a["head_dim"]
        self.sets = (1 if a["shared_kv"] else 3) if self.nsa else 1
        self.q_proj = nn.Linear(a["dim"], self.hq * self.dk, bias=False)
        self.kv_proj = nn.Linear(a["dim"], self.sets * self.hkv * (self.dk + self.dv), bias=False)
        self.o_proj = nn.Linear(self.hq * self.dv, a["dim"], bias=False)
        if self.nsa:
            self.compress_k = Compressor(self.dk, a["cmp_block"], a["cmp_stride"], a["compress"])
            self.compress_v = Compressor(self.dv, a["cmp_block"], a["cmp_stride"], a["compress"])
            self.g_proj = nn.Linear(a["dim"], self.hq * 3, bias=False)

    def forward(self, x):
        a, (b, t, _) = self.a, x.shape
        theta = a["rope_theta"]
        q = _rope(self.q_proj(x).view(b, t, self.hq, self.dk), theta)
        kv = self.kv_proj(x).view(b, t, self.sets, self.hkv, self.dk + self.dv)
        k, v = kv.split([self.dk, self.dv], dim=-1)
        k = _rope(k.flatten(2, 3), theta).view_as(k)
        if not self.nsa:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), _heads_first(k[:, :, 0], self.hq // self.hkv),
                                                 _heads_first(v[:, :, 0], self.hq // self.hkv), is_causal=True)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        ks, vs = k.unbind(2), v.unbind(2)
        if self.sets == 1:
            ks, vs = ks * 3, vs * 3
        gates = torch.sigmoid(self.g_proj(x).float()).view(b, t, self.hq, 3)
        kc, vc = self.compress_k(ks[0]), self.compress_v(vs[0])
        o_cmp, group_probs = compressed_attention(q, kc, vc, a["cmp_block"], a["cmp_stride"])
        idx = select_blocks(group_probs, t, a["cmp_block"], a["cmp_stride"], a["slc_block"], a["slc_top_n"])
        o_slc = selected_attention(q, ks[1], vs[1], idx, a["slc_block"])
        o_win = window_attention(q, ks[2], vs[2], a["window"])
        g = gates.unsqueeze(-1).to(o_cmp.dtype)
        out = g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc.to(o_cmp.dtype) + g[..., 2, :] * o_win.to(o_cmp.dtype)
        return self.o_proj(out.to(x.dtype).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: dict):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a["dim"], a["ffn_hidden_dim"])
        self.input_layernorm = nn.RMSNorm(a["dim"], eps=a["norm_eps"])
        self.post_attention_layernorm = nn.RMSNorm(a["dim"], eps=a["norm_eps"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class NSABackbone(nn.Module):
    """Embedding, blocks, final norm: ``model.*`` of the exported tensor names."""

    def __init__(self, a: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(a["vocab_size"], a["dim"])
        self.layers = nn.ModuleList(Block(a) for _ in range(a["n_layers"]))
        self.norm = nn.RMSNorm(a["dim"], eps=a["norm_eps"])

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class NSACausalLMCore(nn.Module):
    """The whole language model from nsa_titan's model args (``config.json``'s ``nsa_model_args``): no
    ``transformers`` needed (tests compare it with nsa_titan's model where transformers is not installed)."""

    def __init__(self, model_args: dict):
        super().__init__()
        self.model = NSABackbone(model_args)
        self.lm_head = nn.Linear(model_args["dim"], model_args["vocab_size"], bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


# ----------------------------------------------------------------------------------------------- transformers

try:
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError:  # the modules above still work with torch alone
    PreTrainedModel = None

if PreTrainedModel is not None:

    class NSAConfig(PretrainedConfig):
        model_type = "nsa_titan"

        def __init__(self, nsa_model_args: dict | None = None, **kwargs):
            self.nsa_model_args = dict(nsa_model_args or {})
            kwargs.setdefault("use_cache", False)  # no KV cache: generate() re-runs the prefix
            kwargs.setdefault("tie_word_embeddings", False)
            super().__init__(**kwargs)

    class NSAForCausalLM(PreTrainedModel, GenerationMixin):
        config_class = NSAConfig
        base_model_prefix = "model"
        _no_split_modules = ["Block"]

        def __init__(self, config: NSAConfig):
            super().__init__(config)
            a = config.nsa_model_args
            self.model = NSABackbone(a)
            self.lm_head = nn.Linear(a["dim"], a["vocab_size"], bias=False)
            self.post_init()

        def _init_weights(self, module):  # weights come from model.safetensors; only defaults for new modules
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

        def get_input_embeddings(self):
            return self.model.embed_tokens

        def set_input_embeddings(self, value):
            self.model.embed_tokens = value

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids=None, labels=None, attention_mask=None, **kwargs):
            """attention_mask is accepted for generate()'s sake; padded batches are not supported (left padding
            would shift RoPE positions), so every row must be a full sequence."""
            logits = self.lm_head(self.model(input_ids))
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

        def prepare_inputs_for_generation(self, input_ids, **kwargs):
            return {"input_ids": input_ids}  # the whole sequence every step: there is no cache to continue

        def _reorder_cache(self, past, beam_idx):
            return past

