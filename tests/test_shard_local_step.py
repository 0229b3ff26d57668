"""optimizer.shard_local: FSDP2's clipping and AdamW step on the local shards, without DTensor dispatch.

The 2-rank parity scenario (test_parallelisms.py, tests/_dist_worker.py) holds both paths to one process's training.
Here, in one process standing in for rank 0 of 2 (a fake process group: collectives return at once), the local
path must give the same norm, gradients and parameters as the DTensor path, keep the optimizer state as DTensors
(what checkpoints save), and dispatch no DTensor op at all: the point of it is the host time that dispatch costs.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from nsa_titan.components.optimizer import ShardLocalAdamW, build_optimizer
from nsa_titan.components.train_step import clip_grad_norm


@pytest.fixture()
def mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


class Sharded(nn.Module):
    """Two parameters (one with uneven shards: 5 rows on 2 ranks) as FSDP2 holds them: Shard(0) DTensors."""

    def __init__(self, mesh, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(distribute_tensor(torch.randn(6, 4, generator=g), mesh, [Shard(0)]))
        self.b = nn.Parameter(distribute_tensor(torch.randn(5, generator=g), mesh, [Shard(0)]))
        for p in self.parameters():  # gradients large enough that clipping at 1.0 scales them
            p.grad = distribute_tensor(torch.randn(p.shape, generator=g) * 3, mesh, [Shard(0)])


def _opt_cfg(shard_local: bool):
    return SimpleNamespace(name="adamw", lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, fused=False,
                           shard_local=shard_local)


class DTensorOps(TorchDispatchMode):
    """Records every op called with a DTensor argument (a mode sees an op before DTensor's own dispatch)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _steps(model: nn.Module, shard_local: bool, n: int = 2) -> tuple[list[float], torch.optim.Optimizer, list[str]]:
    """n clip + AdamW steps; the DTensor ops of the last one (the first also creates the optimizer state)."""
    opt = build_optimizer(model, _opt_cfg(shard_local), "cpu")
    params = list(model.parameters())
    norms, seen = [], DTensorOps()
    for i in range(n):
        with seen if i == n - 1 else contextlib.nullcontext():
            norms.append(clip_grad_norm(model, params, 1.0, shard_local))
            opt.step()
    return [x.item() for x in norms], opt, seen.ops


def test_local_path_equals_dtensor_path_and_dispatches_nothing(mesh):
    ref_model, model = Sharded(mesh), Sharded(mesh)
    ref_norms, ref_opt, ref_ops = _steps(ref_model, shard_local=False)
    norms, opt, ops = _steps(model, shard_local=True)
    assert isinstance(opt, ShardLocalAdamW) and not isinstance(ref_opt, ShardLocalAdamW)
    assert ops == [], f"the shard-local step dispatched DTensor ops: {sorted(set(ops))}"
    assert ref_ops, "the DTensor path must dispatch DTensor ops, or the check above proves nothing"
    assert ref_norms[0] > 1.0  # clipping scaled the gradients, so the clip arithmetic is exercised
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), rtol=1e-6, atol=0, msg=name)
        torch.testing.assert_close(p.to_local(), q.to_local(), rtol=1e-6, atol=0, msg=name)
        state = opt.state[p]
        assert isinstance(state["exp_avg"], DTensor) and isinstance(state["exp_avg_sq"], DTensor), name
        assert not torch.equal(p.to_local(), Sharded(mesh).get_parameter(name).to_local()), f"{name} did not move"
