"""Whether `flock` on a folder excludes processes of other hosts. A folder's lock (job_lock.py)
keeps a second job out only as far as its filesystem's flock reaches: a local disk holds one
host's jobs anyway; NFS (local_lock=none, the default) and Lustre mounted with `flock` lock on the
server, for every host. NFS mounted with `local_lock=flock`, `local_lock=all` or `nolock`, and
Lustre with `localflock`, keep flock locks on each client: a job on another host saving into the
same folder would not be detected. Those mounts are read from /proc/self/mountinfo and warned
about once per mount."""

from __future__ import annotations

import logging
from typing import Optional

from ..storage.mounts import Mount, mount_of_path

log = logging.getLogger(__name__)

_warned: set[str] = set()  # mount points warned about in this process


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
    mount = mount_of_path(folder)
    reason = local_flock(mount) if mount is not None else None
    if reason is None or mount.point in _warned:
        return
    _warned.add(mount.point)
    log.warning("%s is on %s, %s: its flock locks are this host's only, so a job on another host saving "
                "into the same folder would not be refused (docs/guarantees.md, One job per root)",
                folder, mount.point, reason)
