"""Writing buckets to storage: with threads, or with one forked child process per bucket.

Both modes run the same `write_bucket`, so they produce byte-identical files. A failure names the
file; the partial file is removed.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from asyncckpt.formats import ItemSink, use_fast_serialization, write_object_bytes, write_tensor
from asyncckpt.protocol import TENSOR, ItemSpec, ItemWritten, WriteDone, WriteOptions
from asyncckpt.storage import Storage, storage_for

from .buckets import Bucket, make_buckets


class WriteError(Exception):
    """Writing a data file failed; `path` names it."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message

    def __reduce__(self):  # crosses the pipe from a forked writer
        return (WriteError, (self.path, self.message))


@dataclass
class StagedSave:
    """Everything a writer needs for one save: items, their staged tensors and pickled objects."""

    save_id: int
    rank: int
    checkpoint_dir: str
    items: Sequence[ItemSpec]
    staged: Sequence[Optional[torch.Tensor]]
    objects: dict[int, bytes]
    options: WriteOptions


def write_bucket(storage: Storage, save: StagedSave, bucket: Bucket) -> list[ItemWritten]:
    """Write one bucket file, fsync it, and say where each item landed."""
    path = storage.join(save.checkpoint_dir, bucket.file_name)
    try:
        handle = storage.create(path, fsync=save.options.fsync)
    except OSError as exc:
        raise WriteError(path, _describe(exc)) from exc
    sink = ItemSink(handle, checksums=save.options.checksums)
    written: list[ItemWritten] = []
    try:
        for pos in bucket.positions:
            spec = save.items[pos]
            start = sink.begin_item()
            if spec.kind == TENSOR:
                write_tensor(sink, save.staged[pos])
            else:
                write_object_bytes(sink, save.objects[pos])
            written.append(
                ItemWritten(spec.index, bucket.file_name, start, sink.offset - start, sink.item_crc())
            )
        handle.commit()
    except BaseException as exc:
        handle.abort()
        raise WriteError(path, _describe(exc)) from exc
    return written


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        import errno as _errno

        return f"[{_errno.errorcode.get(exc.errno, exc.errno)}] {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


class Writers:
    """Runs the writes of one save in the configured I/O mode."""

    def __init__(self) -> None:
        self._threads: Optional[ThreadPoolExecutor] = None
        self._thread_count = 0
        self.children: set[int] = set()  # pids of live forked writers, for the watchdog

    def write(self, save: StagedSave) -> WriteDone:
        started = time.perf_counter()
        storage = storage_for(save.checkpoint_dir)
        object_sizes = {pos: len(data) for pos, data in save.objects.items()}
        buckets = make_buckets(
            save.items, object_sizes, save.rank, save.options.io_workers, save.options.separation_hint
        )
        if save.options.io == "process":
            results = self._write_in_children(storage, save, buckets)
        else:
            results = self._write_in_threads(storage, save, buckets)
        items = tuple(item for bucket_items in results for item in bucket_items)
        return WriteDone(
            save_id=save.save_id,
            items=items,
            files=tuple(b.file_name for b in buckets),
            bytes_written=sum(i.length for i in items),
            write_s=time.perf_counter() - started,
        )

    def _write_in_threads(self, storage: Storage, save: StagedSave, buckets: list[Bucket]):
        if self._threads is None or self._thread_count != save.options.io_workers:
            self.close()
            # torch's serialization config is per thread (a ContextVar): each writer thread turns
            # torch.save's own CRC off itself, or thread and process modes would differ in bytes
            self._threads = ThreadPoolExecutor(
                save.options.io_workers, thread_name_prefix="asyncckpt-writer", initializer=use_fast_serialization
            )
            self._thread_count = save.options.io_workers
        futures = [self._threads.submit(write_bucket, storage, save, b) for b in buckets]
        results, first_error = [], None
        for future in futures:  # wait for all, so no thread still writes when we report
            try:
                results.append(future.result())
            except WriteError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results

    def _write_in_children(self, storage: Storage, save: StagedSave, buckets: list[Bucket]):
        launched = [(bucket, *self._fork_writer(storage, save, bucket)) for bucket in buckets]
        results, first_error = [], None
        for bucket, pid, read_fd in launched:
            payload = _read_all(read_fd)
            _, status = os.waitpid(pid, 0)
            self.children.discard(pid)
            path = storage.join(save.checkpoint_dir, bucket.file_name)
            try:
                outcome = pickle.loads(payload)
            except Exception:
                outcome = WriteError(path, f"writer process died ({_exit_reason(status)})")
            if isinstance(outcome, WriteError):
                first_error = first_error or outcome
            else:
                results.append(outcome)
        if first_error is not None:
            raise first_error
        return results

    def _fork_writer(self, storage: Storage, save: StagedSave, bucket: Bucket) -> tuple[int, int]:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: write one bucket, report, exit without running any parent cleanup
            code = 0
            try:
                os.close(read_fd)
                _die_with_parent()
                use_fast_serialization()
                try:
                    outcome = write_bucket(storage, save, bucket)
                except WriteError as exc:
                    outcome, code = exc, 1
                data = pickle.dumps(outcome)
                view = memoryview(data)
                while view:
                    view = view[os.write(write_fd, view) :]
            finally:
                os._exit(code)
        os.close(write_fd)
        self.children.add(pid)
        return pid, read_fd

    def kill_children(self) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None


def _read_all(fd: int) -> bytes:
    chunks = []
    try:
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def _exit_reason(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this writer child when the worker that forked it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
