"""io="process": one round's parts written by writer children forked from the fork server.

The worker sends each child a `ChildJob` (what to write, where each staged tensor sits in the
slab) with the data file's and the slab's descriptors; the child maps the slab, writes with the
same `write_part` as the thread writers and sends back its outcome. Every wait is bounded by the
round's deadline: a child still running then is killed, and its file named.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import signal
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from asyncckpt.protocol import TENSOR, ItemSpec, WriteOptions

from .buckets import Bucket
from .forkserver import ForkServer, ForkServerError, split_result
from .parts import OpenFile, SaveData, WriteError, prepare_writer, write_part


@dataclass
class ChildJob:
    """What one forked writer writes: `positions` of one file, appended at `offset`."""

    items: dict[int, ItemSpec]
    slab_offsets: dict[int, int]  # tensor position -> where its staged bytes start in the slab
    objects: dict[int, bytes]
    options: WriteOptions
    bucket: Bucket
    path: str
    offset: int
    positions: list[int]
    slab_size: int
    nice: Optional[int]


@dataclass
class _Child:
    """A launched writer: its file, pid, the read end of its result pipe, what came back."""

    file: OpenFile
    pid: int
    read_fd: int
    data: bytearray = field(default_factory=bytearray)
    eof: bool = False
    killed: bool = False  # by us, for not finishing in time


def write_in_children(
    forks: ForkServer, data: SaveData, parts: list, deadline: float, nice: Optional[int], live: set
) -> list:
    """Write each (file, positions) part in a child of `forks`; every outcome is a WriteError
    or (items, end, file). `live` holds the pids of running children (for the watchdog)."""
    launched: list[_Child] = []
    try:
        for file, positions in parts:
            payload, fds = _job(data, file, positions, nice)
            try:
                pid, read_fd = forks.spawn(payload, fds, deadline - time.monotonic())
            except ForkServerError as exc:
                raise WriteError(file.path, str(exc)) from exc
            live.add(pid)
            launched.append(_Child(file, pid, read_fd))
        _read_results(launched, deadline)
    finally:
        for child in launched:
            os.close(child.read_fd)
            if not child.eof:  # still running at the deadline (or we are failing): it goes
                child.killed = True
                _kill(child.pid)
            live.discard(child.pid)
    return [_outcome(child, data.options.timeout_s) for child in launched]


def child_main(payload: bytes, fds: list) -> int:
    """A forked writer's whole life (the fork server's target): map the slab, write the part,
    send the outcome through the result pipe. Returns the exit code."""
    result_fd, file_fd, *slab_fd = fds
    job: ChildJob = pickle.loads(payload)
    prepare_writer(job.nice)
    slab = mmap.mmap(slab_fd[0], job.slab_size) if slab_fd else None
    staged: dict[int, torch.Tensor] = {}
    for pos in job.positions:
        spec = job.items[pos]
        if spec.kind != TENSOR:
            continue
        if spec.nbytes == 0:
            staged[pos] = torch.empty(spec.shape, dtype=spec.dtype)
        else:
            flat = torch.frombuffer(slab, dtype=torch.uint8, count=spec.nbytes, offset=job.slab_offsets[pos])
            staged[pos] = flat.view(spec.dtype).view(spec.shape)
    data = SaveData(job.items, staged, job.objects, job.options)
    file = OpenFile(job.bucket, job.path, _FdWriter(job.path, file_fd), job.offset)
    code = 0
    try:
        outcome = write_part(data, file, job.positions, commit=False)
    except WriteError as exc:
        outcome, code = exc, 1
    view = memoryview(pickle.dumps(outcome))
    while view:
        view = view[os.write(result_fd, view) :]
    return code


class _FdWriter:
    """The data file as a child writes it: the worker's open file, through its descriptor (the
    file position is shared, so the child appends where the worker left off)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += os.write(self._fd, view[written:])
        return written


def _job(data: SaveData, file: OpenFile, positions: list[int], nice: Optional[int]) -> tuple:
    """The pickled ChildJob and the descriptors it needs: the data file, then the slab."""
    slab = data.slab
    offsets = {}
    for pos in positions:
        if data.items[pos].kind == TENSOR and data.items[pos].nbytes:
            offsets[pos] = data.staged[pos].data_ptr() - slab.base
    job = ChildJob(
        items={pos: data.items[pos] for pos in positions},
        slab_offsets=offsets,
        objects={pos: data.objects[pos] for pos in positions if pos in data.objects},
        options=data.options,
        bucket=file.bucket,
        path=file.path,
        offset=file.offset,
        positions=list(positions),
        slab_size=slab.size if offsets else 0,
        nice=nice,
    )
    fds = [file.handle.fileno()] + ([slab.fd] if offsets else [])
    return pickle.dumps(job), fds


def _read_results(children: list[_Child], deadline: float) -> None:
    """Read every child's result pipe to its end, all at once (a child blocks on a full pipe),
    until `deadline`."""
    waiting = {child.read_fd: child for child in children}
    poller = select.poll()  # not select(): the worker holds thousands of descriptors (shared storages)
    for fd in waiting:
        poller.register(fd, select.POLLIN)
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for fd, _ in poller.poll(left * 1000):
            chunk = os.read(fd, 1 << 16)
            if chunk:
                waiting[fd].data += chunk
            else:
                waiting.pop(fd).eof = True
                poller.unregister(fd)


def _outcome(child: _Child, timeout_s: float):
    path = child.file.path
    if child.killed:
        return WriteError(path, f"writer process {child.pid} did not finish within {timeout_s:.1f}s; killed it")
    payload, status = split_result(bytes(child.data))
    try:
        outcome = pickle.loads(payload)
    except Exception:
        reason = _exit_reason(status) if status is not None else "no exit status: the fork server is gone"
        return WriteError(path, f"writer process {child.pid} died ({reason})")
    return outcome if isinstance(outcome, WriteError) else (*outcome, child.file)


def _exit_reason(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)  # ends a stopped child too; the fork server reaps it
    except ProcessLookupError:
        pass
