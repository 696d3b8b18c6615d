"""The exit of a script that Ctrl-C ended, for a checkpointer it did not close (at_exit.py).

Only a save the worker has already staged is finished: its writes end (bounded by timeout_s and
the worker's life, as always) and it is committed. Anything earlier is given up at once, the
worker killed (it ignores SIGINT: the trainer decides), so the exit never waits for a worker's
start-up or a staging; the last committed checkpoint stays as it was. With several ranks nothing
is committed: each rank was interrupted at its own point, and a collective then could wait for
a rank that is not coming. A second Ctrl-C during that exit ends the process at once (at_exit.py).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from ..errors import CheckpointError
from ..layout import METADATA_FILE
from ..storage import storage_for
from .at_exit import say
from .commit import RankOutcome
from .inflight import InFlightSave
from .preempted_close import one_call_at_a_time
from .rank_worker import RankWorker

POLL_S = 0.05
THREAD_AFTER_KILL_S = 30.0  # a hand-off thread whose worker was killed ends at its next wait (packing a copy may come first)


class InterruptedExit:
    """AsyncCheckpointer's exit after Ctrl-C (its part kept here, with the rules above)."""

    _scheduling: Optional[str] = None  # the save schedule_save is handing over (set there, cleared when it returns)

    @one_call_at_a_time  # (not beside a close the preemption watchdog runs for the loop)
    def close_interrupted(self) -> str:
        """close() at the exit of a script Ctrl-C ended (at_exit.py): a save already staged is
        committed, anything earlier given up at once. Returns what happened, in words."""
        flight, doing, error = self._in_flight, self._scheduling, None
        reason = settle(flight, self._worker, self._group.size)
        if self._group.size > 1:
            self._in_flight = None  # no collective: the ranks were interrupted each at its own point
        try:
            self.close()
        except CheckpointError as exc:
            error = exc
        return describe(doing, flight, reason, error, flight is not None and committed_on_disk(flight))

    def _close_after_ctrl_c(self) -> None:
        """Ctrl-C while close() waited: as at an interrupted exit, a save already staged is
        committed and anything earlier given up, and what happened is said once; a second Ctrl-C
        gives up at once."""
        try:
            note = self.close_interrupted()
        except KeyboardInterrupt:
            self.kill_worker()
            note = "interrupted twice (Ctrl-C) while closing: the save in flight was given up"
        if note:
            say(logging.WARNING, f"asyncckpt: {note}")

    def kill_worker(self) -> None:
        """A second Ctrl-C: SIGKILL the worker, wait for nothing."""
        self._worker.abandon()


def settle(flight: Optional[InFlightSave], worker: RankWorker, ranks: int) -> Optional[str]:
    """Make `flight` (the save in flight, if any) one that close() ends within the bound above:
    staged (close() waits for its writes and commits it) or given up (it fails at once). Returns
    why it was given up; None when it was not."""
    if flight is None or flight.error is not None or flight.outcome is not None:
        return None  # nothing in flight, or its end is known: close() only reports it
    hand_off = flight.hand_off
    if hand_off is None and ranks == 1 and not worker.torn:  # take in what the worker sent (never waits)
        flight.outcome = worker.outcome(flight, blocking=False)
        if flight.outcome is not None:
            return None
    if ranks > 1:
        reason = "with several ranks an interrupted exit commits nothing"
    elif worker.torn:
        reason = "Ctrl-C cut the worker's answer short"
    elif flight.staged is None:
        reason = "the worker had not staged it" + ("" if worker.said_ready else " (it was still starting)")
    else:
        reason = None  # staged: its writes end on their own
    if reason is not None:
        worker.abandon()
    if hand_off is not None:
        _wait_for(hand_off, worker, killed=reason is not None)
    if reason is not None and (flight.outcome is None or flight.outcome.error is not None):  # (its error: our kill)
        flight.outcome = RankOutcome(worker.rank, error=f"given up at the exit after Ctrl-C: {reason}")
        flight.hand_off = None  # (a thread still packing its copy fails at its next step: no worker starts)
    return reason


def _wait_for(hand_off, worker: RankWorker, killed: bool) -> None:
    """Wait for a first save's hand-off thread: while its worker lives (the thread's own waits are
    bounded), and at most THREAD_AFTER_KILL_S once it is dead."""
    deadline = time.monotonic() + hand_off.bound_s
    dead_since = time.monotonic() if killed else None
    while not hand_off.finished(wait=False) and time.monotonic() < deadline:
        if dead_since is None and not worker.alive:
            dead_since = time.monotonic()
        if dead_since is not None and time.monotonic() - dead_since > THREAD_AFTER_KILL_S:
            return
        time.sleep(POLL_S)


def committed_on_disk(flight: InFlightSave) -> bool:
    """Whether the save's `.metadata` is in place after close(): the note says what the disk
    holds, whatever point of the commit the Ctrl-C cut short (a save that replaces a committed
    checkpoint of its step, or a memory-only one, cannot be told this way: False)."""
    if flight.replaces or (flight.memory is not None and flight.memory.memory_only):
        return False
    try:
        storage = storage_for(flight.step_dir)
        return storage.exists(storage.join(flight.step_dir, METADATA_FILE))
    except Exception:  # (an unreachable store: the bookkeeping's word stands)
        return False


def describe(doing: Optional[str], flight: Optional[InFlightSave], reason: Optional[str], error: Optional[Exception],
             on_disk: bool = False) -> str:
    """What happened, for the user: 'interrupted while step 1 was being handed over; step 0
    committed' (or 'not committed: why'); nothing when no save was in flight. `on_disk`: the
    save's commit is on disk (it is then called committed, whatever the bookkeeping says)."""
    if flight is None:
        return "" if error is None else f"interrupted (Ctrl-C); closing failed: {error}"
    where = f"while {doing} was being handed over" if doing else f"while {flight.label} was in flight"
    if on_disk:
        outcome = f"{flight.label} committed ({flight.step_dir})" + (f"; closing then failed: {error}" if error else "")
    elif reason is not None and error is None:  # several ranks: not even tried
        outcome = f"{flight.label} not committed: {reason}"
    elif error is not None:
        outcome = str(error)
    else:
        outcome = f"{flight.label} committed ({flight.step_dir})"
    return f"interrupted (Ctrl-C) {where}; {outcome}"
