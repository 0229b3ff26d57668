"""Worker processes for tests/test_parallelisms.py: 2 gloo ranks on CPU, spawned by ``launch``.

Every scenario compares data-parallel runs built by ``parallelize_nsa`` with a single-process run of the
same model on the same global batches, in the same process (each rank computes the reference itself).
Rank 0 writes ``{case: metrics}`` as JSON; the test asserts on it, so a failure names the case and numbers.

The data are made to stress the normalisation: every rank gets a different number of ignored labels,
so normalising the loss by a rank's own token count (instead of the global one) changes the gradients.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from _reference_step import reference_forward_backward
from _step_graph_stand_in import stand_in
from nsa_titan.components.optimizer import build_optimizer
from nsa_titan.components.step_graph import StepGraph
from nsa_titan.components.train_step import clip_grad_norm, forward_backward, full_param_shapes, train_step
from nsa_titan.config import load_job_config
from nsa_titan.data import IGNORE_INDEX
from nsa_titan.models import build_model, get_model_args
from nsa_titan.parallelisms import ParallelDims, early_unshard, materialize, parallelize_nsa

WORLD = 2
SEQ, LOCAL_BS, STEPS = 32, 2, 3
# Wrapper prefixes that FSDP1 / DDP / AC / compile add to parameter names.
_PREFIX = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod|module)\.")


def tiny_args(n_layers: int = 2):
    return get_model_args("debug", dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16,
                          ffn_hidden_dim=96, cmp_block=8, cmp_stride=4, slc_block=16, slc_top_n=3, window=24,
                          attn_impl="torch")


def job_config(*overrides: str, n_layers: int = 2, ga: int = 1):
    return load_job_config(["--training.device", "cpu", "--training.seq_len", str(SEQ), "--model.n_layers",
                            str(n_layers), "--training.grad_accum_steps", str(ga), *overrides])


def opt_cfg(shard_local: bool = True, fused: bool | str = False):
    # Large lr and weight decay: a wrong decay group or update shows up in the later steps' losses.
    return SimpleNamespace(name="adamw", lr=1e-2, betas=[0.9, 0.95], eps=1e-6, weight_decay=0.5, fused=fused,
                           shard_local=shard_local)


def global_batches(step: int, ga: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """ga micro-batches of WORLD * LOCAL_BS rows; rank r owns rows [r*LOCAL_BS, (r+1)*LOCAL_BS)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(ga):
        tokens = torch.randint(0, vocab, (WORLD * LOCAL_BS, SEQ + 1), generator=g)
        labels = tokens[:, 1:].clone()
        for row in range(WORLD * LOCAL_BS):  # uneven ignored labels: rank 1 loses many more than rank 0
            labels[row, : (row * 7) % SEQ] = IGNORE_INDEX
        out.append({"input": tokens[:, :-1], "labels": labels})
    return out


def local(mb, rank):
    return {k: v[rank * LOCAL_BS:(rank + 1) * LOCAL_BS] for k, v in mb.items()}


def clean(name: str) -> str:
    return _PREFIX.sub("", name)


def full_grads(model) -> dict[str, torch.Tensor]:
    """Unsharded gradients by clean parameter name (every rank gets them)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.tensor import DTensor

    if isinstance(model, FSDP1):
        with FSDP1.summon_full_params(model, with_grads=True):
            return {clean(n): p.grad.detach().clone() for n, p in model.named_parameters()}
    return {clean(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def reference_state(n_layers: int) -> dict[str, torch.Tensor]:
    """One process's initial weights: seed, build on meta, materialise (as the single-process trainer does)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(tiny_args(n_layers))
    materialize(model, torch.device("cpu"))
    return {k: v.clone() for k, v in model.state_dict().items()}


def run_single(state, n_layers: int, ga: int, steps: int = STEPS, ac_model=None):
    """Single-process reference: the whole global batch, the oracle's forward_backward, plain clipping."""
    model = ac_model or build_model(tiny_args(n_layers))
    model.load_state_dict(state, strict=False)
    opt = build_optimizer(model, opt_cfg(), "cpu")
    params = [p for p in model.parameters()]
    losses, grads, norms = [], [], []
    for step in range(steps):
        loss = reference_forward_backward(model, global_batches(step, ga, model.args.vocab_size))
        losses.append(loss.item())
        grads.append({clean(n): p.grad.detach().clone() for n, p in model.named_parameters()})
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, norms


def dp_model(state, cfg, n_layers: int, backend: str = "inductor"):
    """-> (the model parallelized as the case's config says, its ParallelDims), holding the reference's weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    dims = ParallelDims.from_config(WORLD, cfg.parallelism)
    with torch.device("meta"):
        model = build_model(tiny_args(n_layers))
    model = parallelize_nsa(model, dims, cfg, torch.device("cpu"), compile_backend=backend)
    # The same initial weights as the reference (sharded / broadcast as each wrapper needs).
    set_model_state_dict(model, {k: v for k, v in state.items() if "rope" not in k},
                         options=StateDictOptions(full_state_dict=True, strict=False))
    return model, dims


def run_dp(state, cfg, n_layers: int, ga: int, steps: int = STEPS, backend: str = "inductor"):
    model, dims = dp_model(state, cfg, n_layers, backend)
    # optimizer.shard_local from the case's overrides: FSDP2 clips and steps on local shards or through DTensor
    shard_local = cfg.optimizer.shard_local
    with full_param_shapes(model):
        opt = build_optimizer(model, opt_cfg(shard_local), "cpu")
    params = [p for p in model.parameters()]
    rank, losses, grads, norms = dist.get_rank(), [], [], []
    sync_every = cfg.parallelism.grad_sync == "every_micro_batch"
    unshard_early = early_unshard(model, cfg.parallelism)
    assert (unshard_early is not None) == cfg.parallelism.fsdp_unshard_early, "fsdp_unshard_early not applied"
    for step in range(steps):
        mbs = [local(mb, rank) for mb in global_batches(step, ga, tiny_args().vocab_size)]
        loss = forward_backward(model, mbs, dp_degree=dims.dp_degree, sync_every_micro_batch=sync_every)
        losses.append(loss.item())
        grads.append(full_grads(model))
        norms.append(clip_grad_norm(model, params, 1.0, shard_local).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if unshard_early is not None:  # as the trainer does; the next forward must find the new weights gathered
            unshard_early()
            assert not any(isinstance(p, DTensor) for p in model.layers["0"].parameters()), "first unit not gathered"
    return losses, grads, norms


def run_dp_step_graph(state, cfg, n_layers: int, ga: int, steps: int = STEPS):
    """The trainer's compile.step_graph wiring under FSDP2: train_step inside a StepGraph whose capture is the eager
    stand-in (tests/_step_graph_stand_in.py: each replay re-runs the step against the captured learning rate
    tensors), one warm-up step, and a no-grad forward between steps followed by the reshard the trainer does after
    validation. The fused AdamW (which the trainer's non-finite guard asks for) takes a tensor lr on the CPU.
    Losses and clipping norms; train_step clears the gradients, so none are returned."""
    model, dims = dp_model(state, cfg, n_layers)
    opt = build_optimizer(model, opt_cfg(fused="auto"), "cpu", require_fused=True)
    params = [p for p in model.parameters()]
    graph = StepGraph(lambda mbs, sched: train_step(model, opt, sched, mbs, params=params, max_norm=1.0,
                                                    dp_degree=dims.dp_degree),
                      opt, LambdaLR(opt, lambda s: 1.0), warmup_steps=1, device=torch.device("cpu"),
                      capture=stand_in(opt))
    rank, losses, norms = dist.get_rank(), [], []
    for step in range(steps):
        mbs = [local(mb, rank) for mb in global_batches(step, ga, tiny_args().vocab_size)]
        loss, norm = graph(mbs)
        losses.append(loss.item())
        norms.append(norm.item())
        with torch.no_grad():  # validation between replays
            model(mbs[0]["input"])
        graph.after_eager_forward(model)
        assert all(isinstance(p, DTensor) for p in model.parameters()), "a unit left unsharded after the reshard"
    assert graph.captured
    return losses, [], norms


def fsdp2_units_of_blocks(n_layers: int, per_unit: int) -> list[int]:
    """Which FSDP2 unit (state) each block of a parallelized model belongs to, numbered in block order."""
    from torch.distributed.fsdp import fully_shard

    cfg = job_config("--parallelism.data_parallel", "fsdp2", "--parallelism.fsdp_blocks_per_unit", str(per_unit),
                     n_layers=n_layers)
    with torch.device("meta"):
        model = build_model(tiny_args(n_layers))
    model = parallelize_nsa(model, ParallelDims.from_config(WORLD, cfg.parallelism), cfg, torch.device("cpu"))
    states = [fully_shard.state(b) for b in model.layers.values()]
    return [next(i for i, s in enumerate(states) if s is st) for st in states]


def init_matches_single_process(dp: str, *overrides: str, n_layers: int = 2) -> dict:
    """parallelize_nsa's own initialisation (no state loaded) == one process's init with the same seed."""
    cfg = job_config("--parallelism.data_parallel", dp, *overrides, n_layers=n_layers)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(tiny_args(n_layers))
    model = parallelize_nsa(model, ParallelDims.from_config(WORLD, cfg.parallelism), cfg, torch.device("cpu"))
    ref = reference_state(n_layers)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    err = max((full[k] - ref[k]).abs().max().item() for k in ref)
    return {"ref_losses": [], "losses": [], "loss_err": 0.0, "grad_rel_err": err, "worst_param": "init (max abs)",
            "norm_rel_err": 0.0}


def compare(ref, got) -> dict:
    (ref_l, ref_g, ref_n), (got_l, got_g, got_n) = ref, got
    worst, worst_name = 0.0, None
    for rg, gg in zip(ref_g, got_g):
        assert set(rg) == set(gg), (sorted(set(rg) ^ set(gg)))
        for name, r in rg.items():
            err = ((gg[name] - r).norm() / r.norm().clamp(min=1e-12)).item()
            if err > worst:
                worst, worst_name = err, name
    return {"ref_losses": ref_l, "losses": got_l, "loss_err": max(abs(a - b) for a, b in zip(ref_l, got_l)),
            "grad_rel_err": worst, "worst_param": worst_name,
            # the clipping norm each step (a norm missing a rank's shard shows here before it skews later losses)
            "norm_rel_err": max(abs(a - b) / b for a, b in zip(got_n, ref_n)), "norms": got_n}


# ---- scenarios: name -> list of (case, overrides, n_layers, ga) --------------------------------------
def _parity_cases():
    cases = []
    for dp in ("fsdp2", "fsdp1", "ddp"):
        for ga in (1, 2):
            cases.append((f"{dp}_ga{ga}", ["--parallelism.data_parallel", dp], 2, ga))
        cases.append((f"{dp}_ga2_sync_every", ["--parallelism.data_parallel", dp,
                                              "--parallelism.grad_sync", "every_micro_batch"], 2, 2))
    fs2 = ["--parallelism.data_parallel", "fsdp2"]
    cases += [
        ("fsdp2_hsdp_2x1_ga2", [*fs2, "--parallelism.dp_replicate", "2"], 2, 2),
        # clipping and AdamW through DTensor dispatch instead of the local shards (the default)
        ("fsdp2_dtensor_step_ga2", [*fs2, "--optimizer.shard_local", "false"], 2, 2),
        ("fsdp2_never_reshard_prefetch1", [*fs2, "--parallelism.fsdp_reshard_after_forward", "never",
                                           "--parallelism.fsdp_prefetch", "1"], 2, 2),
        # 3 blocks in units of 2 ([0, 1], [2]) with explicit prefetch, and with full AC inside a grouped unit
        ("fsdp2_units2_prefetch1_ga2", [*fs2, "--parallelism.fsdp_blocks_per_unit", "2",
                                        "--parallelism.fsdp_prefetch", "1"], 3, 2),
        ("fsdp2_units2_full_ac", [*fs2, "--parallelism.fsdp_blocks_per_unit", "2", "--activation_checkpoint.mode",
                                  "full"], 3, 1),
        # ratio 0.5 of 3 blocks checkpoints blocks 0 and 2: one unit holds a recomputed and a plain block
        ("fsdp2_units2_ratio_ga2", [*fs2, "--parallelism.fsdp_blocks_per_unit", "2", "--activation_checkpoint.mode",
                                    "ratio", "--activation_checkpoint.ratio", "0.5"], 3, 2),
        # the first units gathered after each optimizer step (the trainer's order): the next forward must use the
        # updated weights (a stale gather would change the losses from step 2 on)
        ("fsdp2_unshard_early_units2_ga2", [*fs2, "--parallelism.fsdp_unshard_early",
                                            "--parallelism.fsdp_blocks_per_unit", "2"], 3, 2),
        ("fsdp2_always_reshard_cpu_offload", [*fs2, "--parallelism.fsdp_reshard_after_forward", "always",
                                              "--parallelism.fsdp_cpu_offload"], 2, 1),
        ("fsdp1_grad_op_post_prefetch", ["--parallelism.data_parallel", "fsdp1",
                                         "--parallelism.fsdp1_sharding_strategy", "grad_op",
                                         "--parallelism.fsdp1_backward_prefetch", "post",
                                         "--parallelism.fsdp1_forward_prefetch"], 2, 2),
        ("ddp_no_static_graph", ["--parallelism.data_parallel", "ddp", "--parallelism.ddp_static_graph", "false"],
         2, 2),
    ]
    return cases


def _ac_cases():
    # 4 blocks with different weights: a recompute of the wrong block changes the gradients. DDP with GA 1
    # runs with static_graph; GA 2 adds no_sync micro-batches.
    cases = []
    for dp, ga in (("ddp", 1), ("fsdp2", 2)):
        for mode in ("none", "full", "selective_op", "ratio"):
            extra = ["--activation_checkpoint.ratio", "0.5"] if mode == "ratio" else []
            cases.append((f"{dp}_{mode}", ["--parallelism.data_parallel", dp, "--activation_checkpoint.mode", mode,
                                           *extra], 4, ga))
    cases.append(("ddp_full_ga2", ["--parallelism.data_parallel", "ddp", "--activation_checkpoint.mode", "full"], 4, 2))
    return cases


def _compile_cases():
    # One inductor compile (the real thing, ~30 s on CPU); the others use 'aot_eager_decomp_partition', which
    # runs the same AOTAutograd partitioner (so memory_budget decides the same recomputation) without
    # generating code. Memory budget 0.0 = recompute as much as the partitioner can.
    budget = ["--compile.enable", "--activation_checkpoint.mode", "memory_budget",
              "--activation_checkpoint.memory_budget", "0.0"]
    return [
        ("fsdp2_inductor_memory_budget", ["--parallelism.data_parallel", "fsdp2", *budget], 2, 1),
        ("ddp_memory_budget", ["--parallelism.data_parallel", "ddp", *budget], 2, 1, "aot_eager_decomp_partition"),
        ("fsdp2_memory_budget_ga2", ["--parallelism.data_parallel", "fsdp2", *budget], 2, 2,
         "aot_eager_decomp_partition"),
        ("fsdp2_compiled_ratio", ["--parallelism.data_parallel", "fsdp2", "--compile.enable",
                                  "--activation_checkpoint.mode", "ratio", "--activation_checkpoint.ratio", "0.5"],
         2, 2, "aot_eager_decomp_partition"),
    ]


SCENARIOS = {"parity": _parity_cases, "ac": _ac_cases, "compile": _compile_cases}


def _worker(rank: int, port: int, scenario: str, only: list[str] | None, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # two ranks share the CI machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results, refs = {}, {}
    try:
        for case, overrides, n_layers, ga, *backend in SCENARIOS[scenario]():
            if only and case not in only:
                continue
            key = (n_layers, ga)
            if key not in refs:
                refs[key] = run_single(reference_state(n_layers), n_layers, ga)
            cfg = job_config(*overrides, n_layers=n_layers, ga=ga)
            got = run_dp(reference_state(n_layers), cfg, n_layers, ga, backend=backend[0] if backend else "inductor")
            results[case] = compare(refs[key], got)
        if scenario == "parity" and (not only or "fsdp2_step_graph_never_reshard_ga2" in only):
            # FSDP2 units that stay unsharded after forward: the reshard after the no-grad forward is needed
            cfg = job_config("--parallelism.data_parallel", "fsdp2", "--parallelism.fsdp_reshard_after_forward",
                             "never", ga=2)
            ref = refs.get((2, 2)) or run_single(reference_state(2), 2, 2)
            results["fsdp2_step_graph_never_reshard_ga2"] = {
                **compare(ref, run_dp_step_graph(reference_state(2), cfg, 2, 2)), "grads_compared": False}
        if scenario == "parity":
            for dp in ("fsdp2", "fsdp1", "ddp"):
                results[f"{dp}_init"] = init_matches_single_process(dp)
            results["fsdp2_units2_init"] = init_matches_single_process(
                "fsdp2", "--parallelism.fsdp_blocks_per_unit", "2", n_layers=3)
            results["fsdp2_units2_init"]["units"] = fsdp2_units_of_blocks(3, 2)
        if scenario == "ac" and not only:  # last: it instruments FSDP2 for the rest of this process
            from _fsdp_order_worker import record_order

            results["fsdp2_ac_order"] = record_order()
        if rank == 0:
            Path(out_path).write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()
    # Done and reported: skip the interpreter's teardown, where gloo / DDP threads left by the cases above could
    # abort the process ("terminate called without an active exception": 1 in 3 spawns on a loaded 2-core box,
    # seen on main before and after 2026-11-23) and fail a test whose results were already complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, only: list[str] | None = None) -> dict:
    """Run a scenario on WORLD spawned gloo ranks; returns rank 0's {case: metrics}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(free_port(), scenario, only, out), nprocs=WORLD, join=True)
        return json.loads(Path(out).read_text())


if __name__ == "__main__":  # python tests/_dist_worker.py parity [case ...]
    import sys

    print(json.dumps(launch(sys.argv[1], sys.argv[2:] or None), indent=1))
