"""The first save to a worker (starting, or started but holding nothing of this state yet, or still
busy with `prepare`): hand it a private copy in the background.

A worker's start-up (an interpreter importing torch: about a second) and its first slab (a fresh
copy of the state's size to fault in: 0.5-1 s per GiB here) have no earlier save to hide behind on
the first save. So when a save would send its worker every tensor, the trainer does its part as
always (planning, moving its own CPU tensors into shared memory once, in place: what every later
save relies on) and returns with a private copy: the pages its tensors left when they moved,
which hold the values of the call (no copy made; where torch cannot swap a storage's pages, or a
storage did not move, those tensors are copied into ordinary memory). A background thread packs
that copy into one shared-memory segment, waits for the worker, sends it the save of the copy,
then hands it the trainer's own tensors to keep, as `prepare` does, so the second save sends nothing.
After `prepare`, a save that comes before the worker has answered it (start-up, slab) is handed
over the same way, so that work never lands on it; its copy goes into memory `prepare` readied
meanwhile (spare_copy.py), so the save costs about one warm copy of the state.

Cost: one more copy of the state: in ordinary memory from the call (the pages the move would
have freed), in shared memory from the hand-off until the worker has written that first save (it
lets the copy go when it takes the trainer's own tensors). Each rank decides alone: nothing here
is a collective.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

import torch

from ..config import CheckpointConfig, hand_off_bound_s
from .inflight import InFlightSave
from ..protocol import IncrementalBase
from .rank_worker import RankWorker
from .sharing import (SHARE_THREADS, SHM_HEADROOM_BYTES, available_memory_bytes, free_shared_storages,
                      new_reserved_shared, shm_bytes, shm_free_bytes)
from .snapshot import Snapshot
from .spare_copy import packed as _packed

if TYPE_CHECKING:
    from .memory_tier import MemoryTier

EXTRA_BOUND_S = 60.0  # beyond the worker's start-up and its bounded answers: moving the copy into shared memory


class HandOff:
    """One first save handed to the worker by a thread of its own, which also takes the worker's
    answers to it (staged, written, the trainer's tensors taken) into `flight.outcome`. The
    trainer touches the worker again only once `finished` says the thread is done."""

    def __init__(self, worker: RankWorker, flight: InFlightSave, copy: Snapshot, own: Optional[Snapshot],
                 bases: tuple[IncrementalBase, ...], slot: int) -> None:
        """`own`: the trainer's tensors, handed to the worker to keep after the save (None: not
        now; the persist of a restored copy: mapped_copy.py)."""
        self.worker, self.flight = worker, flight
        config = worker.config  # the sum of its waits: start-up and staging, the writes, Prepared, packing
        self.bound_s = hand_off_bound_s(config) + 2 * config.timeout_s + EXTRA_BOUND_S
        flight.to_starting_worker = True  # its bounds include the worker's start-up
        self._copy: Optional[Snapshot] = copy  # the thread takes it (its memory goes as it is packed)
        self._done = threading.Event()  # not Thread.join/is_alive: a join cut by Ctrl-C marks a live thread dead (3.11)
        self._thread = threading.Thread(target=self._run, args=(own, bases, slot),
                                        name="asyncckpt-first-save", daemon=True)
        self._thread.start()

    def finished(self, wait: bool) -> bool:
        """Whether the hand-off is over (`wait`: waiting for it, at most `bound_s`; past that the
        save fails, and the worker is left to the thread, whose own waits are bounded)."""
        if wait:
            if not self._done.wait(self.bound_s) and self.flight.error is None:
                self.flight.error = f"handing the save to the worker did not end within {self.bound_s:.0f}s"
            return True
        return self._done.is_set()

    def _run(self, own: Optional[Snapshot], bases: tuple[IncrementalBase, ...], slot: int) -> None:
        try:
            copy, self._copy = _shared(self._copy), None
            self.worker.ensure_alive()  # a worker that died meanwhile is replaced here, off the trainer's path
            self.worker.send(self.flight, copy, bases, slot)
            if own is not None:
                self.worker.prepare(own, slot, spare=False)  # taken after the copy's save: the copy is let go then
            outcome = self.worker.outcome(self.flight, blocking=True)  # bounded; never raises
            prepared = self.worker.settle_preparation()  # the save is over once the worker holds the trainer's tensors
            self.flight.outcome = outcome
            if own is not None and prepared and outcome.written is not None:
                # the worker is done with the copy (written; it holds the trainer's tensors now): its
                # pages go off the GIL first (its one segment, packed or prepare's spare: dropping a
                # GiB whole held the GIL ~0.1 s, a stall of the training loop)
                free_shared_storages(copy.tensors)
        except Exception as exc:  # reaches every rank as CheckpointError through finalize's verdict
            self.flight.error = f"handing the save to the worker failed: {type(exc).__name__}: {exc}"
        finally:
            self._done.set()


def hand_off_from_copy(worker: RankWorker, flight: InFlightSave, snapshot: Snapshot,
                         bases: tuple[IncrementalBase, ...], slot: int) -> Optional[HandOff]:
    """Hand the save over in the background from a private copy (`hands_off` said so), if
    `private_snapshot` takes one."""
    copy = private_snapshot(snapshot, worker)
    snapshot.old_pages.clear()  # the copy holds what it needs of them; the others go now
    return None if copy is None else HandOff(worker, flight, copy, snapshot, bases, slot)


def hands_off(config: CheckpointConfig, worker: RankWorker, slot: int, memory: Optional["MemoryTier"]) -> bool:
    """Whether a save in `slot` is handed over from a private copy (if its tensors allow:
    `private_snapshot`): a first save to its worker (`copies_allowed`, `may_hand_off`),
    or the persist of the copy load_latest just restored from memory (`MemoryTier.persisting`),
    whatever the worker's state: the tier's file holds that copy until the persist's own copy is
    sealed, so nothing needs it staged when the call returns, and load_latest waits for neither
    the new worker's start-up nor its staging."""
    if memory is not None and memory.persisting:
        return config.staging_budget_bytes is None and worker.holds_nothing_in(slot)
    return copies_allowed(config) and may_hand_off(worker, slot)


def copies_allowed(config: CheckpointConfig) -> bool:
    """Whether a first save may be handed over from a private copy at all: not with the memory tier
    (its staged save must be in the tier's file when the call returns), nor under a staging budget
    (it bounds what a save holds: the save waits for the worker instead). The doors ask this too."""
    return not config.memory_tier and config.staging_budget_bytes is None


def may_hand_off(worker: RankWorker, slot: int) -> bool:
    """Whether a save in `slot` now would be handed over from a private copy (if its tensors allow:
    `private_snapshot`): its worker would be sent every tensor (still starting, or started and
    holding nothing for `slot`: it would fault a fresh slab in while the save waits), or is still
    busy with `prepare` (starting up, readying its slab: work that must not land on the save that
    follows it). Asked before the snapshot, so that moving the trainer's tensors into shared
    memory keeps their old pages."""
    return worker.holds_nothing_in(slot) or worker.preparing


def private_snapshot(snapshot: Snapshot, worker: RankWorker) -> Optional[Snapshot]:
    """A private copy of `snapshot`'s tensors, when `hands_off` and a copy is cheap and safe:
    CPU tensors only, room in /dev/shm for the copy at hand-off, and at least twice what must be
    copied in available memory (asked before copying anything). None otherwise: the save waits for
    the worker instead. A tensor whose storage moved into shared memory for this save is copied for
    nothing: its view of the storage's old pages (`Snapshot.old_pages`), which hold the values of
    the call. The others are copied into one ordinary buffer."""
    if snapshot.cuda_devices:  # (whether to hand off at all, `hands_off` decided before the snapshot)
        return None
    old = [None if t is None else snapshot.old_pages.get(t.untyped_storage().data_ptr()) for t in snapshot.tensors]
    offsets, total = _packed([t if pages is None else None for t, pages in zip(snapshot.tensors, old)])
    free, available = shm_free_bytes(), available_memory_bytes()
    if free is not None and shm_bytes(_packed(snapshot.tensors)[1]) + SHM_HEADROOM_BYTES > free:
        return None
    if available is not None and 2 * total > available:  # no copy that would push the job towards swap or OOM
        return None
    buffer = worker.take_spare(total)  # after prepare: memory faulted in meanwhile, already shared
    buffer = torch.empty(total, dtype=torch.uint8) if buffer is None else buffer
    copies, pairs = [], []
    for tensor, pages, offset in zip(snapshot.tensors, old, offsets):
        if tensor is None:
            copies.append(None)
        elif pages is not None:  # the same view, of the old pages
            view = torch.empty(0, dtype=tensor.dtype)
            copies.append(view.set_(pages, tensor.storage_offset(), tensor.shape, tensor.stride()))
        else:
            copies.append(_view(buffer, offset, tensor))
            pairs.append((copies[-1], tensor))
    # largest first on a few threads: most of the time is the kernel faulting fresh pages in, which
    # runs in parallel (measured, 1 GiB: median 0.39 s on 4 threads, 0.60 s in one loop of copy_)
    with ThreadPoolExecutor(SHARE_THREADS, thread_name_prefix="asyncckpt-copy") as pool:
        list(pool.map(lambda pair: pair[0].copy_(pair[1]), sorted(pairs, key=lambda pair: -pair[0].nbytes)))
    return dataclasses.replace(snapshot, tensors=copies, fingerprints=[None] * len(copies),
                               always_fresh=frozenset(), old_pages={})


def _shared(copy: Snapshot) -> Snapshot:
    """The copy packed into one shared-memory segment, where the worker can reach it: one
    descriptor however many tensors; its pages reserved first (a full /dev/shm: CheckpointError). Each tensor of the copy is let go once packed (the memory
    it was in goes with the last one in it), so the copy is not held twice."""
    if not copy.mapped_from and all(t is None or t.untyped_storage().is_shared() for t in copy.tensors):
        return copy  # copied into the spare (spare_copy.py): the worker maps it as it is
    # (a mapped file's views count as shared, but torch cannot hand them over by descriptor)
    offsets, total = _packed(copy.tensors)
    buffer = torch.empty(0, dtype=torch.uint8).set_(new_reserved_shared(max(total, 1)))  # (reserved: no SIGBUS)
    packed, unpacked = [], copy.tensors  # the copy is this thread's alone
    for pos, offset in enumerate(offsets):
        tensor, unpacked[pos] = unpacked[pos], None
        packed.append(None if tensor is None else _view(buffer, offset, tensor).copy_(tensor))
    return dataclasses.replace(copy, tensors=packed, mapped_from="")


def _view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor shaped and typed like `like`, in `buffer` from `offset`."""
    return buffer[offset:offset + like.numel() * like.element_size()].view(like.dtype).view(like.shape)
