"""Does NSA's selected branch do the retrieving? Per layer, on the retrieval task, at the answer positions.

For a trained NSA model and retrieval samples at the training length, per layer:
- ``output_share``: share of each branch (cmp, slc, win) in the gated attention output, ||g_b o_b|| / sum over
  branches, at the positions that predict answer tokens (``NSADiagnostics``, pointed at those positions);
- ``gate_mean``: mean sigmoid gate per branch over all positions;
- ``pair_block_hit``: share of (answer position, KV head) whose selected blocks contain the block of the token
  the answer copies (the queried pair's value); ``pair_block_hit_chance``: the same if the non-forced blocks were
  chosen at random (free slots / non-forced blocks available) -- a hit rate well above chance means selection
  finds the pair;
- ``slc_distance_hist``: where the selected blocks of the answer positions lie, as the distance in selection
  blocks from the query's own block (bins of ``DISTANCE_BINS``); ``pair_distance_blocks``: how far the queried
  pairs are, for comparison.
The queried pair is never inside the sliding window (the task's gap), so only the compressed and selected
branches can carry it: a large selected share with a high hit rate is the selected branch retrieving.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from nsa_titan.components.diagnostics import BRANCHES, DISTANCE_BINS, N_DISTANCE_BINS, NSADiagnostics, block_indices
from nsa_titan.data import RetrievalTask

__all__ = ["AnswerDiagnostics", "retrieval_diagnostics", "diagnostics_table"]


class AnswerDiagnostics(NSADiagnostics):
    """NSADiagnostics that also keeps each layer's selected blocks at ``positions`` ([HKV, S, n] per layer)."""

    def __init__(self):
        super().__init__()
        self.blocks: list[torch.Tensor] = []

    def record(self, q, kv_cmp, kv_slc, kv_win, gates, blocks, params) -> torch.Tensor:
        self.blocks.append(block_indices(blocks.detach(), params.slc_top_n)[0][:, self.positions])
        return super().record(q, kv_cmp, kv_slc, kv_win, gates, blocks, params)


def distance_hist(dist: torch.Tensor) -> torch.Tensor:
    """Counts of block distances (>= 0) in the bins of DISTANCE_BINS."""
    bounds = 2 ** torch.arange(N_DISTANCE_BINS - 1, device=dist.device)
    return torch.bincount(torch.bucketize(dist, bounds, right=True), minlength=N_DISTANCE_BINS).float()


@torch.no_grad()
def retrieval_diagnostics(model, task: RetrievalTask, *, samples: int, device: torch.device,
                          autocast=contextlib.nullcontext, indices_from: int = 0) -> dict | None:
    """Per-layer diagnostics over ``samples`` samples of ``task`` (one forward each); None for dense models."""
    diag = AnswerDiagnostics.attach(model)
    if not diag.attached:
        return None
    params = diag._modules[0].params
    n_layers = len(diag._modules)
    shares, gates = np.zeros((n_layers, 3)), np.zeros((n_layers, 3))
    hits, chance = np.zeros(n_layers), 0.0
    hist = torch.zeros(n_layers, N_DISTANCE_BINS)
    pair_dist = []
    for i in range(indices_from, indices_from + samples):
        tokens, _, layout = task.sample_with_layout(i)
        # Input position t predicts token t + 1: value token j of a query is predicted at answer_pos + j - 1 and
        # copies the pair's value token j at pair_value_pos + j.
        j = np.arange(task.value_len)
        pos = torch.from_numpy((layout.answer_pos[:, None] - 1 + j).reshape(-1)).to(device)
        target = torch.from_numpy((layout.pair_value_pos[:, None] + j).reshape(-1)).to(device)
        diag.positions, diag.blocks = pos, []
        with diag.collecting(True), autocast():
            model(torch.from_numpy(tokens[None, :-1]).to(device))
        read = diag.read()  # host sync ok: evaluation
        own, target_block = pos // params.slc_block, target // params.slc_block
        for layer, blk in enumerate(diag.blocks):  # blk [HKV, S, n]
            hits[layer] += (blk == target_block[None, :, None]).any(-1).float().mean().item()  # host sync ok: eval
            valid = blk >= 0
            hist[layer] += distance_hist((own[None, :, None] - blk)[valid].clamp(min=0)).cpu()
            shares[layer] += read["layers"][layer]["output_share"]
            gates[layer] += read["layers"][layer]["gate_mean"]
        # Chance: a forced block (0, own, own - 1) is always selected; otherwise the n - 3 free slots over the
        # non-forced blocks 1 .. own - 2 the query may choose from.
        forced = (target_block == 0) | (target_block >= own - 1)
        random_pick = ((params.slc_top_n - 3) / (own - 2).clamp(min=1).float()).clamp(max=1.0)
        chance += torch.where(forced, 1.0, random_pick).mean().item()  # host sync ok: eval
        pair_dist += (own - target_block).tolist()  # host sync ok: eval
    diag.positions = None
    for m in diag._modules:  # detach: later forwards of this model record nothing
        m.diagnostics = None
    layers = [{"layer": k, "output_share": (shares[k] / samples).tolist(), "gate_mean": (gates[k] / samples).tolist(),
               "pair_block_hit": hits[k] / samples, "slc_distance_hist": (hist[k] / hist[k].sum().clamp(min=1)).tolist()}
              for k in range(n_layers)]
    return {"layers": layers, "branches": list(BRANCHES), "distance_bins": DISTANCE_BINS,
            "pair_block_hit_chance": chance / samples, "pair_distance_blocks": float(np.mean(pair_dist)),
            "samples": samples, "answers_per_sample": task.answer_tokens_per_sample}


def diagnostics_table(diag: dict) -> list[str]:
    """Markdown lines: one row per layer."""
    bins = diag["distance_bins"]
    lines = [f"Answer positions of {diag['samples']} samples ({diag['answers_per_sample']} answer tokens each); "
             f"queried pairs are {diag['pair_distance_blocks']:.1f} selection blocks back on average; a random "
             f"choice of the free blocks would hit the pair's block {100 * diag['pair_block_hit_chance']:.1f} % "
             "of the time.", "",
             "| layer | output share cmp / slc / win | gate mean cmp / slc / win | pair block selected | "
             "selected blocks by distance (" + ", ".join(bins) + ") |", "|---|---|---|---|---|"]
    for r in diag["layers"]:
        fmt = lambda v: " / ".join(f"{x:.2f}" for x in v)  # noqa: E731
        lines.append(f"| {r['layer']} | {fmt(r['output_share'])} | {fmt(r['gate_mean'])} | "
                     f"{100 * r['pair_block_hit']:.1f} % | {' '.join(f'{100 * x:.0f}' for x in r['slc_distance_hist'])} |")
    return lines
