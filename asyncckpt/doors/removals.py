"""Removals: deleting un-committed checkpoint directories on a background thread, in call order.

Deleting a checkpoint's files takes time the trainer should not wait for: unlinking 86 MB of
fsynced data takes 0.06-0.14 s on a local disk, far longer on an object store. The caller
un-commits the directory first (its `.metadata` goes, so no loader takes it and a crash leaves
a torn directory, never a broken checkpoint), then hands the rest here. Anything that uses that
path next (a save, a load, another removal) waits for its removal first (`wait_for`); a failed
removal is kept for the caller's next call (`take_failures`). Every wait is bounded.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Optional

from ..errors import CheckpointError, CheckpointTimeoutError
from ..storage import storage_for

log = logging.getLogger("asyncckpt")


class Removals:
    """Deletes directories queued by `delete_tree`, one at a time, on one daemon thread
    (started by the first one). `timeout_s` bounds every wait for them."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._queue: collections.deque[str] = collections.deque()
        self._busy: Optional[str] = None  # the directory being deleted right now
        self._failures: list[str] = []
        self._serving = False  # a thread is serving the queue (it ends when the queue is empty)

    def delete_tree(self, path: str) -> None:
        """Queue the un-committed directory `path` for deletion; returns at once."""
        with self._cond:
            self._queue.append(path)
            if self._serving:
                return
            try:
                threading.Thread(target=self._serve, name="asyncckpt-removals", daemon=True).start()
                self._serving = True
                return
            except RuntimeError:  # no thread to be had (e.g. at interpreter exit): delete it here
                self._queue.remove(path)
        try:
            storage_for(path).remove_tree(path)
        except Exception as exc:
            raise CheckpointError(_failed_text(path, exc)) from exc

    def wait_for(self, path: str) -> None:
        """Return once no removal of `path` is queued or under way."""
        self._wait(lambda: path not in self._queue and self._busy != path, f"the removal of {path!r}")

    def wait_all(self) -> None:
        """Return once every queued removal has ended."""
        self._wait(lambda: not self._queue and self._busy is None, "the queued checkpoint removals")

    def take_failures(self) -> list[str]:
        with self._cond:
            failures, self._failures = self._failures, []
            return failures

    def _wait(self, done, what: str) -> None:
        with self._cond:
            if not self._cond.wait_for(done, self.timeout_s):
                raise CheckpointTimeoutError(
                    f"{what} did not end within timeout_s={self.timeout_s:g}s (a slow or unreachable store?)")

    def _serve(self) -> None:
        while True:
            with self._cond:
                if not self._queue:  # a new thread starts with the next removal
                    self._serving = False
                    return
                self._busy = self._queue.popleft()
            path = self._busy
            try:
                storage_for(path).remove_tree(path)
                log.debug("removed checkpoint %s", path)
            except Exception as exc:
                log.error("removing checkpoint %s failed: %r", path, exc)
                with self._cond:
                    self._failures.append(_failed_text(path, exc))
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()


def _failed_text(path: str, exc: Exception) -> str:
    return f"removing {path} failed (it is un-committed; delete it by hand): {exc!r}"
