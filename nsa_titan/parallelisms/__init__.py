"""Distribution for training: activation checkpointing -> per-block compile -> data parallelism (FSDP2,
FSDP1, DDP) and the device mesh. The optimizer step (which works under any of them) is
``nsa_titan.components.train_step``; the process group is the trainer's (``components.runtime.init_distributed``).

    dims = ParallelDims.from_config(world_size, job_config.parallelism)
    with torch.device("meta"):
        model = build_model(model_args)
    model = parallelize_nsa(model, dims, job_config, device)   # sharded, initialised, ready to train
"""

from nsa_titan.parallelisms.activation_checkpoint import apply_ac, ratio_block_ids, selective_save_ops
from nsa_titan.parallelisms.compile import CompileCounter, apply_compile, compile_loss
from nsa_titan.parallelisms.data_parallel import early_unshard
from nsa_titan.parallelisms.parallel_dims import ParallelDims
from nsa_titan.parallelisms.parallelize import describe_parallelism, materialize, parallelize_nsa

__all__ = [
    "CompileCounter",
    "ParallelDims",
    "apply_ac",
    "apply_compile",
    "compile_loss",
    "describe_parallelism",
    "early_unshard",
    "materialize",
    "parallelize_nsa",
    "ratio_block_ids",
    "selective_save_ops",
]
