"""Writing data files: each staging round's part of every file, on writer threads (io="thread")
or forked writer children (io="process", forked.py). Both run parts.write_part, so they produce
byte-identical files. Files are opened by the worker (rounds.py) and appended to round after
round; a failure names the file.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional

from asyncckpt.protocol import ItemWritten, WriteOptions

from .forked import write_in_children
from .forkserver import ForkServer
from .parts import OpenFile, SaveData, WriteError, commit, prepare_writer, write_part

log = logging.getLogger("asyncckpt.worker")


class Writers:
    """Runs the writes of one round in the configured I/O mode."""

    def __init__(self, nice: Optional[int] = None, forks: Optional[ForkServer] = None) -> None:
        self._nice = nice  # applied in each writer thread and child only (nice is per thread on Linux)
        self._forks = forks  # forks the io="process" writers (see forkserver.py)
        self._threads: Optional[ThreadPoolExecutor] = None
        self._thread_count = 0
        self.children: set[int] = set()  # pids of live forked writers, for the watchdog

    def run(
        self, data: SaveData, parts: list[tuple[OpenFile, list[int]]], final: bool, deadline: float
    ) -> list[ItemWritten]:
        """Write every part (one per file, so no two writers share a file); with `final`, also
        commit every file of `parts`. Waits for all (until the monotonic `deadline`: a write or
        upload still running then fails, naming its file) before reporting the first failure."""
        options = data.options
        if options.io == "process":
            outcomes = self._in_children(data, [(f, p) for f, p in parts if p], deadline)
            # commit (on object stores: upload) only when every child's part landed: a file a child
            # failed on is partial and must never be published; the caller aborts them all
            if final and not any(isinstance(o, WriteError) for o in outcomes):
                outcomes += self._in_threads(options, [(f, commit, (f,)) for f, _ in parts], deadline)
        else:
            calls = [(f, write_part, (data, f, p, final)) for f, p in parts]
            outcomes = self._in_threads(options, calls, deadline)
        first_error = next((o for o in outcomes if isinstance(o, WriteError)), None)
        if first_error is not None:
            raise first_error
        written: list[ItemWritten] = []
        for outcome in outcomes:
            if outcome is not None:
                items, end, file = outcome
                written += items
                file.offset = end
        if final:
            for file, _ in parts:
                file.committed = True
        return written

    def _in_threads(self, options: WriteOptions, calls: list[tuple], deadline: float) -> list:
        """Run (file, fn, args) calls on the writer threads; each outcome is a WriteError,
        None, or (items, end, file). A call still running at `deadline` becomes a WriteError and
        its pool is abandoned (a thread cannot be killed): the next round gets fresh threads."""
        workers = options.io_workers
        if self._threads is None or self._thread_count != workers:
            self._close_threads()
            # torch's serialization config is per thread (a ContextVar): each writer thread turns
            # torch.save's own CRC off itself, or thread and process modes would differ in bytes
            self._threads = ThreadPoolExecutor(
                workers, thread_name_prefix="asyncckpt-writer", initializer=prepare_writer, initargs=(self._nice,)
            )
            self._thread_count = workers
        futures = [(file, self._threads.submit(fn, *args)) for file, fn, args in calls]
        outcomes = []
        for file, future in futures:
            try:
                result = future.result(timeout=max(deadline - time.monotonic(), 0))
            except WriteError as exc:
                outcomes.append(exc)
                continue
            except FutureTimeout:
                outcomes.append(WriteError(file.path, f"write did not finish within {options.timeout_s:.1f}s"))
                continue
            outcomes.append(None if result is None else (*result, file))
        if any(not future.done() for _, future in futures):
            log.warning("writer threads stuck past the save's deadline; abandoning them")
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        return outcomes

    def _in_children(self, data: SaveData, parts: list[tuple[OpenFile, list[int]]], deadline: float) -> list:
        if self._forks is None:
            return [WriteError(file.path, "io='process' needs the worker's fork server, which did not start")
                    for file, _ in parts]
        return write_in_children(self._forks, data, parts, deadline, self._nice, self.children)

    @property
    def usable(self) -> bool:
        """False once the fork server died: no process-mode save can work in this worker."""
        return self._forks is None or self._forks.alive()

    def kill_children(self) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self._close_threads()
        if self._forks is not None:
            self._forks.close()
            self._forks = None

    def _close_threads(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None
