"""asyncckpt: asynchronous PyTorch DCP checkpoints written by a persistent worker process.

The public names resolve on first use (PEP 562): the worker process imports `asyncckpt.protocol`,
`formats`, `layout`, `storage` and `errors`, and importing them must not load the trainer side (the
checkpointer and its exit handler, planning, loading) into it.

The folders are the parts: `save/` (the trainer's side of a save), `load/`, `storage/`, `doors/`
(torch DCP, Lightning, Transformers), `cli/`; the worker process is the `asyncckpt_worker`
package. docs/how_it_works.md draws the save and load paths through them.
"""

from __future__ import annotations

import importlib

_PUBLIC = {  # name -> the module that defines it
    "AsyncCheckpointer": "save.checkpointer",
    "CheckpointConfig": "config",
    "CheckpointError": "errors",
    "CheckpointInfo": "loading.load",
    "CheckpointTimeoutError": "errors",
    "PartialLoadError": "errors",
    "ResumeReport": "loading.resume",
    "SaveReport": "report",
    "TrainState": "train_state",
    "WorkerDiedError": "errors",
    "async_save": "doors.torch_dcp",
    "cleanup": "loading.load",
    "latest_checkpoint": "loading.load",
    "list_checkpoints": "loading.load",
    "load": "loading.load",
    "requeue_exit": "save.preemption",
    "verify_checkpoint": "loading.load",
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

