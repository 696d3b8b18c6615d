"""The memory tier in the worker: the staging slab is the file (staging.py makes it a named file
in memory_dir); this module keeps the record after it (asyncckpt/memory_file.py) true.

Before a save touches the slab the copy is marked incomplete; once its staging ended (and
`Staged` went out) every item's CRC32C is computed and the header and footer are written: the
copy is complete. A worker whose trainer died lets the save under way finish staging and seal it
(bounded) before it exits, so the newest staged save survives the trainer (`hold_for_exit`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Optional, Sequence

import torch

from asyncckpt.formats import crc32c
from asyncckpt.memory_file import COMPLETE_AT, FOOTER_BYTES, Footer, StoredItem, encode_header, incomplete_flag
from asyncckpt.protocol import TENSOR, ItemSpec, MemorySave, MemoryTier

from .replicas import Replicator
from .staging import StagingPool

log = logging.getLogger("asyncckpt.worker")


class TrainerGone(Exception):
    """The trainer died before this save began: it is not started (the last copy stays complete)."""


def reserve(fd: int, offset: int, nbytes: int, path: str, step: int) -> None:
    """Reserve the room for the copy's objects, header and footer before writing them: on a full
    tmpfs this is ENOSPC here, naming the mount, the bytes needed and free (never a SIGBUS later)."""
    try:
        os.posix_fallocate(fd, offset, max(nbytes, 1))
    except OSError as exc:
        room = os.statvfs(os.path.dirname(path))
        raise OSError(exc.errno, f"the memory tier cannot seal its copy of step {step}: {os.path.dirname(path)} has "
                      f"{room.f_bavail * room.f_frsize / 2**20:.1f} MiB free, its objects and header need "
                      f"{nbytes / 2**20:.1f} MiB ({exc.strerror})") from None


class TierFile:
    def __init__(self, settings: MemoryTier, rank: int, trainer_pid: int, pool: StagingPool) -> None:
        self.settings = settings
        self.rank = rank
        self.trainer_pid = trainer_pid
        self.pool = pool
        self._state = threading.Condition()
        self._busy = False  # a save is between begin() and seal()/abandon()
        self._exiting = False
        self.replicator = Replicator(settings, rank) if settings.replication is not None else None

    def begin(self) -> None:
        """A save is about to touch the slab: the copy there is no longer complete."""
        with self._state:
            if self._exiting:
                raise TrainerGone("the trainer is gone; this save is not started")
            self._busy = True
        if self.replicator is not None:
            self.replicator.abandon()  # the copy being sent is about to change
        slab = self.pool.share()
        if slab is not None:
            size = os.fstat(slab.fd).st_size
            if size >= slab.size + FOOTER_BYTES:
                footer = size - FOOTER_BYTES
                os.pwrite(slab.fd, incomplete_flag() + os.getpid().to_bytes(4, "little"), footer + COMPLETE_AT)

    def seal(self, memory: MemorySave, plan: bytes, items: Sequence[ItemSpec], views: Sequence[Optional[torch.Tensor]],
             objects: dict[int, bytes]) -> None:
        """Every byte of the save is staged: write its objects, header and footer (complete)."""
        try:
            slab = self.pool.share()
            at = slab.size
            stored, blobs = [], []
            for pos, spec in enumerate(items):
                if spec.kind == TENSOR:
                    view = views[pos]
                    offset = view.data_ptr() - slab.base if spec.nbytes else 0
                    data = view.reshape(-1).view(torch.uint8).numpy() if spec.nbytes else b""
                    stored.append(StoredItem(offset, spec.nbytes, crc32c(data) if spec.nbytes else 0))
                else:
                    blob = objects[pos]
                    stored.append(StoredItem(at, len(blob), crc32c(blob)))
                    blobs.append(blob)
                    at += len(blob)
            header = encode_header({
                "root": self.settings.root, "rank": self.rank, "world_size": self.settings.world_size,
                "step": memory.step, "token": memory.token, "memory_only": memory.memory_only,
                "trainer_pid": self.trainer_pid, "worker_pid": os.getpid(), "host": socket.gethostname(),
                "sealed_at": time.time(), "plan": plan.decode(), "root_id": memory.root_id,
                "base": None if memory.base_step is None else [memory.base_step, memory.base_token],
            }, stored)
            footer = Footer(True, os.getpid(), at, len(header), crc32c(header)).encode()
            reserve(slab.fd, slab.size, at + len(header) + len(footer) - slab.size, self.settings.path, memory.step)
            os.ftruncate(slab.fd, at + len(header) + len(footer))  # the footer ends the file (an older one was longer)
            os.pwrite(slab.fd, b"".join(blobs) + header, slab.size)
            os.pwrite(slab.fd, footer, at + len(header))
            self.pool.publish_slab()  # a fresh slab file replaces the previous copy only now, sealed
            if self.replicator is not None:
                self.replicator.push(memory.step, memory.token)
        finally:
            self._done()

    def abandon(self) -> None:
        """The save failed before it was staged whole: its copy stays incomplete (never used)."""
        self._done()

    def _done(self) -> None:
        with self._state:
            self._busy = False
            self._state.notify_all()

    def hold_for_exit(self) -> bool:
        """The trainer died: start no save, let the one staging now seal and reach its peers (at
        most hold_s in all). True when no save nor push is left under way."""
        deadline = time.monotonic() + self.settings.hold_s
        with self._state:
            self._exiting = True
            if not self._state.wait_for(lambda: not self._busy, self.settings.hold_s):
                return False
        return self.replicator is None or self.replicator.finish(max(0.0, deadline - time.monotonic()))
