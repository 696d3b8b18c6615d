"""Memory for a first save's private copy, readied while the worker is busy with `prepare`.

A save that comes while the worker is still preparing (starting up, readying its slab) is handed
over from a private copy (first_save.py), so that the worker's unfinished work does not land on
it. Copying into fresh memory costs the page faults as well as the copy (twice or more a steady
save's copy); so `prepare` readies that memory meanwhile: one shared-memory segment the size of
the state's CPU tensors, faulted in by a thread of its own. The save that takes it copies into
warm pages, and the copy is already where the worker can map it (no second packing copy).
No save needs it once the worker has answered the preparation; it is let go when the next save
is staged, on a thread of its own (unmapping a faulted GiB takes ~0.2 s: that save's blocked
time doubled when it was let go on the caller's thread as the save found the answer).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from .sharing import (SHM_HEADROOM_BYTES, free_shared_storages, populate_for_writing, shared_segment,
                      shm_bytes, shm_free_bytes)
from .snapshot import Snapshot

ALIGN = 64  # bytes: where each tensor's copy starts in the copy's one buffer
# A save that comes while the faulting is under way waits for it: faulting fresh memory itself
# would cost the save as much again. Bounded all the same; past it, the save copies into fresh memory.
READY_WAIT_S = 30.0


def packed(tensors: list[Optional[torch.Tensor]]) -> tuple[list[int], int]:
    """Where each tensor starts in one buffer holding them all (None: takes no room), and its size."""
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        if tensor is not None:
            total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return offsets, total


class SpareCopy:
    """A shared-memory segment for `nbytes`, faulted in on a daemon thread; `take` hands it to
    one save, `release` lets it go (a segment the thread finishes after either is dropped)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._buffer: Optional[torch.Tensor] = None
        self._wanted = True
        self._thread = threading.Thread(target=self._ready, name="asyncckpt-spare-copy", daemon=True)
        self._thread.start()

    @classmethod
    def for_snapshot(cls, snapshot: Snapshot) -> Optional["SpareCopy"]:
        """One for the CPU tensors of `snapshot`, where /dev/shm has room for it beside them."""
        if snapshot.cuda_devices:
            return None
        total = packed(snapshot.tensors)[1]
        free = shm_free_bytes()
        if total == 0 or (free is not None and shm_bytes(total) + SHM_HEADROOM_BYTES > free):
            return None
        return cls(total)

    def _ready(self) -> None:
        try:
            buffer = torch.empty(0, dtype=torch.uint8).set_(shared_segment(self.nbytes))
            _fault_in(buffer)  # every page faulted in now, not in the save
        except Exception:  # e.g. /dev/shm filled meanwhile: the save copies into fresh memory
            return
        with self._lock:
            if self._wanted:
                self._buffer = buffer

    def wait_ready(self) -> None:
        """Until every page is faulted in (at most `READY_WAIT_S`)."""
        self._thread.join(READY_WAIT_S)

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        """The faulted-in segment, once ready (waiting `READY_WAIT_S` at most), if it holds `nbytes`."""
        self._thread.join(READY_WAIT_S)
        with self._lock:
            buffer, self._buffer, self._wanted = self._buffer, None, False
        return buffer if buffer is not None and buffer.numel() >= nbytes else None

    def release(self) -> None:
        """Let the segment go. Unmapping it frees every faulted page (~0.2 s per GiB here): that
        happens on a thread of its own, not in the save that finds the preparation answered."""
        with self._lock:
            held = [self._buffer] if self._buffer is not None else []
            self._buffer, self._wanted = None, False
        if held:
            threading.Thread(target=_let_go, args=(held,), name="asyncckpt-spare-release", daemon=True).start()


def _let_go(held: list[torch.Tensor]) -> None:
    """Free the segment's pages without the GIL, then drop it (the last reference: an unmap of
    nothing left). Dropping it whole would hold the GIL while the kernel frees every page."""
    free_shared_storages(held)
    held.clear()


FAULT_CHUNK = 64 << 20
FAULT_THREADS = max(2, min(8, os.cpu_count() or 1))


def _fault_in(buffer: torch.Tensor) -> None:
    """Fault in every page of `buffer` in chunks on several threads (one faults about 1 GB/s);
    madvise where the kernel can, else by writing the chunk (its contents do not matter yet)."""

    def fault(start: int) -> None:
        chunk = buffer[start:start + FAULT_CHUNK]
        if not populate_for_writing(chunk.data_ptr(), chunk.numel()):
            chunk.fill_(0)

    with ThreadPoolExecutor(FAULT_THREADS, thread_name_prefix="asyncckpt-spare-fault") as pool:
        list(pool.map(fault, range(0, buffer.numel(), FAULT_CHUNK)))
