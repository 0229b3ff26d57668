"""Distribution for training: activation checkpointing -> per-block compile -> data parallelism (FSDP2,
FSDP1, DDP), the device mesh, and the data-parallel optimizer step.

    dims = ParallelDims.from_config(world_size, job_config.parallelism)
    with torch.device("meta"):
        model = build_model(model_args)
    model = parallelize_nsa(model, dims, job_config, device)   # sharded, initialised, ready to train
"""

from nsa_titan.parallelisms.activation_checkpoint import apply_ac, ratio_block_ids, selective_save_ops
from nsa_titan.parallelisms.compile import CompileCounter, apply_compile
from nsa_titan.parallelisms.parallel_dims import ParallelDims
from nsa_titan.parallelisms.parallelize import describe_parallelism, materialize, parallelize_nsa
from nsa_titan.parallelisms.train_step import clip_grad_norm, forward_backward, full_param_shapes, train_step

__all__ = [
    "CompileCounter",
    "ParallelDims",
    "apply_ac",
    "apply_compile",
    "clip_grad_norm",
    "describe_parallelism",
    "forward_backward",
    "full_param_shapes",
    "materialize",
    "parallelize_nsa",
    "ratio_block_ids",
    "selective_save_ops",
    "train_step",
]
