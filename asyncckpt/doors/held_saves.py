"""HeldSaves: saves into named directories, in call order, on one worker, where a save that comes
while the worker is busy is copied and held instead of waiting. A first save while it is still
starting is AsyncCheckpointer's (its hand-off of a private copy, save/first_save.py), or held
here where that hand-off is not made (`_core_hands_off`).

The trainer never waits for an earlier save's writes: the second save of Lightning's checkpoint
event (ModelCheckpoint with `save_last=True` saves twice) returns once copied. The held copy's
memory is taken again by the next such save (its pages already in shared memory, its tensors
already held by the worker in a cache slot of their own), so a steady save sends no tensors.
`max_in_flight` bounds the saves outstanding (in flight plus held); `max_in_flight=1` makes the
second save wait instead, without the held copy's memory. A commit thread commits saves as their
writes end and hands held saves over as the worker frees up. Failures are kept and raised as
CheckpointError by the caller's next call (`raise_failures`). No collective: one process saves.
Directories the caller removes are deleted in the background (`removals`); a later save of the
same directory waits for that.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from ..save import at_exit
from ..save.checkpointer import AsyncCheckpointer
from ..save.first_save import copies_allowed
from ..config import CheckpointConfig
from ..errors import CheckpointError
from ..save.private_copy import HeldCopy
from .removals import Removals
from ..save.sharing import SHM_DIR, SHM_HEADROOM_BYTES, shared_memory_needed, shm_free_bytes
from ..storage import check_writable_without_writing

log = logging.getLogger("asyncckpt")

COMMIT_POLL_S = 0.02  # how often the commit thread looks for finished writes while a save is in flight
HELD_SLOT = 1  # the worker's cache slot for held copies (the trainer's own tensors use slot 0)

_live: "weakref.WeakSet[HeldSaves]" = weakref.WeakSet()


class HeldSaves:
    """One process's saves on one worker (created at the first use: `ensure_saver`). Every use
    holds `lock`; `owner` names the user of it in errors."""

    def __init__(self, config: CheckpointConfig, max_in_flight: int, owner: str) -> None:
        self.config, self.max_in_flight, self.owner = config, max_in_flight, owner
        self.lock = threading.RLock()  # every use of the checkpointer holds it
        self._wake = threading.Event()  # a save was scheduled: the commit thread has work
        self._stop = threading.Event()  # closed: the commit thread ends
        self.saver: Optional[AsyncCheckpointer] = None  # created with the worker
        self.held: deque[_HeldSave] = deque()  # saves copied while the worker was busy or starting, in order
        self._spare: list[HeldCopy] = []  # held copies no save uses now, taken again by the next one
        self._in_flight_copy: Optional[HeldCopy] = None  # the held copy the save in flight was scheduled from
        self._failures: list[str] = []  # failed saves not yet raised to the caller
        self._committer: Optional[threading.Thread] = None
        self._said_no_shm = False  # the warning that held copies do not fit in /dev/shm is given once
        self._closed = False
        self.removals = Removals(config.timeout_s)  # un-committed directories the caller removed, deleted in order
        _live.add(self)  # closed at exit: saves committed, removals waited for

    def ensure_saver(self, folder: Optional[str] = None) -> AsyncCheckpointer:
        """`folder` (where the saves go) keys the memory tier (CheckpointConfig.memory_tier)."""
        if self.saver is None:  # spawns its worker, without waiting
            self.saver = AsyncCheckpointer(config=self.config, no_dist=True, memory_folder=folder)
        return self.saver

    def save(self, flat: dict, target: str) -> None:
        """Snapshot the flat state dict `flat` as of now into the directory `target`; returns
        once staged, or copied while the worker is busy or starting."""
        with self.lock:
            self.check_open()
            self.removals.wait_for(target)  # a directory removed just before: its old files go first
            self.raise_failures()  # (a failed removal of it too: never saved into half-deleted)
            saver = self.ensure_saver(os.path.dirname(target))
            saver.take_folder_of(target)  # another job's folder fails this call, not a held copy's save later
            while True:
                self._advance(blocking=False)
                idle = not self.held and saver.in_flight_dir is None
                if idle and (saver.worker_ready or _core_hands_off(self.config, flat)):
                    saver.schedule_save(flat, checkpoint_dir=target)
                    break
                if self._may_hold(saver) and self._hold(flat, target):
                    break
                if idle:  # no copy possible (e.g. no room in /dev/shm)
                    saver.schedule_save(flat, checkpoint_dir=target)  # waits for the worker's start
                    break
                self._advance(blocking=True)  # the save in flight commits; the next held one goes in
            self._start_committer()
            self._wake.set()

    def settle(self) -> None:
        """Commit every save held or in flight, wait for the removed directories and the files
        commits made obsolete (a replaced checkpoint's) to go, and raise what failed."""
        with self.lock:
            self.drain()
            self.removals.wait_all()
            if self.saver is not None:
                self.saver.wait_tidy()
            self.raise_failures()

    def close(self) -> None:
        """Commit what is held or in flight and stop the worker; raise what failed."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            _live.discard(self)
            if self.saver is not None:
                self.drain()
                try:
                    self.saver.close()
                except Exception as exc:
                    self._failed(str(exc))
                self.saver = None
            try:
                self.removals.wait_all()
            except CheckpointError as exc:
                self._failed(str(exc))
            self._spare, self._in_flight_copy = [], None
            self._stop.set()
            self._wake.set()
            self.raise_failures()

    def _may_hold(self, saver: AsyncCheckpointer) -> bool:
        """Whether one more save may be held: the saves outstanding stay within max_in_flight,
        except that a first save never waits for the worker's start (where the core's hand-off is
        not made: `_core_hands_off`)."""
        outstanding = len(self.held) + (saver.in_flight_dir is not None)
        return outstanding < self.max_in_flight or (outstanding == 0 and not saver.worker_ready)

    def _hold(self, flat: dict, target: str) -> bool:
        """Copy `flat` for a save handed over later; False where no copy can be taken, or where
        /dev/shm has no room for it at hand-over (the save then waits for the worker instead of
        failing later: the trainer's own tensors are in shared memory already)."""
        check_writable_without_writing(target)
        spare = self._spare.pop() if self._spare else None
        held_copy = spare or HeldCopy(device_to_host=True)
        if not self._shm_room_for(held_copy.bytes_to_share(flat)):  # asked before copying anything
            state = None
        else:
            state = held_copy.take(flat)  # GPU tensors land in host memory: the save must not wait for a write
        if state is None:
            if spare is not None:  # its memory is as it was: still the one to take again
                self._spare.append(spare)
            return False
        self.held.append(_HeldSave(state, target, held_copy))
        return True

    def _shm_room_for(self, copy_bytes: int) -> bool:
        """Whether /dev/shm can take `copy_bytes` of a new held copy, besides the held copies not
        handed over yet (free space does not count them until then), leaving its headroom."""
        held = [v for h in self.held for v in h.state.values() if isinstance(v, torch.Tensor)]
        needed = copy_bytes + shared_memory_needed((tensor, False) for tensor in held).nbytes
        free = shm_free_bytes()
        if needed == 0 or free is None or needed + SHM_HEADROOM_BYTES <= free:
            return True
        if not self._said_no_shm:
            self._said_no_shm = True
            log.warning("asyncckpt: %s free in %s cannot take a held copy of %.1f MiB: saves that come while the "
                        "worker is busy wait for it instead (enlarge %s, e.g. docker --shm-size, to avoid the wait)",
                        f"{free / 2**20:.1f} MiB", SHM_DIR, needed / 2**20, SHM_DIR)
        return False

    def _advance(self, blocking: bool) -> None:
        """Commit the save in flight once its writes end (`blocking`: wait for them), then hand
        the next held save to the worker (once it is up, unless `blocking`). A failure reaches
        the caller at its next call."""
        saver = self.saver
        if saver.in_flight_dir is not None:
            try:
                saver.finalize(blocking=blocking)
            except Exception as exc:  # the failed save removed its own files; the caller hears of it next call
                self._failed(str(exc))
        if saver.in_flight_dir is not None:
            return
        if self._in_flight_copy is not None:  # staged and written: its memory serves the next held save
            if not self._spare:  # one is kept; another (two saves held at once) is let go
                self._spare.append(self._in_flight_copy)
            self._in_flight_copy = None
        if self.held and not saver.worker_alive:  # it died or was killed: start the next one now
            saver.ensure_worker()
        if self.held and (blocking or saver.worker_ready):  # not before: the hand-off would hold the lock
            held = self.held.popleft()
            try:
                saver.schedule_save(held.state, checkpoint_dir=held.target, wait=False, cache_slot=HELD_SLOT)
                self._in_flight_copy = held.copy
            except Exception as exc:
                self._failed(str(exc))

    def drain(self) -> None:
        """Commit every save held or in flight."""
        while self.saver is not None and (self.held or self.saver.in_flight_dir is not None):
            self._advance(blocking=True)

    def finish_saves_of(self, target: str) -> None:
        """Commit the saves writing `target` (and those before them), and (incremental) the one in
        flight if it reuses its files; wait for a removal of `target` under way."""
        saver = self.saver
        while saver is not None and (
            any(held.target == target for held in self.held)
            or saver.in_flight_dir == target
            or target in saver.in_flight_base_dirs
        ):
            self._advance(blocking=True)
        self.removals.wait_for(target)

    def _failed(self, message: str) -> None:
        log.error("asynchronous checkpoint failed: %s", message)
        self._failures.append(message)

    def raise_failures(self) -> None:
        self._failures += self.removals.take_failures()
        if self._failures:
            failures, self._failures = self._failures, []
            raise CheckpointError("; ".join(failures))

    def check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this {self.owner} is closed")

    def _start_committer(self) -> None:
        if self._committer is None or not self._committer.is_alive():
            self._committer = threading.Thread(target=self._commit_loop, name="asyncckpt-held-saves-commit", daemon=True)
            self._committer.start()

    def _commit_loop(self) -> None:
        """Commit saves as their writes end and hand held saves over as the worker frees up, so a
        checkpoint exists (and on_commit runs) without waiting for the caller's next call. Polls
        while a save is held or in flight; sleeps otherwise."""
        while True:
            with self.lock:
                if self._closed:
                    return
                if self.saver is not None:
                    self._advance(blocking=False)
                pending = self.saver is not None and (bool(self.held) or self.saver.in_flight_dir is not None)
                if not pending:
                    self._wake.clear()  # under the lock: a save scheduled after this sets it again
            if pending:
                self._stop.wait(COMMIT_POLL_S)
            else:
                self._wake.wait(1.0)


def _core_hands_off(config: CheckpointConfig, flat: dict) -> bool:
    """Whether AsyncCheckpointer.schedule_save hands a first save of `flat` to a worker still
    starting from a private copy (save/first_save.py: the trainer's tensors go to the worker
    then too, so the next save sends none): the one mechanism for every entry point. It copies
    CPU tensors only, and not where `copies_allowed` says no (the memory tier, a staging budget);
    other first saves are held here instead (a host copy, handed over once the worker is up), so
    that they need not wait for the worker's start-up either."""
    on_a_device = any(isinstance(value, torch.Tensor) and value.device.type != "cpu" for value in flat.values())
    return not on_a_device and copies_allowed(config)


@dataclass
class _HeldSave:
    """A save copied while the worker was busy or starting, handed over in order."""

    state: dict
    target: str
    copy: HeldCopy


@atexit.register
def _close_all() -> None:
    """Registered after asyncckpt.save.checkpointer's, so it runs first: commit through the lock (the
    commit thread may be polling) before the checkpointers are closed."""
    for saves in list(_live):
        try:
            saves.close()
        except Exception as exc:  # said, with exit status 1, by at_exit.close_all (it runs next)
            at_exit.report_failure(f"{saves.owner}: {exc}")
