"""Writing data files: each staging round's part of every file, with threads or forked children.

Both modes run the same `write_part`, so they produce byte-identical files. Files are opened by
the worker (rounds.py) and appended to round after round; a failure names the file.
"""

from __future__ import annotations

import logging
import errno
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from asyncckpt.formats import ItemSink, use_fast_serialization, write_object_bytes, write_tensor, write_tensor_streamed
from asyncckpt.protocol import TENSOR, ItemSpec, ItemWritten, WriteOptions
from asyncckpt.storage import WriteHandle

from asyncckpt_worker.buckets import Bucket
from asyncckpt_worker.forkserver import ForkServer
from asyncckpt_worker.staging import SlabShare

log = logging.getLogger("asyncckpt.worker")


class WriteError(Exception):
    """Writing a data file failed; `path` names it."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message

    def __reduce__(self):  # crosses the pipe from a forked writer
        return (WriteError, (self.path, self.message))


@dataclass
class SaveData:
    """What writers read for one save: the items, their staged tensors, the pickled objects."""

    items: Sequence[ItemSpec]
    staged: Sequence[Optional[torch.Tensor]]
    objects: dict[int, bytes]
    options: WriteOptions
    slab: Optional[SlabShare] = None  # where forked writers find the staged tensors


@dataclass
class OpenFile:
    """A data file being written, round after round: the next item goes at `offset`."""

    bucket: Bucket
    path: str
    handle: WriteHandle
    offset: int = 0
    committed: bool = False


def write_part(data: SaveData, file: OpenFile, positions: Sequence[int], commit: bool):
    """Append the items at `positions` to `file`; commit (fsync, close) it when asked.
    Returns (where each item landed, the file's new end)."""
    sink = ItemSink(file.handle, data.options.checksums, file.offset)
    written: list[ItemWritten] = []
    try:
        for pos in positions:
            spec = data.items[pos]
            start = sink.begin_item()
            if spec.kind == TENSOR:
                write_tensor(sink, data.staged[pos], file.bucket.format)
            else:
                write_object_bytes(sink, data.objects[pos])
            written.append(_landed(spec, file, start, sink))
        if commit:
            file.handle.commit()
    except BaseException as exc:
        raise WriteError(file.path, describe(exc)) from exc
    return written, sink.offset


def write_streamed(data: SaveData, file: OpenFile, pos: int, pieces: Iterable) -> list[ItemWritten]:
    """Append one tensor that passes through the staging slab in `pieces` (runs in the worker,
    which may touch CUDA; forked writers never do)."""
    spec = data.items[pos]
    sink = ItemSink(file.handle, data.options.checksums, file.offset)
    try:
        start = sink.begin_item()
        write_tensor_streamed(sink, spec.dtype, spec.shape, pieces, file.bucket.format)
    except BaseException as exc:
        raise WriteError(file.path, describe(exc)) from exc
    file.offset = sink.offset
    return [_landed(spec, file, start, sink)]


def _landed(spec: ItemSpec, file: OpenFile, start: int, sink: ItemSink) -> ItemWritten:
    return ItemWritten(spec.index, file.bucket.file_name, start, sink.offset - start, sink.item_crc())


def describe(exc: BaseException) -> str:
    # torch.save's C++ writer turns an OSError from write() (ENOSPC, EFBIG, EIO) into a bare
    # "unexpected pos" RuntimeError; the OSError survives only as its __context__
    seen = exc
    for _ in range(8):  # a short walk down the chain (chains can loop)
        if seen is None or (isinstance(seen, OSError) and seen.errno):
            break
        seen = seen.__cause__ or seen.__context__
    if isinstance(seen, OSError):
        exc = seen
    if isinstance(exc, OSError) and exc.errno:
        return f"[{errno.errorcode.get(exc.errno, exc.errno)}] {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


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
                outcomes += self._in_threads(options, [(f, _commit, (f,)) for f, _ in parts], deadline)
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
        from asyncckpt_worker.forked import write_in_children  # it builds on this module's writers

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


def _commit(file: OpenFile):
    try:
        file.handle.commit()
    except BaseException as exc:
        raise WriteError(file.path, describe(exc)) from exc
    return None


def prepare_writer(nice: Optional[int]) -> None:
    """Run in every writer thread or child: torch.save's own CRC off (its setting is per
    thread), and the configured lower CPU priority (per thread on Linux, so staging keeps the
    trainer's)."""
    use_fast_serialization()
    if nice:
        try:
            os.nice(nice)
        except OSError as exc:
            log.warning("could not lower writer CPU priority by %d: %s", nice, exc)
