"""The commit: turn finished writes into a checkpoint that exists.

Order matters and is the whole guarantee: data files are fsynced by the writers, and with several
ranks each rank publishes the checksums of its items beside them (its part: the coordinator
gathers no checksums); here the checksums sidecar is published, the directory synced, then
`.metadata` is published atomically (that is the commit), the root synced, then `latest` moves.
What the commit made obsolete (files of a replaced save, checkpoints beyond keep_last), and with
several ranks what a failed save wrote, is removed afterwards, off the collective path
(retention.py). The verdict says what is on disk: once `.metadata` is in place the save is
committed, even if making it durable then failed (logged as an ERROR). Right before `.metadata`
and before `latest` the coordinator confirms that its job still holds the folder (job_lock.py): a
job that lost it publishes nothing more and deletes nothing.

`.metadata` is assembled from bytes (metadata_bytes.py): the plan's head, pickled once, and each
rank's entries, encoded by that rank and sent only when they changed since its last committed
save, so a steady save's coordinator writes again the image it kept, with a new tail
(docs/benchmark.md, "Scale").
"""

from __future__ import annotations

import logging
import os
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import CheckpointError
from ..formats import ChecksumsPart, ItemChecksum, crc32c, encode_checksums
from ..layout import LATEST_FILE, METADATA_FILE, checksums_part_file, sidecar_file
from ..protocol import WriteDone
from .metadata_bytes import EntriesPlan, MetadataHead, MetadataImage, build_image, encode_entries
from .ranks import RankGroup
from .retention import Janitor, Tidy, discard_uncommitted
from ..storage import Storage

log = logging.getLogger(__name__)


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
    entries_plan: Optional[EntriesPlan]  # how its `.metadata` is put together (the coordinator's holds the head)
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


@dataclass(frozen=True)
class RankShare:
    """What a rank sends the coordinator at the commit. On a steady save (its entries as in its
    last committed save) a few numbers: no item, no checksum (docs/benchmark.md, "Scale")."""

    rank: int
    error: Optional[str] = None
    entries: Optional[bytes] = None  # its `.metadata` entries (metadata_bytes); None: as in its last committed save
    entries_crc: int = 0  # of its entries, sent or not: the coordinator checks what it kept
    head_crc: int = 0  # of the head its entries refer to: the coordinator checks it is the one it writes
    checksums: Optional[ChecksumsPart] = None  # its checksums part (several ranks)
    bytes_written: int = 0
    bytes_linked: int = 0


@dataclass
class CommitMemory:
    """What the next commit reuses, kept from committed saves: on every rank its own encoded
    entries; on the coordinator the image of its last `.metadata` (the plan's head, every rank's
    entries)."""

    own_entries: Optional[bytes] = None
    image: Optional[MetadataImage] = None


def _no_folder_taken(path: str) -> None:
    """The ownership check where no folder is taken for a job (simulations, benchmarks)."""


def finish_save(
    group: RankGroup, storage: Storage, target: SaveTarget, outcome: RankOutcome, fsync: bool,
    keep_last: Optional[int], janitor: Janitor, memory: CommitMemory,
    confirm_owner: Callable[[str], None] = _no_folder_taken,
) -> Verdict:
    """Collective: gather every rank's share; the coordinator commits if all succeeded; every
    rank gets the same verdict. What to remove (a failed save's files, replaced files, retention)
    is handed to `janitor` after the broadcast (see `_failed` for a single rank's failed save).
    `confirm_owner(path)` raises CheckpointError when this job no longer holds the folder of `path`."""
    own_part = group.size > 1 and not group.is_coordinator
    share, entries = rank_share(storage, target, outcome, fsync, memory, own_part)
    # the coordinator's own share stays here: gather_object pads every rank's message to the
    # largest, so sending it would make every rank send as much as the coordinator writes (DDP:
    # all of it; docs/benchmark.md, "Scale")
    shares = group.gather(RankShare(share.rank) if group.is_coordinator else share)
    decision = None
    if group.is_coordinator:
        shares[0] = share
        decision = _decide(storage, target, outcome, shares, fsync, keep_last, memory, confirm_owner)
    verdict = group.broadcast(decision.verdict if decision is not None else None)
    if not verdict.committed:  # the next save sends its entries whole: nothing stale is ever assumed
        memory.own_entries = None
    elif entries is not None:
        memory.own_entries = entries
    janitor.finished(decision.tidy if decision is not None else None)
    return verdict


def rank_share(storage: Storage, target: SaveTarget, outcome: RankOutcome, fsync: bool, memory: CommitMemory,
           own_part: bool) -> tuple[RankShare, Optional[bytes]]:
    """This rank's share, and its encoded entries: sent unless unchanged since its last committed
    save. With `own_part` (a rank other than the coordinator) its checksums are published here."""
    if outcome.error is not None:
        return RankShare(outcome.rank, error=outcome.error), None
    if target.memory_only:
        return RankShare(outcome.rank), None
    written = outcome.written
    try:  # any failure here must reach every rank through the verdict, not stop this one before the gather
        refs = target.entries_plan.refs
        entries = encode_entries(written.items, refs)
    except Exception as exc:
        return RankShare(outcome.rank, error=f"could not encode its .metadata entries: {exc!r}"), None
    try:
        part = _publish_part(storage, target, outcome.rank, written.items, fsync) if own_part else None
    except Exception as exc:  # an object store's last failure need not be an OSError
        return RankShare(outcome.rank, error=f"could not publish its checksums in {target.step_dir}: {exc!r}"), None
    try:
        if fsync:
            _sync_data_folders(storage, target, written.items)
    except Exception as exc:
        return RankShare(outcome.rank, error=f"could not sync its data folder in {target.step_dir}: {exc!r}"), None
    sent = None if entries == memory.own_entries else entries
    share = RankShare(outcome.rank, None, sent, zlib.crc32(entries), refs.head_crc, part, written.bytes_written,
                      written.bytes_linked)
    return share, entries


def _publish_part(storage: Storage, target: SaveTarget, rank: int, items, fsync: bool) -> Optional[ChecksumsPart]:
    checksums = _checksums(items)
    if not checksums:
        return None
    folder = items[0].relative_path.rpartition("/")[0]  # beside its (first) data file
    name = checksums_part_file(rank, target.file_tag, folder)
    data = encode_checksums(checksums, None)
    storage.write_atomic(storage.join(target.step_dir, name), data, fsync=fsync)
    return ChecksumsPart(name, len(data), crc32c(data), tuple(sorted({c.relative_path for c in checksums})))


def _sync_data_folders(storage: Storage, target: SaveTarget, items) -> None:
    """This rank's data folders (prefix spreading; an in-place incremental save may keep reused
    files in an older one): every file's entry is durable before the commit. Files right in the
    step directory are covered by the coordinator's sync of it."""
    for folder in sorted({item.relative_path.rpartition("/")[0] for item in items} - {""}):
        storage.sync_dir(storage.join(target.step_dir, folder))


def _checksums(items) -> list[ItemChecksum]:
    return [
        ItemChecksum(w.index.fqn, w.index.offset, w.relative_path, w.offset, w.length, w.crc32, w.digest)
        for w in items
        if w.crc32 is not None
    ]


def _naming_rank(share: RankShare) -> str:
    """A rank's error, prefixed with its rank unless it says it already (a worker's death does)."""
    prefix = f"rank {share.rank}: "
    return share.error if share.error.startswith(prefix) else prefix + share.error


def _decide(storage: Storage, target: SaveTarget, own: RankOutcome, shares: list[RankShare], fsync: bool,
            keep_last, memory: CommitMemory, confirm_owner: Callable[[str], None]) -> Decision:
    failures = [s for s in shares if s.error is not None]
    what = f"step {target.step}" if target.name is not None else target.step_dir
    root = target.root if target.name is not None else None
    if failures:
        return _failed(storage, target, "; ".join(_naming_rank(s) for s in failures), len(shares) > 1, confirm_owner)
    if target.memory_only:  # every rank holds it in memory; nothing on disk changes
        return Decision(Verdict(True))
    lost = _ownership_lost(confirm_owner, target.step_dir)
    if lost is not None:  # the folder is another job's now: no commit, and nothing of it deleted
        return Decision(Verdict(False, f"{what}: {lost}"))
    started = time.perf_counter()
    if all(s.entries is not None for s in shares):  # nothing kept is needed: free it before building anew
        memory.image = None
    try:
        image = _image_of(target.entries_plan.head, shares, memory.image)
        parts = [s.checksums for s in shares if s.checksums is not None]
        save_id = commit_checkpoint(storage, target, image, _checksums(own.written.items), parts, fsync)
    except Exception as exc:  # any failure here must reach every rank through the verdict
        return _failed(storage, target, f"{what}: commit failed in {target.step_dir}: {exc!r}", len(shares) > 1,
                       confirm_owner)
    memory.image = image
    if target.name is not None:
        lost = _ownership_lost(confirm_owner, target.root)
        if lost is not None:  # its .metadata is in place, but `latest` and retention are the new holder's
            return Decision(Verdict(False, f"{what}: {target.step_dir} has its {METADATA_FILE}, but `latest` "
                                           f"was not moved to it and nothing was removed: {lost}"))
        try:
            move_latest(storage, target.root, target.name, fsync)
        except Exception as exc:
            log.error("%s is committed but `latest` could not be moved to it (it still names an older one): %r",
                      target.step_dir, exc)
    total = sum(s.bytes_written for s in shares)
    written_now = total - sum(s.bytes_linked for s in shares)
    retention = keep_last if target.name is not None else None
    tidy = Tidy(root, target.step_dir, target.replaces, retention, checkpoint_bytes=written_now)
    return Decision(Verdict(True, None, total, time.perf_counter() - started, written_now, save_id), tidy)


def _image_of(head: MetadataHead, shares: list[RankShare], kept: Optional[MetadataImage]) -> MetadataImage:
    """The `.metadata` image of this save: the kept one while the plan and every rank's entries
    are those of the last committed save (a steady save), else one built from the entries sent
    and those kept."""
    for share in shares:
        if share.head_crc != head.crc:  # its fqns would name other tensors: a bug, never a bad file
            raise RuntimeError(f"rank {share.rank} encoded its .metadata entries for another plan")
        known = kept.ranks.get(share.rank) if kept is not None else None
        if share.entries is None and (known is None or known.crc != share.entries_crc):  # a bug, never a bad file
            raise RuntimeError(f"rank {share.rank} sent no .metadata entries and the coordinator keeps none that match")
    if kept is not None and head is kept.head and len(kept.ranks) == len(shares) and \
            all(share.entries is None for share in shares):
        return kept
    return build_image(head, {share.rank: (share.entries_crc, share.entries if share.entries is not None
                                           else kept.entries(share.rank)) for share in shares})


def _ownership_lost(confirm_owner: Callable[[str], None], path: str) -> Optional[str]:
    try:
        confirm_owner(path)
    except CheckpointError as exc:
        return str(exc)
    return None


def _failed(storage: Storage, target: SaveTarget, error: str, ranks_wait: bool,
            confirm_owner: Callable[[str], None]) -> Decision:
    """A failed save's files go: on the retention thread when other ranks wait for this verdict
    (deleting on a slow store must not outlast their collective timeout), else at once, so they
    are gone when the error is raised. Its multipart uploads left open go on that thread too.
    Nothing goes when the folder is another job's now (its save may be writing that directory)."""
    if not ranks_wait:  # (else the retention thread confirms it before it deletes)
        lost = _ownership_lost(confirm_owner, target.step_dir)
        if lost is not None:
            return Decision(Verdict(False, f"{error}; {lost}"))
        discard_uncommitted(storage, target.step_dir, target.file_tag, target.owns_dir)
    root = target.root if target.name is not None else None
    tidy = Tidy(root, target.step_dir, committed=False, discard=ranks_wait, file_tag=target.file_tag,
                owns_dir=target.owns_dir)
    return Decision(Verdict(False, error), tidy)


def commit_checkpoint(
    storage: Storage, target: SaveTarget, image: MetadataImage, checksums: list[ItemChecksum],
    parts: list[ChecksumsPart], fsync: bool,
) -> str:
    """Write the sidecar and `.metadata` for a save whose data files (and checksums parts) are all
    durable. Returns its save id once `.metadata` is in place (the save is committed); raises
    only when it is not.

    A save replacing a committed checkpoint writes its sidecar under its own name
    (`.checksums.<save_id>.json`), so the committed checkpoint keeps a matching sidecar until
    the new `.metadata` replaces the old one."""
    step_dir = target.step_dir
    save_id = target.save_id or uuid.uuid4().hex
    sidecar = storage.join(step_dir, sidecar_file(save_id if target.file_tag else None))
    if checksums or parts:
        storage.write_atomic(sidecar, encode_checksums(checksums, save_id, parts), fsync=fsync)
    elif not target.file_tag:  # nothing is committed here: a leftover sidecar would describe other files
        storage.remove_file(sidecar)
    metadata_path, metadata = storage.join(step_dir, METADATA_FILE), image.with_tail(step_dir, save_id)
    try:
        if fsync:
            storage.sync_dir(step_dir)  # every data file's entry is durable before the commit (ranks sync their folders)
        storage.write_atomic(metadata_path, metadata, fsync=fsync)
    except Exception as exc:
        if not _holds(storage, metadata_path, metadata.view()):
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


def _holds(storage: Storage, path: str, payload: memoryview) -> bool:
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
