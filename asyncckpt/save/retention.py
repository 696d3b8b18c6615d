"""Removing what finished saves made obsolete: the files a re-save replaced, sidecars of other
saves, checkpoints beyond `keep_last`, what a failed save wrote (with several ranks; one rank
removes it before raising, see commit._failed), and multipart uploads failed saves left open.

It runs on one background thread of the coordinator's checkpointer, after the verdict is
broadcast: deleting a large checkpoint on a slow store must not hold up the commit's collectives
(every rank waits there, under a timeout). A directory a save is writing into is never touched:
the save claims it first, and a claim waits (bounded) for a deletion of that directory under way.
Before it deletes anything, and again before each checkpoint it removes, it confirms that the job
still holds the folder (job_lock.py): the checkpoints of a job that took it over are not ours to remove.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from ..errors import CheckpointError, CheckpointTimeoutError
from ..layout import SIDECAR_NAME, is_checksums_part, is_data_file, list_files, remove_empty_data_folders
from ..loading.load import unreferenced_files, uploads_left_open
from ..layout import LOCK_FILE, METADATA_FILE, list_checkpoints, read_latest_marker
from ..storage import Storage, is_remote, storage_for
from .disk_space import DiskSpaceWarning

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tidy:
    """What to clear up after one save ended."""

    root: Optional[str]  # set for ROOT/step_N saves: retention and the upload sweep cover the root
    step_dir: str
    replaced: bool = False  # the save replaced a committed checkpoint of its step: its old files go
    keep_last: Optional[int] = None
    committed: bool = True  # False: the save failed
    discard: bool = False  # remove the failed save's files here (see commit._failed)
    file_tag: str = ""  # as in commit.SaveTarget, for that removal
    owns_dir: bool = True
    checkpoint_bytes: int = 0  # what the committed save added to the disk (the disk-space warning compares with it)


class Janitor:
    """Runs `Tidy` jobs in order on one daemon thread (started by the first job).
    `confirm_owner(path)` raises CheckpointError once this job no longer holds the folder of `path`."""

    def __init__(self, confirm_owner: Optional[Callable[[str], None]] = None) -> None:
        self._confirm_owner = confirm_owner
        self._cond = threading.Condition()
        self._jobs: collections.deque[Tidy] = collections.deque()
        self._running = False  # a job is being worked on
        self._claimed: Optional[str] = None  # the step directory a save is writing into
        self._busy: Optional[str] = None  # the directory being deleted from right now
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._disk_space = DiskSpaceWarning()

    def claim(self, step_dir: str, timeout_s: float) -> None:
        """A save is about to write into `step_dir`: keep retention out of it until `finished`."""
        with self._cond:
            self._claimed = step_dir
            if not self._cond.wait_for(lambda: self._busy != step_dir, timeout_s):
                raise CheckpointTimeoutError(f"{step_dir} is still being deleted by retention after {timeout_s:.1f}s")

    def finished(self, tidy: Optional[Tidy]) -> None:
        """The claiming save is over (committed or not); `tidy` is what its commit made obsolete."""
        with self._cond:
            self._claimed = None
            if tidy is None:
                return
            self._jobs.append(tidy)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="asyncckpt-retention", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` for the queued jobs to end; whether they did."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._running, timeout_s)

    def close(self, timeout_s: float) -> None:
        """At the checkpointer's close: wait at most `timeout_s`, then log and move on. The
        thread ends once it has nothing left to do (a daemon: the process's exit does not wait)."""
        if not self.wait(timeout_s):
            log.warning("retention still running after %.1fs (%d jobs queued); not waiting for it", timeout_s, len(self._jobs))
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._running = True
            try:
                self._tidy(job)
            except Exception as exc:
                log.warning("after committing %s: removing replaced files / retention failed: %r", job.step_dir, exc)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    @contextlib.contextmanager
    def _deleting(self, path: str) -> Iterator[bool]:
        """Yields whether `path` may be deleted from (no save claims it); claims wait meanwhile."""
        with self._cond:
            free = path != self._claimed
            if free:
                self._busy = path
        if not free:
            log.debug("retention: skipping %s: a save is writing into it", path)
            yield False
            return
        try:
            yield True
        finally:
            with self._cond:
                self._busy = None
                self._cond.notify_all()

    def _still_ours(self, path: str) -> bool:
        """Whether this job still holds the folder of `path` (asked right before deleting there)."""
        try:
            if self._confirm_owner is not None:
                self._confirm_owner(path)
            return True
        except CheckpointError as exc:
            log.error("not removing anything in %s: %s", path, exc)
            return False

    def _tidy(self, job: Tidy) -> None:
        if not self._still_ours(job.root or job.step_dir):
            return
        try:
            self._abort_stale_uploads(job)
        except OSError as exc:  # e.g. the store still unreachable: the next commit tries again
            log.warning("after %s: could not abort multipart uploads left open: %s", job.step_dir, exc)
        if not job.committed:
            with self._deleting(job.step_dir) as free:  # not free: a new save is writing there
                if free and job.discard:
                    discard_uncommitted(storage_for(job.step_dir), job.step_dir, job.file_tag, job.owns_dir)
            return
        if job.replaced:
            with self._deleting(job.step_dir) as free:
                if free:
                    remove_replaced_files(storage_for(job.step_dir), job.step_dir)
        if job.keep_last is None:
            self._disk_space.after_commit(job.root, job.checkpoint_bytes)
            return
        storage = storage_for(job.root)
        for path in retention_candidates(storage, job.root, job.keep_last):
            with self._deleting(path) as free:
                # re-checked now that no save can claim it: a re-save may have just committed it
                # (and made it `latest`); is_dir: never through a symlink
                if not free or path not in retention_candidates(storage, job.root, job.keep_last):
                    continue
                if not self._still_ours(path):
                    return
                if storage.is_dir(path):
                    # un-commit first, so a crash mid-delete leaves a torn directory, never a broken checkpoint
                    storage.remove_file(storage.join(path, METADATA_FILE))
                    storage.remove_tree(path)
                    log.debug("retention removed %s", path)


    def _abort_stale_uploads(self, job: Tidy) -> None:
        """Abort multipart uploads our failed saves left open (a writer cut off from the store
        could not abort its own). After a failed save: those in its own directory. After a
        commit: those in any step directory of the root (or the save's own directory) that
        started before this commit's `.metadata` was written (the store's clock), so leftovers
        of any earlier save, whatever its step, go once the store is reachable again.
        Never in a directory a save of ours is writing into (claimed): every rank starts a
        save's uploads only after the coordinator claimed its directory."""
        storage = storage_for(job.step_dir)
        scope = job.root if job.committed and job.root is not None else job.step_dir
        found = uploads_left_open(storage.open_uploads(scope), job.step_dir, job.root if job.committed else None)
        if not found:
            return
        before = None
        if job.committed:
            before = storage.modified_time(storage.join(job.step_dir, METADATA_FILE))
            if before is None:
                log.warning("not aborting uploads left open in %s: the commit's time is unknown", scope)
                return
        for directory, uploads in sorted(found.items()):
            with self._deleting(directory) as free:
                if not free:
                    continue
                for upload in uploads:
                    # <=: stores keep these times to the second, so a leftover begun in the second of
                    # the commit counts (a save writing now has its directory claimed: skipped above)
                    if before is None or (upload.initiated is not None and upload.initiated <= before):
                        storage.abort_upload(upload)
                        log.info("aborted the multipart upload of %s left open by a failed save", upload.path)


def discard_uncommitted(storage: Storage, step_dir: str, file_tag: str = "", owns_dir: bool = True) -> None:
    """Remove what a failed save wrote; it was never committed, so nothing can depend on it.
    A save that was replacing a committed checkpoint removes only its own (tagged) files; one into
    a directory it did not create, or that holds this job's lock, removes only data files, then the
    directory if that left it empty (a locked one when its lock goes)."""
    try:
        if not storage.is_dir(step_dir):
            return
        if not storage.exists(storage.join(step_dir, METADATA_FILE)):
            if owns_dir and not storage.exists(storage.join(step_dir, LOCK_FILE)):  # (locked: job_lock.folder_to_lock)
                storage.remove_tree(step_dir)
                return
            for name in list_files(storage, step_dir):
                if is_data_file(name) or SIDECAR_NAME.match(name):
                    storage.remove_file(storage.join(step_dir, name))
            remove_empty_data_folders(storage, step_dir)
            storage.remove_empty_dir(step_dir)
        elif file_tag:  # the committed checkpoint stays; so do the files it uses (ours, if the
            for name in unreferenced_files(step_dir, list_files(storage, step_dir)):  # commit failed after publishing it)
                if is_data_file(name, tag=file_tag) or is_checksums_part(name, tag=file_tag):
                    storage.remove_file(storage.join(step_dir, name))
            remove_empty_data_folders(storage, step_dir)
    except (OSError, CheckpointError) as exc:
        log.warning("could not remove uncommitted files in %s: %s", step_dir, exc)


@dataclass
class ReadyDirectory:
    """What readying a save's directory found, filled in as it goes (read after a failure too)."""

    created: bool = False  # the save makes the directory it names (a failed save may remove all of it)
    in_our_folder: bool = False  # the folder checks passed: it is not another job's
    overwrite: bool = False  # (the coordinator) a committed checkpoint is there: it is replaced at commit


def ready_directory(ready: ReadyDirectory, storage: Storage, step_dir: str, named: bool, write: bool, group, folders,
                    janitor: "Janitor", config) -> None:
    """Ready a save's directory before anything is written (schedule_save, and a preempted close's
    write of a memory-only save): the folder must be this job's (`folders`, the coordinator's
    FolderLocks; a directory the caller names takes its folder), and for a save that writes
    (`write`): no symlink, retention kept out of it, the directory made and proved writable, and
    whether a committed checkpoint is there. `named`: ROOT/step_N. Raises on the first problem."""
    ready.created = not named and write and not is_dir_or_unknown(storage, step_dir)  # (before a lock in it)
    if group.is_coordinator:
        folders.check(step_dir)
        if not named:
            folders.take_folder_of(step_dir, config.fsync)
    ready.in_our_folder = True
    if not write:  # (a memory-only save writes nothing there)
        return
    if storage.is_symlink(step_dir):
        raise CheckpointError(f"{step_dir!r} is a symlink; refusing to write a checkpoint through it")
    janitor.claim(step_dir, config.timeout_s)
    if group.is_coordinator or not is_remote(step_dir):  # (no probe per rank in one S3 prefix)
        storage.prepare_dir(step_dir, config.fsync)  # proves it writable first; its entry durable
    ready.overwrite = group.is_coordinator and storage.exists(storage.join(step_dir, METADATA_FILE))


def raise_start_failure(
    group, problem: Optional[Exception], label: str, step_dir: str, owns_dir: bool, in_our_folder: bool
) -> None:
    """Some rank could not start the save: every rank raises, naming the ranks and causes.
    The directory prepared for it goes too, unless it holds a committed checkpoint or the
    folder is another job's (its save may be writing there)."""
    problems = group.all_gather(None if problem is None else str(problem))
    storage = storage_for(step_dir)
    if group.is_coordinator and in_our_folder and not storage.is_symlink(step_dir):
        discard_uncommitted(storage, step_dir, owns_dir=owns_dir)
    causes = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None)
    if group.size == 1 and problem is not None:
        raise problem
    raise CheckpointError(f"{label} not started: {causes}")


def remove_replaced_files(storage: Storage, step_dir: str) -> None:
    """After a save replaced a committed checkpoint: delete the data files and sidecar of the old one
    (whatever the committed `.metadata` does not name)."""
    for name in unreferenced_files(step_dir, list_files(storage, step_dir)):
        storage.remove_file(storage.join(step_dir, name))
        log.debug("removed %s of a replaced save of %s", name, step_dir)
    remove_empty_data_folders(storage, step_dir)


def retention_candidates(storage: Storage, root: str, keep_last: int) -> list[str]:
    """Committed checkpoints beyond the newest `keep_last`, never the one `latest` names.
    Uncommitted (in-flight or torn) directories are not candidates."""
    committed = [c for c in list_checkpoints(root, storage) if c.committed]
    protected = read_latest_marker(root, storage)
    return [c.path for c in committed[: max(len(committed) - keep_last, 0)] if c.name != protected]


def is_dir_or_unknown(storage, path: str) -> bool:
    """Whether a named directory exists already (a failed save never removes it whole, see
    discard_uncommitted); True when unknown."""
    try:
        return storage.is_dir(path)
    except OSError:
        return True
