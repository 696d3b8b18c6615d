"""Incremental saves, trainer side: the committed checkpoint a save continues from.

Within a run it is this rank's last committed save (kept by AsyncCheckpointer). After a resume
it is read back from the loaded checkpoint's sidecar, which records every tensor's digest; only
entries that agree with its `.metadata` and lie in this rank's own files are trusted. The worker
decides per tensor (worker/rounds.py)."""

from __future__ import annotations

import logging
from typing import Optional

from torch.distributed.checkpoint.metadata import MetadataIndex

from .errors import CheckpointError
from .protocol import IncrementalBase, ItemWritten
from .safe_reader import read_metadata
from .storage import storage_for
from .verify import committed_save_id, find_sidecar, read_sidecar, sidecar_belongs_to

log = logging.getLogger("asyncckpt")


def base_from_checkpoint(path: str, rank: int) -> Optional[IncrementalBase]:
    """What an incremental save may reuse of committed checkpoint `path`; None (logged) when
    nothing: no sidecar, a sidecar without digests, or one that does not match `.metadata`."""
    storage = storage_for(path)
    try:
        metadata = read_metadata(path)
        sidecar_path = find_sidecar(storage, path, metadata)
        if sidecar_path is None:
            raise CheckpointError("it has no checksums sidecar")
        sidecar = read_sidecar(storage, path, sidecar_path)
        if not sidecar_belongs_to(sidecar, metadata):
            raise CheckpointError(f"{sidecar_path} belongs to another save")
    except (OSError, CheckpointError) as exc:
        log.info("the next save is a full one: cannot continue incrementally from %s: %s", path, exc)
        return None
    stored = metadata.storage_data or {}
    own = f"__{rank}_"
    items = []
    for entry in sidecar.items:
        index = MetadataIndex(entry.fqn, entry.offset)
        info = stored.get(index)
        if (entry.digest is None or not entry.relative_path.startswith(own) or info is None
                or (info.relative_path, info.offset, info.length) != (entry.relative_path, entry.start, entry.length)):
            continue
        items.append(ItemWritten(index, entry.relative_path, entry.start, entry.length, entry.crc32, entry.digest))
    if not items:
        log.info("the next save is a full one: %s records no tensor digests of rank %d", path, rank)
        return None
    return IncrementalBase(path, tuple(items), committed_save_id(metadata))


def current_save_id(path: str) -> Optional[str]:
    """The save id of the checkpoint committed in `path` now (None: none, or unreadable)."""
    try:
        return committed_save_id(read_metadata(path))
    except (OSError, CheckpointError):
        return None
