"""Whether `flock` on a folder excludes processes of other hosts. A folder's lock (job_lock.py)
keeps a second job out only as far as its filesystem's flock reaches: a local disk holds one
host's jobs anyway; NFS (local_lock=none, the default) and Lustre mounted with `flock` lock on the
server, for every host. NFS mounted with `local_lock=flock`, `local_lock=all` or `nolock`, and
Lustre with `localflock`, keep flock locks on each client: a job on another host saving into the
same folder would not be detected. Those mounts are read from /proc/self/mountinfo and warned
about once per mount."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

MOUNTINFO = "/proc/self/mountinfo"
_warned: set[str] = set()  # mount points warned about in this process


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


def local_flock(mount: Mount) -> Optional[str]:
    """Why flock on `mount` excludes only this host's processes; None when nothing says so."""
    if mount.fstype in ("nfs", "nfs4"):
        for option in ("local_lock=flock", "local_lock=all", "nolock"):
            if option in mount.options:
                return f"NFS mounted with {option}"
    if mount.fstype == "lustre" and "localflock" in mount.options:
        return "Lustre mounted with localflock"
    return None


def warn_if_flock_is_local(folder: str) -> None:
    """A WARNING, once per mount, when `folder`'s lock cannot keep out a job on another host."""
    try:
        with open(MOUNTINFO) as file:
            mount = mount_of(folder, parse_mountinfo(file.read()))
    except OSError:
        return
    reason = local_flock(mount) if mount is not None else None
    if reason is None or mount.point in _warned:
        return
    _warned.add(mount.point)
    log.warning("%s is on %s, %s: its flock locks are this host's only, so a job on another host saving "
                "into the same folder would not be refused (docs/guarantees.md, One job per root)",
                folder, mount.point, reason)
