"""Where checkpoint bytes live, behind one small interface.

`LocalStorage` uses plain `os` calls with the full fsync discipline. `MscStorage` serves object
stores (`msc://profile/...`, `s3://bucket/...`) through multi-storage-client. `storage_for(path)`
picks the backend from the path.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shutil
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, Optional

from .errors import CheckpointError


class WriteHandle(ABC):
    """A data file being written. Its bytes count only after `commit()`; `abort()` removes it."""

    path: str

    @abstractmethod
    def write(self, data) -> int:
        """Append bytes (any buffer); return how many were written."""

    @abstractmethod
    def commit(self) -> None:
        """Make the file complete and durable (flush, fsync when asked, close)."""

    @abstractmethod
    def abort(self) -> None:
        """Close and delete the partial file. Never raises."""


class Storage(ABC):
    """Operations the checkpointer and the worker need, each with one meaning on every backend."""

    @abstractmethod
    def join(self, *parts: str) -> str:
        """Join path parts the way this backend spells paths."""

    @abstractmethod
    def prepare_dir(self, path: str) -> None:
        """Create `path` (and parents) and prove it can be written; CheckpointError if not.
        Called before any work of a save is handed off."""

    @abstractmethod
    def create(self, path: str, fsync: bool = True) -> WriteHandle:
        """Open a data file for writing from the start."""

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


class _LocalFile(WriteHandle):
    def __init__(self, path: str, fsync: bool) -> None:
        self.path = path
        self._fsync = fsync
        self._file = open(path, "wb", buffering=0)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):  # a raw file may write less than asked
            written += self._file.write(view[written:])
        return written

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


class LocalStorage(Storage):
    """A local (or network-mounted) filesystem."""

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def prepare_dir(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, f".asyncckpt-probe-{os.getpid()}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            if isinstance(exc, (NotADirectoryError, FileExistsError)):
                reason = "a path component is a file, not a directory"
            raise CheckpointError(f"checkpoint directory {path!r} is not writable: {reason}") from exc

    def create(self, path: str, fsync: bool = True) -> WriteHandle:
        return _LocalFile(path, fsync)

    def write_atomic(self, path: str, data: bytes, fsync: bool = True) -> None:
        directory = os.path.dirname(path) or "."
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
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

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _ignore_missing(func, path, exc_info) -> None:
    exc = exc_info[1]
    if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
        return
    raise exc


OBJECT_STORE_SCHEMES = ("msc", "s3")
# msc sends a file at or below the profile's multipart threshold (64 MiB by default) as one PUT of
# the whole file read into memory; such uploads share this budget, so together they never hold
# more than this in memory (larger files stream in multipart chunks)
SINGLE_PUT_MEMORY_BYTES = 128 << 20


class _MemoryBudget:
    """Bytes that concurrent uploads may hold in memory at once; a request larger than the whole
    budget waits until the budget is entirely free."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._free = total
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int):
        nbytes = min(nbytes, self._total)
        with self._cond:
            self._cond.wait_for(lambda: self._free >= nbytes)
            self._free -= nbytes
        try:
            yield
        finally:
            with self._cond:
                self._free += nbytes
                self._cond.notify_all()


class _SpooledUpload(WriteHandle):
    """An object-store data file: bytes go to a local temp file, uploaded whole by `commit()`.

    Nothing is visible in the bucket before the upload completes, and a failed or aborted file
    never publishes anything (an `msc.open` object would be uploaded by `close()` even after an
    exception, and would hold the whole object in memory). The temp file is written through an
    unbuffered OS file, so a forked writer's writes land in it too. `upload_file` streams a large
    file in multipart chunks; a file small enough for one PUT is read whole, within the storage's
    shared `upload_memory` budget, so memory stays bounded whatever the objects' sizes."""

    def __init__(self, storage: "MscStorage", path: str) -> None:
        self.path = path
        self._storage = storage
        fd, self._tmp = tempfile.mkstemp(prefix="asyncckpt-upload-", suffix=".part")
        self._file = os.fdopen(fd, "wb", buffering=0)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += self._file.write(view[written:])
        return written

    def commit(self) -> None:
        try:
            self._file.close()
            size = os.path.getsize(self._tmp)

            def upload(client, key) -> None:
                in_memory = size if size <= _single_put_limit(client) else 0
                with self._storage.upload_memory.hold(in_memory):
                    client.upload_file(key, self._tmp)

            self._storage._call("upload", self.path, upload)
        finally:
            self._discard_tmp()

    def abort(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        self._discard_tmp()

    def _discard_tmp(self) -> None:
        try:
            os.unlink(self._tmp)
        except OSError:
            pass


class MscStorage(Storage):
    """Object stores through multi-storage-client: `msc://profile/prefix` (a profile of the
    MSC_CONFIG file) and `s3://bucket/prefix` (msc's implicit profile: boto3's credentials and
    AWS_ENDPOINT_URL).

    There are no directories and no rename: a "directory" is a key prefix; data files are spooled
    to a local temp file (`$TMPDIR`) and uploaded once complete; small files (`.metadata`, the
    sidecar, `latest`) are one PUT each, which readers see whole or not at all. Deleting a tree
    lists and deletes every key under the prefix, dot-files included (msc's recursive delete
    skips them on object stores). Every msc failure comes out as an OSError naming the URL."""

    PROBE_TTL_S = 60.0

    def __init__(self, single_put_memory_bytes: int = SINGLE_PUT_MEMORY_BYTES) -> None:
        import multistorageclient  # noqa: F401  (fail here, with the hint from storage_for)

        self.upload_memory = _MemoryBudget(single_put_memory_bytes)
        self._proven: dict[str, float] = {}  # prefix -> when a probe write there last succeeded

    def join(self, *parts: str) -> str:
        head, *rest = parts
        pieces = [str(head).rstrip("/")] + [str(p).strip("/") for p in rest if str(p).strip("/")]
        return "/".join(pieces)

    def prepare_dir(self, path: str) -> None:
        """Nothing to create; prove the store takes writes there by writing and deleting a probe
        key. A prefix under one proven in the last PROBE_TTL_S is not probed again (a save
        prepares its root and its step prefix; a later failure still surfaces from the writes)."""
        path = path.rstrip("/")
        now = time.monotonic()
        if any(now - self._proven.get(p, -math.inf) < self.PROBE_TTL_S for p in _self_and_parents(path)):
            return
        probe = self.join(path, f".asyncckpt-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self._call("write", probe, lambda client, key: client.write(key, b""))
            self._call("delete", probe, lambda client, key: client.delete(key))
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {path!r} is not writable: {exc}") from exc
        self._proven[path] = now

    def create(self, path: str, fsync: bool = True) -> WriteHandle:
        return _SpooledUpload(self, path)  # an upload is durable once it returns: fsync has no work

    def write_atomic(self, path: str, data: bytes, fsync: bool = True) -> None:
        self._call("write", path, lambda client, key: client.write(key, bytes(data)))

    def read_bytes(self, path: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        from multistorageclient.types import Range

        if offset == 0 and length is None:
            return self._call("read", path, lambda client, key: client.read(key))
        if length is None:
            length = self.size(path) - offset
        if length <= 0:
            return b""
        return self._call("read", path, lambda client, key: client.read(key, byte_range=Range(offset, length)))

    def exists(self, path: str) -> bool:
        def is_object(client, key) -> bool:
            try:  # strict=False: one HEAD, without msc's "is it a directory then?" listing
                return client.info(key, strict=False).type == "file"
            except FileNotFoundError:
                return False

        return self._call("stat", path, is_object)

    def is_dir(self, path: str) -> bool:
        def has_keys(client, key) -> bool:
            return next(iter(client.list(path=_as_prefix(key), include_directories=True)), None) is not None

        return self._call("list", path, has_keys)

    def list_dir(self, path: str) -> list[str]:
        def names(client, key) -> list[str]:
            prefix = _as_prefix(key)
            found = set()
            for entry in client.list(path=prefix, include_directories=True):
                name = entry.key[len(prefix) :] if entry.key.startswith(prefix) else entry.key.rsplit("/", 1)[-1]
                if name and "/" not in name.rstrip("/"):
                    found.add(name.rstrip("/"))
            return sorted(found)

        return self._call("list", path, names)

    def size(self, path: str) -> int:
        return self._call("stat", path, lambda client, key: client.info(key, strict=False).content_length)

    def remove_file(self, path: str) -> None:
        def delete(client, key) -> None:
            try:
                client.delete(key)
            except FileNotFoundError:
                pass

        self._call("delete", path, delete)

    def remove_tree(self, path: str) -> None:
        def delete_all(client, key) -> None:
            keys = [entry.key for entry in client.list_recursive(path=_as_prefix(key))]
            # a checkpoint's commit object goes first: a crash mid-delete leaves it uncommitted
            first = [k for k in keys if k.rsplit("/", 1)[-1] == ".metadata"]
            for batch in (first, [k for k in keys if k not in first]):
                if batch:
                    client.delete_many(batch)
            if _is_posix(client):  # a POSIX profile has real directories: remove the empty ones
                try:
                    client.delete(key, recursive=True)
                except FileNotFoundError:
                    pass

        self._call("delete", path, delete_all)

    def sync_dir(self, path: str) -> None:
        pass  # no directories: an object is durable once its upload returned

    def _call(self, operation: str, url: str, action) -> Any:
        """Run `action(client, key)` for `url`; any msc failure (RuntimeError, ValueError for an
        unknown profile, botocore errors...) becomes an OSError naming the operation and URL."""
        try:
            client, key = _resolve(url)
            return action(client, key)
        except OSError as exc:
            raise _with_context(exc, f"{operation} {url}: {exc}") from exc
        except Exception as exc:
            raise OSError(f"{operation} {url}: {type(exc).__name__}: {exc}") from exc


def _with_context(exc: OSError, message: str) -> OSError:
    """The same kind of OSError (FileNotFoundError stays one), its message naming the URL."""
    try:
        return type(exc)(message)
    except Exception:
        return OSError(message)


def _single_put_limit(client) -> int:
    """Largest file msc uploads as one in-memory PUT for this client's profile (0: none, as for
    POSIX profiles, which copy files). Reads msc's provider setting; msc's default otherwise."""
    if _is_posix(client):
        return 0
    limit = getattr(getattr(client, "_storage_provider", None), "_multipart_threshold", None)
    return limit if isinstance(limit, int) else 64 << 20


def _is_posix(client) -> bool:
    """A `type: file` profile (a directory tree behind msc), not an object store."""
    return type(getattr(client, "_storage_provider", None)).__name__.startswith("Posix")


def _resolve(url: str):
    import multistorageclient as msc

    return msc.resolve_storage_client(url)


def _self_and_parents(url: str) -> list[str]:
    """`msc://p/a/b` -> [`msc://p/a/b`, `msc://p/a`, `msc://p`]."""
    scheme, rest = url.split("://", 1)
    parts = rest.split("/")
    return [f"{scheme}://" + "/".join(parts[:n]) for n in range(len(parts), 0, -1)]


def _as_prefix(key: str) -> str:
    key = key.strip("/")
    return f"{key}/" if key else ""


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
        if kind not in OBJECT_STORE_SCHEMES:
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


def _make_backend(path: str, kind: str) -> Storage:
    if kind == "local":
        return LocalStorage()
    try:
        return MscStorage()
    except ImportError as exc:
        raise CheckpointError(
            f"{path!r}: object-store roots need multi-storage-client: pip install 'asyncckpt[msc]' ({exc})"
        ) from exc
