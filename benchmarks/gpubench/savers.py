"""The ways of saving the GPU benchmark compares: asyncckpt's checkpointer (eager, lazy, process
io), its `async_save` door, and `torch.distributed.checkpoint.async_save` with its default stager
and with a pinned-memory DefaultStager in process mode."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from savebench.common import Skip
from savebench.measure import remove
from savebench.methods import start_single_rank_group, stop_dcp_daemon

from .state import state_tensors

LABELS = {  # the save methods, by their --methods name
    "eager": "asyncckpt eager",
    "lazy": "asyncckpt lazy",
    "process": "asyncckpt process",
    "async_save": "asyncckpt.async_save",
    "dcp": "dcp.async_save",
    "dcp_pinned": "dcp.async_save pinned, process",
}
OURS = ("eager", "lazy", "process", "async_save")


@dataclass
class Call:
    """What the caller saw of one save's call."""

    call_s: float  # the call itself
    blocked_s: float  # until the state may change (lazy: + wait_staged; a staging future: + its wait)


class Saver:
    """One way of saving, from `open` (its constructor: a checkpointer, a stager) to `close`.
    `save` returns once the caller may change the state; `wait_durable` once the save is committed.
    Every wait is bounded by `timeout_s`."""

    label = "?"

    def __init__(self, state: dict[str, Any], workdir: str, timeout_s: float) -> None:
        self.state = state
        self.workdir = workdir
        self.timeout_s = timeout_s
        self.note = ""

    def open(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)

    def save(self, step: int) -> Call:
        raise NotImplementedError

    def wait_durable(self) -> None:
        raise NotImplementedError

    def poll(self) -> None:
        """What a training loop calls every step (asyncckpt: commit a save whose writes ended)."""

    def path(self, step: int) -> str:
        """The checkpoint directory of `step`."""
        return os.path.join(self.workdir, f"step_{step:08d}")

    def discard(self, step: int) -> None:
        remove(self.path(step))

    def close(self) -> None:
        """Stop what `open` started (waiting for a save in flight)."""


def _config(timeout_s: float, **kwargs: Any):
    """A CheckpointConfig with `kwargs`, every wait (staging, writes, the worker's start) bounded by `timeout_s`."""
    from asyncckpt import CheckpointConfig

    return CheckpointConfig(timeout_s=timeout_s, worker_start_timeout_s=timeout_s, **kwargs)


class Checkpointer(Saver):
    """asyncckpt's AsyncCheckpointer: the default configuration but for `variant` (and the bounds)."""

    def __init__(self, state, workdir, timeout_s, label: str, variant: dict[str, Any]) -> None:
        super().__init__(state, workdir, timeout_s)
        self.label = label
        self.variant = variant
        self.ckpt = None

    def open(self) -> None:
        from asyncckpt import AsyncCheckpointer

        super().open()
        self.ckpt = AsyncCheckpointer(self.workdir, _config(self.timeout_s, **self.variant))

    def save(self, step: int) -> Call:
        start = time.perf_counter()
        self.ckpt.schedule_save(self.state, step)
        call = time.perf_counter() - start
        self.ckpt.wait_staged()  # returns at once in eager mode: schedule_save waited for staging
        return Call(call, time.perf_counter() - start)

    def wait_durable(self) -> None:
        self.ckpt.finalize(blocking=True)

    def poll(self) -> None:
        self.ckpt.finalize()

    def path(self, step: int) -> str:
        from asyncckpt.layout import step_dir_name

        return os.path.join(self.workdir, step_dir_name(step))

    def close(self) -> None:
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            ckpt.close()


class Door(Saver):
    """`asyncckpt.async_save(state, checkpoint_id=...)`, the drop-in for DCP's: it has no
    constructor; its first call starts its worker (`open` only ends an earlier door's)."""

    label = LABELS["async_save"]

    def __init__(self, state, workdir, timeout_s) -> None:
        super().__init__(state, workdir, timeout_s)
        self.future = None

    def open(self) -> None:
        from asyncckpt import torch_dcp

        super().open()
        torch_dcp.shutdown()
        torch_dcp.configure(_config(self.timeout_s))

    def save(self, step: int) -> Call:
        import asyncckpt

        start = time.perf_counter()
        self.future = asyncckpt.async_save(self.state, checkpoint_id=self.path(step))
        elapsed = time.perf_counter() - start
        return Call(elapsed, elapsed)

    def wait_durable(self) -> None:
        future, self.future = self.future, None
        future.result(timeout=self.timeout_s)

    def close(self) -> None:
        from asyncckpt import torch_dcp

        torch_dcp.shutdown()


class DcpAsyncSave(Saver):
    """`dcp.async_save`: THREAD mode with the stager it makes itself (`options` None), or PROCESS
    mode in a one-rank gloo group with a reused DefaultStager built from `options`."""

    def __init__(self, state, workdir, timeout_s, label: str, options: Optional[dict[str, bool]], note: str = "") -> None:
        super().__init__(state, workdir, timeout_s)
        self.label = label
        self.options = options
        self.note = note
        self.stager = None
        self.future = None
        self.group = False

    def open(self) -> None:
        super().open()
        if self.options is None:
            return
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self.options["use_shared_memory"] and os.path.isdir("/dev/shm"):
            need = sum(t.numel() * t.element_size() for t in state_tensors(self.state))
            free = shutil.disk_usage("/dev/shm").free
            if free < 1.1 * need:  # a write past a full /dev/shm is a SIGBUS that ends the benchmark
                raise Skip(f"/dev/shm has {free / 2**30:.1f} GiB free; this stager's shared memory needs "
                           f"{need / 2**30:.1f} GiB")
        start_single_rank_group(os.path.join(self.workdir, "pg_store"))
        self.group = True
        self.stager = DefaultStager(StagingOptions(**self.options))

    def save(self, step: int) -> Call:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kwargs: dict[str, Any] = {}
        if self.stager is not None:
            kwargs = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS, "async_stager": self.stager}
        start = time.perf_counter()
        response = dcp.async_save(self.state, checkpoint_id=self.path(step), **kwargs)
        call = time.perf_counter() - start
        staging = getattr(response, "staging_completion", None)
        if staging is not None:  # AsyncSaveResponse: the caller may change the state once staging completes
            staging.result(timeout=self.timeout_s)
        self.future = getattr(response, "upload_completion", response)
        return Call(call, time.perf_counter() - start)

    def wait_durable(self) -> None:
        future, self.future = self.future, None
        future.result(timeout=self.timeout_s)

    def close(self) -> None:
        try:
            if self.future is not None:  # a save that failed midway: let it end before the next row
                future, self.future = self.future, None
                try:
                    future.result(timeout=self.timeout_s)
                except BaseException:
                    pass
            if self.stager is not None:
                self.stager.close()
        finally:
            if self.group:
                import torch.distributed as dist

                stop_dcp_daemon()
                if dist.is_initialized():
                    dist.destroy_process_group()
                self.group = False


def pinned_stager_options(device: torch.device) -> tuple[dict[str, bool], str]:
    """The DefaultStager options of the pinned peer (torchtitan's async_with_pinned_mem), and what
    the CPU changes: pinning is ignored there and a non-blocking copy needs an accelerator."""
    on_gpu = device.type == "cuda"
    options = dict(use_pinned_memory=True, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=on_gpu)
    note = "pinned, shared, async staging, non-blocking copy"
    return options, note if on_gpu else "pinned (ignored: no GPU), shared, async staging, blocking copy (no GPU)"


def make_saver(name: str, state: dict[str, Any], workdir: str, timeout_s: float, device: torch.device) -> Saver:
    """The Saver of one name of LABELS."""
    variants = {"eager": {}, "lazy": {"staging": "lazy"}, "process": {"io": "process"}}
    if name in variants:
        return Checkpointer(state, workdir, timeout_s, LABELS[name], variants[name])
    if name == "async_save":
        return Door(state, workdir, timeout_s)
    if name == "dcp":
        return DcpAsyncSave(state, workdir, timeout_s, LABELS[name], None, "thread mode, its default stager")
    if name == "dcp_pinned":
        options, note = pinned_stager_options(device)
        return DcpAsyncSave(state, workdir, timeout_s, LABELS[name], options, note)
    raise ValueError(f"unknown save method {name!r}; known: {', '.join(LABELS)}")
