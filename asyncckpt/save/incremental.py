"""Incremental saves, trainer side: the committed checkpoints a save may reuse files of.

Within a run they are this rank's last committed saves (`Continuation`). After a resume
it is read back from the loaded checkpoint's sidecar, which records every tensor's digest; only
entries that agree with its `.metadata` and lie in this rank's own files are trusted. The worker
decides per tensor (worker/rounds.py)."""

from __future__ import annotations

import logging
from typing import Optional

from ..errors import CheckpointError
from ..protocol import IncrementalBase, ItemIndex, ItemWritten
from ..loading.safe_reader import read_metadata
from ..storage import storage_for
from ..loading.verify import committed_save_id, find_sidecar, read_sidecar, sidecar_belongs_to

log = logging.getLogger("asyncckpt")


class Continuation:
    """One checkpointer's incremental state: the committed saves its next save may reuse files of.

    It keeps the last BASES committed directories. A save reuses the files of its own directory's
    save first (a re-save in place: Lightning's last.ckpt, saved again after each top-k
    checkpoint, keeps what did not change where it is), then those of the newest other one (that
    last.ckpt holds exactly the top-k checkpoint just saved: every file is linked from it). Never
    more: removing an older checkpoint (ModelCheckpoint's previous best) waits for no save."""

    BASES = 2

    def __init__(self, enabled: bool, rank: int) -> None:
        self.enabled, self.rank = enabled, rank
        self.bases: list[IncrementalBase] = []  # newest first, one per directory
        self._said: set[str] = set()  # why saves were full (each reason logged once)

    def bases_for(self, step_dir: str) -> tuple[IncrementalBase, ...]:
        """The bases of a save into `step_dir`, in the order the worker tries them (empty: a full
        save, the reason logged once)."""
        if not self.enabled:
            return ()
        own = [base for base in self.bases if base.checkpoint_dir == step_dir]
        others = [base for base in self.bases if base.checkpoint_dir != step_dir]
        if not storage_for(step_dir).supports_links:
            self._say(step_dir, "is a full save: its storage can neither link nor copy files server-side")
            return ()
        if own and current_save_id(step_dir) != own[0].save_id:
            self._say(step_dir, "does not reuse its directory's files: it was saved again by someone else since")
            own = []
        others = others[:1]
        if others and current_save_id(others[0].checkpoint_dir) != others[0].save_id:  # its files may be others now
            self._say(others[0].checkpoint_dir, "is not reused: it was removed or saved again by someone else since")
            others = []
        if not self.bases:
            self._say(step_dir, "is a full save: no committed checkpoint of this run or resumed from yet")
        return (*own, *others)

    def _say(self, directory: str, reason: str) -> None:
        if reason not in self._said:
            self._said.add(reason)
            log.info("incremental save: %s %s", directory, reason)

    def committed(self, step_dir: str, items: tuple[ItemWritten, ...], save_id: Optional[str]) -> None:
        if self.enabled:
            self._newest(IncrementalBase(step_dir, items, save_id))

    def resumed(self, path: str) -> None:
        if self.enabled:
            base = base_from_checkpoint(path, self.rank)
            self.bases = [] if base is None else [base]

    def _newest(self, base: IncrementalBase) -> None:
        others = [b for b in self.bases if b.checkpoint_dir != base.checkpoint_dir]
        self.bases = [base, *others][: self.BASES]


def base_from_checkpoint(path: str, rank: int) -> Optional[IncrementalBase]:
    """What an incremental save may reuse of committed checkpoint `path`; None (logged) when
    nothing: no sidecar, a sidecar without digests, or one that does not match `.metadata`."""
    storage = storage_for(path)
    try:
        metadata = read_metadata(path)
        sidecar_path = find_sidecar(storage, path, metadata)
        if sidecar_path is None:
            raise CheckpointError("it has no checksums sidecar")
        own_files = {i.relative_path for i in (metadata.storage_data or {}).values()
                     if i.relative_path.rpartition("/")[2].startswith(f"__{rank}_")}
        sidecar = read_sidecar(storage, path, sidecar_path, data_files=own_files)  # this rank's part only
        if not sidecar_belongs_to(sidecar, metadata):
            raise CheckpointError(f"{sidecar_path} belongs to another save")
    except (OSError, CheckpointError) as exc:
        log.info("the next save is a full one: cannot continue incrementally from %s: %s", path, exc)
        return None
    stored = metadata.storage_data or {}
    own = f"__{rank}_"
    items = []
    for entry in sidecar.items:
        index = ItemIndex(entry.fqn, tuple(entry.offset) if entry.offset is not None else None)
        info = stored.get(index.to_dcp())
        if (entry.digest is None or not entry.relative_path.rpartition("/")[2].startswith(own) or info is None
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
