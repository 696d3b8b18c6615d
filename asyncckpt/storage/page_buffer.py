"""Bytes kept in page-aligned memory, so a local file system can write them without a CPU copy.

A steady save's coordinator writes the same `.metadata` bytes save after save, with only a short
tail new (save/metadata_bytes.py): GiBs at 16,384 ranks for a 70B model. Through the page cache
every write costs the CPU a copy of every byte (~0.7 s per GiB here, and writeback after it);
with O_DIRECT from page-aligned memory the device reads the pages itself (~0.05 s per GiB), so
the commit's CPU barely grows with the file (docs/benchmark.md, "Scale"). Object stores and file
systems that refuse O_DIRECT get the bytes the ordinary way.
"""

from __future__ import annotations

import mmap

PAGE = mmap.PAGESIZE


def round_up(size: int, to: int = PAGE) -> int:
    return -(-size // to) * to


class PageBuffer:
    """A growable byte string in an anonymous mapping (page-aligned, zero-filled past its end)."""

    def __init__(self, capacity: int) -> None:
        self._map = _anonymous(max(PAGE, round_up(capacity)))
        self.length = 0

    def append(self, data) -> int:
        """Copy `data` in at the end; returns where it starts."""
        view = memoryview(data).cast("B")
        start, end = self.length, self.length + len(view)
        if end > len(self._map):
            self._grow(end)
        self._map[start:end] = view
        self.length = end
        return start

    def truncate(self, length: int) -> None:
        """Keep the first `length` bytes (what follows reads as zeros again: see `padded_view`)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} bytes to {length}")
        end = min(round_up(self.length), len(self._map))
        self._map[length:end] = bytes(end - length)
        self.length = length

    def view(self, start: int = 0, end: int | None = None) -> memoryview:
        return memoryview(self._map)[start:self.length if end is None else end]

    def padded_view(self) -> memoryview:
        """The bytes, then zeros to a whole page: what an O_DIRECT write takes (the file is cut to
        `length` after it)."""
        return memoryview(self._map)[:round_up(self.length)]

    def _grow(self, needed: int) -> None:
        bigger = _anonymous(round_up(max(needed, 2 * len(self._map))))
        bigger[:self.length] = self._map[:self.length]
        self._map = bigger  # the old mapping goes with its last view


def _anonymous(size: int) -> mmap.mmap:
    """Private memory (a process forked meanwhile gets its own copy on write, not these pages)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
