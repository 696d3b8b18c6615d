"""The ceilings a save and a load are measured against: device-to-host copies (pinned and pageable),
host-to-device, and the disk's raw write + fsync and cold read of as many bytes."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from loadbench.measure import drop_cache
from savebench.common import MiB
from savebench.measure import tensor_bytes_view

from .state import state_tensors

ALIGN = 64  # bytes between tensors in a host buffer, as in the worker's staging slab
WRITE_CHUNK = 64 * MiB


@dataclass
class LimitRow:
    """One ceiling: median seconds of its repeats for the whole state, or why it was not measured."""

    name: str
    seconds: Optional[float] = None
    samples: list[float] = field(default_factory=list)
    status: str = "ok"  # ok | skipped | error
    note: str = ""

    def gbps(self, nbytes: int) -> Optional[float]:
        return nbytes / self.seconds / 1e9 if self.seconds else None


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_views(tensors: list[torch.Tensor], pinned: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One host buffer for every tensor (pinned or pageable) and a view of it shaped like each."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    buffer = torch.empty(sum(-(-n // ALIGN) * ALIGN for n in sizes), dtype=torch.uint8, pin_memory=pinned)
    views, offset = [], 0
    for t, n in zip(tensors, sizes):
        views.append(buffer[offset : offset + n].view(t.dtype).view(t.shape))
        offset += -(-n // ALIGN) * ALIGN
    return buffer, views


def timed(repeat: int, run: Callable[[], None], device: torch.device) -> list[float]:
    """Seconds of each of `repeat` runs, the device synchronized before and after each."""
    samples = []
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return samples


def row(name: str, samples: list[float], note: str = "") -> LimitRow:
    return LimitRow(name, statistics.median(samples), samples, note=note)


def copy_limits(state: dict, device: torch.device, repeat: int) -> list[LimitRow]:
    """Pinned and pageable device-to-host copies of every tensor, and pinned host-to-device (which
    writes the same values back). On the CPU both copies are a memcpy into pageable memory and
    there is no host-to-device copy."""
    tensors = state_tensors(state)

    def copy_all(sources: list[torch.Tensor], targets: list[torch.Tensor], non_blocking: bool) -> Callable[[], None]:
        def run() -> None:
            for src, dst in zip(sources, targets):
                dst.copy_(src, non_blocking=non_blocking)
        return run

    if device.type != "cuda":
        _, views = host_views(tensors, pinned=False)
        copy_all(tensors, views, False)()  # faults the pages in
        samples = timed(repeat, copy_all(tensors, views, False), device)
        note = "no GPU: a memcpy into pageable host memory"
        return [row("pinned D2H", samples, note), row("pageable D2H", samples, note),
                LimitRow("pinned H2D", status="skipped", note="no GPU: no host-to-device copy")]
    rows = []
    pinned, views = host_views(tensors, pinned=True)
    rows.append(row("pinned D2H", timed(repeat, copy_all(tensors, views, True), device)))
    rows.append(row("pinned H2D", timed(repeat, copy_all(views, tensors, True), device), "the same values back"))
    del pinned, views
    _, views = host_views(tensors, pinned=False)
    copy_all(tensors, views, False)()  # faults the pages in
    rows.append(row("pageable D2H", timed(repeat, copy_all(tensors, views, False), device), "pages faulted in first"))
    return rows


def disk_limits(state: dict, path: str) -> list[LimitRow]:
    """A raw sequential write of the state's bytes into one file, fsync'd, then a read of it with
    its pages dropped (posix_fadvise DONTNEED after fsync). The file is removed after."""
    tensors = state_tensors(state)
    buffer, views = host_views(tensors, pinned=False)
    for src, dst in zip(tensors, views):
        dst.copy_(src)
    data = tensor_bytes_view(buffer)
    try:
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for offset in range(0, len(data), WRITE_CHUNK):
                chunk = data[offset : offset + WRITE_CHUNK]
                while chunk:
                    chunk = chunk[f.write(chunk):]
            os.fsync(f.fileno())
        write_s = time.perf_counter() - start
        del data, buffer, views
        drop_cache(path)
        dest = memoryview(bytearray(os.path.getsize(path)))  # touched: a load fills memory of its own too
        start = time.perf_counter()
        read_file(path, dest, READ_THREADS)
        read_s = time.perf_counter() - start
    finally:
        if os.path.exists(path):
            os.remove(path)
    return [row("raw write + fsync", [write_s], "one file, 64 MiB writes"),
            row("raw read (cold)", [read_s], f"16 MiB positional reads on {READ_THREADS} threads")]


READ_CHUNK = 16 << 20
READ_THREADS = min(8, os.cpu_count() or 1)


def read_file(path: str, dest: memoryview, threads: int) -> None:
    """Every byte of `path` into `dest`, by positional reads of READ_CHUNK on `threads` threads."""
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(offset: int) -> None:
            done, n = 0, min(READ_CHUNK, len(dest) - offset)
            while done < n:
                got = os.preadv(fd, [dest[offset + done : offset + n]], offset + done)
                if got == 0:
                    raise OSError(f"{path}: ends at {offset + done}")
                done += got

        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(read, range(0, len(dest), READ_CHUNK)))
    finally:
        os.close(fd)
