"""The first save to a worker that is still starting: hand it a private copy in the background.

A worker's start-up (an interpreter importing torch: about a second) has no earlier save to hide
behind on the first save. So when a save finds its worker not ready, the trainer does its part as
always (planning, moving its own CPU tensors into shared memory once, in place: what every later
save relies on), copies the tensors into ordinary memory and returns. A background thread moves
that copy into shared memory, waits for the worker, sends it the save of the copy, then hands it
the trainer's own tensors to keep, as `prepare` does, so the second save sends nothing.

Cost: one more copy of the state, in ordinary memory from the call, in shared memory from the
hand-off until the worker has written that first save (it lets the copy go when it takes the
trainer's own tensors). Each rank decides alone: nothing here is a collective.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from .inflight import InFlightSave
from ..protocol import IncrementalBase
from .rank_worker import RankWorker
from .sharing import (
    SHARE_THREADS, SHM_HEADROOM_BYTES, available_memory_bytes, move_into_shared_memory, shareable_tensor, shm_bytes,
    shm_free_bytes,
)
from .snapshot import Snapshot

ALIGN = 64  # bytes: where each tensor's copy starts in the copy's one buffer
EXTRA_BOUND_S = 60.0  # beyond the worker's start-up and its bounded answers: moving the copy into shared memory


class HandOff:
    """One first save handed to the worker by a thread of its own, which also takes the worker's
    answers to it (staged, written, the trainer's tensors taken) into `flight.outcome`. The
    trainer touches the worker again only once `finished` says the thread is done."""

    def __init__(self, worker: RankWorker, flight: InFlightSave, copy: Snapshot, own: Snapshot,
                 bases: tuple[IncrementalBase, ...], slot: int) -> None:
        self.worker, self.flight = worker, flight
        self.bound_s = worker.config.worker_start_timeout_s + 3 * worker.config.timeout_s + EXTRA_BOUND_S
        flight.to_starting_worker = True  # its bounds include the worker's start-up
        self._thread = threading.Thread(target=self._run, args=(copy, own, bases, slot),
                                        name="asyncckpt-first-save", daemon=True)
        self._thread.start()

    def finished(self, wait: bool) -> bool:
        """Whether the hand-off is over (`wait`: waiting for it, at most `bound_s`; past that the
        save fails, and the worker is left to the thread, whose own waits are bounded)."""
        if wait:
            self._thread.join(self.bound_s)
            if self._thread.is_alive() and self.flight.error is None:
                self.flight.error = f"handing the save to the worker did not end within {self.bound_s:.0f}s"
            return True
        return not self._thread.is_alive()

    def _run(self, copy: Snapshot, own: Snapshot, bases: tuple[IncrementalBase, ...], slot: int) -> None:
        try:
            copy = _shared(copy)
            self.worker.ensure_alive()  # a worker that died meanwhile is replaced here, off the trainer's path
            self.worker.send(self.flight, copy, bases, slot)
            self.worker.prepare(own, slot)  # taken after the copy's save: the copy is let go then
            outcome = self.worker.outcome(self.flight, blocking=True)  # bounded; never raises
            self.worker.settle_preparation()  # the save is over once the worker holds the trainer's tensors
            self.flight.outcome = outcome
        except Exception as exc:  # reaches every rank as CheckpointError through finalize's verdict
            self.flight.error = f"handing the save to the worker failed: {type(exc).__name__}: {exc}"


def hand_off_if_starting(worker: RankWorker, flight: InFlightSave, snapshot: Snapshot,
                         bases: tuple[IncrementalBase, ...], slot: int) -> Optional[HandOff]:
    """Hand the save over in the background from a private copy, if `private_snapshot` takes one."""
    copy = private_snapshot(snapshot, worker, slot)
    return None if copy is None else HandOff(worker, flight, copy, snapshot, bases, slot)


def private_snapshot(snapshot: Snapshot, worker: RankWorker, slot: int) -> Optional[Snapshot]:
    """A copy of `snapshot`'s tensors in ordinary memory, when its worker is still starting and
    would be sent every tensor (nothing prepared), and a copy is cheap and safe: CPU tensors only,
    room in /dev/shm for the copy at hand-off, and at least twice its size in available memory
    (asked before copying anything). None otherwise:
    the save waits for the worker instead. The copies are views of one buffer: one shared-memory
    segment, so the copy costs no open files beyond one (a state of many tensors needs one each)."""
    if worker.ready or not worker.holds_nothing_in(slot) or snapshot.cuda_devices:
        return None
    offsets, total = [], 0
    for tensor in snapshot.tensors:
        offsets.append(total)
        if tensor is not None:
            total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    free, available = shm_free_bytes(), available_memory_bytes()
    if free is not None and shm_bytes(total) + SHM_HEADROOM_BYTES > free:
        return None
    if available is not None and 2 * total > available:  # no copy that would push the job towards swap or OOM
        return None
    buffer = torch.empty(total, dtype=torch.uint8)
    copies = [None if t is None else buffer[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
              for t, o in zip(snapshot.tensors, offsets)]
    pairs = sorted(((c, t) for c, t in zip(copies, snapshot.tensors) if t is not None), key=lambda p: -p[0].nbytes)
    # largest first on a few threads: most of the time is the kernel faulting fresh pages in, which
    # runs in parallel (measured, 1 GiB: median 0.39 s on 4 threads, 0.60 s in one loop of copy_)
    with ThreadPoolExecutor(SHARE_THREADS, thread_name_prefix="asyncckpt-copy") as pool:
        list(pool.map(lambda pair: pair[0].copy_(pair[1]), pairs))
    return dataclasses.replace(snapshot, tensors=copies, fingerprints=[None] * len(copies), always_fresh=frozenset())


def _shared(copy: Snapshot) -> Snapshot:
    """The copy with its buffer moved into shared memory (in place), where the worker can reach it."""
    move_into_shared_memory((t, False) for t in copy.tensors if t is not None)
    tensors = [None if t is None else shareable_tensor(t, False, spec.index.fqn)[0]
               for t, spec in zip(copy.tensors, copy.items)]
    return dataclasses.replace(copy, tensors=tensors)
