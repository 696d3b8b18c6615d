"""asyncckpt: asynchronous PyTorch DCP checkpoints written by a persistent worker process."""

from .checkpointer import AsyncCheckpointer
from .report import SaveReport
from .config import CheckpointConfig
from .errors import CheckpointError, CheckpointTimeoutError, WorkerDiedError
from .loading import CheckpointInfo, cleanup, latest_checkpoint, list_checkpoints, load, verify_checkpoint

__all__ = [
    "AsyncCheckpointer",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointTimeoutError",
    "SaveReport",
    "WorkerDiedError",
    "cleanup",
    "latest_checkpoint",
    "list_checkpoints",
    "load",
    "verify_checkpoint",
]
