"""The commit: turn finished writes into a checkpoint that exists.

Order matters and is the whole guarantee: data files are fsynced by the writers; here the
checksums sidecar is published, the directory synced, then `.metadata` is published atomically
(that is the commit), then `latest` moves, then retention runs.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .formats import CHECKSUMS_FILE, ItemChecksum, encode_checksums, is_data_file
from .loading import LATEST_FILE, METADATA_FILE, list_checkpoints, read_latest_marker, read_metadata
from .errors import CheckpointError
from .protocol import ItemWritten, WriteDone
from .ranks import RankGroup
from .storage import Storage

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
    total_bytes: int = 0
    commit_s: float = 0.0


@dataclass(frozen=True)
class SaveTarget:
    root: Optional[str]
    step: Optional[int]
    name: Optional[str]  # step directory name in `root`; None: a directory the caller named (no latest, no retention)
    step_dir: str
    metadata: Optional[Metadata]  # the global metadata; the coordinator's is the one used
    file_tag: str = ""  # set when the save replaces a committed checkpoint of the same step
    owns_dir: bool = True  # the save created the directory: a failed save removes it whole


def finish_save(
    group: RankGroup, storage: Storage, target: SaveTarget, outcome: RankOutcome, fsync: bool, keep_last: Optional[int]
) -> Verdict:
    """Collective: gather every rank's outcome; the coordinator commits if all succeeded, else
    removes the uncommitted directory; every rank gets the same verdict."""
    outcomes = group.gather(outcome)
    verdict = None
    if group.is_coordinator:
        verdict = _decide(storage, target, outcomes, fsync, keep_last)
    return group.broadcast(verdict)


def _decide(storage: Storage, target: SaveTarget, outcomes: list[RankOutcome], fsync: bool, keep_last) -> Verdict:
    failures = [o for o in outcomes if o.error is not None]
    what = f"step {target.step}" if target.name is not None else target.step_dir
    if failures:
        discard_uncommitted(storage, target.step_dir, target.file_tag, target.owns_dir)
        return Verdict(False, "; ".join(f"rank {o.rank}: {o.error}" for o in failures))
    started = time.perf_counter()
    written = [item for o in outcomes for item in o.written.items]
    try:
        commit_checkpoint(storage, target.step_dir, target.metadata, written, fsync)
    except Exception as exc:  # any failure here must reach every rank through the verdict
        discard_uncommitted(storage, target.step_dir, target.file_tag, target.owns_dir)
        return Verdict(False, f"{what}: commit failed in {target.step_dir}: {exc!r}")
    if target.name is not None:
        try:
            move_latest(storage, target.root, target.name, fsync)
        except Exception as exc:
            log.error("%s is committed but `latest` could not be moved to it (it still names an older one): %r",
                      target.step_dir, exc)
    try:
        if target.file_tag:
            remove_replaced_files(storage, target.step_dir, written)
        if target.name is not None:
            apply_retention(storage, target.root, keep_last)
    except Exception as exc:
        log.warning("after committing %s: removing replaced files / retention failed: %r", target.step_dir, exc)
    total = sum(o.written.bytes_written for o in outcomes)
    return Verdict(True, None, total, time.perf_counter() - started)


def discard_uncommitted(storage: Storage, step_dir: str, file_tag: str = "", owns_dir: bool = True) -> None:
    """Remove what a failed save wrote; it was never committed, so nothing can depend on it.
    A save that was replacing a committed checkpoint removes only its own (tagged) files; one into
    a directory it did not create removes only data files, then the directory if that left it empty."""
    try:
        if not storage.is_dir(step_dir):
            return
        if not storage.exists(storage.join(step_dir, METADATA_FILE)):
            if owns_dir:
                storage.remove_tree(step_dir)
                return
            for name in storage.list_dir(step_dir):
                if is_data_file(name) or name == CHECKSUMS_FILE:
                    storage.remove_file(storage.join(step_dir, name))
            storage.remove_empty_dir(step_dir)
        elif file_tag:  # the committed checkpoint stays; so do files its .metadata names (ours, if
            used = _referenced_files(step_dir)  # the commit failed after publishing it)
            for name in storage.list_dir(step_dir):
                if is_data_file(name, tag=file_tag) and name not in used:
                    storage.remove_file(storage.join(step_dir, name))
    except (OSError, CheckpointError) as exc:
        log.warning("could not remove uncommitted files in %s: %s", step_dir, exc)


def _referenced_files(step_dir: str) -> set[str]:
    return {info.relative_path for info in (read_metadata(step_dir).storage_data or {}).values()}


def remove_replaced_files(storage: Storage, step_dir: str, written: list[ItemWritten]) -> None:
    """After a save replaced a committed checkpoint: delete the data files of the old one."""
    current = {w.relative_path for w in written}
    for name in storage.list_dir(step_dir):
        if is_data_file(name) and name not in current:
            storage.remove_file(storage.join(step_dir, name))


def commit_checkpoint(
    storage: Storage, step_dir: str, metadata: Metadata, written: list[ItemWritten], fsync: bool
) -> None:
    """Write the sidecar and `.metadata` for a save whose data files are all durable."""
    storage_data = {w.index: _StorageInfo(w.relative_path, w.offset, w.length) for w in written}
    save_id = uuid.uuid4().hex
    final = dataclasses.replace(
        metadata,
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=step_dir, save_id=save_id),
        version=DCP_VERSION,
    )
    checksums = [
        ItemChecksum(
            w.index.fqn,
            tuple(w.index.offset) if w.index.offset is not None else None,
            w.relative_path,
            w.offset,
            w.length,
            w.crc32,
        )
        for w in written
        if w.crc32 is not None
    ]
    sidecar = storage.join(step_dir, CHECKSUMS_FILE)
    if checksums:
        storage.write_atomic(sidecar, encode_checksums(checksums, save_id), fsync=fsync)
    elif storage.exists(sidecar):  # a re-save without checksums: the old ones describe other files
        storage.remove_file(sidecar)
    if fsync:
        storage.sync_dir(step_dir)  # every data file's entry is durable before the commit
    storage.write_atomic(storage.join(step_dir, METADATA_FILE), pickle.dumps(final), fsync=fsync)


def move_latest(storage: Storage, root: str, step_dir_name: str, fsync: bool) -> None:
    storage.write_atomic(storage.join(root, LATEST_FILE), f"{step_dir_name}\n".encode(), fsync=fsync)


def apply_retention(storage: Storage, root: str, keep_last: int | None) -> list[str]:
    """Delete committed checkpoints beyond the newest `keep_last`. Uncommitted (in-flight or torn)
    directories are never touched here, nor is the one `latest` names. Returns deleted names."""
    if keep_last is None:
        return []
    committed = [c for c in list_checkpoints(root, storage) if c.committed]
    protected = read_latest_marker(root, storage)
    deleted = []
    for info in committed[: max(len(committed) - keep_last, 0)]:
        if info.name == protected or not storage.is_dir(info.path):  # re-checked: never through a symlink
            continue
        # un-commit first, so a crash mid-delete leaves a torn directory, never a broken checkpoint
        storage.remove_file(storage.join(info.path, METADATA_FILE))
        storage.remove_tree(info.path)
        deleted.append(info.name)
    if deleted:
        log.debug("retention removed %s", ", ".join(deleted))
    return deleted

