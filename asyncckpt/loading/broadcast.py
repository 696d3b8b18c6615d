"""Resume at scale: a checkpoint opened once per job, not once per rank.

Without this, every rank of a job reads and unpickles the whole `.metadata` (and the checksums
sidecar) from storage on its own: 16,384 ranks x a 3.5 GiB file of a 70B FSDP save is tens of TB
of reads of one object. Here one rank of the load's group (its rank 0) reads them, checks them
(`opened.open_checkpoint`: refused pickles and paths outside the checkpoint fail there), and sends
their bytes to the others a node at a time (metadata_share.py: to one rank of each node over
gloo, inside a node through /dev/shm; the plain gloo broadcast where that cannot be); every other
rank parses the bytes it got and reads nothing of them from storage (on an object store: one
GET of `.metadata` per job). A failure on the reading rank is sent instead, so every
rank raises the same error. A rank that dies meanwhile makes the others raise within the group's
timeout (`LOAD_TIMEOUT_S`, or the checkpointer's own collective timeout for `load_latest`).

Without a process group (or with `no_dist`, or one rank) every rank opens the checkpoint itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..layout import METADATA_FILE
from ..storage import storage_for
from .metadata_share import blob_lengths, cut_blobs, joined_blobs, node_keys, spread_blobs
from .opened import OpenCheckpoint, as_open, opened_from_bytes, require_committed

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0  # the gloo group a load makes when the caller's group is not gloo (NCCL)
_gloo_groups: dict[Any, Any] = {}  # the caller's group -> the gloo group made for it (made once: a collective)


@dataclass(frozen=True)
class LoadGroup:
    """The ranks a load shares its reads with: a gloo group, this rank in it, and its rank 0's global rank."""

    pg: Any
    rank: int
    size: int
    src: int  # the global rank of the group's rank 0, the one that reads

    @property
    def is_reader(self) -> bool:
        return self.rank == 0


def load_group(process_group: Any = None, no_dist: bool = False) -> Optional[LoadGroup]:
    """The group a load's shared reads go through (None: this process loads alone). A gloo
    group is used as it is; for any other (NCCL) a gloo group over the same ranks is made once."""
    if no_dist or not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(process_group) <= 1:
        return None
    pg = process_group if process_group is not None else dist.group.WORLD
    if "gloo" not in str(dist.get_backend(pg)):
        if pg not in _gloo_groups:
            _gloo_groups[pg] = dist.new_group(
                ranks=dist.get_process_group_ranks(pg), backend="gloo", timeout=timedelta(seconds=LOAD_TIMEOUT_S),
                use_local_synchronization=True,  # the ranks of `pg` make it, not every rank of the job
            )
        pg = _gloo_groups[pg]
    return LoadGroup(pg, dist.get_rank(pg), dist.get_world_size(pg), dist.get_global_rank(pg, 0))


def broadcast_blobs(blobs: Optional[Sequence[Optional[bytes]]], count: int, group: LoadGroup, what: str) -> list[Optional[bytes]]:
    """The reading rank's `count` blobs (None allowed) on every rank of `group`: one collective
    for their lengths, one for their bytes. CheckpointError naming `what` if a rank failed or died."""
    lengths = torch.full((count,), -1, dtype=torch.int64)
    if group.is_reader:
        lengths = torch.tensor(blob_lengths(blobs), dtype=torch.int64)
    try:
        dist.broadcast(lengths, src=group.src, group=group.pg)
        total = int(lengths.clamp(min=0).sum())
        payload = joined_blobs(blobs) if group.is_reader else torch.empty(max(total, 1), dtype=torch.uint8)
        if total:
            dist.broadcast(payload, src=group.src, group=group.pg)
    except Exception as exc:  # gloo: a peer gone, or the group's timeout
        raise CheckpointError(f"{what}: the broadcast from rank {group.src} failed ({type(exc).__name__}: {exc})") from None
    if group.is_reader:
        return list(blobs)
    return cut_blobs(memoryview(payload.numpy()), lengths.tolist())


_ERROR_KINDS = {b"C": CheckpointError, b"O": OSError}


def open_shared(path: str | OpenCheckpoint, *, trusted: bool = False, group: Optional[LoadGroup] = None) -> OpenCheckpoint:
    """`path` opened as `opened.open_checkpoint` does, its `.metadata` and sidecar read from
    storage by the group's rank 0 only and sent to the others (a collective: every rank of
    `group` calls it). Raises on every rank what the reading rank's open raised."""
    if isinstance(path, OpenCheckpoint):
        return path
    if group is None:
        log.debug("opening %s on this rank alone (no process group to share its %s through)", path, METADATA_FILE)
        return as_open(path, trusted=trusted)
    storage = storage_for(path)
    blobs: Optional[list[Optional[bytes]]] = None
    opened = None
    if group.is_reader:
        try:
            require_committed(path, storage)
            data = storage.read_bytes(storage.join(path, METADATA_FILE))
            opened = opened_from_bytes(path, storage, data, trusted)
            sidecar_file = opened.sidecar_file
            sidecar = _read_or_none(storage, sidecar_file)  # unreadable: each rank fails as it would alone, when it reads
            opened._sidecar_bytes = sidecar
            blobs = [None, data, sidecar_file.encode() if sidecar_file else None, sidecar]
        except Exception as exc:
            kind = b"C" if isinstance(exc, CheckpointError) else b"O" if isinstance(exc, OSError) else b"?"
            _spread([kind + str(exc).encode(), None, None, None], group, f"opening {path}")
            raise
    error, data, sidecar_file, sidecar = _spread(blobs, group, f"opening {path}")
    if error is not None:
        message = error[1:].decode(errors="replace")
        raise _ERROR_KINDS.get(error[:1], CheckpointError)(message if error[:1] != b"?" else f"rank {group.src}: {message}")
    if opened is None:
        opened = opened_from_bytes(path, storage, data, trusted)
        opened._sidecar_file = sidecar_file.decode() if sidecar_file is not None else None
        opened._sidecar_bytes = sidecar
    return opened


def _spread(blobs: Optional[list[Optional[bytes]]], group: LoadGroup, what: str) -> list[Optional[bytes]]:
    """The reading rank's four blobs on every rank of `group`, a node at a time."""
    return spread_blobs(blobs, 4, group, what, node_keys(group), broadcast_blobs)


def _read_or_none(storage, file: Optional[str]) -> Optional[bytes]:
    if file is None:
        return None
    try:
        return storage.read_bytes(file)
    except OSError:
        return None
