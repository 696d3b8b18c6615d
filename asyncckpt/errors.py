"""Errors raised to the trainer. All subclass Exception, so `except Exception` catches them."""


class CheckpointError(Exception):
    """A save, commit or load failed. The message names the cause (rank, step, file)."""


class WorkerDiedError(CheckpointError):
    """The worker process exited while a save depended on it."""


class CheckpointTimeoutError(CheckpointError):
    """A bounded wait on the worker ran past `timeout_s`."""


class PartialLoadError(CheckpointError):
    """A load failed after it began writing into the caller's tensors: they now hold a mix of
    old and loaded values and must not be trained from."""
