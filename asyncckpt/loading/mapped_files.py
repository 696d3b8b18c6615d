"""`MappedFiles`: the memory tier's slab files as a byte source for the parallel reader
(reader.py), copied out of read-only mappings rather than read with `preadv`.

Why: a restore from memory is nothing but a copy of every byte and its CRC32C, and `preadv` from
tmpfs copies one 4 KiB page at a time in the kernel: 0.31-0.33 CPU-s per GiB on this box, against
0.19 for a copy out of a mapping plus about 0.04 to map and unmap its pages. Each reading thread
maps the window of the file it reads (`window_bytes`, its pages mapped in at once:
MADV_POPULATE_READ), copies out of it with NumPy (the GIL released) and unmaps it when it moves
on: mapping and unmapping run on every thread, and no more than a window a thread is mapped. The reader checksums each step
right after it is copied, while it is still in the core's cache, as it does for `preadv`.

Only the tensors' region of a file is mapped (`mapped_bytes`): nothing ever shrinks a slab file
below it (the worker makes a new file for a new slab, and its seal rewrites only what follows),
so no page of a mapping can vanish while it is copied (a SIGBUS). The objects, the header and
anything past that end are read with `pread`, as LocalFiles reads them.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Optional

import numpy as np

from ..errors import PartialLoadError
from .byte_sources import LocalFiles

POPULATE_READ = 22  # MADV_POPULATE_READ (Linux 5.14): a range's pages mapped in one call, not a fault each


class _Window:
    """One thread's mapping of `[start, start + len(data))` of `path`."""

    def __init__(self, path: str, fd: int, start: int, length: int) -> None:
        self.path, self.start = path, start
        self.mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ, offset=start)
        try:
            self.mapping.madvise(POPULATE_READ)
        except OSError:  # a kernel before 5.14: the copies fault the pages in
            pass
        self.data = np.frombuffer(self.mapping, dtype=np.uint8)

    def holds(self, path: str, offset: int, n: int) -> bool:
        return path == self.path and self.start <= offset and offset + n <= self.start + len(self.data)

    def close(self) -> None:
        del self.data  # the array over the mapping goes first: a mapping with views cannot close
        self.mapping.close()


class MappedFiles(LocalFiles):
    """Local files whose first `mapped_bytes[path]` bytes are copied out of mappings."""

    window_bytes = 16 << 20

    def __init__(self, mapped_bytes: dict[str, int]) -> None:
        super().__init__()
        self.mapped_bytes = mapped_bytes
        self._windows = threading.local()
        self._open_windows: list[_Window] = []  # every thread's, for close()
        self._lock = threading.Lock()

    def read_into(self, path: str, offset: int, buffers: list[memoryview], what: str) -> None:
        total = sum(len(b) for b in buffers)
        window = self._window(path, offset, total, what)
        if window is None:
            return super().read_into(path, offset, buffers, what)
        at = offset - window.start
        for buffer in buffers:
            n = len(buffer)
            np.copyto(np.frombuffer(buffer, dtype=np.uint8), window.data[at:at + n])
            at += n

    def _window(self, path: str, offset: int, n: int, what: str) -> Optional[_Window]:
        """This thread's window holding the range, mapped now if need be; None past the mapped end."""
        end = self.mapped_bytes.get(path, 0)
        if offset + n > end:
            return None
        window: Optional[_Window] = getattr(self._windows, "current", None)
        if window is not None and window.holds(path, offset, n):
            return window
        if window is not None:
            self._drop(window)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        fd = self._thread_fd(path, PartialLoadError)
        length = min(max(self.window_bytes, offset + n - start), end - start)
        size = os.fstat(fd).st_size
        if size < start + length:
            raise PartialLoadError(f"{what}: the file ends at byte {size}, inside the item (truncated)")
        try:
            window = _Window(path, fd, start, length)
        except OSError as exc:
            raise PartialLoadError(f"{what}: cannot map bytes {start}..{start + length} ({exc.strerror or exc})") from None
        self._windows.current = window
        with self._lock:
            self._open_windows.append(window)
        return window

    def _drop(self, window: _Window) -> None:
        with self._lock:
            self._open_windows.remove(window)
        window.close()

    def close(self) -> None:
        with self._lock:
            windows, self._open_windows = self._open_windows, []
        for window in windows:
            window.close()
        self._windows = threading.local()
        super().close()
