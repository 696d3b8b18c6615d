"""Where the parallel reader (reader.py) gets its bytes: one engine, a source per kind of storage.

`LocalFiles` reads with `os.preadv` (the GIL released) through each thread's own descriptor, a
step at a time, so each step is checksummed while it is still in the CPU cache. `ObjectRanges`
reads an object store (msc://, s3://) with ranged GETs through the Storage (multi-storage-client's
`read(path, byte_range=...)`), one GET per piece, copied into the targets: a rank reads only the
items it needs, adjacent ones in one request, never a whole object it needs a part of.
`PeerFiles` (peer_source.py) reads the memory tier's copies held on other nodes. All fill the
buffers they are given completely or raise PartialLoadError naming the item.
`SharedSource` answers from bytes held in memory where it holds them (resume at scale: items
another rank read, replicated.py) and passes any other read on.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
import threading
from abc import ABC, abstractmethod
from typing import ContextManager

import numpy as np

from ..errors import CheckpointError, PartialLoadError
from ..formats import GIL_FREE_BYTES
from ..storage import Storage


class ByteSource(ABC):
    """Reads byte ranges of a checkpoint's data files for the reader's threads."""

    threads: int  # reading threads
    piece_bytes: int  # most bytes of one task: adjacent items of one file coalesced up to this
    step_bytes: int  # most bytes of one read call, checksummed right after it
    whole_item_bytes: int  # torch.save items up to this size are read whole (no reads to find their tensor)

    def open(self, paths: set[str]) -> None:
        """Called once before any read, with every file the load reads."""

    def piece(self, path: str, offset: int, nbytes: int) -> ContextManager[None]:
        """Around the reads of one piece (`nbytes` from `offset`, read in order): a source that
        streams (peer_source.py) asks for them in one request."""
        return contextlib.nullcontext()

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


class SharedSource(ByteSource):
    """Reads served from the shared items' bytes where they cover them, from `base` elsewhere."""

    def __init__(self, base: ByteSource, held: dict[tuple[str, int], bytes | memoryview],
                 checked: frozenset[tuple[str, int, int]] = frozenset()) -> None:
        """`held`: the bytes held, by (file path, offset). `checked`: the (file path, offset,
        length) of items whose checksum was checked where this rank copies them from (the memory
        its reader read them into, a relay received them into, or the page cache of its node,
        which its reader read them through), which the load need not check again."""
        self.base = base
        self.checked = checked
        self.threads, self.piece_bytes = base.threads, base.piece_bytes
        self.step_bytes, self.whole_item_bytes = base.step_bytes, base.whole_item_bytes
        self._ranges: dict[str, list[tuple[int, int, bytes | memoryview]]] = {}
        for (path, offset), data in held.items():
            self._ranges.setdefault(path, []).append((offset, offset + len(data), data))
        for ranges in self._ranges.values():
            ranges.sort()
        self._starts = {path: [r[0] for r in ranges] for path, ranges in self._ranges.items()}

    def open(self, paths: set[str]) -> None:
        self.base.open(paths)

    def close(self) -> None:
        self.base.close()

    def _spans(self, path: str, offset: int, n: int):
        """(start, end, bytes or None) covering [offset, offset + n): held bytes, or None for the storage's."""
        ranges, starts = self._ranges.get(path, []), self._starts.get(path, [])
        at, end = offset, offset + n
        i = max(bisect.bisect_right(starts, at) - 1, 0)
        while at < end:
            while i < len(ranges) and ranges[i][1] <= at:
                i += 1
            if i < len(ranges) and ranges[i][0] <= at:
                stop = min(end, ranges[i][1])
                yield at, stop, memoryview(ranges[i][2])[at - ranges[i][0]:stop - ranges[i][0]]
            else:
                stop = min(end, ranges[i][0]) if i < len(ranges) else end
                yield at, stop, None
            at = stop

    def read(self, path: str, offset: int, n: int) -> bytes:
        out = bytearray()
        for start, stop, held in self._spans(path, offset, n):
            if held is not None:
                out += held
            else:
                data = self.base.read(path, start, stop - start)
                out += data
                if len(data) < stop - start:
                    break
        return bytes(out)

    def read_into(self, path: str, offset: int, buffers: list[memoryview], what: str) -> None:
        flat = list(buffers)  # bytes ("B") views, as the reader makes them
        total = sum(len(b) for b in flat)
        for start, stop, held in self._spans(path, offset, total):
            targets = _slice(flat, start - offset, stop - offset)
            if held is None:
                self.base.read_into(path, start, targets, what)
            else:
                at = 0
                for target in targets:
                    _copy(target, held[at:at + len(target)])
                    at += len(target)


def _copy(target: memoryview, source: memoryview) -> None:
    """target[:] = source, the GIL released for a large copy (the loader's threads copy in parallel:
    a slice assignment would hold it, and 512 MiB would be copied on one thread at a time)."""
    if len(target) != len(source):
        raise ValueError(f"copying {len(source)} bytes into {len(target)}")
    if len(target) < GIL_FREE_BYTES:
        target[:] = source
    else:
        ctypes.memmove(np.frombuffer(target, np.uint8).ctypes.data, np.frombuffer(source, np.uint8).ctypes.data,
                       len(target))


def _slice(buffers: list[memoryview], start: int, stop: int) -> list[memoryview]:
    """The part [start, stop) of `buffers` laid end to end, as views."""
    out, at = [], 0
    for buffer in buffers:
        lo, hi = max(start - at, 0), min(stop - at, len(buffer))
        if lo < hi:
            out.append(buffer[lo:hi])
        at += len(buffer)
        if at >= stop:
            break
    return out
