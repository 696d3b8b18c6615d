"""What the integrations (doors/) and the tests ask of an AsyncCheckpointer beyond the training
loop's API: its memory tier, its worker's state, the folder of a directory they will save into,
the save in flight. A mixin of AsyncCheckpointer (checkpointer.py), kept here so that module
holds the save and load path alone."""

from __future__ import annotations

import os
from typing import Optional

from .memory_tier import MemoryTier


class IntegrationHooks:
    """AsyncCheckpointer's accessors for the doors; every attribute it uses is the checkpointer's."""

    def resumed_from(self, path: str) -> None:
        """Incremental: the next save reuses what it can of committed checkpoint `path`, loaded by the caller."""
        self._incremental.resumed(path)

    @property
    def memory_tier(self) -> Optional[MemoryTier]:  # the doors' resumes read from it (MemoryTier.load_saved)
        return self._memory

    @property
    def worker_ready(self) -> bool:  # the worker has started up (and lives): a save waits for no start-up
        return self._worker_free() and self._worker.ready

    @property
    def worker_alive(self) -> bool:  # started or starting, and not dead
        return not self._worker_free() or self._worker.alive

    def _worker_free(self, wait: bool = False) -> bool:  # no first save's hand-off uses the worker now
        return self._in_flight is None or self._in_flight.hand_off is None or self._in_flight.hand_off.finished(wait)

    def ensure_worker(self) -> None:
        """Start a worker if there is none (it died, or was killed), without waiting for it."""
        self._check_open()
        self._worker_free(wait=True)
        self._worker.ensure_alive()

    def take_folder_of(self, checkpoint_dir: str) -> None:
        """Take the folder holding `checkpoint_dir` for this job now, as a save into it would (a caller
        holding a save for later learns at once that it is another job's). One process saving alone."""
        self._check_open()
        self._folders.take_folder_of(os.fspath(checkpoint_dir), self.config.fsync)

    def wait_tidy(self) -> bool:  # files that commits made obsolete are gone (waits at most timeout_s)
        return self._janitor.wait(self.config.timeout_s)

    in_flight_dir = property(lambda self: self._in_flight.step_dir if self._in_flight is not None else None,
                             doc="The directory the save in flight writes (None when no save is in flight).")
    in_flight_base_dirs = property(
        lambda self: self._in_flight.base_dirs if self._in_flight is not None else (),
        doc="Incremental: the checkpoints whose files the save in flight may reuse. Deleting one meanwhile "
            "would only cost that save its reuse; waiting for the save keeps the reuse.")
