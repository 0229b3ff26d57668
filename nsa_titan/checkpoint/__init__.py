"""Checkpoints that lose nothing: DCP save/resume of model, optimizer, LR schedule, train state, data-loader
position and RNG states; atomic, pruned, optionally asynchronous; plus a model-only safetensors export.

    ckpt = CheckpointManager(job_config.checkpoint, dump_folder=..., rank=r, world_size=w, model_args=...)
    ckpt.bind(model=..., optimizer=..., scheduler=..., loader=..., train_state=TrainState(), device=...)
    ckpt.load()                       # newest complete checkpoint (or the named one); None: fresh start
    ckpt.maybe_save(step, last=...)   # every checkpoint.interval steps and at the end
"""

from nsa_titan.checkpoint.folder import MARKER, inspect_checkpoint, list_checkpoints, step_dir_name
from nsa_titan.checkpoint.manager import CheckpointManager
from nsa_titan.checkpoint.state import TrainState, capture_host_state, restore_host_state

__all__ = [
    "MARKER",
    "CheckpointManager",
    "TrainState",
    "capture_host_state",
    "inspect_checkpoint",
    "list_checkpoints",
    "restore_host_state",
    "step_dir_name",
]
