"""An object-store folder held for one job: a lease object, renewed while the job runs
(job_lock.py says when a folder is taken and what a lease guarantees)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Optional

from ..errors import CheckpointError
from ..layout import LOCK_FILE
from ..storage import Storage
from .lock_holder import UNRECORDED, Holder, clock_text, in_use, taken_over

log = logging.getLogger(__name__)

LEASE_TTL_S = 60.0  # a lease its job has not renewed for this long is free
LEASE_RENEW_S = 15.0  # how often a running job renews its leases
RELEASE_WAIT_S = 10.0  # at release, how long to wait for a renewal under way


class Lease:
    """A lease object on an object store, written with conditional PUTs (only if absent, or only
    if unchanged since read), so two jobs can never both believe they took it. A thread renews it
    every LEASE_RENEW_S; finding another job's lease there means ours was lost."""

    for_one_dir = False  # (FolderLocks.take) the folder is a checkpoint directory

    def __init__(self, storage: Storage, folder: str, me: Holder, what: str) -> None:
        self.path = storage.join(folder, LOCK_FILE)
        self._storage, self._me, self._what = storage, me, what
        self._lost: Optional[Holder] = None
        self._lost_how = ""
        self._valid_until = 0.0  # the expiry of the last lease this process wrote (its clock)
        self._lock = threading.Lock()  # one read-then-write at a time (the renewer, a confirm)
        self._stop = threading.Event()
        self._renewer: Optional[threading.Thread] = None

    def take(self) -> None:
        try:
            for _ in range(3):  # another process wrote it between our read and our write
                current = self._storage.read_versioned(self.path)
                holder = Holder.decode(current.data) if current is not None else None
                if holder is not None and holder.job != self._me.job and not self._free(holder):
                    raise in_use(self._what, holder.describe(), (
                        f"stop that job first. Its lease ({self.path}) expires at {clock_text(holder.expires or 0)} unless "
                        f"that job renews it: if it is gone, retry after that, or restart with its job id "
                        f"(ASYNCCKPT_JOB_ID={holder.job}) to take it over now"
                    ))
                if self._write(current.version if current is not None else None):
                    break
            else:
                raise CheckpointError(f"{self._what}: its lease {self.path} changed on every try; try again")
        except OSError as exc:
            raise CheckpointError(f"{self._what}: cannot take its lease {self.path}: {exc}") from exc
        self._renewer = threading.Thread(target=self._renew_until_released, name="asyncckpt-lease", daemon=True)
        self._renewer.start()

    def check(self) -> None:
        if self._lost is not None:
            raise taken_over(self._what, self._lost, self._lost_how)

    def confirm(self) -> None:
        """Read the lease now; renew it first if it expires within half its time to live."""
        self.check()
        try:
            self._hold(renew=False)
        except OSError as exc:
            raise CheckpointError(f"{self._what}: cannot confirm that this job still holds its lease "
                                  f"{self.path} (not publishing without it): {exc}") from exc
        self.check()

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(RELEASE_WAIT_S)
        try:
            current = self._storage.read_versioned(self.path)
            holder = Holder.decode(current.data) if current is not None else None
            if holder is not None and holder.job == self._me.job:
                self._storage.remove_file(self.path)
        except OSError as exc:
            log.warning("releasing %s: %s (it expires by itself)", self.path, exc)

    @staticmethod
    def _free(holder: Holder) -> bool:
        return (holder.expires is not None and holder.expires < time.time()) or holder.gone()

    def _write(self, version: Optional[str]) -> bool:
        lease = replace(self._me, expires=time.time() + LEASE_TTL_S)
        written = self._storage.write_if_version(self.path, lease.encode(), version)
        if written:
            self._valid_until = max(self._valid_until, lease.expires)
        return written

    def _hold(self, renew: bool) -> None:
        """Whether this job still holds the lease, from the store: if so, renew it (`renew`, or
        when it expires within LEASE_TTL_S / 2); if not, record who took it (`_lost`)."""
        with self._lock:
            if self._lost is not None:
                return
            for _ in range(2):  # a conditional write that lost a race: read once more
                current = self._storage.read_versioned(self.path)
                holder = Holder.decode(current.data) if current is not None else None
                now = time.time()
                if holder is not None and holder.job != self._me.job:
                    return self._lose(holder, f"ours was not renewed in time, or its holder looked gone; it took over "
                                              f"the lease {self.path}")
                if holder is None and now >= self._valid_until:
                    return self._lose(None, f"this job's lease {self.path} expired at {clock_text(self._valid_until)} "
                                            "and was gone when this job came back")
                if self._stop.is_set() and holder is None:
                    return  # a process of this job let go, and so do we
                if not renew and holder is not None and (holder.expires or 0) - now > LEASE_TTL_S / 2:
                    return
                if self._write(current.version if current is not None else None):
                    return
            raise OSError(f"the lease {self.path} changed under every conditional write")

    def _lose(self, holder: Optional[Holder], how: str) -> None:
        self._lost, self._lost_how = holder if holder is not None else UNRECORDED, how
        log.error("%s: taken over by %s (%s); saves there are refused", self._what,
                  holder.describe() if holder is not None else "another job", how)

    def _renew_until_released(self) -> None:
        while self._lost is None and not self._stop.wait(LEASE_RENEW_S):
            try:
                self._hold(renew=True)
            except OSError as exc:
                log.warning("renewing %s: %s", self.path, exc)
