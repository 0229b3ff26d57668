"""Where logged scalars go besides the console and metrics.jsonl: TensorBoard and Weights & Biases, both optional.

Each sink takes ``scalar(name, value, step)`` and ``close()``; ``open_sinks`` makes the ones the [metrics] section
asks for (rank 0 only: the logger calls it there). wandb runs offline by default (``metrics.wandb_mode``): these
machines have no network, and an offline run is synced later with ``wandb sync <dump_folder>/wandb/...``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


class TensorBoardSink:
    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional

        self.writer = SummaryWriter(log_dir=str(folder / "tb"))

    def scalar(self, name: str, value: float, step: int) -> None:
        self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, folder: Path, metrics_cfg: Any, run_config: dict[str, Any] | None):
        import wandb  # noqa: PLC0415 - optional

        self.run = wandb.init(project=metrics_cfg.wandb_project, name=metrics_cfg.wandb_run_name,
                              mode=metrics_cfg.wandb_mode, dir=str(folder), config=run_config or {})

    def scalar(self, name: str, value: float, step: int) -> None:
        self.run.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_sinks(metrics_cfg: Any, folder: Path, run_config: dict[str, Any] | None,
               warn: Callable[[str], None]) -> list[Any]:
    sinks: list[Any] = []
    if metrics_cfg.enable_tensorboard:
        try:
            sinks.append(TensorBoardSink(folder))
        except ImportError as e:
            warn(f"WARNING: metrics.enable_tensorboard is set but TensorBoard is unavailable ({e}); "
                 "logging to console/JSONL only")
    if getattr(metrics_cfg, "enable_wandb", False):
        sinks.append(WandbSink(folder, metrics_cfg, run_config))  # the config refused it when wandb is missing
    return sinks
