"""Worker for test_parallelisms.py's FSDP2 + activation-checkpointing order test: 2 gloo ranks on CPU.

Records, in one training step (the second: the first initialises FSDP lazily), when FSDP2 issues each all-gather
and reduce-scatter and when each block's forward runs (a block's forward during backward is its recompute). It
instruments torch's private FSDP2 classes (``_fsdp_param_group``), so it is a test of torch's and our wiring on
the installed version, not library code. ``record_order`` returns ``{case: {"events": [...], "all_gathers": n, ...}}``;
it runs at the end of _dist_worker's "ac" scenario (one spawn for both), or alone:
``python tests/_fsdp_order_worker.py``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_pg

from _dist_worker import free_port, job_config, tiny_args
from nsa_titan.models import build_model
from nsa_titan.parallelisms import ParallelDims, parallelize_nsa

N_LAYERS = 4
CASES = {
    "none": ["--activation_checkpoint.mode", "none"],
    "full": ["--activation_checkpoint.mode", "full"],
    "ratio": ["--activation_checkpoint.mode", "ratio", "--activation_checkpoint.ratio", "0.5"],
    "full_prefetch2": ["--activation_checkpoint.mode", "full", "--parallelism.fsdp_prefetch", "2"],
}


def _instrument(log: list) -> None:
    """Append ("ag", unit) when an unshard really starts an all-gather and ("rs", unit) per reduce-scatter."""
    unshard, reduce = fsdp_pg.FSDPParamGroup.unshard, fsdp_pg.foreach_reduce
    current = {}

    def recording_unshard(self, *args, **kwargs):
        before = self._all_gather_result
        out = unshard(self, *args, **kwargs)
        if before is None and self._all_gather_result is not None:
            log.append(("ag", self._module_fqn))
        return out

    post_backward = fsdp_pg.FSDPParamGroup.post_backward

    def recording_post_backward(self, *args, **kwargs):
        current["unit"] = self._module_fqn
        return post_backward(self, *args, **kwargs)

    def recording_reduce(*args, **kwargs):
        log.append(("rs", current.get("unit")))
        return reduce(*args, **kwargs)

    fsdp_pg.FSDPParamGroup.unshard = recording_unshard
    fsdp_pg.FSDPParamGroup.post_backward = recording_post_backward
    fsdp_pg.foreach_reduce = recording_reduce


def _run_case(overrides: list[str], log: list) -> dict:
    cfg = job_config("--parallelism.data_parallel", "fsdp2", *overrides, n_layers=N_LAYERS)
    with torch.device("meta"):
        model = build_model(tiny_args(N_LAYERS))
    model = parallelize_nsa(model, ParallelDims.from_config(2, cfg.parallelism), cfg, torch.device("cpu"))
    phase = {"now": "forward"}
    for name, block in model.layers.items():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        inner.register_forward_pre_hook(lambda m, a, name=name: log.append((f"{phase['now']}_fwd", f"layers.{name}")))
    tokens = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        log.clear()
        phase["now"] = "forward"
        loss = model(tokens[:, :-1]).float().pow(2).mean()
        phase["now"] = "backward"
        log.append(("backward", ""))
        loss.backward()
    return {"events": list(log), "all_gathers": sum(e[0] == "ag" for e in log),
            "reduce_scatters": sum(e[0] == "rs" for e in log)}


def record_order() -> dict:
    """Every case's events, in a process of an initialised 2-rank gloo group. The instrumentation stays in place
    afterwards: call it last in a worker (_dist_worker's "ac" scenario does, to spare a second spawn)."""
    log: list = []
    _instrument(log)
    return {case: _run_case(overrides, log) for case, overrides in CASES.items()}


def _worker(rank: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = record_order()
        if rank == 0:
            Path(out_path).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def launch() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "order.json")
        mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


if __name__ == "__main__":  # python tests/_fsdp_order_worker.py: print the recorded events
    print(json.dumps(launch(), indent=1))
