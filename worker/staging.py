"""The host staging pool: one reused slab, carved into compact per-item storages.

Each staged tensor is a `torch.frombuffer` view over its own slice of the slab, so it owns a
storage of exactly its size: `torch.save` then writes just that chunk, never the whole slab.
The slab is allocated once and grown only when a larger layout arrives (pinned on GPU). With a
staging budget the slab holds one round at a time (rounds reuse the same bytes), and a tensor
larger than the budget passes through it in pieces (`pieces`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Iterator, Optional, Sequence

import torch

from asyncckpt.protocol import TENSOR, ItemSpec

from .buckets import ALIGNMENT, staged_size


@dataclass(frozen=True)
class SlabShare:
    """The staging slab as a forked writer maps it: its memfd, size, and where the worker has it
    mapped (a staged tensor's offset in the slab is its address minus `base`)."""

    fd: int
    size: int
    base: int


class StagingPool:
    """The slab is pinned from the first save that holds CUDA tensors on: a CPU-only job on a
    machine with a GPU never creates a CUDA context here nor page-locks memory."""

    def __init__(self, memory_path: Optional[str] = None) -> None:
        self.memory_path = memory_path  # the memory tier: the slab is this named file (memory_file.py)
        self._pin = False  # a save held CUDA tensors: slabs are page-locked from then on
        self._slab: Optional[torch.Tensor] = None
        self._slab_fd = -1
        self._pinned = False
        self.generation = 0  # bumps when the slab is replaced; views of older generations are stale
        self._streams: dict[int, object] = {}  # a side stream per CUDA device the sources are on
        self._helpers: Optional[ThreadPoolExecutor] = None  # extra copy threads, made on first use
        self._helper_count = 0
        self._unpublished: Optional[str] = None  # the memory tier: a fresh slab file not yet named `memory_path`

    def publish_slab(self) -> None:
        """The memory tier sealed a copy in a fresh slab file: it takes the tier's name now,
        replacing the previous copy (kept until here: a crash while the first save of a new
        worker stages, or after a `prepare`, leaves the previous copy whole)."""
        if self._unpublished is not None:
            os.rename(self._unpublished, self.memory_path)
            self._unpublished = None

    @property
    def capacity(self) -> int:
        return 0 if self._slab is None else self._slab.numel()

    def layout(
        self, items: Sequence[ItemSpec], groups: Sequence[Sequence[int]], reserve: int = 0, budget: Optional[int] = None
    ) -> list[Optional[torch.Tensor]]:
        """Compact staging tensors for the tensor items of every group (None elsewhere). Each
        group is laid out from the start of the slab: groups are staged one after the other.
        The slab holds at least `reserve` bytes (the piece size for streamed tensors), and a new
        one no more than the staging `budget` beyond what it needs."""
        offsets: dict[int, int] = {}
        need = reserve
        for group in groups:
            total = 0
            for pos in group:
                if items[pos].kind == TENSOR:
                    offsets[pos] = total
                    total += staged_size(items[pos])
            need = max(need, total)
        self._ensure_capacity(need, budget)
        buffer = self._slab.numpy()
        views: list[Optional[torch.Tensor]] = [None] * len(items)
        for pos, start in offsets.items():
            spec = items[pos]
            if spec.nbytes == 0:
                views[pos] = torch.empty(spec.shape, dtype=spec.dtype)
            else:
                flat = torch.frombuffer(buffer[start : start + spec.nbytes], dtype=torch.uint8)
                views[pos] = flat.view(spec.dtype).view(spec.shape)
        return views

    def _ensure_capacity(self, nbytes: int, budget: Optional[int], fault: bool = False) -> None:
        if self._slab is not None and self._slab.numel() >= nbytes:
            return
        size = max(nbytes, ALIGNMENT)
        size = max(size, min(_with_headroom(size, self.capacity), budget or sys.maxsize))
        self._release()  # drop the old slab before allocating the new one
        # A memfd mapped MAP_SHARED, not private memory: forked writers (io="process") map it by
        # its descriptor, which the fork server passes on, so a slab allocated (or grown) after
        # the server started is reachable. Private memory would also be write-protected in the
        # worker by every fork (measured: 0.26 s instead of 0.08 s per GiB for the next copy).
        # It is shmem but not in /dev/shm, so it does not count against that mount's size.
        if self.memory_path:  # a fresh file: the previous copy stays whole until this one is sealed
            fd, self._unpublished = _named_slab(self.memory_path, size), next_name(self.memory_path)
        else:
            fd = os.memfd_create("asyncckpt-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self._slab = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        self._slab_fd = fd
        if self._pin or fault:  # registering faulted pages is several times faster than faulting one by one
            fault_in(self._slab)
        if self._pin:
            self._pin_slab()
        self.generation += 1

    def _pin_slab(self) -> None:
        """Page-lock the slab for non-blocking device-to-host copies (registered portable: any
        device's copies may land in it)."""
        from torch.cuda._pin_memory_utils import pin_memory

        pin_memory(self._slab.data_ptr(), self._slab.numel())
        self._pinned = True

    def _ready_for_cuda(self, device: int) -> None:
        """From the first save with CUDA sources on: their device is this process's current one
        (what CUDA creates without naming a device lands there, never on device 0 of a node
        whose ranks each use another GPU), and the slab is pinned."""
        if not self._pin:
            torch.cuda.set_device(device)
            self._pin = True
        if self._slab is not None and not self._pinned:
            self._pin_slab()

    def prepare(self, nbytes: int, budget: Optional[int], sources: Sequence[Optional[torch.Tensor]]) -> None:
        """A first save's one-time work, ahead of it: a slab for `nbytes` of staged tensors (at
        most the budget), its pages faulted in on several threads and, when a source is on a
        GPU, pinned; the CPU sources' shared pages mapped in. The save then only copies."""
        cuda = sorted({src.device.index for src in sources if src is not None and src.is_cuda})
        if cuda and not self._pin:
            torch.cuda.set_device(cuda[0])
            self._pin = True
        self._ensure_capacity(min(nbytes, budget) if budget else nbytes, budget, fault=True)
        host = [src.untyped_storage() for src in sources if src is not None and not src.is_cuda and src.numel()]
        with ThreadPoolExecutor(FAULT_THREADS, thread_name_prefix="asyncckpt-prepare") as pool:
            list(pool.map(lambda storage: populate(storage.data_ptr(), storage.nbytes(), READ), host))

    def share(self) -> Optional[SlabShare]:
        """How a forked writer maps the slab (None before the first layout)."""
        if self._slab is None:
            return None
        return SlabShare(self._slab_fd, self._slab.numel(), self._slab.data_ptr())

    def _release(self) -> None:
        if self._slab is None:
            return
        if self._pinned:
            from torch.cuda._pin_memory_utils import unpin_memory

            unpin_memory(self._slab.data_ptr())
            self._pinned = False
        os.close(self._slab_fd)  # the mapping lives on while views of it do
        self._slab = None

    def copy_in(
        self, sources: Sequence[Optional[torch.Tensor]], views: Sequence[Optional[torch.Tensor]], threads: int = 1
    ) -> None:
        """Copy every source tensor into its staging view.

        GPU sources are copied with non-blocking copies on a side stream of their own device,
        while the CPU sources are copied; then every device's stream is synchronized (returning
        earlier would let `Staged` and the checksums go before the bytes land).
        CPU sources are cut into pieces that `threads` threads take from one queue, so a thread
        that loses its core only takes fewer pieces (a static split would wait for it)."""
        pairs = [(src, dst) for src, dst in zip(sources, views) if src is not None]
        on_device = by_cuda_device(pairs)
        if on_device:
            self._ready_for_cuda(min(on_device))
        host = [(src, dst) for src, dst in pairs if not src.is_cuda]
        launched = []
        try:
            for device in sorted(on_device):
                launched.append(self._launch_device_copies(device, on_device[device]))
            if threads > 1 and host:
                self._copy_on_threads(list(_copy_pieces(host)), threads)
            else:
                for src, dst in host:
                    dst.copy_(src)
        finally:  # never answer while a device still writes the slab
            for stream in launched:
                stream.synchronize()

    def _launch_device_copies(self, device: int, pairs: list) -> object:
        """Queue `pairs`' device-to-host copies on `device`'s side stream; return the stream."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        # a handle opened by this request made the device's current stream wait for the trainer's
        # event (torch's IPC); the side stream inherits that wait
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
        return stream

    def _copy_on_threads(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], threads: int) -> None:
        queue = iter(pieces)
        lock = threading.Lock()

        def drain() -> None:
            while True:
                with lock:
                    piece = next(queue, None)
                if piece is None:
                    return
                piece[1].copy_(piece[0])

        if self._helper_count < threads - 1:
            self._close_helpers()
            self._helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="asyncckpt-staging")
            self._helper_count = threads - 1
        helpers = [self._helpers.submit(drain) for _ in range(threads - 1)]
        try:
            drain()
        finally:  # never report a copy done (or failed) while a helper still writes the slab
            wait(helpers)
        for helper in helpers:
            helper.result()

    def close(self) -> None:
        self._close_helpers()
        self._release()
        if self._unpublished is not None:  # a slab no copy was sealed in (a prepare without a save)
            try:
                os.unlink(self._unpublished)
            except FileNotFoundError:
                pass

    def _close_helpers(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
            self._helpers, self._helper_count = None, 0

    def pieces(self, source: torch.Tensor) -> Iterator:
        """Copy `source` through the slab piece by piece (C order, each at most the slab's size)
        and yield each piece's bytes. A piece is valid until the next one is requested."""
        limit = self.capacity
        flat = self._slab
        for piece in _pieces(source, limit):
            nbytes = piece.numel() * piece.element_size()
            staged = flat[:nbytes].view(piece.dtype).view(piece.shape)
            self.copy_in([piece], [staged])
            yield flat[:nbytes].numpy()


def next_name(path: str) -> str:
    """Where a fresh slab file of the memory tier lives until its first copy is sealed."""
    return path.removesuffix(".slab") + ".next.slab"


def _named_slab(path: str, size: int) -> int:
    """A fresh file for the memory tier (a new inode: views of an older slab stay valid), private
    to this user, at `next_name(path)` until its first copy is sealed, its `size` bytes reserved
    now: on a full tmpfs a fault in a mapped page is a SIGBUS, so a slab that does not fit fails
    here, saying how much it needs. Where the previous copy and the new slab do not both fit,
    the previous copy goes first (with a WARNING)."""
    fresh = next_name(path)
    for attempt in (1, 2):
        try:
            os.unlink(fresh)
        except FileNotFoundError:
            pass
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            return fd
        except OSError as exc:
            os.close(fd)
            os.unlink(fresh)
            if attempt == 1 and exc.errno == errno.ENOSPC and os.path.exists(path):
                logging.getLogger("asyncckpt.worker").warning(
                    "memory tier: no room for a new slab beside the previous copy %s; that copy goes first", path)
                os.unlink(path)
                continue
            room = os.statvfs(os.path.dirname(path))
            raise OSError(exc.errno, f"memory tier: {os.path.dirname(path)} has {room.f_bavail * room.f_frsize / 2**20:.0f} "
                          f"MiB free, the staging slab needs {size / 2**20:.0f} MiB ({exc.strerror})") from None
    raise AssertionError("unreachable")


READ, WRITE = 22, 23  # MADV_POPULATE_READ / MADV_POPULATE_WRITE (Linux 5.14)
_PAGE = mmap.PAGESIZE
_FAULT_CHUNK = 64 << 20
FAULT_THREADS = max(2, min(8, os.cpu_count() or 1))
_libc = ctypes.CDLL(None, use_errno=True)


def populate(start: int, nbytes: int, how: int) -> None:
    """Fault in the pages of the `nbytes` at address `start` for reading or writing, so a later
    copy meets no page fault. Where madvise cannot (an older kernel), touch one byte per page
    (for writing: only on memory whose contents do not matter)."""
    first = start - start % _PAGE
    if _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(start + nbytes - first), how) == 0:
        return
    pages = torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(start), dtype=torch.uint8)[::_PAGE]
    pages.fill_(0) if how == WRITE else int(pages.sum())


def fault_in(slab: torch.Tensor) -> None:
    """Fault in every page of a fresh slab, in chunks on several threads (one thread faults
    about 1 GB/s; the first copy into the slab would otherwise pay for it on the trainer's time)."""
    base, size = slab.data_ptr(), slab.numel()
    chunks = [(base + start, min(_FAULT_CHUNK, size - start)) for start in range(0, size, _FAULT_CHUNK)]
    with ThreadPoolExecutor(FAULT_THREADS, thread_name_prefix="asyncckpt-fault") as pool:
        list(pool.map(lambda chunk: populate(*chunk, WRITE), chunks))


def by_cuda_device(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[int, list]:
    """The (source, destination) pairs whose source is on a CUDA device, by device index."""
    groups: dict[int, list] = {}
    for src, dst in pairs:
        if src.is_cuda:
            groups.setdefault(src.device.index, []).append((src, dst))
    return groups


COPY_PIECE_BYTES = 16 << 20
SLAB_HEADROOM = 1 / 64  # spare bytes beyond the layout: a few new small tensors fit without a new slab
SLAB_GROWTH = 1 / 4  # a slab that must grow grows by at least this share, so growth is rare


def _with_headroom(needed: int, current: int) -> int:
    """The size of a new slab for `needed` bytes. A new slab's pages are faulted in by the copy
    that first writes them, on the trainer's blocked time (about 40 ms per 100 MB here), so a
    state that gains a scalar (Lightning's top-k scores at its second checkpoint event) should
    not replace the slab; rounded up to whole MiB."""
    size = max(needed + int(needed * SLAB_HEADROOM), current + int(current * SLAB_GROWTH) if current else 0)
    return -(-size // (1 << 20)) * (1 << 20)


def _copy_pieces(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(source, destination) pairs with large contiguous tensors cut into flat pieces of at most
    COPY_PIECE_BYTES, largest tensors first, so threads finish together."""
    for src, dst in sorted(pairs, key=lambda pair: -pair[1].nbytes):
        if src.nbytes > COPY_PIECE_BYTES and src.is_contiguous() and dst.is_contiguous():
            flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
            step = COPY_PIECE_BYTES // src.element_size()
            for start in range(0, flat_src.numel(), step):
                yield flat_src[start : start + step], flat_dst[start : start + step]
        else:
            yield src, dst


def _pieces(tensor: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of `tensor` that cover it in C order, each at most `limit` bytes (or one element)."""
    size = tensor.element_size()
    if tensor.numel() * size <= limit or tensor.dim() == 0:
        yield tensor
        return
    row = tensor[0].numel() * size
    if row <= limit:
        step = max(limit // max(row, 1), 1)
        for start in range(0, tensor.shape[0], step):
            yield tensor[start : start + step]
    else:
        for i in range(tensor.shape[0]):
            yield from _pieces(tensor[i], limit)
