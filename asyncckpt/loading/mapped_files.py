"""The memory tier's files as a ByteSource for the parallel reader (reader.py): each file is
mapped once and every read is a copy out of the mapping (ctypes.memmove, the GIL released).

A file in /dev/shm is already memory: a positional read would only have the kernel copy it, a
little slower than memmove (4.2 against 6.5 GB/s a core here). Small steps keep each step in the
CPU cache for its checksum, which the reader computes right after the copy: the bytes come from
memory once (measured on 1 GiB: 0.31 CPU-seconds at 256 KiB steps, 0.37 at 1 MiB, 0.42 for
preadv with the checksum holding the GIL).
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from ..errors import CheckpointError, PartialLoadError
from .byte_sources import ByteSource


class MappedFiles(ByteSource):
    """Local files read by copying out of a shared read-only mapping of each."""

    threads = max(2, min(8, os.cpu_count() or 2))  # memory, not a disk: as many as there are cores
    piece_bytes = 64 << 20
    step_bytes = 256 << 10  # copied, then checksummed while it is in the CPU cache
    whole_item_bytes = 0

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}  # path -> (mapping, its address)

    def open(self, paths: set[str]) -> None:
        for path in sorted(paths):
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    mapping = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else None
            except (OSError, ValueError) as exc:
                self.close()
                raise CheckpointError(f"{path}: cannot map it ({exc}); nothing in state_dict was changed") from None
            self._maps[path] = (mapping, np.frombuffer(mapping, np.uint8).ctypes.data if mapping else 0)

    def read(self, path: str, offset: int, n: int) -> bytes:
        mapping, _ = self._maps[path]
        return mapping[offset:offset + n] if mapping else b""

    def read_into(self, path: str, offset: int, buffers: list[memoryview], what: str) -> None:
        mapping, address = self._maps[path]
        end = offset + sum(len(b) for b in buffers)
        if end > (len(mapping) if mapping else 0):
            raise PartialLoadError(f"{what}: the file ends before byte {end}, inside the item (truncated)")
        for buffer in buffers:
            if len(buffer):
                ctypes.memmove(np.frombuffer(buffer, np.uint8).ctypes.data, address + offset, len(buffer))
                offset += len(buffer)

    def close(self) -> None:
        for mapping, _ in self._maps.values():
            if mapping is not None:
                mapping.close()
        self._maps = {}
