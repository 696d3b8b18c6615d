"""The storage interface: what a save and a load need from where checkpoint bytes live. Each
method's docstring says when it is called and what it must return. Backends: local.py (plain
`os` calls, full fsync discipline) and msc.py (object stores through multi-storage-client); this
module imports neither."""

from __future__ import annotations

import errno
import os
import re
import socket
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

from .page_buffer import PageBuffer


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
    def write_atomic(self, path: str, data: bytes | Sequence[bytes] | PageBuffer, fsync: bool = True) -> None:
        """Publish a file whole or not at all: readers see the old state or the new bytes (`data`,
        or its pieces in order: a local file is written without joining them first; a
        `PageBuffer` with O_DIRECT where the file system takes it)."""

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

    def make_dir(self, path: str, fsync: bool = True) -> None:
        """Create `path`, a data folder inside a checkpoint directory a save prepared; with
        `fsync`, its entry made durable. Nothing to do where the backend has no directories."""

    def writes_to_upload(self, path: str, nbytes: int) -> int:
        """Write requests a data file of `nbytes` at `path` costs (object stores: one PUT, or a
        multipart upload's create, parts and complete); 1 where nothing is counted."""
        return 1

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


_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def unique_suffix() -> str:
    """host-pid-random: a probe or temp name no other rank, process or call uses, even where
    ranks on different nodes share a pid (containers) and a filesystem. Only [A-Za-z0-9-]."""
    return f"{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def is_remote(path: str) -> bool:
    return "://" in str(path)
