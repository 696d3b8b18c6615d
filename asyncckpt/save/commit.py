"""The commit: turn finished writes into a checkpoint that exists.

Order matters and is the whole guarantee: data files are fsynced by the writers; here the
checksums sidecar is published, the directory synced, then `.metadata` is published atomically
(that is the commit), the root synced, then `latest` moves. What the commit made obsolete (files
of a replaced save, checkpoints beyond keep_last), and with several ranks what a failed save
wrote, is removed afterwards, off the collective path (retention.py). The verdict says what is on disk: once `.metadata` is in place the save is
committed, even if making it durable then failed (logged as an ERROR).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..formats import ItemChecksum, encode_checksums
from ..layout import sidecar_file
from ..layout import LATEST_FILE, METADATA_FILE
from ..protocol import ItemWritten, WriteDone
from .ranks import RankGroup
from .retention import Janitor, Tidy, discard_uncommitted
from ..storage import Storage

log = logging.getLogger(__name__)

DCP_VERSION = "1.0.0"


@dataclass(frozen=True)
class RankOutcome:
    """How one rank's part of a save ended: its write results, or the error that stopped it."""

    rank: int
    written: Optional[WriteDone] = None
    error: Optional[str] = None


@dataclass(frozen=True)
class Verdict:
    """The coordinator's decision, broadcast to every rank."""

    committed: bool
    error: Optional[str] = None
    total_bytes: int = 0  # the checkpoint's size
    commit_s: float = 0.0
    written_bytes: int = 0  # of it, written by this save (incremental saves link the rest)
    save_id: Optional[str] = None  # the committed `.metadata`'s StorageMeta.save_id


@dataclass(frozen=True)
class SaveTarget:
    root: Optional[str]
    step: Optional[int]
    name: Optional[str]  # step directory name in `root`; None: a directory the caller named (no latest, no retention)
    step_dir: str
    metadata: Optional[Metadata]  # the global metadata; the coordinator's is the one used
    file_tag: str = ""  # set when the save replaces a committed checkpoint of the same step, or links files (incremental)
    owns_dir: bool = True  # the save created the directory: a failed save removes it whole
    replaces: bool = False  # (agreed by every rank) a committed checkpoint was in the directory: its files go after ours commits
    save_id: Optional[str] = None  # the memory tier's id of the save: its `.metadata` records it (None: a fresh uuid)
    memory_only: bool = False  # staged into the memory tier only: nothing to commit


@dataclass(frozen=True)
class Decision:
    """The coordinator's verdict and what to tidy once every rank has it."""

    verdict: Verdict
    tidy: Optional[Tidy] = None


def finish_save(
    group: RankGroup, storage: Storage, target: SaveTarget, outcome: RankOutcome, fsync: bool,
    keep_last: Optional[int], janitor: Janitor,
) -> Verdict:
    """Collective: gather every rank's outcome; the coordinator commits if all succeeded; every
    rank gets the same verdict. What to remove (a failed save's files, replaced files, retention)
    is handed to `janitor` after the broadcast (see `_failed` for a single rank's failed save)."""
    # the coordinator's own outcome stays here: gather_object pads every rank's message to the
    # largest, so sending it would make every rank send as much as the coordinator writes (DDP:
    # all of it; docs/benchmark.md, "Scale")
    outcomes = group.gather(RankOutcome(outcome.rank) if group.is_coordinator else outcome)
    if outcomes is not None:
        outcomes[0] = outcome
    decision = None
    if group.is_coordinator:
        decision = _decide(storage, target, outcomes, fsync, keep_last)
    verdict = group.broadcast(decision.verdict if decision is not None else None)
    janitor.finished(decision.tidy if decision is not None else None)
    return verdict


def _naming_rank(outcome: RankOutcome) -> str:
    """A rank's error, prefixed with its rank unless it says it already (a worker's death does)."""
    prefix = f"rank {outcome.rank}: "
    return outcome.error if outcome.error.startswith(prefix) else prefix + outcome.error


def _decide(storage: Storage, target: SaveTarget, outcomes: list[RankOutcome], fsync: bool, keep_last) -> Decision:
    failures = [o for o in outcomes if o.error is not None]
    what = f"step {target.step}" if target.name is not None else target.step_dir
    root = target.root if target.name is not None else None
    if failures:
        return _failed(storage, target, "; ".join(_naming_rank(o) for o in failures), len(outcomes) > 1)
    if target.memory_only:  # every rank holds it in memory; nothing on disk changes
        return Decision(Verdict(True))
    started = time.perf_counter()
    written = [item for o in outcomes for item in o.written.items]
    try:
        save_id = commit_checkpoint(storage, target, written, fsync)
    except Exception as exc:  # any failure here must reach every rank through the verdict
        return _failed(storage, target, f"{what}: commit failed in {target.step_dir}: {exc!r}", len(outcomes) > 1)
    if target.name is not None:
        try:
            move_latest(storage, target.root, target.name, fsync)
        except Exception as exc:
            log.error("%s is committed but `latest` could not be moved to it (it still names an older one): %r",
                      target.step_dir, exc)
    total = sum(o.written.bytes_written for o in outcomes)
    written_now = total - sum(o.written.bytes_linked for o in outcomes)
    retention = keep_last if target.name is not None else None
    tidy = Tidy(root, target.step_dir, target.replaces, retention)
    return Decision(Verdict(True, None, total, time.perf_counter() - started, written_now, save_id), tidy)


def _failed(storage: Storage, target: SaveTarget, error: str, ranks_wait: bool) -> Decision:
    """A failed save's files go: on the retention thread when other ranks wait for this verdict
    (deleting on a slow store must not outlast their collective timeout), else at once, so they
    are gone when the error is raised. Its multipart uploads left open go on that thread too."""
    if not ranks_wait:
        discard_uncommitted(storage, target.step_dir, target.file_tag, target.owns_dir)
    root = target.root if target.name is not None else None
    tidy = Tidy(root, target.step_dir, committed=False, discard=ranks_wait, file_tag=target.file_tag,
                owns_dir=target.owns_dir)
    return Decision(Verdict(False, error), tidy)


def commit_checkpoint(storage: Storage, target: SaveTarget, written: list[ItemWritten], fsync: bool) -> str:
    """Write the sidecar and `.metadata` for a save whose data files are all durable. Returns its
    save id once `.metadata` is in place (the save is committed); raises only when it is not.

    A save replacing a committed checkpoint writes its sidecar under its own name
    (`.checksums.<save_id>.json`), so the committed checkpoint keeps a matching sidecar until
    the new `.metadata` replaces the old one."""
    step_dir = target.step_dir
    storage_data = {w.index.to_dcp(): _StorageInfo(w.relative_path, w.offset, w.length) for w in written}
    save_id = target.save_id or uuid.uuid4().hex
    final = dataclasses.replace(
        target.metadata,
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=step_dir, save_id=save_id),
        version=DCP_VERSION,
    )
    checksums = [
        ItemChecksum(
            w.index.fqn,
            w.index.offset,
            w.relative_path,
            w.offset,
            w.length,
            w.crc32,
            w.digest,
        )
        for w in written
        if w.crc32 is not None
    ]
    sidecar = storage.join(step_dir, sidecar_file(save_id if target.file_tag else None))
    if checksums:
        storage.write_atomic(sidecar, encode_checksums(checksums, save_id), fsync=fsync)
    elif not target.file_tag:  # nothing is committed here: a leftover sidecar would describe other files
        storage.remove_file(sidecar)
    metadata_path, payload = storage.join(step_dir, METADATA_FILE), pickle.dumps(final)
    try:
        if fsync:
            for folder in sorted({w.relative_path.rpartition("/")[0] for w in written} - {""}):  # data folders
                storage.sync_dir(storage.join(step_dir, folder))
            storage.sync_dir(step_dir)  # every data file's entry is durable before the commit
        storage.write_atomic(metadata_path, payload, fsync=fsync)
    except Exception as exc:
        if not _holds(storage, metadata_path, payload):
            if target.file_tag:  # our sidecar beside the checkpoint that stays committed
                _remove_quietly(storage, sidecar)
            raise
        log.error("%s: %s is in place, so the save is committed, but making it durable failed: %r; "
                  "it may not survive a power loss", step_dir, METADATA_FILE, exc)
    if fsync:
        parent = os.path.dirname(step_dir.rstrip("/")) or "."  # the root, for ROOT/step_N
        try:
            storage.sync_dir(parent)  # the checkpoint directory's own entry
        except OSError as exc:
            log.error("%s is committed, but syncing %s failed: %r; it may not survive a power loss",
                      step_dir, parent, exc)
    return save_id


def _holds(storage: Storage, path: str, payload: bytes) -> bool:
    """Whether the file at `path` is exactly `payload` (each save's `.metadata` is unique: save_id)."""
    try:
        return storage.exists(path) and storage.read_bytes(path) == payload
    except OSError:
        return False


def _remove_quietly(storage: Storage, path: str) -> None:
    try:
        storage.remove_file(path)
    except OSError as exc:
        log.warning("could not remove %s: %r", path, exc)


def move_latest(storage: Storage, root: str, step_dir_name: str, fsync: bool) -> None:
    storage.write_atomic(storage.join(root, LATEST_FILE), f"{step_dir_name}\n".encode(), fsync=fsync)
