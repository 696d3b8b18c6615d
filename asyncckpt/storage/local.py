"""Checkpoints on a local or shared file system: plain `os` calls, every file and directory
entry fsynced, atomic publish by rename."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from typing import Optional, Sequence

from ..errors import CheckpointError
from .base import Storage, WriteHandle, unique_suffix
from .page_buffer import PAGE, PageBuffer


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


_DIRECT_CHUNK = 64 << 20  # whole pages per write call (Linux caps one call at ~2 GiB)
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}  # how file systems say no to O_DIRECT


def _write_direct(tmp: str, buffer: PageBuffer) -> bool:
    """Write `buffer` to the new file `tmp` with O_DIRECT and fsync it: whole pages from
    page-aligned memory, then the file cut to the buffer's length. False, and no file at `tmp`,
    where the platform or the file system refuses O_DIRECT (some FUSE and network mounts)."""
    if not getattr(os, "O_DIRECT", 0):
        return False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT, 0o666)
    except OSError as exc:
        if exc.errno not in _REFUSED:
            raise
        _unlink_quietly(tmp)  # a refusal may come after the file was created
        return False
    try:
        with buffer.padded_view() as view:
            written = _write_pages(fd, view)
        if written:
            os.ftruncate(fd, buffer.length)
            os.fsync(fd)
    finally:
        os.close(fd)
    if not written:
        _unlink_quietly(tmp)
    return written


def _write_pages(fd: int, view: memoryview) -> bool:
    """False where the file system refuses the direct write itself, or writes part of a page (the
    next write would not be aligned)."""
    written = 0
    while written < len(view):
        try:
            n = os.write(fd, view[written:written + _DIRECT_CHUNK])
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
            return False
        if n <= 0 or n % PAGE:
            return False
        written += n
    return True


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
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

    def make_dir(self, path: str, fsync: bool = True) -> None:
        if os.path.islink(path):  # never write a checkpoint's files through a planted symlink
            raise CheckpointError(f"{path!r} is a symlink; refusing to write a checkpoint through it")
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            return
        if fsync:
            self.sync_dir(os.path.dirname(path))

    def create(self, path: str, fsync: bool = True, timeout_s: float = 600.0) -> WriteHandle:
        return _LocalFile(path, fsync)

    supports_links = True

    def link(self, source: str, path: str) -> None:
        try:
            os.link(source, path, follow_symlinks=False)
        except FileExistsError:
            os.unlink(path)
            os.link(source, path, follow_symlinks=False)

    def write_atomic(self, path: str, data: bytes | Sequence[bytes] | PageBuffer, fsync: bool = True) -> None:
        directory = os.path.dirname(path) or "."
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{unique_suffix()}")
        try:
            # O_DIRECT saves the CPU a copy of every byte, but waits for the device: only worth it when
            # the bytes must be durable anyway
            if not (isinstance(data, PageBuffer) and fsync and _write_direct(tmp, data)):
                with open(tmp, "xb") as f:
                    f.writelines([data.view()] if isinstance(data, PageBuffer)
                                 else [data] if isinstance(data, (bytes, bytearray, memoryview)) else data)
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
        _unlink_quietly(path)

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


def _ignore_missing(func, path, exc_info) -> None:
    exc = exc_info[1]
    if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
        return
    raise exc
