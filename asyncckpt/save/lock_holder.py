"""Who holds a folder for its job (job_lock.py), and the errors that name the holder."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Optional

from ..errors import CheckpointError


@dataclass(frozen=True)
class Holder:
    """Who holds a folder (what its lock file or lease records)."""

    job: str
    host: str
    pid: int
    since: float  # when it took the folder, seconds since the epoch
    expires: Optional[float] = None  # leases only: free after this (the holder's clock)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Optional["Holder"]:
        try:
            fields = json.loads(data)
            return cls(str(fields["job"]), str(fields["host"]), int(fields["pid"]), float(fields["since"]),
                       None if fields.get("expires") is None else float(fields["expires"]))
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        return f"job {self.job} (host {self.host}, pid {self.pid}, since {clock_text(self.since)})"

    def gone(self) -> bool:
        """A process of this host that no longer runs."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # EPERM: it runs, as another user
            pass
        return False


def clock_text(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def taken_over(what: str, holder: Optional[Holder], how: str) -> CheckpointError:
    by = holder.describe() if holder is not None and holder is not UNRECORDED else "another job"
    return CheckpointError(
        f"{what} taken over by {by} ({how}): this job no longer holds it, so this save is not published "
        "and nothing there is deleted; stop one of the two jobs"
    )


def in_use(what: str, holder: str, remedy: str) -> CheckpointError:
    return CheckpointError(
        f"{what} is in use by another job: {holder}. Two jobs saving into one folder overwrite "
        f"each other's checkpoints: give this job a folder of its own, or {remedy}"
    )


UNRECORDED = Holder("?", "?", 0, 0.0)  # a lock file held by a process that wrote no record in it
