"""Whether the memory tier's `memory_dir` is memory.

The tier's copy is meant to outlive the trainer in RAM (a tmpfs such as /dev/shm). A
`memory_dir` on a disk still works, but every save then stages through that disk's page cache
and writes it back: say so once, where the tier is set up.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

log = logging.getLogger("asyncckpt")

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
MOUNTS = "/proc/mounts"
_warned: set[str] = set()


def filesystem_type(path: str) -> Optional[str]:
    """The type of the filesystem `path` is on (the longest mount point above it), or None where
    the mount table cannot be read (not Linux)."""
    try:
        with open(MOUNTS) as f:
            table = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best: tuple[int, Optional[str]] = (-1, None)
    for fields in table:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best[0]:
            best = (len(point), fields[2])
    return best[1]


def warn_unless_memory(directory: str) -> None:
    """A WARNING (once per directory and process) when `directory` is not on a memory filesystem."""
    kind = filesystem_type(directory)
    if kind is None or kind in MEMORY_FILESYSTEMS or directory in _warned:
        return
    _warned.add(directory)
    log.warning(
        "memory_tier: memory_dir %r is on a %s filesystem, not in memory (tmpfs): each save's copy is written "
        "to that disk as well and does not survive as a RAM copy; use a tmpfs such as /dev/shm", directory, kind,
    )
