"""The ways of saving a user would otherwise pick: raw write, memcpy, torch.save, DCP (sync, async); and the Method interface."""

from __future__ import annotations

import os
from typing import Any

import torch

from .common import MiB, Skip
from .measure import fsync_path, remove, tensor_bytes_view, tree_bytes
from .state import state_tensors


class Method:
    """One way of saving. `begin` returns when the caller is free; `poll` says durable without
    waiting; `end` waits until durable. Sync methods do everything in `begin`."""

    name = "?"
    sync = True

    def __init__(self, state: dict[str, Any], workdir: str) -> None:
        self.state = state
        self.workdir = workdir
        self.note = ""

    def prepare(self) -> None:
        """Start what the method needs beside the trainer (a server), before the memory baseline;
        raise Skip if it cannot. The processes it starts go in `outside_pids`."""

    def outside_pids(self) -> frozenset[int]:
        """Descendant processes that are not the saving side (left out of the memory figures)."""
        return frozenset()

    def setup(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)

    def warm_up(self) -> None:
        """The one-time work a user can have done before the training loop, after `setup`
        (asyncckpt: `prepare(state)`); none for the others."""

    def begin(self, step: int) -> None:
        raise NotImplementedError

    def poll(self) -> bool:
        return True

    def end(self) -> dict[str, Any]:
        """Wait until durable; return extra figures of this save."""
        return {}

    def output_of(self, step: int) -> str:
        return os.path.join(self.workdir, f"step_{step:06d}")

    def output_size(self, step: int) -> int:
        """Bytes one save wrote."""
        out = self.output_of(step)
        return tree_bytes(out) if out else 0

    def discard(self, step: int) -> None:
        """Delete what one save wrote."""
        out = self.output_of(step)
        if out:
            remove(out)

    def check_first(self, step: int) -> None:
        """Called once after the first save: raise Skip if the output is not what was asked."""

    def teardown(self) -> None:
        pass


class RawWrite(Method):
    """Sequential write of the tensor bytes into one file, fsync'd: the disk ceiling."""

    name = "raw_write"

    def begin(self, step: int) -> None:
        path = self.output_of(step)
        with open(path, "wb", buffering=16 * MiB) as f:
            for t in state_tensors(self.state):
                f.write(tensor_bytes_view(t))
            f.flush()
            os.fsync(f.fileno())


class Memcpy(Method):
    """Copy of every tensor into buffers allocated once and reused: the copy ceiling.

    The first save also faults the buffer's pages in (cold copy); later saves are warm. It copies
    with asyncckpt's own staging copy (worker/staging.py, `StagingPool.copy_in`) in this process,
    with the eager-staging thread count: the same copy, without the worker hand-off, so "blocked /
    memcpy" is what the hand-off and planning cost on top."""

    name = "memcpy"

    def setup(self) -> None:
        from asyncckpt.config import eager_staging_threads
        from asyncckpt_worker.staging import StagingPool

        tensors = state_tensors(self.state)
        total = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)
        self.slab = torch.empty(total, dtype=torch.uint8)  # not yet faulted in
        self.views, offset = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            self.views.append(self.slab[offset : offset + n].view(t.dtype).view(t.shape))
            offset += -(-n // 64) * 64  # 64-byte aligned, like the staging pool
        self.threads = eager_staging_threads()
        self.copier = StagingPool()
        self.note = f"{self.threads} thread(s)"

    def begin(self, step: int) -> None:
        saved = torch.get_num_threads()
        torch.set_num_threads(1)  # as in the worker: each copy on one torch thread
        try:
            self.copier.copy_in(state_tensors(self.state), self.views, self.threads)
        finally:
            torch.set_num_threads(saved)

    def output_of(self, step: int) -> str:
        return ""

    def teardown(self) -> None:
        if getattr(self, "copier", None) is not None:
            self.copier.close()
            self.copier = None
        self.views, self.slab = [], None


class TorchSave(Method):
    """torch.save of the whole state into one file, then fsync."""

    name = "torch.save+fsync"

    def begin(self, step: int) -> None:
        path = self.output_of(step)
        torch.save(self.state, path)
        fsync_path(path)
        fsync_path(self.workdir)


class DcpSave(Method):
    """Synchronous torch.distributed.checkpoint.save without a process group."""

    name = "dcp.save"

    def begin(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, checkpoint_id=self.output_of(step))


class DcpAsync(Method):
    """dcp.async_save in THREAD mode, or PROCESS mode with a reused CPU-safe DefaultStager."""

    sync = False

    def __init__(self, state, workdir, process: bool, with_group: bool = False) -> None:
        super().__init__(state, workdir)
        self.process = process
        self.with_group = with_group
        self.name = "dcp.async_save " + ("process" if process else "thread") + ("+gloo" if with_group else "")
        self.stager = None
        self.future = None

    def setup(self) -> None:
        super().setup()
        if self.with_group:
            start_single_rank_group(os.path.join(self.workdir, "pg_store"))
        if self.process:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            options = StagingOptions(
                use_pinned_memory=False, use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=False
            )
            self.stager = DefaultStager(options)

    def begin(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        kwargs = {"async_stager": self.stager} if self.stager is not None else {}
        response = dcp.async_save(
            self.state, checkpoint_id=self.output_of(step), async_checkpointer_type=kind, **kwargs
        )
        staging = getattr(response, "staging_completion", None)
        if staging is not None:  # AsyncSaveResponse: the caller is free once staging completes
            staging.result()
        self.future = getattr(response, "upload_completion", response)

    def poll(self) -> bool:
        return self.future is None or self.future.done()

    def end(self) -> dict[str, Any]:
        if self.future is not None:
            future, self.future = self.future, None
            future.result()
        return {}

    def teardown(self) -> None:
        if self.future is not None:
            try:
                self.future.result()
            except BaseException:
                pass
        if self.stager is not None:
            self.stager.close()
        if self.with_group:
            stop_dcp_daemon()
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def start_single_rank_group(store_path: str) -> None:
    """A one-rank gloo process group (file store), which DCP's PROCESS mode insists on."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise Skip("a process group is already initialized")
    store = dist.FileStore(store_path, 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def stop_dcp_daemon() -> None:
    """End DCP's checkpoint daemon process so it does not linger into later methods (DCP keeps
    it in a private module global for the life of the trainer)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    daemon = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if daemon is not None:
        executor._CHECKPOINT_PROCESS = None
        daemon.__del__()  # sends TERMINATE, joins, terminates if needed
