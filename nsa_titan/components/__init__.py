"""Training components: optimizer, LR schedule, metrics, runtime setup, the train step and validation."""

from nsa_titan.components.device_stats import peak_flops_for_device
from nsa_titan.components.lr_scheduler import build_lr_scheduler, lr_factor
from nsa_titan.components.metrics import MetricsLogger
from nsa_titan.components.optimizer import build_optimizer
from nsa_titan.components.runtime import World, resolve_device, seed_everything, world_from_env
from nsa_titan.components.train_step import evaluate, train_step

__all__ = [
    "MetricsLogger",
    "World",
    "build_lr_scheduler",
    "build_optimizer",
    "evaluate",
    "lr_factor",
    "peak_flops_for_device",
    "resolve_device",
    "seed_everything",
    "train_step",
    "world_from_env",
]
