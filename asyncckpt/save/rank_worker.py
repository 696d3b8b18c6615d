"""RankWorker: this rank's persistent worker as the checkpointer sees it.

It starts the worker (and a new one after a crash), remembers which structures and tensors the
worker holds (one per cache slot) so a request carries only what is new, and turns the worker's answers into a
RankOutcome within the save's bounds: a dead or silent worker becomes an error, never a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Optional

import torch

from .client import WorkerClient, free_released_cuda_blocks
from .commit import RankOutcome
from ..config import CheckpointConfig, write_options
from ..errors import CheckpointTimeoutError, WorkerDiedError
from .inflight import InFlightSave
from ..protocol import (
    CACHE_SLOTS, IncrementalBase, MemorySave, MemoryTier, Prepared, SaveFailed, SaveRequest, Staged, WorkerSettings, WriteDone,
    WriteStaged,
)
from .snapshot import Snapshot
from .spare_copy import SpareCopy
from .holds import WorkerHolds, tensors_to_send

log = logging.getLogger("asyncckpt")


class RankWorker:
    def __init__(self, config: CheckpointConfig, rank: int, memory: Optional[MemoryTier] = None,
                 defer: bool = False) -> None:
        """`defer`: start the worker later (`start_deferred`, or the first call that needs it), not now."""
        self.config = config
        self.rank = rank
        self.memory = memory  # the memory tier's file, when configured
        self._client: Optional[WorkerClient] = None
        self._holds: list[Optional[WorkerHolds]] = [None] * CACHE_SLOTS
        self._next_save_id = 0
        self._preparing: Optional[int] = None  # the id of a preparation not answered yet
        self._abandoned = False  # after Ctrl-C: the worker was killed, and no other may start
        self._spare: Optional[SpareCopy] = None  # a first save's copy's memory, while it is under way
        self._spare_left: Optional[SpareCopy] = None  # that memory once no save needs it: freed after the next staging
        self._deferred = defer
        if not defer:
            self.start()  # spawn now, so the first save does not pay for the interpreter start

    def start_deferred(self) -> None:
        """Start the worker whose start was deferred, if nothing has started it since."""
        if self._deferred and self._client is None and not self._abandoned:
            self.start()

    @property
    def pid(self) -> Optional[int]:
        return self._client.pid if self._client is not None else None

    @property
    def ready(self) -> bool:  # started up and alive: a save waits for no start-up
        return self._client is not None and self._client.poll_ready() and self._client.is_alive()

    @property
    def said_ready(self) -> bool:  # the worker's Ready was taken in (reads nothing: safe beside a hand-off thread)
        return self._client is not None and self._client.ready

    def holds_nothing_in(self, slot: int) -> bool:  # a save in `slot` sends every tensor (a first save, a new worker)
        return self._holds[slot] is None

    @property
    def alive(self) -> bool:
        return self._client is not None and self._client.is_alive()

    def start(self) -> None:
        if self._abandoned:
            raise WorkerDiedError(f"rank {self.rank}: the checkpointer is closing after Ctrl-C; no new worker starts")
        self._deferred = False
        # no CUDA device here: the worker takes it from the tensors of each save (a device read
        # now would be the wrong one where the checkpointer is built before set_device or on
        # another thread, and would initialise CUDA in a CPU-only job)
        settings = WorkerSettings(
            rank=self.rank,
            parent_pid=os.getpid(),
            log_level=logging.getLogger("asyncckpt").getEffectiveLevel(),
            nice=self.config.worker_nice,
            ionice=self.config.worker_ionice,
            memory=self.memory,
            ignored_signals=tuple(int(number) for number in self.config.preemption_signals),
        )
        self._client = WorkerClient(settings, self.config.worker_start_timeout_s)
        self._client.start()
        self._holds, self._preparing = [None] * CACHE_SLOTS, None
        self._let_spare_go()

    def ensure_alive(self) -> None:
        """A worker that is gone (crashed, killed, or reset after a failure) is replaced."""
        self._await_prepared()
        if self._abandoned:
            self.start()  # (raises: no new worker after Ctrl-C)
        if self._client is None or not self._client.is_alive():
            if self._client is not None:
                log.warning("checkpoint worker pid %s is gone; starting a new one", self._client.pid)
                self._client.kill()
            self.start()

    def reset(self, kill: bool) -> None:
        """Let go of the worker (killed, or asked to exit); the next save starts a new one."""
        if self._client is not None:
            self._client.kill() if kill else self._client.stop()
        self._client, self._holds, self._preparing = None, [None] * CACHE_SLOTS, None
        self._let_spare_go()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker and let go of the trainer's tensors it was tracking: a closed
        checkpointer pins none of the user's memory (on a GPU, torch warns at exit about shared
        CUDA tensors still alive then)."""
        if self._client is not None:
            self._client.stop(timeout_s)  # (killed past it)
            self._client = None
        self._holds, self._preparing = [None] * CACHE_SLOTS, None
        self._let_spare_go()  # (a prepare with no save after it)

    @property
    def torn(self) -> bool:  # Ctrl-C cut a message short: nothing more can be read from this worker
        return self._client is not None and self._client.torn

    def abandon(self) -> None:
        """Kill the worker now (SIGKILL, no wait), whatever it is doing, and start no other: the
        exit after Ctrl-C gives up a save not staged yet. A thread waiting for the worker
        (first_save.HandOff) sees it gone within its poll slice."""
        self._abandoned = True
        if self._client is not None:
            self._client.signal_kill()

    # preparation ---------------------------------------------------------------------------------
    def prepare(self, snapshot: Snapshot, slot: int = 0, spare: bool = True) -> None:
        """Hand the worker the structure and tensors of `snapshot` ahead of the first save, so it
        readies its slab meanwhile (the answer is taken before the next save). `spare`: ready the
        memory of a private copy, for a save that comes before the answer; it is faulted in before
        this returns (~0.3 s per GiB), so such a save only copies (else it waited for that too)."""
        request = self.request_for(snapshot, "", "", (), slot, prepare_only=True)
        self._client.send(request, self.config.timeout_s)
        self._holds[request.slot] = WorkerHolds.of(snapshot)
        self._preparing = request.save_id
        self._spare = SpareCopy.for_snapshot(snapshot) if spare else None
        if self._spare is not None:
            self._spare.wait_ready()

    def take_spare(self, nbytes: int) -> Optional[torch.Tensor]:
        """Memory for a private copy of `nbytes`, readied during a preparation (spare_copy.py), or None."""
        spare, self._spare = self._spare, None
        return spare.take(nbytes) if spare is not None else None

    def settle_preparation(self) -> bool:
        """Take the answer to a preparation under way, if any (bounded; a failed one is logged).
        True: the worker answered that it holds the preparation's tensors."""
        return self._await_prepared()

    @property
    def preparing(self) -> bool:
        """Whether a preparation is still under way: its answer not in yet (never waits)."""
        if self._preparing is None or self._client is None:
            return False
        try:
            answer = self._client.take(self._preparing, (Prepared, SaveFailed), 0)
        except WorkerDiedError:
            return False  # the next ensure_alive says so and starts another
        if answer is None:
            return True
        self._preparing = None
        self._took_preparation(answer)
        return False

    def _await_prepared(self) -> bool:
        """Take the answer to a preparation (waiting for it, bounded): a preparation that failed
        is logged, and the save sends everything as if there had been none. True: it succeeded."""
        save_id, self._preparing = self._preparing, None
        if save_id is None or self._client is None:
            return False
        try:
            answer = self._client.take(save_id, (Prepared, SaveFailed), self.config.timeout_s)
        except (CheckpointTimeoutError, WorkerDiedError) as exc:
            log.warning("rank %d: preparing the first save failed (%s); the save starts over", self.rank, exc)
            self.reset(kill=True)
            return False
        self._took_preparation(answer)
        return isinstance(answer, Prepared)

    def _took_preparation(self, answer) -> None:
        # no save needs the spare copy now; unmapping it (~0.2 s per GiB) waits until the save
        # that found this answer is staged: not on its blocked time
        self._spare_left, self._spare = self._spare, None
        if isinstance(answer, SaveFailed):
            log.warning("rank %d: preparing the first save failed (%s); the save starts over", self.rank,
                        self._describe_failure(answer))
            self._holds = [None] * CACHE_SLOTS
        else:
            log.debug("rank %d: the worker prepared a %.1f MB slab in %.2fs", self.rank, answer.slab_bytes / 1e6,
                      answer.seconds)

    def _let_spare_go(self) -> None:
        for spare in (self._spare, self._spare_left):
            if spare is not None:
                spare.release()
        self._spare = self._spare_left = None

    # one save ------------------------------------------------------------------------------------
    def send(self, flight: InFlightSave, snapshot: Snapshot, bases: tuple[IncrementalBase, ...], slot: int = 0) -> None:
        """Hand the save to the worker: the structure key, and only the tensors it does not hold
        (in cache `slot`)."""
        request = self.request_for(snapshot, flight.step_dir, flight.file_tag, bases, slot, memory=flight.memory,
                                   data_folder=flight.data_folder)
        for device in snapshot.cuda_devices:  # the worker must see finished values
            torch.cuda.synchronize(device)
        self._client.send(request, self.config.timeout_s)
        flight.save_id, flight.tensors_sent = request.save_id, len(request.fresh_tensors)
        flight.to_starting_worker = not self._client.ready
        flight.deadline = time.monotonic() + self._client.allowance(self.config.timeout_s)  # start-up
        flight.deadline_says = self._client.bound_text(self.config.timeout_s)
        self._holds[request.slot] = WorkerHolds.of(snapshot)

    def write_staged(self, flight: InFlightSave) -> None:
        """Have the worker write the copy its memory-only save `flight.memory.token` staged into
        `flight.step_dir` (a preempted close: preemption.py); answered as a save is."""
        if self._client is None or not self._client.is_alive():
            raise WorkerDiedError(f"rank {self.rank}: the worker that held the copy of {flight.label} is gone")
        self._next_save_id += 1
        request = WriteStaged(self._next_save_id, flight.memory.token, flight.step_dir, write_options(self.config),
                              flight.file_tag, flight.data_folder)
        self._client.send(request, self.config.timeout_s)
        flight.save_id = request.save_id
        flight.deadline = time.monotonic() + self.config.timeout_s
        flight.deadline_says = f"within {self.config.timeout_s:.1f}s"

    def request_for(
        self, snapshot: Snapshot, step_dir: str, file_tag: str, bases: tuple[IncrementalBase, ...] = (), slot: int = 0,
        prepare_only: bool = False, memory: Optional[MemorySave] = None, data_folder: str = "",
    ) -> SaveRequest:
        held = self._holds[slot] if self.config.cache_structure else None
        send = tensors_to_send(snapshot, held)
        if memory is not None and send.known_structure:  # the worker keeps the plan with the structure
            memory = dataclasses.replace(memory, plan=None)
        self._next_save_id += 1
        return SaveRequest(
            save_id=self._next_save_id,
            checkpoint_dir=step_dir,
            structure_key=snapshot.structure_key,
            options=write_options(self.config),
            items=None if send.known_structure else snapshot.items,
            fresh_tensors=send.fresh,
            transient=snapshot.always_fresh & send.fresh.keys(),
            byte_items=snapshot.objects,
            file_tag=file_tag,
            data_folder=data_folder,
            bases=bases,
            kept_from=held.structure_key if send.kept else "",
            kept_tensors=send.kept,
            slot=slot,
            prepare_only=prepare_only,
            memory=memory,
        )

    def await_staged(self, flight: InFlightSave) -> None:
        """Block (at most timeout_s) until the worker has copied the save; a failure lands in
        `flight.error`."""
        try:
            message = self._client.take(flight.save_id, (Staged, SaveFailed), self.config.timeout_s)
        except (CheckpointTimeoutError, WorkerDiedError) as exc:
            self.reset(kill=True)
            message = SaveFailed(flight.save_id, "staging", str(exc))
        if isinstance(message, SaveFailed):
            flight.error = self._describe_failure(message)
        else:
            self._mark_staged(flight, message)

    def outcome(self, flight: InFlightSave, blocking: bool) -> Optional[RankOutcome]:
        """This rank's part of the save: None while its worker still works; never raises for a
        failed save (the failure must reach every rank through the collective verdict)."""
        if flight.error is not None:
            return RankOutcome(self.rank, error=flight.error)
        timeout = self.config.timeout_s if blocking else 0
        try:
            if flight.staged is None:
                message = self._client.take(flight.save_id, (Staged, SaveFailed), timeout)
                if message is None:
                    return self._unless_overdue(flight, "Staged")
                if isinstance(message, SaveFailed):
                    return RankOutcome(self.rank, error=self._describe_failure(message))
                self._mark_staged(flight, message)
            message = self._client.take(flight.save_id, (WriteDone, SaveFailed), timeout)
            if message is None:
                return self._unless_overdue(flight, "WriteDone")
        except (CheckpointTimeoutError, WorkerDiedError) as exc:
            self.reset(kill=True)  # it may still be writing; a fresh one serves the next save
            return RankOutcome(self.rank, error=str(exc))
        if isinstance(message, SaveFailed):
            return RankOutcome(self.rank, error=self._describe_failure(message))
        return RankOutcome(self.rank, written=message)

    def _mark_staged(self, flight: InFlightSave, staged: Staged) -> None:
        if flight.tensors_sent:  # the worker dropped the tensors these replaced: their blocks may go
            free_released_cuda_blocks()
        flight.staged = staged
        self._let_spare_go()  # (a preparation's spare copy, if one is left)
        flight.deadline = time.monotonic() + self.config.timeout_s  # the writes get their own bound
        flight.deadline_says = f"within {self.config.timeout_s:.1f}s"

    def _unless_overdue(self, flight: InFlightSave, awaited: str) -> None:
        """A non-blocking poll found no answer: fine, unless the save is past its bound."""
        if time.monotonic() > flight.deadline:
            raise CheckpointTimeoutError(
                f"rank {self.rank}: no {awaited} from worker pid {self.pid} {flight.deadline_says}; killed it"
            )
        return None

    def _describe_failure(self, failed: SaveFailed) -> str:
        if failed.phase in ("cache", "request"):
            self._holds = [None] * CACHE_SLOTS  # it may hold nothing of ours: resend everything next time
        where = f" ({failed.path})" if failed.path else ""
        return f"{failed.phase} failed{where}: {failed.message}"
