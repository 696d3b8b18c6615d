"""The mount a path is on, from /proc/self/mountinfo: its filesystem type and options (what a
lock on it reaches: save/mounts.py; whether its ranks share a page cache: loading/safe_reader.py)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    options: frozenset[str]  # the per-mount and the filesystem's (super) options together


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a /proc/PID/mountinfo text, in its order (a later mount hides an earlier one
    at the same point). A line: ID PARENT MAJ:MIN ROOT POINT OPTIONS [TAGS...] - FSTYPE SOURCE SUPER."""
    mounts = []
    for line in text.splitlines():
        before, dash, after = line.partition(" - ")
        fields, rest = before.split(), after.split()
        if not dash or len(fields) < 6 or not rest:
            continue
        options = fields[5].split(",") + (rest[2].split(",") if len(rest) > 2 else [])
        mounts.append(Mount(_unescape(fields[4]), rest[0], frozenset(options)))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str, mounts: list[Mount]) -> Optional[Mount]:
    """The mount `path` is on: the longest mount point holding it, the last one of that length."""
    path = os.path.realpath(path)
    found = None
    for mount in mounts:
        inside = mount.point == "/" or path == mount.point or path.startswith(mount.point.rstrip("/") + "/")
        if inside and (found is None or len(mount.point) >= len(found.point)):
            found = mount
    return found


def mount_of_path(path: str) -> Optional[Mount]:
    """The mount `path` is on in this process (None where /proc/self/mountinfo cannot be read)."""
    try:
        with open(MOUNTINFO) as file:
            return mount_of(path, parse_mountinfo(file.read()))
    except OSError:
        return None
