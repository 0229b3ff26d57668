"""nsa_titan.parallelisms: data parallelism, activation checkpointing and compile, on CPU.

Distributed cases run on 2 gloo ranks spawned by tests/_dist_worker.py (one spawn per scenario, many cases
each); every case is compared with a single-process run on the same global batches.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch._functorch.config as functorch_config
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from _dist_worker import launch, tiny_args
from nsa_titan.config import ConfigError, load_job_config
from nsa_titan.config.job_config import Compile
from nsa_titan.models import build_model
from nsa_titan.parallelisms import (
    CompileCounter,
    ParallelDims,
    apply_ac,
    apply_compile,
    compile_loss,
    describe_parallelism,
    parallelize_nsa,
    ratio_block_ids,
    selective_save_ops,
)

REPO = Path(__file__).resolve().parents[1]
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # fp32: observed ~5e-7 / ~3e-6 (reduction order differs between runs)


def _check(results: dict, expected_cases: list[str]) -> None:
    assert sorted(results) == sorted(expected_cases), "the worker skipped cases"
    bad = {case: r for case, r in results.items()
           if r["loss_err"] > LOSS_TOL or r["grad_rel_err"] > GRAD_TOL or r["norm_rel_err"] > LOSS_TOL}
    assert not bad, "\n".join(f"{c}: loss err {r['loss_err']:.2e} ({r['losses']} vs {r['ref_losses']}), "
                              f"grad rel err {r['grad_rel_err']:.2e} at {r['worst_param']}, "
                              f"clip norm rel err {r['norm_rel_err']:.2e}" for c, r in bad.items())


# ---- data parallelism == one process --------------------------------------------------------------------
def test_fsdp2_fsdp1_ddp_match_single_process():
    """3 steps with and without GA (both sync policies), plus HSDP, reshard/prefetch/offload variants and the step
    graph's wiring; and
    each wrapper's own initialisation equals one process's (on CPU, sharded FSDP2 init once duplicated
    the same random rows on every rank)."""
    results = launch("parity")
    cases = [f"{dp}_{v}" for dp in ("fsdp2", "fsdp1", "ddp") for v in ("ga1", "ga2", "ga2_sync_every", "init")]
    cases += ["fsdp2_hsdp_2x1_ga2", "fsdp2_dtensor_step_ga2", "fsdp2_never_reshard_prefetch1",
              "fsdp2_units2_prefetch1_ga2",
              "fsdp2_units2_full_ac", "fsdp2_units2_ratio_ga2", "fsdp2_units2_init", "fsdp2_unshard_early_units2_ga2",
              "fsdp2_always_reshard_cpu_offload",
              "fsdp1_grad_op_post_prefetch", "ddp_no_static_graph",
              # compile.step_graph's wiring with the eager stand-in for the capture: losses and clip norms (and the
              # worker asserts every unit resharded after a no-grad forward between steps)
              "fsdp2_step_graph_never_reshard_ga2"]
    _check(results, cases)
    assert results["fsdp2_units2_init"]["units"] == [0, 0, 2]  # blocks 0 and 1 share a unit, block 2 is alone


@pytest.fixture(scope="module")
def ac_results() -> dict:
    """One spawn of the "ac" scenario serves two tests (spawning 2 ranks costs ~20 s on a busy 2-core box)."""
    return launch("ac")


def test_every_ac_mode_matches_no_ac_under_ddp_and_fsdp2(ac_results):
    """4 blocks with different weights: recomputing the wrong block, or a block's gradient reduced twice
    ("marked ready twice"), changes or breaks the gradients. memory_budget is in the compile test."""
    results = {k: v for k, v in ac_results.items() if k != "fsdp2_ac_order"}
    _check(results, [f"{dp}_{m}" for dp in ("ddp", "fsdp2") for m in ("none", "full", "selective_op", "ratio")]
           + ["ddp_full_ga2"])


def test_fsdp2_recompute_issues_no_all_gather_and_runs_behind_the_next_prefetch(ac_results):
    """FSDP2 + AC, 4 blocks (tests/_fsdp_order_worker.py records one step): the recompute re-issues no collective
    (11 all-gathers: embedding, 4 blocks, head in forward; 4 blocks and the embedding again in backward; 6
    reduce-scatters, whatever the AC mode); only checkpointed blocks recompute; and when block i recomputes, the
    all-gather of block i-1 (i-1 and i-2 with fsdp_prefetch 2) is already issued, so it overlaps the recompute.
    The CPU evidence for docs/experiments.md's FSDP2 + AC hypotheses 1 and 2."""
    order = ac_results["fsdp2_ac_order"]
    recomputed = {"none": [], "full": [3, 2, 1, 0], "ratio": [2, 0], "full_prefetch2": [3, 2, 1, 0]}
    for case, rec in order.items():
        assert (rec["all_gathers"], rec["reduce_scatters"]) == (11, 6), case
        events = [tuple(e) for e in rec["events"]]
        backward = events[events.index(("backward", "")):]
        assert [int(u.split(".")[1]) for kind, u in backward if kind == "backward_fwd"] == recomputed[case], case
        depth = 2 if case == "full_prefetch2" else 1  # fsdp_prefetch N: N blocks ahead; the embedding after block 0
        for i in recomputed[case]:
            at = backward.index(("backward_fwd", f"layers.{i}"))
            ahead = [f"layers.{j}" for j in range(max(0, i - depth), i)] or ["tok_embeddings"]
            for unit in ahead:
                assert ("ag", unit) in backward[:at], (case, f"block {i} recomputes before {unit} is gathered")
    # The recompute runs the checkpointed block's own forward: its all-gather comes from pre_backward, never from
    # inside the recompute (no all-gather directly follows a recompute).
    full = [tuple(e) for e in order["full"]["events"]]
    assert all(full[k + 1][0] != "ag" for k, e in enumerate(full[:-1]) if e[0] == "backward_fwd")


def test_compile_with_fsdp2_and_memory_budget_trains():
    """Per-block inductor compile under FSDP2 (+ memory_budget, also under DDP, + compiled ratio AC)."""
    _check(launch("compile"), ["fsdp2_inductor_memory_budget", "ddp_memory_budget", "fsdp2_memory_budget_ga2",
                               "fsdp2_compiled_ratio"])


# ---- activation checkpointing, single process -------------------------------------------------------------
@pytest.mark.parametrize("ratio, expected", [(0.0, []), (0.25, [0, 4]), (0.5, [0, 2, 4, 6]), (1.0, list(range(8)))])
def test_ratio_picks_evenly_spaced_blocks(ratio, expected):
    assert ratio_block_ids(8, ratio) == expected
    model = build_model(tiny_args(8))
    assert apply_ac(model, SimpleNamespace(mode="ratio", ratio=ratio)) == expected
    wrapped = [i for i, b in enumerate(model.layers.values()) if type(b).__name__ == "CheckpointWrapper"]
    assert wrapped == expected


def test_ratio_out_of_range_is_rejected():
    with pytest.raises(ConfigError, match="activation_checkpoint.ratio"):
        load_job_config(["--activation_checkpoint.ratio", "-0.1"])


def _model_and_batch(n_layers=4, seed=0):
    torch.manual_seed(seed)
    model = build_model(tiny_args(n_layers))
    model.init_weights()
    tokens = torch.randint(0, model.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))
    return model, tokens


def _grads(model, tokens):
    model.zero_grad(set_to_none=True)
    model(tokens).float().pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _fwd_bwd_flops(mode: str) -> int:
    model, tokens = _model_and_batch()
    apply_ac(model, SimpleNamespace(mode=mode, ratio=1.0))
    with FlopCounterMode(display=False) as counter:
        model(tokens).float().pow(2).mean().backward()
    return counter.get_total_flops()


def test_selective_op_saves_the_ops_the_model_names():
    """The generic AC code knows no model: parallelize_nsa hands it the NSA package's kernel op names."""
    from nsa_titan.models.nsa.attention import NSA_IMPLS, SELECTIVE_AC_SAVE_OPS

    if NSA_IMPLS["triton"] is None:
        pytest.skip("the Triton kernels (and their ops) do not import here")
    nsa_fwd = torch.ops.nsa_titan.nsa_fwd.default
    assert nsa_fwd in selective_save_ops(SELECTIVE_AC_SAVE_OPS) and nsa_fwd not in selective_save_ops()


def test_selective_op_recomputes_less_than_full_and_more_than_none():
    none, selective, full = (_fwd_bwd_flops(m) for m in ("none", "selective_op", "full"))
    assert none < selective < full, (none, selective, full)


def _late_bound_forward(model, tokens):
    """The old system's bug: a checkpointed lambda made in a loop reads the loop variable when called. The
    forward calls it at once (right block); the recompute in backward runs after the loop (LAST block)."""
    t = tokens.shape[1]
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]
    h = model.tok_embeddings(tokens)
    for block in model.layers.values():
        h = checkpoint(lambda x: block(x, cos, sin), h, use_reentrant=False)  # noqa: B023 - the bug on purpose
    return model.output(model.norm(h))


def test_gradient_check_would_catch_a_late_bound_recompute():
    """The AC gradient comparison fails for the old bug and passes for apply_ac: the check can fail."""
    model, tokens = _model_and_batch()
    reference = _grads(model, tokens)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(_late_bound_forward(model, tokens), model(tokens))  # the forward is right...
    _late_bound_forward(model, tokens).float().pow(2).mean().backward()
    buggy = [p.grad.clone() for p in model.parameters()]
    assert any(not torch.allclose(r, b, rtol=1e-4, atol=1e-6) for r, b in zip(reference, buggy))  # ...not grads

    for mode in ("full", "selective_op"):
        model, tokens = _model_and_batch()
        apply_ac(model, SimpleNamespace(mode=mode, ratio=1.0))
        for r, g in zip(reference, _grads(model, tokens)):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def _saved_bytes(budget: float) -> int:
    torch._dynamo.reset()  # dynamo's guards ignore the budget: without a reset the first compile is reused
    model, tokens = _model_and_batch(n_layers=1)
    apply_compile(model, Compile(enable=True), memory_budget=budget, backend="aot_eager_decomp_partition")
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens)
    out.float().pow(2).mean().backward()
    return sum(saved)


def test_memory_budget_is_applied_per_block_and_not_leaked():
    before = functorch_config.activation_memory_budget
    low, high = _saved_bytes(0.0), _saved_bytes(1.0)
    assert low < high, (low, high)  # a budget of 0 recomputes more, so it saves less
    assert functorch_config.activation_memory_budget == before


def test_compile_cache_tag_is_set_while_blocks_compile_and_not_leaked():
    """The custom ops' source fingerprint is part of the compile caches' key while a block compiles (added to a
    tag the user set), and nothing of it stays set afterwards."""
    import torch.compiler.config as compiler_config

    seen = []

    def backend(gm, example_inputs):  # called while the block compiles
        seen.append(compiler_config.cache_key_tag)
        return gm.forward

    torch._dynamo.reset()
    model, tokens = _model_and_batch(n_layers=1)
    apply_compile(model, Compile(enable=True), backend=backend, cache_tag="nsa_titan-ops-test")
    with compiler_config.patch(cache_key_tag="mine"):  # a tag of the user's own
        model(tokens)
        assert compiler_config.cache_key_tag == "mine"
    assert seen == ["mine|nsa_titan-ops-test"], seen


def test_compile_cache_tag_follows_the_kernel_sources(tmp_path):
    """A change to any file behind the custom ops gives another tag; the same files give the same one."""
    import shutil

    from nsa_titan.models.nsa import attention

    src = Path(attention.__file__).resolve().parents[2] / "kernels"
    shutil.copytree(src, tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    tag = attention.compile_cache_tag()
    assert tag.startswith("nsa_titan-ops-") and attention.compile_cache_tag(tmp_path / "kernels") == tag
    with open(tmp_path / "kernels" / "ops.py", "a") as f:
        f.write("\n# another version\n")
    assert attention.compile_cache_tag(tmp_path / "kernels") != tag


# ---- meshes and configuration ---------------------------------------------------------------------------
def _pcfg(**kw):
    return load_job_config([f"--parallelism.{k}={v}" for k, v in kw.items()]).parallelism


def test_parallel_dims_resolve_and_validate():
    dims = ParallelDims.from_config(8, _pcfg())
    assert (dims.dp_replicate, dims.dp_shard, dims.mesh_shape()) == (1, 8, ((8,), ("dp_shard",)))
    dims = ParallelDims.from_config(8, _pcfg(dp_replicate=2))
    assert dims.hsdp and dims.mesh_shape() == ((2, 4), ("dp_replicate", "dp_shard"))
    dims = ParallelDims.from_config(4, _pcfg(data_parallel="ddp"))
    assert (dims.dp_replicate, dims.dp_shard, dims.mesh_shape()[1]) == (4, 1, ("dp_replicate",))
    assert not ParallelDims.from_config(1, _pcfg()).dp_enabled

    errors = [
        (8, _pcfg(dp_replicate=3), "does not divide the world size 8"),
        (8, _pcfg(dp_replicate=2, dp_shard=2), "2 x 2 = 4 but the world size"),
        (4, _pcfg(data_parallel="ddp", dp_shard=2), "ddp replicates over all 4 ranks"),
        (4, _pcfg(data_parallel="fsdp1", fsdp1_sharding_strategy="hybrid"), "dp_replicate > 1"),
        (2, _pcfg(data_parallel="fsdp1", fsdp1_sharding_strategy="hybrid", dp_replicate=2), "dp_shard=1"),
        (4, _pcfg(data_parallel="fsdp1", dp_replicate=2), "hybrid"),
        (4, _pcfg(fsdp_reshard_after_forward=4), "1 < k < dp_shard"),
        (8, _pcfg(fsdp_reshard_after_forward=3), "divisor"),
    ]
    for world, pcfg, message in errors:
        with pytest.raises(ConfigError, match=message):
            ParallelDims.from_config(world, pcfg)
    assert ParallelDims.from_config(8, _pcfg(fsdp_reshard_after_forward=4)).dp_shard == 8


def test_config_sections_and_cross_checks():
    cfg = load_job_config(["--parallelism.data_parallel", "ddp", "--activation_checkpoint.mode", "ratio",
                           "--activation_checkpoint.ratio", "0.25",
                           "--parallelism.fsdp_reshard_after_forward", "never"])
    assert (cfg.parallelism.data_parallel, cfg.activation_checkpoint.ratio) == ("ddp", 0.25)
    assert cfg.parallelism.fsdp_reshard_after_forward == "never"
    reshard_2 = load_job_config(["--parallelism.fsdp_reshard_after_forward", "2"]).parallelism
    assert reshard_2.fsdp_reshard_after_forward == 2
    with pytest.raises(ConfigError, match="needs|compile.enable"):
        load_job_config(["--activation_checkpoint.mode", "memory_budget"])
    with pytest.raises(ConfigError, match="parallelism.data_parallel"):
        load_job_config(["--parallelism.data_parallel", "zero3"])


def test_parallelize_requires_a_meta_model():
    model = build_model(tiny_args(2))
    with pytest.raises(ValueError, match="meta"):
        parallelize_nsa(model, ParallelDims.from_config(1, _pcfg()), load_job_config([]), torch.device("cpu"))


def test_cuda_graph_mode_refused_off_gpu_before_anything_is_built():
    cfg = load_job_config(["--compile.enable", "--compile.mode", "reduce-overhead"])
    with torch.device("meta"):
        model = build_model(tiny_args(2))
    with pytest.raises(ConfigError, match="reduce-overhead.*one CUDA GPU"):
        parallelize_nsa(model, ParallelDims.from_config(1, cfg.parallelism), cfg, torch.device("cpu"))
    assert all(p.is_meta for p in model.parameters())  # refused before compile or materialisation


def test_auto_compile_mode_runs_without_graphs_off_gpu(monkeypatch):
    """compile.mode 'auto' is accepted where 'reduce-overhead' is refused, and compiles the blocks plainly there."""
    import nsa_titan.parallelisms.compile as compile_mod

    modes, real_compile = [], torch.compile

    def recording_compile(fn, **kw):
        modes.append(kw.get("mode"))
        return real_compile(fn, **kw)

    monkeypatch.setattr(compile_mod.torch, "compile", recording_compile)
    cfg = load_job_config(["--compile.enable", "--compile.mode", "auto", "--model.n_layers", "2"])
    with torch.device("meta"):
        model = build_model(tiny_args(2))
    dims = ParallelDims.from_config(1, cfg.parallelism)
    parallelize_nsa(model, dims, cfg, torch.device("cpu"), compile_backend="eager")
    assert modes == [None, None]  # torch.compile's default mode for both blocks, no CUDA graphs
    assert "mode default" in describe_parallelism(dims, cfg, 2, "cpu")
    assert "mode reduce-overhead" in describe_parallelism(dims, cfg, 2, "cuda")


def test_single_process_parallelize_materialises_and_checkpoints():
    cfg = load_job_config(["--activation_checkpoint.mode", "full", "--model.n_layers", "2"])
    with torch.device("meta"):
        model = build_model(tiny_args(2))
    model = parallelize_nsa(model, ParallelDims.from_config(1, cfg.parallelism), cfg, torch.device("cpu"))
    assert not any(p.is_meta for p in model.parameters()) and model.rope_cos.device.type == "cpu"
    assert all(type(b).__name__ == "CheckpointWrapper" for b in model.layers.values())
    assert torch.isfinite(model(torch.zeros(1, 16, dtype=torch.long))).all()


def test_fsdp2_materialises_one_unit_at_a_time(monkeypatch):
    """Each FSDP2 unit is allocated and initialised just before it is sharded, so no rank ever holds more than
    one unit unsharded, and the shards hold exactly one process's init (rank 0 of 4 owns the first quarter)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from nsa_titan.experiments.probe import init_fake_process_group
    from nsa_titan.parallelisms import data_parallel

    cfg = load_job_config(["--parallelism.data_parallel", "fsdp2", "--model.n_layers", "3"])
    with torch.device("meta"):
        ref, model = build_model(tiny_args(3)), build_model(tiny_args(3))
    torch.manual_seed(0)
    ref.to_empty(device="cpu")
    ref.init_weights()  # one process
    full_at_shard_time = []
    real_fully_shard = data_parallel.fully_shard

    def recording_fully_shard(module, **kw):
        modules = module if isinstance(module, list) else [module]
        inside = {id(p) for m in modules for p in m.parameters()}
        full_at_shard_time.append(sum(p.numel() for p in model.parameters()
                                      if not p.is_meta and not isinstance(p, DTensor) and id(p) not in inside))
        return real_fully_shard(module, **kw)

    monkeypatch.setattr(data_parallel, "fully_shard", recording_fully_shard)
    init_fake_process_group(4)
    torch.manual_seed(0)
    try:
        model = parallelize_nsa(model, ParallelDims.from_config(4, cfg.parallelism), cfg, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert len(full_at_shard_time) == 3 + 3 and not any(full_at_shard_time)  # emb, 3 blocks, head, root
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        local = p.to_local()
        rows = local.shape[0]
        assert torch.equal(local, q[:rows]), name  # dim-0 shards: rank 0 holds the leading rows


# ---- the trainer, 2 gloo processes through run_train.sh (torchrun) --------------------------------------------
def test_run_train_sh_two_cpu_processes(tmp_path):
    env = {**os.environ, "NGPU": "2", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = ["bash", str(REPO / "run_train.sh"), "--training.device", "cpu", "--model.n_layers", "2",
           "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.head_dim", "16",
           "--model.ffn_hidden_dim", "96", "--training.seq_len", "128", "--training.local_batch_size", "2",
           "--training.grad_accum_steps", "2", "--training.steps", "6", "--metrics.log_freq", "3",
           "--metrics.val_freq", "0", "--lr_scheduler.warmup_steps", "2", "--parallelism.data_parallel", "fsdp2",
           "--activation_checkpoint.mode", "ratio",
           "--activation_checkpoint.ratio", "0.5", "--parallelism.fsdp_unshard_early", "--job.dump_folder",
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fsdp2 over 2 ranks" in proc.stdout and "ratio 0.5 (blocks [0])" in proc.stdout
    assert "first units gathered after each step" in proc.stdout
    import json

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["tokens"] == 6 * 2 * 2 * 128 * 2  # steps x GA x batch x seq x ranks
    assert summary["final_loss"] < summary["initial_loss"]


def test_group_blocks_merges_runs_of_blocks_and_keeps_the_init_order():
    """parallelism.fsdp_blocks_per_unit: runs of k consecutive blocks become one unit (the last run may be
    shorter), the embedding and [norm + output] stay alone, and the initialisers still run in one process's
    order (the same random draws)."""
    import functools

    from torch import nn

    from nsa_titan.parallelisms.data_parallel import group_blocks

    calls = []
    emb, head, blocks = nn.Linear(1, 1), [nn.Linear(1, 1), nn.Linear(1, 1)], [nn.Linear(1, 1) for _ in range(5)]
    units = [(emb, functools.partial(calls.append, "emb")),
             *((b, functools.partial(calls.append, i)) for i, b in enumerate(blocks)),
             (head, functools.partial(calls.append, "head"))]
    for k, sizes in ((1, [1, 1, 1, 1, 1]), (2, [2, 2, 1]), (5, [5]), (8, [5])):
        grouped = group_blocks(units, blocks, k)
        assert grouped[0][0] is emb and grouped[-1][0] is head
        assert [len(u) if isinstance(u, list) else 1 for u, _ in grouped[1:-1]] == sizes
        assert [m for u, _ in grouped[1:-1] for m in (u if isinstance(u, list) else [u])] == blocks
        calls.clear()
        for _, init in grouped:
            init()
        assert calls == ["emb", 0, 1, 2, 3, 4, "head"]


def test_the_parallelism_line_names_units_of_several_blocks():
    cfg = load_job_config(["--parallelism.fsdp_blocks_per_unit", "3", "--model.n_layers", "6"])
    line = describe_parallelism(ParallelDims.from_config(2, cfg.parallelism), cfg, 6, "cuda")
    assert "fsdp2 over 2 ranks" in line and "3 blocks per unit" in line
    one = load_job_config(["--model.n_layers", "6"])
    assert "per unit" not in describe_parallelism(ParallelDims.from_config(2, one.parallelism), one, 6, "cuda")


def test_the_parallelism_line_points_compiled_fsdp2_at_the_step_graph():
    """Compiled FSDP2 without the step graph is host-bound for small models (m7c: 39 % of one GPU against 101 %
    with it): the startup line says so, and says when the whole step is replayed instead."""
    def line(*extra, ranks=2):
        cfg = load_job_config(["--model.n_layers", "2", *extra])
        return describe_parallelism(ParallelDims.from_config(ranks, cfg.parallelism), cfg, 2, "cuda")

    assert "--compile.step_graph" in line("--compile.enable")
    assert "--compile.step_graph" not in line("--compile.enable", ranks=1)  # one GPU: reduce-overhead graphs
    assert "--compile.step_graph" not in line()  # not compiled: nothing to replay
    assert "--compile.step_graph" not in line("--compile.enable", "--parallelism.data_parallel", "ddp")
    graphed = line("--compile.enable", "--compile.step_graph", "--metrics.nsa_diagnostics", "false")
    assert "replayed as one CUDA graph" in graphed and "--compile.step_graph" not in graphed


def test_compiled_loss_keeps_no_fp32_vocabulary_tensor_for_its_backward():
    """compile.loss: the eager loss (F.cross_entropy over an fp32 copy of the logits) saves an fp32 log-softmax
    [tokens, vocab] for its backward (7.8 GiB at the 1b's 64k, with 15.6 more of fp32 in that backward); the
    compiled one keeps the bf16 logits and per-token statistics, and gives the same loss and gradient (in bf16)."""
    from nsa_titan.components.train_step import token_loss_sum

    assert compile_loss(token_loss_sum, Compile()) is token_loss_sum  # compile.enable off
    assert compile_loss(token_loss_sum, Compile(enable=True, loss=False)) is token_loss_sum
    compiled = compile_loss(token_loss_sum, Compile(enable=True))
    n, v = 96, 1000
    logits = torch.randn(2, n // 2, v, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (2, n // 2), generator=torch.Generator().manual_seed(1))
    labels[0, :5] = -100  # ignored positions
    results = {}
    for name, fn in (("eager", token_loss_sum), ("compiled", compiled)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = fn(logits, labels)
        (grad,) = torch.autograd.grad(loss, logits)
        big_fp32 = [t for t in saved if t.dtype == torch.float32 and t.numel() >= n * v]
        results[name] = loss.detach(), grad, big_fp32
    assert len(results["eager"][2]) >= 1  # what the compiled loss removes (else this test could not fail)
    assert results["compiled"][2] == []
    torch.testing.assert_close(results["compiled"][0], results["eager"][0], rtol=1e-5, atol=1e-4)
    assert results["compiled"][1].dtype == torch.bfloat16
    torch.testing.assert_close(results["compiled"][1].float(), results["eager"][1].float(), rtol=1e-2, atol=1e-4)


def test_compile_counter_expects_the_graphs_a_run_makes_by_design():
    counter = CompileCounter.__new__(CompileCounter)  # the arithmetic only: no model, no compile
    counter.kinds = 2
    assert counter.expected() == 2
    assert counter.expected(diagnostics=True) == 4
    assert counter.expected(evaluated=True) == 4
    assert counter.expected(loss=True) == 3
    assert counter.expected(diagnostics=True, evaluated=True, loss=True) == 2 * 3 + 2
