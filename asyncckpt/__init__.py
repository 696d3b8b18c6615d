"""asyncckpt: asynchronous PyTorch DCP checkpoints written by a persistent worker process.

The public names resolve on first use (PEP 562): the worker process imports `asyncckpt.protocol`,
`formats`, `storage` and `errors`, and importing them must not load the trainer side (the
checkpointer and its exit handler, planning, loading) into it.
"""

from __future__ import annotations

import importlib

_PUBLIC = {  # name -> the module that defines it
    "AsyncCheckpointer": "checkpointer",
    "CheckpointConfig": "config",
    "CheckpointError": "errors",
    "CheckpointInfo": "loading",
    "CheckpointTimeoutError": "errors",
    "PartialLoadError": "errors",
    "ResumeReport": "resume",
    "SaveReport": "report",
    "WorkerDiedError": "errors",
    "async_save": "torch_dcp",
    "cleanup": "loading",
    "latest_checkpoint": "loading",
    "list_checkpoints": "loading",
    "load": "loading",
    "verify_checkpoint": "loading",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

