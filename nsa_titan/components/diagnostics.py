"""NSA diagnostics: per layer, what the gates do, which branch carries the output, where the selected blocks lie.

Per layer (``NSADiagnostics.read()``):
- ``gate_mean``: mean sigmoid gate per branch (cmp, slc, win) over batch, positions and heads;
- ``gate_entropy``: per query head, the entropy of the gates normalised over the three branches, averaged over
  batch and positions (log 3 = 1.0986 when the branches are mixed equally, 0 when one branch takes all);
- ``output_share``: share of each branch in the gated output, ||g_b o_b|| / sum_b' ||g_b' o_b'||, averaged over
  heads and ``num_positions`` evenly spaced query positions of the first sequence of the micro-batch (the
  branch outputs are recomputed exactly for those positions from the layer's own q/k/v and selection: the
  fused kernels never materialise them separately);
- ``slc_distance_hist``: distribution of the distance (in selection blocks) from a query's own block to each
  block it selected, in the bins of ``DISTANCE_BINS`` (0 = its own block); ``slc_mean_distance``;
- ``forced_share``: share of the selected blocks that were forced (block 0, the current and previous block).

Hot-path contract: an opt-in collector object, no module-global state. ``attach(model)`` points every
NSAAttention module at it; their forward calls ``record`` only while ``enabled`` is True (a host bool, so a
disabled collector costs no device work and no sync). ``record`` only enqueues device ops that overwrite the
module's own small device tensor; ``read`` (log steps only) does the one host sync. A recompute of the same
forward (activation checkpointing) writes identical values again; with gradient accumulation the last
micro-batch's values are kept. Under torch.compile the enabled forward is a second graph per block kind
(dynamo guards on the flag), compiled the first time diagnostics are collected.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from nsa_titan.models.nsa.attention import NSAAttention

BRANCHES = ("cmp", "slc", "win")
N_DISTANCE_BINS = 12
# Bin i >= 1 holds distances [2^(i-1), 2^i); bin 0 the query's own block; the last bin is open-ended.
DISTANCE_BINS = ["0", "1"] + [f"{2 ** (i - 1)}-{2 ** i - 1}" for i in range(2, N_DISTANCE_BINS - 1)] + \
    [f">={2 ** (N_DISTANCE_BINS - 2)}"]


def block_indices(blocks: torch.Tensor, top_n: int) -> torch.Tensor:
    """Selections as indices [B, HKV, T, n] (-1 = unused). The fast paths return that already; the reference
    returns a bool mask [B, HKV, T, Nb], converted here (its True entries, in any order)."""
    if blocks.dtype != torch.bool:
        return blocks
    k = min(top_n, blocks.shape[-1])
    vals, idx = blocks.float().topk(k, dim=-1)
    return torch.where(vals > 0, idx, -1)


def selection_stats(block_idx: torch.Tensor, slc_block: int) -> dict[str, torch.Tensor]:
    """Distance histogram (fractions over DISTANCE_BINS), mean distance and forced share of [B, HKV, T, n]."""
    t = torch.arange(block_idx.shape[2], device=block_idx.device)[:, None]
    current = t // slc_block
    valid = block_idx >= 0
    dist = (current - block_idx).clamp(min=0)
    # Built on the device (a Python-list tensor would be a host-to-device copy in the forward).
    bounds = 2 ** torch.arange(N_DISTANCE_BINS - 1, device=block_idx.device)
    bins = torch.bucketize(dist, bounds, right=True)  # 0 -> 0, 1 -> 1, 2..3 -> 2, 4..7 -> 3, ...
    # Unused slots go to an extra last bin that is cut off (bincount would size itself with a host sync).
    bins = torch.where(valid, bins, N_DISTANCE_BINS).flatten()
    counts = torch.zeros(N_DISTANCE_BINS + 1, device=block_idx.device)
    counts = counts.scatter_add_(0, bins, torch.ones_like(bins, dtype=torch.float32))
    n_valid = valid.sum().float().clamp(min=1)
    forced = valid & ((block_idx == 0) | (block_idx == current) | (block_idx == current - 1))
    return {"slc_distance_hist": counts[:N_DISTANCE_BINS] / n_valid,
            "slc_mean_distance": (dist * valid).sum().float() / n_valid,
            "forced_share": forced.sum().float() / n_valid}


def gate_stats(gates: torch.Tensor) -> dict[str, torch.Tensor]:
    """gates [B, T, HQ, 3] -> mean per branch [3] and entropy over branches per head [HQ]."""
    g = gates.detach().float()
    p = g / g.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)  # xlogy: 0 * log 0 = 0
    return {"gate_mean": g.mean(dim=(0, 1, 2)), "gate_entropy": entropy.mean(dim=(0, 1))}


def sample_positions(seq_len: int, num: int, device=None) -> torch.Tensor:
    """``num`` evenly spaced positions ending at the last one (all positions when the sequence is shorter)."""
    num = min(num, seq_len)
    return (torch.arange(1, num + 1, device=device) * seq_len) // num - 1


def _attend(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """qs [S, HKV, G, Dk]; k/v [S, HKV, K, D]; valid [S, HKV, K] -> [S, HKV, G, Dv]; no valid key -> 0."""
    scores = torch.einsum("shgd,shkd->shgk", qs, k) * qs.shape[-1] ** -0.5
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: NaN -> 0, as in the reference
    return torch.einsum("shgk,shkd->shgd", probs, v)


def sampled_branch_outputs(q, kv_cmp, kv_slc, kv_win, block_idx, params, positions) -> torch.Tensor:
    """Each branch's output at ``positions`` of sequence 0, recomputed exactly: [3, S, HQ, Dv] (fp32, no grad).

    Same rules as models/nsa/reference.py; the selected branch reads the layer's own ``block_idx``.
    """
    (kc, vc), (ks, vs), (kw, vw) = kv_cmp, kv_slc, kv_win
    t_len, hq, dk = q.shape[1], q.shape[2], q.shape[3]
    hkv = ks.shape[2]
    pos = positions
    qs = q[0, pos].detach().float().view(len(pos), hkv, hq // hkv, dk)  # [S, HKV, G, Dk]
    heads_first = lambda x: x[0].detach().float().transpose(0, 1)  # noqa: E731 - [T, HKV, D] -> [HKV, T, D]
    outs = []
    # Compressed: every compressed token i with i*d + l - 1 <= t.
    i = torch.arange(kc.shape[1], device=q.device)
    vis = (i[None, :] * params.cmp_stride + params.cmp_block - 1 <= pos[:, None])[:, None, :].expand(-1, hkv, -1)
    kch, vch = heads_first(kc), heads_first(vc)
    outs.append(_attend(qs, kch.expand(len(pos), -1, -1, -1), vch.expand(len(pos), -1, -1, -1), vis))
    # Selected: the tokens s <= t of the chosen blocks.
    idx = block_idx[0][:, pos].transpose(0, 1)  # [S, HKV, n]
    tok = idx[..., None] * params.slc_block + torch.arange(params.slc_block, device=q.device)  # [S, HKV, n, l']
    tok = tok.flatten(2)
    ok = (idx[..., None] >= 0).expand(-1, -1, -1, params.slc_block).flatten(2) & (tok <= pos[:, None, None])
    tok = tok.clamp(0, t_len - 1)
    h = torch.arange(hkv, device=q.device)[None, :, None]
    ksh, vsh = heads_first(ks), heads_first(vs)
    outs.append(_attend(qs, ksh[h, tok], vsh[h, tok], ok))
    # Window: t - w + 1 .. t.
    wtok = pos[:, None] - torch.arange(params.window, device=q.device)[None, :]  # [S, w]
    wok = (wtok >= 0)[:, None, :].expand(-1, hkv, -1)
    wtok = wtok.clamp(min=0)[:, None, :].expand(-1, hkv, -1)
    kwh, vwh = heads_first(kw), heads_first(vw)
    outs.append(_attend(qs, kwh[h, wtok], vwh[h, wtok], wok))
    return torch.stack([o.reshape(len(pos), hq, -1) for o in outs])


def output_shares(branch_out: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """branch_out [3, S, HQ, Dv], gates [S, HQ, 3] -> mean share of each gated branch in the output norm [3]."""
    norms = (gates.detach().float().permute(2, 0, 1) * branch_out.norm(dim=-1))  # [3, S, HQ]
    total = norms.sum(dim=0)
    has = total > 0  # positions/heads where every branch is 0 (nothing visible) carry no share
    share = torch.where(has, norms / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    return share.sum(dim=(1, 2)) / has.sum().float().clamp(min=1)


def stat_layout(n_heads: int) -> list[tuple[str, int]]:
    """(name, size) of the values one layer writes, in order, into its flat float32 tensor."""
    return [("gate_mean", 3), ("gate_entropy", n_heads), ("output_share", 3), ("slc_distance_hist", N_DISTANCE_BINS),
            ("slc_mean_distance", 1), ("forced_share", 1)]


class NSADiagnostics:
    """Opt-in collector; see the module docstring. ``num_positions``: query positions for the output shares.

    ``record`` returns one flat float32 tensor per call, which the attention module stores on itself
    (``diagnostics_out``, a plain attribute: not a parameter or buffer, so not in state dicts, FSDP or DDP).
    Storing on the module's own attribute, rather than in a per-layer slot of a shared container, keeps every
    block's traced code identical: dynamo would specialise (and recompile) per layer on a layer index or on a
    container's contents. It is a new tensor, not an in-place write: inside a checkpointed block an in-place
    write to a tensor from outside would trip autograd's version check of the saved inputs.
    """

    def __init__(self, num_positions: int = 64):
        self.enabled = False
        self.num_positions = num_positions
        # Query positions (of sequence 0) for the output shares; None: ``num_positions`` evenly spaced ones. Set
        # by evaluations that care about particular tokens (e.g. retrieval answers: eval/retrieval_diagnostics.py).
        self.positions: torch.Tensor | None = None
        self._modules: list[nn.Module] = []
        self._layout: list[tuple[str, int]] = []
        self._fresh = False  # a collecting(True) context ran since the last read

    @classmethod
    def attach(cls, model: nn.Module, **kwargs: Any) -> NSADiagnostics:
        """A collector wired into every NSAAttention of ``model`` (wrapped or not; none for dense attention)."""
        collector = cls(**kwargs)
        collector._modules = [m for m in model.modules() if isinstance(m, NSAAttention)]  # in layer order
        for m in collector._modules:
            collector._layout = stat_layout(m.n_heads)
            m.diagnostics = collector
        return collector

    @property
    def attached(self) -> bool:
        """Whether any attention module records into this collector (False for dense attention or detached)."""
        return bool(self._modules)

    @contextlib.contextmanager
    def collecting(self, enabled: bool = True) -> Iterator[None]:
        """Enable for the enclosed forward(s) (and their recomputes in backward), e.g. one log step.

        While enabled, dynamo may skip replaying ``record`` in the backward recompute of a compiled,
        checkpointed block (otherwise it refuses the side effect and the fullgraph compile fails): the
        recompute would write the same values again. Scoped to this context, never set process-wide.
        """
        before, self.enabled = self.enabled, enabled
        with contextlib.ExitStack() as stack:
            if enabled and hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
                stack.enter_context(torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True))
            try:
                yield
            finally:
                self.enabled = before
                self._fresh = self._fresh or (enabled and bool(self._modules))

    def record(self, q, kv_cmp, kv_slc, kv_win, gates, blocks, params) -> torch.Tensor:
        """Called by NSAAttention.forward while enabled: this layer's values, flat (``stat_layout``). No host sync."""
        # fp32 statistics: the training forward runs under bf16 autocast, which would also cast these matmuls.
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
            block_idx = block_indices(blocks.detach(), params.slc_top_n)
            pos = self.positions if self.positions is not None else sample_positions(q.shape[1], self.num_positions,
                                                                                     q.device)
            branch_out = sampled_branch_outputs(q, kv_cmp, kv_slc, kv_win, block_idx, params, pos)
            stats = {**gate_stats(gates), "output_share": output_shares(branch_out, gates[0, pos]),
                     **selection_stats(block_idx, params.slc_block)}
            return torch.cat([stats[name].reshape(-1).float() for name, _ in stat_layout(q.shape[2])])

    def read(self) -> dict[str, Any] | None:
        """Per-layer values as Python numbers plus layer means; None if nothing was collected since the last read."""
        if not self._fresh:
            return None
        self._fresh = False
        rows = torch.stack([m.diagnostics_out for m in self._modules]).tolist()  # host sync ok: log step
        out = []
        for i, row in enumerate(rows):
            rec: dict[str, Any] = {"layer": i}
            pos = 0
            for name, n in self._layout:
                rec[name] = row[pos] if n == 1 and name != "gate_entropy" else row[pos:pos + n]
                pos += n
            rec["gate_entropy_mean"] = sum(rec["gate_entropy"]) / len(rec["gate_entropy"])
            out.append(rec)

        def mean(key: str) -> float:
            return sum(r[key] for r in out) / len(out)

        def mean_vec(key: str) -> list[float]:
            return [sum(r[key][j] for r in out) / len(out) for j in range(len(out[0][key]))]

        return {"layers": out, "distance_bins": DISTANCE_BINS, "branches": list(BRANCHES),
                "mean": {"gate_mean": mean_vec("gate_mean"), "gate_entropy": mean("gate_entropy_mean"),
                         "output_share": mean_vec("output_share"), "slc_mean_distance": mean("slc_mean_distance"),
                         "forced_share": mean("forced_share")}}

    @staticmethod
    def format_line(diag: dict[str, Any]) -> str:
        """One console line: layer means (gates c/s/w, entropy, output shares, forced share, mean distance)."""
        m = diag["mean"]
        fmt3 = lambda v: "/".join(f"{x:.2f}" for x in v)  # noqa: E731
        return (f"nsa  gates c/s/w {fmt3(m['gate_mean'])} | gate entropy {m['gate_entropy']:.3f} "
                f"(max {math.log(3):.3f}) | output share c/s/w {fmt3(m['output_share'])} | forced blocks "
                f"{100 * m['forced_share']:.0f}% | mean block distance {m['slc_mean_distance']:.1f}")

    @staticmethod
    def scalars(diag: dict[str, Any]) -> dict[str, float]:
        """TensorBoard scalars: per layer and branch gate mean / output share, entropy, forced share, distance."""
        out: dict[str, float] = {}
        for r in diag["layers"]:
            pre = f"nsa/layer{r['layer']}"
            for j, b in enumerate(BRANCHES):
                out[f"{pre}/gate_mean_{b}"] = r["gate_mean"][j]
                out[f"{pre}/output_share_{b}"] = r["output_share"][j]
            out[f"{pre}/gate_entropy"] = r["gate_entropy_mean"]
            out[f"{pre}/forced_share"] = r["forced_share"]
            out[f"{pre}/slc_mean_distance"] = r["slc_mean_distance"]
        return out
