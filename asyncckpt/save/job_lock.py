"""One job per checkpoint folder: two jobs saving into one root would overwrite each other's
checkpoints, each reporting its saves as committed. So a checkpointer takes its root for its job
when it is constructed (and, for a save into a directory it names, the folder holding that
directory, at the first such save), and a second job gets a CheckpointError naming the holder.

- Local and shared filesystems: `FOLDER/.asyncckpt.lock`, held with `flock` until release (the
  kernel releases it when the process dies, so a crashed job never blocks its restart). The file
  records the holder; the last process to let go removes it.
- Object stores: a lease object `FOLDER/.asyncckpt.lock` recording the holder and an expiry,
  renewed while the job runs, written only with a conditional PUT. It is taken over once expired,
  by the same job id (a restart), or when its holder was a process of this host that is gone.

The processes of one job share a folder (ranks saving with `no_dist`, several checkpointers of
one process): a job is named by `job_id()`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Optional, Union

from ..errors import CheckpointError
from ..layout import LOCK_FILE
from ..storage import Storage, is_remote, storage_for

log = logging.getLogger(__name__)

LEASE_TTL_S = 60.0  # a lease its job has not renewed for this long is free
LEASE_RENEW_S = 15.0  # how often a running job renews its leases
LOCK_WAIT_S = 5.0  # a lock file another process is just writing or removing: how long to try again
RELEASE_WAIT_S = 10.0  # at release, how long to wait for a renewal under way


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


@dataclass(frozen=True)
class Holder:
    """Who holds a folder (what its lock file or lease records)."""

    job: str
    host: str
    pid: int
    since: float  # when it took the folder, seconds since the epoch
    expires: Optional[float] = None  # leases only: free after this (the holder's clock)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Optional["Holder"]:
        try:
            fields = json.loads(data)
            return cls(str(fields["job"]), str(fields["host"]), int(fields["pid"]), float(fields["since"]),
                       None if fields.get("expires") is None else float(fields["expires"]))
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        return f"job {self.job} (host {self.host}, pid {self.pid}, since {_clock(self.since)})"

    def gone(self) -> bool:
        """A process of this host that no longer runs."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # EPERM: it runs, as another user
            pass
        return False


class FolderLocks:
    """The folders one checkpointer holds for its job, each taken once and kept until `release`."""

    def __init__(self, job: Optional[str] = None) -> None:
        self._job = job  # None: job_id(), asked at the first take
        self._held: dict[str, Union[_FileLock, _Lease]] = {}

    def take(self, folder: str, fsync: bool = True, purpose: str = "") -> None:
        """Create `folder` if needed, prove it writable and take it for this job; CheckpointError
        naming the holder if another job has it. `purpose` says what the folder is for, in errors."""
        key = folder.rstrip("/") if is_remote(folder) else os.path.abspath(folder)
        if key in self._held:
            return
        storage = storage_for(folder)
        storage.prepare_dir(folder, fsync)
        if self._job is None:
            self._job = job_id()
        me = Holder(self._job, socket.gethostname(), os.getpid(), time.time())
        what = purpose or f"folder {folder!r}"
        lock = _Lease(storage, folder, me, what) if is_remote(folder) else _FileLock(folder, me, what)
        lock.take()
        self._held[key] = lock

    def check(self) -> None:
        """CheckpointError if this job no longer holds one of its folders (another job took a
        lease that expired, or the lock file was removed)."""
        for lock in self._held.values():
            lock.check()

    def release(self) -> None:
        """Let go of every folder (never raises: the checkpoints are not at stake)."""
        held, self._held = self._held, {}
        for lock in held.values():
            lock.release()


def parent_folder(checkpoint_dir: str) -> str:
    """The folder holding a checkpoint directory: what a save into it takes for its job."""
    if is_remote(checkpoint_dir):
        scheme, rest = checkpoint_dir.split("://", 1)
        rest = rest.rstrip("/")
        return f"{scheme}://{rest.rsplit('/', 1)[0]}" if "/" in rest else checkpoint_dir
    return os.path.dirname(os.path.abspath(checkpoint_dir))


def _clock(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _in_use(what: str, holder: str, remedy: str) -> CheckpointError:
    return CheckpointError(
        f"{what} is in use by another job: {holder}. Two jobs saving into one folder overwrite "
        f"each other's checkpoints: give this job a folder of its own, or {remedy}"
    )


_UNRECORDED = Holder("?", "?", 0, 0.0)  # a lock file held by a process that wrote no record in it


class _NoLocks(Exception):
    """The filesystem has no flock (e.g. Lustre mounted without `flock`)."""


class _FileLock:
    """`FOLDER/.asyncckpt.lock` held with flock: exclusive while its record is written, shared
    after, so the other processes of the job can hold it too (another job's process reads the
    record and gives up). A process locking a file that was removed meanwhile starts again."""

    def __init__(self, folder: str, me: Holder, what: str) -> None:
        self.path = os.path.join(folder, LOCK_FILE)
        self._me, self._what = me, what
        self._fd: Optional[int] = None

    def take(self) -> None:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                if self._try_take():
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
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            holder = self._lock(fd)
        except BaseException:
            _close(fd)
            raise
        if holder is None or holder.job != self._me.job:
            _close(fd)
            if holder is None:
                return False
            holder_text = "a process that recorded no owner" if holder is _UNRECORDED else holder.describe()
            raise _in_use(self._what, holder_text, f"stop that job first (its lock, {self.path}, goes when its processes exit)")
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
            return self._me if _flock(fd, fcntl.LOCK_SH) else None  # None: another process slipped in
        if not _flock(fd, fcntl.LOCK_SH) or not _same_file(fd, self.path):  # its holder is writing it
            return None
        return Holder.decode(os.pread(fd, 4096, 0)) or _UNRECORDED

    def check(self) -> None:
        if self._fd is not None and not _same_file(self._fd, self.path):
            raise CheckpointError(f"{self._what}: its lock file {self.path} was removed or replaced while this "
                                  "job held it: another job may be saving there; not saving")

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _flock(fd, fcntl.LOCK_EX) and _same_file(fd, self.path):  # no other process holds it
                os.unlink(self.path)
        except (OSError, _NoLocks) as exc:
            log.warning("releasing %s: %s", self.path, exc)
        finally:
            _close(fd)


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


class _Lease:
    """A lease object on an object store, written with conditional PUTs (only if absent, or only
    if unchanged since read), so two jobs can never both believe they took it. A thread renews it
    every LEASE_RENEW_S; finding another job's lease there means ours was lost."""

    def __init__(self, storage: Storage, folder: str, me: Holder, what: str) -> None:
        self.path = storage.join(folder, LOCK_FILE)
        self._storage, self._me, self._what = storage, me, what
        self._lost: Optional[Holder] = None
        self._stop = threading.Event()
        self._renewer: Optional[threading.Thread] = None

    def take(self) -> None:
        try:
            for _ in range(3):  # another process wrote it between our read and our write
                current = self._storage.read_versioned(self.path)
                holder = Holder.decode(current.data) if current is not None else None
                if holder is not None and holder.job != self._me.job and not self._free(holder):
                    raise _in_use(self._what, holder.describe(), (
                        f"stop that job first. Its lease ({self.path}) expires at {_clock(holder.expires or 0)} unless "
                        f"that job renews it: if it is gone, retry after that, or restart with its job id "
                        f"(ASYNCCKPT_JOB_ID={holder.job}) to take it over now"
                    ))
                if self._write(current.version if current is not None else None):
                    break
            else:
                raise CheckpointError(f"{self._what}: its lease {self.path} changed on every try; try again")
        except OSError as exc:
            raise CheckpointError(f"{self._what}: cannot take its lease {self.path}: {exc}") from exc
        self._renewer = threading.Thread(target=self._renew_until_released, name="asyncckpt-lease", daemon=True)
        self._renewer.start()

    def check(self) -> None:
        if self._lost is not None:
            raise CheckpointError(
                f"{self._what}: this job lost its lease ({self.path}) to {self._lost.describe()}, which took it "
                f"over (ours not renewed within {LEASE_TTL_S:.0f}s: the store unreachable, or this process stalled?); "
                "not saving there: stop one of the two jobs"
            )

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(RELEASE_WAIT_S)
        try:
            current = self._storage.read_versioned(self.path)
            holder = Holder.decode(current.data) if current is not None else None
            if holder is not None and holder.job == self._me.job:
                self._storage.remove_file(self.path)
        except OSError as exc:
            log.warning("releasing %s: %s (it expires by itself)", self.path, exc)

    @staticmethod
    def _free(holder: Holder) -> bool:
        return (holder.expires is not None and holder.expires < time.time()) or holder.gone()

    def _write(self, version: Optional[str]) -> bool:
        lease = replace(self._me, expires=time.time() + LEASE_TTL_S)
        return self._storage.write_if_version(self.path, lease.encode(), version)

    def _renew(self) -> None:
        current = self._storage.read_versioned(self.path)
        holder = Holder.decode(current.data) if current is not None else None
        if holder is not None and holder.job != self._me.job:
            self._lost = holder
            log.error("%s: another job took its lease %s: %s; saves there are refused", self._what, self.path, holder.describe())
        elif not self._stop.is_set():
            self._write(current.version if current is not None else None)  # absent: a process of this job let go

    def _renew_until_released(self) -> None:
        while self._lost is None and not self._stop.wait(LEASE_RENEW_S):
            try:
                self._renew()
            except OSError as exc:
                log.warning("renewing %s: %s", self.path, exc)


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
