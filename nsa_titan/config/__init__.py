"""Job configuration: TOML sections as dataclasses, command-line overrides, validation, --help."""

from nsa_titan.config.job_config import (
    ActivationCheckpoint,
    Compile,
    Data,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Training,
    job_config_to_dict,
    load_inference_config,
    load_job_config,
)
from nsa_titan.config.manager import ConfigError, config_to_toml, format_help

__all__ = [
    "ActivationCheckpoint",
    "Compile",
    "ConfigError",
    "Data",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Training",
    "config_to_toml",
    "format_help",
    "job_config_to_dict",
    "load_inference_config",
    "load_job_config",
]
