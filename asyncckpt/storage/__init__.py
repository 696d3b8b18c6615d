"""Where checkpoint bytes live, behind one small interface.

`LocalStorage` uses plain `os` calls with the full fsync discipline. `msc_storage.MscStorage`
serves object stores (`msc://profile/...`, `s3://bucket/...`) through multi-storage-client.
`storage_for(path)` picks the backend from the path.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import socket
import threading
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

from ..errors import CheckpointError


class WriteHandle(ABC):
    """A data file being written. Its bytes count only after `commit()`; `abort()` removes it."""

    path: str

    @abstractmethod
    def write(self, data) -> int:
        """Append bytes (any buffer); return how many were written."""

    @abstractmethod
    def fileno(self) -> int:
        """The OS descriptor the bytes go to (unbuffered): a forked writer appends through it."""

    @abstractmethod
    def commit(self) -> None:
        """Make the file complete and durable (flush, fsync when asked, close)."""

    @abstractmethod
    def abort(self) -> None:
        """Close and delete the partial file. Never raises."""


@dataclass(frozen=True)
class OpenUpload:
    """A multipart upload started and neither completed nor aborted (its writer failed or died):
    no object is visible, but its parts stay stored, and billed, until it is aborted."""

    path: str  # the file it would have published
    upload_id: str
    initiated: Optional[float]  # when it started, seconds since the epoch (the store's clock); None: unknown


@dataclass(frozen=True)
class Versioned:
    """A small object's bytes and the version they are (an object store's ETag)."""

    data: bytes
    version: str


class Storage(ABC):
    """Operations the checkpointer and the worker need, each with one meaning on every backend."""

    @abstractmethod
    def join(self, *parts: str) -> str:
        """Join path parts the way this backend spells paths."""

    @abstractmethod
    def prepare_dir(self, path: str, fsync: bool = True) -> None:
        """Create `path` (and parents) and prove it can be written; CheckpointError if not.
        With `fsync`, the entries of the directories it created are made durable (a checkpoint
        committed in a directory must not vanish with the entry after a power loss).
        Called before any work of a save is handed off."""

    @abstractmethod
    def create(self, path: str, fsync: bool = True, timeout_s: float = 600.0) -> WriteHandle:
        """Open a data file for writing from the start; its commit waits at most `timeout_s`
        for anything the backend shares between files (upload memory)."""

    @abstractmethod
    def write_atomic(self, path: str, data: bytes, fsync: bool = True) -> None:
        """Publish a small file whole or not at all: readers see the old state or the new bytes."""

    @abstractmethod
    def read_bytes(self, path: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        """Read a whole file or a byte range of it."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """True when a file exists at `path`."""

    @abstractmethod
    def is_dir(self, path: str) -> bool:
        """True for a real directory (or prefix holding keys); False for a symlink."""

    @abstractmethod
    def is_symlink(self, path: str) -> bool:
        """True when `path` itself is a symbolic link (never on an object store). Checkpoints are
        not written, cleaned up or deleted through one."""

    @abstractmethod
    def real_path(self, path: str) -> str:
        """`path` with every symbolic link in it resolved (on an object store: `path` itself)."""

    @abstractmethod
    def modified_time(self, path: str) -> Optional[float]:
        """When a file or directory last changed, in seconds since the epoch; None where the
        backend does not say (an object-store prefix)."""

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names directly inside `path` (files and directories), dot-files included."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Size of a file in bytes."""

    @abstractmethod
    def remove_file(self, path: str) -> None:
        """Delete one file if it exists."""

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """Delete a checkpoint directory and everything in it, never following a symlink."""

    @abstractmethod
    def sync_dir(self, path: str) -> None:
        """Make the directory's entries durable (a no-op where the backend has no directories)."""

    @abstractmethod
    def remove_empty_dir(self, path: str) -> None:
        """Remove `path` if it is an empty directory; leave anything else alone. Never raises
        for a directory that is not empty or not there."""

    supports_links = False  # `link` works: an incremental save reuses unchanged files through it

    def link(self, source: str, path: str) -> None:
        """Make `path` hold the committed file `source` without writing its bytes from here (a
        hard link; a server-side copy on an object store), replacing an uncommitted file there.
        OSError where it cannot (another filesystem or profile, `source` gone)."""
        raise OSError(errno.ENOTSUP, f"{type(self).__name__} has no hard links")

    def read_versioned(self, path: str) -> Optional[Versioned]:
        """A small object and its version (None when there is none), for `write_if_version`.
        Object stores only: on a filesystem, folders are locked with flock instead (job_lock)."""
        raise OSError(errno.ENOTSUP, f"{type(self).__name__} has no versioned objects")

    def write_if_version(self, path: str, data: bytes, version: Optional[str]) -> bool:
        """Publish a small object only if it is still at `version` (None: only if there is none),
        in one step on the store's side; False when another writer changed it first."""
        raise OSError(errno.ENOTSUP, f"{type(self).__name__} has no versioned objects")

    def open_uploads(self, path: str) -> list[OpenUpload]:
        """Unfinished multipart uploads of files anywhere under `path` (none on a filesystem)."""
        return []

    def abort_upload(self, upload: OpenUpload) -> None:
        """Abort one upload `open_uploads` found (its parts are freed); one already gone is fine."""


class _LocalFile(WriteHandle):
    def __init__(self, path: str, fsync: bool) -> None:
        self.path = path
        self._fsync = fsync
        # O_NOFOLLOW: a symlink planted in a (torn) step directory must not make a save write
        # through it into a file elsewhere; opening it fails with ELOOP instead. A file there with
        # a second name (a hard link an incremental save made) is unlinked, never truncated: its
        # bytes may belong to a committed checkpoint.
        try:
            if _is_shared_file(os.lstat(path)):
                os.unlink(path)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        self._file = open(fd, "wb", buffering=0)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):  # a raw file may write less than asked
            written += self._file.write(view[written:])
        return written

    def fileno(self) -> int:
        return self._file.fileno()

    def commit(self) -> None:
        if self._fsync:
            os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        try:
            self._file.close()
        finally:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _is_shared_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink > 1


class LocalStorage(Storage):
    """A local (or network-mounted) filesystem."""

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def prepare_dir(self, path: str, fsync: bool = True) -> None:
        created = []
        missing = os.path.abspath(path)
        while not os.path.lexists(missing):
            created.append(missing)
            missing = os.path.dirname(missing)
        doing = f"cannot create it in {missing!r}" if created else "cannot create a file in it"
        try:
            os.makedirs(path, exist_ok=True)
            for new in reversed(created) if fsync else ():
                self.sync_dir(os.path.dirname(new))
            doing = "cannot create a file in it"
            probe = os.path.join(path, f".asyncckpt-probe-{unique_suffix()}")
            with open(probe, "xb"):
                pass
            os.unlink(probe)
        except OSError as exc:
            reason = f"{doing} ({os.strerror(exc.errno) if exc.errno else exc})"
            if isinstance(exc, (NotADirectoryError, FileExistsError)):
                reason = "a path component is a file, not a directory"
            raise CheckpointError(f"checkpoint directory {path!r} is not writable: {reason}") from exc

    def create(self, path: str, fsync: bool = True, timeout_s: float = 600.0) -> WriteHandle:
        return _LocalFile(path, fsync)

    supports_links = True

    def link(self, source: str, path: str) -> None:
        try:
            os.link(source, path, follow_symlinks=False)
        except FileExistsError:
            os.unlink(path)
            os.link(source, path, follow_symlinks=False)

    def write_atomic(self, path: str, data: bytes, fsync: bool = True) -> None:
        directory = os.path.dirname(path) or "."
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{unique_suffix()}")
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if fsync:
            self.sync_dir(directory)

    def read_bytes(self, path: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read() if length is None else f.read(length)

    def exists(self, path: str) -> bool:
        return os.path.isfile(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path) and not os.path.islink(path)

    def is_symlink(self, path: str) -> bool:
        return os.path.islink(path)

    def real_path(self, path: str) -> str:
        return os.path.realpath(path)

    def modified_time(self, path: str) -> Optional[float]:
        return os.path.getmtime(path)

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def remove_file(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        if os.path.islink(path):
            raise CheckpointError(f"refusing to delete {path!r}: it is a symlink")
        shutil.rmtree(path, ignore_errors=False, onerror=_ignore_missing)

    def remove_empty_dir(self, path: str) -> None:
        try:
            os.rmdir(path)  # fails on a non-empty directory, a symlink or a file: all left alone
        except OSError:
            pass

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def unique_suffix() -> str:
    """host-pid-random: a probe or temp name no other rank, process or call uses, even where
    ranks on different nodes share a pid (containers) and a filesystem. Only [A-Za-z0-9-]."""
    return f"{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _ignore_missing(func, path, exc_info) -> None:
    exc = exc_info[1]
    if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
        return
    raise exc


def is_remote(path: str) -> bool:
    return "://" in str(path)


_backends: dict[str, Storage] = {}
_backends_lock = threading.Lock()


def storage_for(path: str) -> Storage:
    """The backend for a checkpoint root or directory: one instance per kind and process (msc
    caches its clients per profile, so they are reused across saves)."""
    kind = "local"
    if is_remote(path):
        kind = str(path).split("://", 1)[0].lower()
        if kind not in ("msc", "s3"):
            raise CheckpointError(
                f"{path!r}: unsupported URL scheme {kind!r}; use a local path, msc://profile/... or s3://bucket/..."
            )
        kind = "msc"
    backend = _backends.get(kind)
    if backend is None:
        with _backends_lock:
            backend = _backends.get(kind)
            if backend is None:
                backend = _backends[kind] = _make_backend(path, kind)
    return backend


def check_writable_without_writing(path: str) -> None:
    """What `prepare_dir` refuses first, checked without writing anything: a local path under a
    file, or in a directory we may not write. For a save whose rest runs later on another thread,
    so a bad path still raises from the call (object stores: nothing checked here)."""
    if is_remote(path):
        return
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CheckpointError(f"checkpoint directory {path!r} is not writable: a path component is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"checkpoint directory {path!r} is not writable: {os.strerror(errno.EACCES)}")


def _make_backend(path: str, kind: str) -> Storage:
    if kind == "local":
        return LocalStorage()
    try:
        from .msc import MscStorage

        return MscStorage()
    except ImportError as exc:
        raise CheckpointError(
            f"{path!r}: object-store roots need multi-storage-client: pip install 'asyncckpt[msc]' ({exc})"
        ) from exc
