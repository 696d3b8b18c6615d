"""One job per checkpoint folder: two jobs saving into one root would overwrite each other's
checkpoints, each reporting its saves as committed. So a checkpointer takes its root for its job
when it is constructed (and, for a save into a directory it names, the folder holding that
directory, or the directory itself in a shared folder such as /tmp: `folder_to_lock`, at the first
such save), and a second job gets a CheckpointError naming the holder.

- Local and shared filesystems: `FOLDER/.asyncckpt.lock`, held with `flock` until release (the
  kernel releases it when the process dies, so a crashed job never blocks its restart). The file
  records the holder; the last process to let go removes it.
- Object stores: a lease object `FOLDER/.asyncckpt.lock` recording the holder and an expiry,
  renewed while the job runs, written only with a conditional PUT. It is taken over once expired,
  by the same job id (a restart), or when its holder was a process of this host that is gone.

The processes of one job share a folder (ranks saving with `no_dist`, several checkpointers of
one process): a job is named by `job_id()`.

A folder is checked when a save is scheduled and confirmed again (`FolderLocks.confirm`) right
before each write that publishes or deletes: the commit's `.metadata`, `latest`, and each of
retention's deletions. A job that lost its folder meanwhile fails that save naming the new holder
and deletes nothing: the folder is another job's now. What "lost" means:
- flock: the kernel never takes a lock back, so it is lost only when the path no longer names
  the file this job locked (removed or replaced, by hand or by a cleanup script): another job may
  then lock a new file there without seeing this one.
- lease: another job's lease is there; or there is none and ours expired (by our clock) before
  we came back: whoever took it over meanwhile may have saved and let go since.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import time
import uuid
from typing import Optional, Union

from ..errors import CheckpointError
from ..layout import LOCK_FILE
from ..storage import is_remote, storage_for
from .lock_holder import UNRECORDED, Holder, in_use, taken_over
from .lease import Lease
from .mounts import warn_if_flock_is_local

log = logging.getLogger(__name__)

LOCK_WAIT_S = 5.0  # a lock file another process is just writing or removing: how long to try again


def job_id() -> str:
    """The job this process belongs to. ASYNCCKPT_JOB_ID, else torchrun's run id
    (TORCHELASTIC_RUN_ID, unless "none") or SLURM_JOB_ID: they survive a restart, so a restarted
    job takes its object-store leases over at once. Else, in a torch.distributed job, a token its
    ranks share through the default store; else this process alone."""
    for name in ("ASYNCCKPT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name, "")
        if value and value != "none":
            return value
    token = _distributed_job_token()
    return token if token is not None else f"{socket.gethostname()}-{os.getpid()}"


def _distributed_job_token() -> Optional[str]:
    """The first rank to ask sets it in the default group's store; every rank reads the same one
    (a store operation, not a collective: a rank saving alone can ask)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        store = dist.distributed_c10d._get_default_store()
        return "dist-" + store.compare_set("asyncckpt/job", "", uuid.uuid4().hex).decode()
    except Exception as exc:  # a private torch API: without it, each process is its own job
        log.debug("no job token from the default store: %r", exc)
        return None


class FolderLocks:
    """The folders one checkpointer holds for its job, each taken once and kept until `release`."""

    def __init__(self, job: Optional[str] = None) -> None:
        self._job = job  # None: job_id(), asked at the first take
        self._held: dict[str, Union[_FileLock, Lease]] = {}

    def take(self, folder: str, fsync: bool = True, purpose: str = "", for_one_dir: bool = False) -> None:
        """Create `folder` if needed, prove it writable and take it for this job; CheckpointError
        naming the holder if another job has it. `purpose` says what the folder is for, in errors.
        `for_one_dir`: the folder is a checkpoint directory itself (folder_to_lock): the one the
        job saves into now, so such folders taken before (their saves ended) are let go, and
        letting go of one removes it if that left it empty."""
        key = folder.rstrip("/") if is_remote(folder) else os.path.abspath(folder)
        if key in self._held:
            return
        if for_one_dir:
            for old in [k for k, lock in self._held.items() if lock.for_one_dir]:
                self._held.pop(old).release()
        storage = storage_for(folder)
        storage.prepare_dir(folder, fsync)
        if self._job is None:
            self._job = job_id()
        me = Holder(self._job, socket.gethostname(), os.getpid(), time.time())
        what = purpose or f"folder {folder!r}"
        lock = Lease(storage, folder, me, what) if is_remote(folder) else _FileLock(folder, me, what)
        lock.take()
        lock.for_one_dir = for_one_dir
        self._held[key] = lock

    def take_folder_of(self, checkpoint_dir: str, fsync: bool = True) -> None:
        """Take what a save into `checkpoint_dir` takes (folder_to_lock): its folder, or itself."""
        folder = folder_to_lock(checkpoint_dir)
        itself = folder == (checkpoint_dir.rstrip("/") if is_remote(checkpoint_dir) else os.path.abspath(checkpoint_dir))
        what = f"checkpoint directory {checkpoint_dir!r}" if itself else f"the folder of checkpoint {checkpoint_dir!r}"
        self.take(folder, fsync, what, for_one_dir=itself)

    def check(self, path: Optional[str] = None) -> None:
        """CheckpointError if this job is known to no longer hold a folder that holds `path` (None:
        any folder): another job took a lease that expired, or the lock file was removed. Asks the
        store nothing."""
        for key, lock in list(self._held.items()):
            if path is None or _within(path, key):
                lock.check()

    def confirm(self, path: Optional[str] = None) -> None:
        """Ask the filesystem or store now whether this job still holds the folders that hold
        `path` (None: every folder); CheckpointError "... taken over by ..." if not, or if that
        cannot be learnt (the store unreachable). Called right before each publishing write."""
        for key, lock in list(self._held.items()):
            if path is None or _within(path, key):
                lock.confirm()

    def release(self) -> None:
        """Let go of every folder (never raises: the checkpoints are not at stake)."""
        held, self._held = self._held, {}
        for lock in held.values():
            lock.release()


def _within(path: str, folder: str) -> bool:
    path = path.rstrip("/") if is_remote(path) else os.path.abspath(path)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def folder_to_lock(checkpoint_dir: str) -> str:
    """The folder a save into a directory the caller names takes for its job: the folder holding
    that directory (a run's folder, where a trainer keeps its step-N, checkpoint-N or *.ckpt
    directories: two jobs sharing it would replace each other's), unless unrelated jobs share that
    folder (a sticky one such as /tmp, /var/tmp, /dev/shm; the filesystem's root; a bucket's
    root): then the directory itself."""
    if is_remote(checkpoint_dir):
        scheme, rest = checkpoint_dir.split("://", 1)
        rest = rest.rstrip("/")
        return f"{scheme}://{rest.rsplit('/', 1)[0]}" if rest.count("/") > 1 else f"{scheme}://{rest}"
    path = os.path.abspath(checkpoint_dir)
    parent = os.path.dirname(path)
    try:
        shared = parent == os.path.dirname(parent) or bool(os.stat(parent).st_mode & stat.S_ISVTX)
    except OSError:  # not there yet: created for this save, shared by nobody
        shared = False
    return path if shared else parent


class _NoLocks(Exception):
    """The filesystem has no flock (e.g. Lustre mounted without `flock`)."""


class _FileLock:
    """`FOLDER/.asyncckpt.lock` held with flock: exclusive while its record is written, shared
    after, so the other processes of the job can hold it too (another job's process reads the
    record and gives up). A process locking a file that was removed meanwhile starts again."""

    for_one_dir = False  # (FolderLocks.take) the folder is a checkpoint directory: removed at release if empty

    def __init__(self, folder: str, me: Holder, what: str) -> None:
        self.folder, self.path = folder, os.path.join(folder, LOCK_FILE)
        self._me, self._what = me, what
        self._fd: Optional[int] = None
        self._lost: Optional[Holder] = None  # set once the path no longer names our file

    def take(self) -> None:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                if self._try_take():
                    warn_if_flock_is_local(self.folder)
                    return
            except _NoLocks as exc:
                log.warning("%s: cannot lock %s (%s): another job saving there would not be detected",
                            self._what, self.path, exc)
                return
            except OSError as exc:
                raise CheckpointError(f"{self._what}: cannot lock {self.path}: {os.strerror(exc.errno or 0) or exc}") from exc
            if time.monotonic() > deadline:
                raise CheckpointError(f"{self._what}: {self.path} kept changing for {LOCK_WAIT_S:.0f}s; try again")
            time.sleep(0.02)

    def _try_take(self) -> bool:
        """One attempt; False: try again (a holder of this job is writing or removing the file)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            holder = self._lock(fd)
        except BaseException:
            _close(fd)
            raise
        if holder is None or holder.job != self._me.job:
            _close(fd)
            if holder is None:
                return False
            holder_text = "a process that recorded no owner" if holder is UNRECORDED else holder.describe()
            raise in_use(self._what, holder_text, f"stop that job first (its lock, {self.path}, goes when its processes exit)")
        self._fd = fd
        return True

    def _lock(self, fd: int) -> Optional[Holder]:
        """Lock the file open at `fd` shared and return its holder (this process, if it was free);
        None when the file is being written or was removed meanwhile."""
        if _flock(fd, fcntl.LOCK_EX):  # nobody holds it: ours; record who we are, then share it
            if not _same_file(fd, self.path):
                return None
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._me.encode(), 0)
            _give_the_folders_group(fd, self.folder)
            return self._me if _flock(fd, fcntl.LOCK_SH) else None  # None: another process slipped in
        if not _flock(fd, fcntl.LOCK_SH) or not _same_file(fd, self.path):  # its holder is writing it
            return None
        return Holder.decode(os.pread(fd, 4096, 0)) or UNRECORDED

    def check(self) -> None:
        if self._fd is None:  # no flock on this filesystem (a warning said so at the take)
            return
        if self._lost is None and not _same_file(self._fd, self.path):
            self._lost = _recorded_holder(self.path)
        if self._lost is not None:
            how = f"its lock file {self.path} was removed or replaced while this job held it"
            raise taken_over(self._what, self._lost, how)

    confirm = check  # a stat of the path: cheap enough to ask every time

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _flock(fd, fcntl.LOCK_EX) and _same_file(fd, self.path):  # no other process holds it
                os.unlink(self.path)
                if self.for_one_dir:  # a failed save's directory, emptied but for the lock: nothing left behind
                    _remove_if_empty(self.folder)
        except (OSError, _NoLocks) as exc:
            log.warning("releasing %s: %s", self.path, exc)
        finally:
            _close(fd)


def _give_the_folders_group(fd: int, folder: str) -> None:
    """The lock file is 0600, or 0660 in a folder its group may write (a team's folder: another
    member's job must open the file to learn who holds it). Never readable by others."""
    try:
        if os.stat(folder).st_mode & 0o020 and os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o660)
    except OSError as exc:
        log.debug("lock file mode: %s", exc)


def _remove_if_empty(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass


def _recorded_holder(path: str) -> Holder:
    """Who the lock file at `path` names (UNRECORDED: none, or no file), read without locking."""
    try:
        with open(path, "rb") as file:
            return Holder.decode(file.read(4096)) or UNRECORDED
    except OSError:
        return UNRECORDED


def _flock(fd: int, kind: int) -> bool:
    """Take (or convert to) a flock without waiting; False when another process's lock is in the way."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise _NoLocks(os.strerror(exc.errno)) from exc
        raise


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` still names the file open at `fd` (a releasing holder may have removed it)."""
    try:
        mine, now = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _close(fd: int) -> bool:
    try:
        os.close(fd)
    except OSError:
        pass
    return False


def take_root(folders: FolderLocks, root: str, group, fsync: bool) -> None:
    """The coordinator takes `root` for the job (into `folders`) and tells the others; every rank
    raises what it could not do, naming the holder."""
    problem = None
    if group.is_coordinator:
        try:
            folders.take(root, fsync, f"checkpoint root {root!r}")
        except CheckpointError as exc:
            problem = str(exc)
        except Exception as exc:  # every rank must reach the broadcast, whatever went wrong here
            problem = f"checkpoint root {root!r}: {type(exc).__name__}: {exc}"
    problem = group.broadcast(problem)
    if problem is not None:
        folders.release()
        raise CheckpointError(problem if group.size == 1 else f"rank {group.rank}: {problem}")
