"""Host time of FSDP2's gradient clipping + AdamW step, through DTensor dispatch vs on the local shards.

    python benchmarks/bench_optimizer_step.py [--config train_configs/m7c_125m.toml] [--world 2] [--reps 30] \
        [--out DIR] [--tag X] [-- trainer overrides, e.g. --model.dim 64]

One process is rank 0 of a fake process group of ``--world`` ranks (collectives return at once, see
nsa_titan/experiments/probe.py), so FSDP2 shards the model exactly as on that many GPUs. After one forward and
backward (the gradients), it times ``clip_grad_norm`` + ``optimizer.step()`` ``--reps`` times for
``optimizer.shard_local`` false (DTensor dispatch) and true (local shards), interleaved, and reports the median
milliseconds of each. On a GPU the model runs at its real size and the numbers include the kernels; on the CPU
use a small ``--model.dim`` so that the kernels cost little and the difference is the host's.
Writes optimizer_step_<tag>.json / .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nsa_titan.components.optimizer import build_optimizer  # noqa: E402
from nsa_titan.components.runtime import device_name, resolve_device, software_versions  # noqa: E402
from nsa_titan.components.train_step import clip_grad_norm, forward_backward, full_param_shapes  # noqa: E402
from nsa_titan.config import load_job_config  # noqa: E402
from nsa_titan.experiments.probe import init_fake_process_group  # noqa: E402
from nsa_titan.models import build_model  # noqa: E402
from nsa_titan.parallelisms import ParallelDims, parallelize_nsa  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="train_configs/m7c_125m.toml")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tag", default="m7c")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a, extra = ap.parse_known_args()
    cfg = load_job_config(["--config", a.config, "--parallelism.data_parallel", "fsdp2", "--training.seq_len", "256",
                           "--training.local_batch_size", "1", *(x for x in extra if x != "--")])
    device = resolve_device(cfg.training.device, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu":  # one intra-op thread: a busy second core turns OpenMP's barriers into the measurement
        torch.set_num_threads(1)
    init_fake_process_group(a.world)
    dims = ParallelDims.from_config(a.world, cfg.parallelism)
    with torch.device("meta"):
        model = build_model(cfg.model_args())
    model = parallelize_nsa(model, dims, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    tokens = torch.randint(0, cfg.model_args().vocab_size, (1, cfg.training.seq_len + 1), device=device)
    forward_backward(model, [{"input": tokens[:, :-1], "labels": tokens[:, 1:]}], dp_degree=dims.dp_degree)
    grads = [p.grad.detach().clone() for p in params]
    opts = {}
    for local in (False, True):
        cfg.optimizer.shard_local = local
        with full_param_shapes(model):
            opts[local] = build_optimizer(model, cfg.optimizer, device.type)
    times: dict[bool, list[float]] = {False: [], True: []}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for rep in range(a.reps + 2):  # the first two: state creation and warm-up, untimed
        for local in (False, True):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            sync()
            t0 = time.perf_counter()
            clip_grad_norm(model, params, cfg.training.max_norm, local)
            opts[local].step()
            sync()
            if rep >= 2:
                times[local].append(time.perf_counter() - t0)
    res = {"config": a.config, "overrides": extra, "world": a.world, "reps": a.reps, "params": len(params),
           "device": device_name(device), **software_versions(),
           "date": datetime.datetime.now(datetime.UTC).isoformat(),
           "dtensor_ms": 1e3 * statistics.median(times[False]),
           "shard_local_ms": 1e3 * statistics.median(times[True])}
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"optimizer_step_{a.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    md = (f"# FSDP2 clip + AdamW step: {a.tag} ({res['device']})\n\n"
          f"torch {res['torch']}, {res['date'][:10]}; rank 0 of a fake group of {a.world}, {len(params)} parameters, "
          f"median of {a.reps} interleaved repetitions; `{' '.join(['--config', a.config, *extra])}`.\n\n"
          "| path | clip + step ms |\n|---|---|\n"
          f"| DTensor dispatch (`--optimizer.shard_local false`) | {res['dtensor_ms']:.2f} |\n"
          f"| local shards (default) | {res['shard_local_ms']:.2f} |\n")
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
