"""Where the parallel reader (reader.py) gets its bytes: one engine, a source per kind of storage.

`LocalFiles` reads with `os.preadv` (the GIL released) through each thread's own descriptor, a
step at a time, so each step is checksummed while it is still in the CPU cache. `ObjectRanges`
reads an object store (msc://, s3://) with ranged GETs through the Storage (multi-storage-client's
`read(path, byte_range=...)`), one GET per piece, copied into the targets: a rank reads only the
items it needs, adjacent ones in one request, never a whole object it needs a part of.
Both fill the buffers they are given completely or raise PartialLoadError naming the item.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod

from ..errors import CheckpointError, PartialLoadError
from ..storage import Storage


class ByteSource(ABC):
    """Reads byte ranges of a checkpoint's data files for the reader's threads."""

    threads: int  # reading threads
    piece_bytes: int  # most bytes of one task: adjacent items of one file coalesced up to this
    step_bytes: int  # most bytes of one read call, checksummed right after it
    whole_item_bytes: int  # torch.save items up to this size are read whole (no reads to find their tensor)

    def open(self, paths: set[str]) -> None:
        """Called once before any read, with every file the load reads."""

    @abstractmethod
    def read(self, path: str, offset: int, n: int) -> bytes:
        """Up to `n` bytes at `offset` (fewer: the file ends first; OSError: it cannot be read).
        Small reads: the head and tail of an archive."""

    @abstractmethod
    def read_into(self, path: str, offset: int, buffers: list[memoryview], what: str) -> None:
        """Fill `buffers`, laid end to end from `offset`, completely; PartialLoadError naming `what` if not."""

    def close(self) -> None:
        """Release what the reads held; called once, after every read ended."""


class LocalFiles(ByteSource):
    """Local files: positional reads, each thread through its own descriptor."""

    threads = min(16, max(4, os.cpu_count() or 4))
    piece_bytes = 64 << 20  # measured: 64 MiB loads 512 MiB faster than 16, cold and warm
    step_bytes = 256 << 10  # checksummed while in the core's cache: 21 GB/s here, 9.5 after 1 MiB reads, 6 from memory
    whole_item_bytes = 0  # finding a tensor costs a pread or two of the page cache: always worth it
    iov_max = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)

    def __init__(self) -> None:
        self._local = threading.local()
        self._opened: dict[int, int] = {}  # thread id -> the one descriptor that thread holds open

    def open(self, paths: set[str]) -> None:
        """Every file opens, checked before any target is touched; none is held open (a checkpoint
        of many files must not take a descriptor per file: see _thread_fd)."""
        for path in sorted(paths):
            try:
                os.close(os.open(path, os.O_RDONLY))
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot open ({exc.strerror or exc}); nothing in state_dict was changed") from None

    def read(self, path: str, offset: int, n: int) -> bytes:
        return os.pread(self._thread_fd(path, CheckpointError), n, offset)  # finding layouts: nothing written yet

    def read_into(self, path: str, offset: int, buffers: list[memoryview], what: str) -> None:
        """preadv until every buffer is full; a file that ends first is a truncated item."""
        fd = self._thread_fd(path, PartialLoadError)
        buffers = [b for b in buffers if len(b)]
        while buffers:
            try:
                n = os.preadv(fd, buffers, offset)
            except OSError as exc:
                raise PartialLoadError(f"{what}: read failed at byte {offset} ({exc.strerror or exc})") from None
            if n == 0:
                raise PartialLoadError(f"{what}: the file ends at byte {offset}, inside the item (truncated)")
            offset += n
            while buffers and n >= len(buffers[0]):
                n -= len(buffers[0])
                buffers.pop(0)
            if n:
                buffers[0] = buffers[0][n:]

    def _thread_fd(self, path: str, error: type) -> int:
        """This thread's own descriptor of `path`: the kernel keeps readahead state per open file,
        and threads reading different pieces through one descriptor would look like random reads.
        A thread holds one file open at a time (pieces come sorted by file), so loading a
        checkpoint of thousands of files stays far below the open-file limit."""
        if getattr(self._local, "path", None) == path:
            return self._local.fd
        me = threading.get_ident()
        if me in self._opened:
            os.close(self._opened.pop(me))
            self._local.path = None
        try:
            self._local.fd = self._opened[me] = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise error(f"{path}: cannot open ({exc.strerror or exc})") from None
        self._local.path = path
        return self._local.fd

    def close(self) -> None:
        for fd in self._opened.values():
            os.close(fd)
        self._opened = {}
        self._local = threading.local()


class ObjectRanges(ByteSource):
    """Objects on a store: one ranged GET per piece. Every object's existence and size was checked
    (and every item's range against it) before the first read, so a failed or short GET means the
    object changed or the store failed meanwhile."""

    threads = 8
    piece_bytes = 16 << 20  # AWS's advice for byte-range GETs is 8-16 MB; threads x this is the memory in flight
    step_bytes = 16 << 20  # a piece is one GET
    whole_item_bytes = 1 << 20  # a small item is cheaper read whole than found by two more GETs

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def read(self, path: str, offset: int, n: int) -> bytes:
        return self.storage.read_bytes(path, offset, n)

    def read_into(self, path: str, offset: int, buffers: list[memoryview], what: str) -> None:
        total = sum(len(b) for b in buffers)
        if not total:
            return
        try:
            data = self.storage.read_bytes(path, offset, total)
        except OSError as exc:  # MscStorage's errors name the URL
            raise PartialLoadError(f"{what}: ranged GET of bytes {offset}..{offset + total} failed ({exc})") from None
        if len(data) != total:
            raise PartialLoadError(f"{what}: the object ends at byte {offset + len(data)}, inside the item (truncated)")
        view, at = memoryview(data), 0
        for buffer in buffers:
            buffer[:] = view[at:at + len(buffer)]
            at += len(buffer)
