"""An eager stand-in for compile.step_graph's CUDA capture (components/step_graph.cuda_capture), for CPU tests.

Same contract: ``capture(fn) -> (outputs, replay, release)``, recording the step without running it. Each replay
runs the step again against the learning rate tensors the param groups held at capture, which is what the
graph's AdamW kernel reads; the outputs are copied into the tensors the capture returned."""

from __future__ import annotations

import torch


def stand_in(optimizer: torch.optim.Optimizer):
    def capture(fn):
        captured_lrs = [g["lr"] for g in optimizer.param_groups]
        assert all(isinstance(lr, torch.Tensor) for lr in captured_lrs)
        outputs = (torch.zeros(()), torch.zeros(()))

        def replay():
            floats = [g["lr"] for g in optimizer.param_groups]
            for g, lr in zip(optimizer.param_groups, captured_lrs):
                g["lr"] = lr
            try:
                for o, r in zip(outputs, fn()):
                    o.copy_(r)
            finally:
                for g, lr in zip(optimizer.param_groups, floats):
                    g["lr"] = lr

        return outputs, replay, lambda: None

    return capture
