"""Preemption: a signal of CheckpointConfig.preemption_signals means the job ends soon.

No new save is made: the newest staged one is made durable. The handler only records the signal
(Python runs it on the main thread between bytecodes; it takes no lock and waits for nothing).
The worker ignores these signals (protocol.run_worker), so the save in flight goes on being
written meanwhile. The loop sees `ckpt.preempted` at its next step and calls `close()`, which
commits that save. The handler also wakes a watchdog thread (one byte down a pipe: no lock taken
in the handler): if the process is still there `grace_s` after the signal (a step, a save or a
commit that takes too long, a worker that hangs), it kills the worker and ends the process with
the exit code below; the last committed checkpoint stays as it was (a commit is one rename). A
second signal (a second or more after the first: a process-group signal and a launcher forwarding
it arrive together) ends the process at once, the same way. `requeue_exit()` then ends the process with
128 + the signal's number: what a shell, Slurm or Kubernetes reports for a process that signal
ended, so scripts and pod failure policies that treat it as a preemption go on doing so.

Several ranks: a rank's signal rides on the small all-reduce every schedule_save and every
finalize poll of a pending save already make (ranks.py): no collective is added, and every rank
turns `preempted` true after the same call, so all stop at the same step. Between saves there is
no agreement, so a signalled rank also sets a key in the job's store (SignalBoard) that a thread of
every rank checks twice a second: it names the finalize() call after which every rank turns
`preempted` true (every rank makes the same calls; the signalled rank picks one far enough ahead,
by how often its loop calls finalize, that every rank sees the key first), and a rank that got no
signal arms its own watchdog from it, so with a loop stuck every rank still closes for its loop,
and none is left hanging. A rank that saw the key too late (past that call) says so and stops at
the next agreement instead.
Memory tier: a newest save that was memory-only is written to disk by close() from the copy the
worker staged (WriteStaged: nothing is copied, and the trainer's state may have moved on since) and
committed under the copy's save id; should that fail, the tier's file is kept (a restart on this
node restores and persists it).

The commit without the loop: a loop that has not called close() when 3/4 of the grace is gone (a
step longer than the grace, a hang in a training collective) would lose the save its worker wrote.
The watchdog then has close() run on a thread of its own ("asyncckpt-takeover"), which does what
the loop's close() would: commit the save in flight, write a memory-only newest one. The
checkpointer's calls take one lock, so that thread never runs beside a call of the loop's: it waits
for one that is under way (which, if it is close(), commits anyway). With several ranks every
rank's watchdog does so (a rank that got no signal arms its own at the agreement or the board that
told it), and their closes meet in the same collectives a loop's would. The process still ends
when the grace does, unless the loop's own close() came.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

from .signal_board import Posted, SignalBoard, board_poll_s

log = logging.getLogger("asyncckpt")

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143; requeue_exit() uses 128 + the signal that came
TAKEOVER_AT = 0.75  # of grace_s after the signal: a loop that has not closed by then is closed for it
STOP_AHEAD_S = 0.5  # the finalize() call every rank stops after is this much later than two polls, at least two calls
DUPLICATE_WINDOW_S = 1.0  # a second signal sooner than this after the first is the same one, delivered twice

_received: Optional[int] = None  # the first preemption signal this process got (for requeue_exit)


def requeue_exit(code: Optional[int] = None) -> None:
    """End a preempted process: `sys.exit(128 + signal)` (143 for SIGTERM, as if the signal had
    ended it, but after the exit handlers ran), or `code` when given. Call it after `close()`."""
    sys.exit(code if code is not None else 128 + (_received or signal.SIGTERM))


class Preemption:
    """The handlers of one checkpointer's preemption signals, and what its close() does after one."""

    def __init__(self, signals: tuple[int, ...], grace_s: float, kill_worker: Callable[[], None], group,
                 take_over: Callable[[], None]) -> None:
        """`take_over`: close() the checkpointer from the watchdog; it sets `closed_for_the_loop` once
        it closed it, failed or not (not if the loop's calls held it until the grace's end)."""
        self.signum: Optional[int] = None  # the first signal that came
        self.grace_s = grace_s
        self.newest = None  # the SaveReport of the newest committed save (memory-only ones included)
        self.persisted: Optional[int] = None  # the step of a memory-only newest save written to disk by close()
        self.staged_only = None  # that save's InFlightSave, while the worker's slab holds its copy
        self._at = 0.0  # monotonic: when the signal came (or, on a rank that got none, when an agreement told it)
        self._armed = False  # the watchdog counts the grace (a signal here, or one to another rank)
        self._kill_worker = kill_worker
        self._take_over = take_over
        self._takeover: Optional[threading.Thread] = None  # the thread running close() for the loop
        self.closed_for_the_loop = False  # take_over closed it (set by the checkpointer, under its lock)
        self.told = False  # a close (the loop's or take_over's) said on stderr what was saved
        self._closed = threading.Event()
        self._wake: Optional[tuple[int, int]] = None  # the watchdog's pipe (read end, write end)
        self._group = group  # several ranks: the flag rides on the agreements the saves make anyway (ranks.py)
        group.signalled = lambda: self._armed  # (a signal here, or another rank's seen on the board)
        group.on_preempted = self._agreed
        self.preempted = False  # what `ckpt.preempted` reads (a plain attribute: read every step)
        self._calls = 0  # the loop's finalize() calls so far (every rank makes the same ones)
        self._last_call_at = 0.0
        self._call_interval_s: Optional[float] = None  # between them, averaged
        self._posted: Optional[Posted] = None  # the board's post, as this rank's threads found it
        self._stop_after: Optional[int] = None  # the call after which `preempted` turns true (the loop's thread decides)
        self._previous: dict[int, object] = {}
        if signals and threading.current_thread() is not threading.main_thread():
            names = ", ".join(signal.Signals(n).name for n in signals)
            raise ValueError(f"CheckpointConfig.preemption_signals ({names}): Python installs signal handlers "
                             "only on the main thread; build the AsyncCheckpointer there")
        self._signals = signals
        self._board = SignalBoard.of(group) if signals and group.size > 1 else None  # (a collective: every rank)

    def _agreed(self) -> None:
        """Several ranks: an agreement said a rank got a signal (ranks.py). `preempted` turns true
        on every rank after the same call, so they stop at the same step; one rank: at the signal.
        A rank that got no signal counts the grace from here (its watchdog closes for a loop that
        does not, as the signalled rank's does)."""
        self.preempted = True
        if not self._armed and self._wake is not None:
            self._at, self._armed = time.monotonic(), True
            self._wake_watchdog()

    def install(self) -> None:
        if not self._signals:
            return
        self._wake = os.pipe()
        os.set_blocking(self._wake[1], False)
        threading.Thread(target=self._watch, args=(self._wake[0],), name="asyncckpt-preemption", daemon=True).start()
        if self._board is not None:
            threading.Thread(target=self._poll_board, name="asyncckpt-preemption-board", daemon=True).start()
        for number in self._signals:
            self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, signum: int, frame) -> None:
        global _received
        now = time.monotonic()
        if self.signum is None:
            self.signum = signum
            if not self._armed:
                self._at, self._armed = now, True
            _received = _received or signum
            self.preempted = self.preempted or self._group.size == 1
            self._wake_watchdog()
        elif now - self._at >= DUPLICATE_WINDOW_S:
            end_now(signum, self._kill_worker, "second preemption signal")

    def _wake_watchdog(self) -> None:
        try:
            os.write(self._wake[1], b"!")
        except (OSError, TypeError):
            pass  # (closed: the checkpointer is closed)

    def _watch(self, wake_r: int) -> None:
        """The watchdog: waits for the handler's byte (or an agreement's), then for the loop's
        close(): past TAKEOVER_AT of the grace it closes for the loop, and at the grace's end it
        ends the process (unless the loop's close() came)."""
        try:
            os.read(wake_r, 1)
        finally:
            os.close(wake_r)
        if self._board is not None and self.signum is not None:  # (its own thread: a store that does not
            threading.Thread(target=self._post, name="asyncckpt-preemption-post", daemon=True).start()  # answer
        if not self._armed or self._closed.wait(max(0.0, self._at + TAKEOVER_AT * self.grace_s - time.monotonic())):
            return
        self.preempted = True  # (every rank's close does as after an agreement: they all get here)
        self._takeover = threading.Thread(target=self._take_over, name="asyncckpt-takeover", daemon=True)
        self._takeover.start()
        if self._closed.wait(max(0.0, self._at + self.grace_s - time.monotonic())):
            return
        after = ("the checkpointer was closed for the loop (above)" if self.closed_for_the_loop else
                 "what was saved is said above (the worker's stop had not ended)" if self.told else "")
        end_now(self.signum or _received or signal.SIGTERM, self._kill_worker, f"grace_s ({self.grace_s:g}s) ran out", after)

    def _post(self) -> None:
        """Post this rank's signal on the board (or take the post of a rank that was first)."""
        posted = Posted(self._group.rank, self.signum, time.time(), self._calls + self._calls_ahead())
        self._posted = self._board.post(posted)

    def _poll_board(self) -> None:
        """Several ranks: arm this rank's watchdog once another rank's signal is on the board."""
        poll_s = board_poll_s(self._group.size)
        while not self._closed.wait(poll_s):
            if self._armed:
                return  # (a signal here, or an agreement, came first)
            posted = self._board.posted()
            if posted is not None:
                global _received
                _received = _received or posted.signum  # (this rank exits as the signalled one does)
                self._posted = posted
                if not self._armed:  # the grace counts from the signal, as on the rank that got it
                    self._at, self._armed = time.monotonic() - min(max(time.time() - posted.at, 0.0), poll_s), True
                    self._wake_watchdog()
                return

    def finalize_called(self) -> None:
        """The loop called finalize(): counted (a few hundred ns); past the board's call, `preempted`.
        Decided here, on the loop's thread, so a rank stops after that call exactly or knows it cannot.
        Nothing to count without a board (one rank, no signals: the loop's hot path stays as it was)."""
        if self._board is None:
            return
        now = time.monotonic()
        if self._last_call_at:
            interval = now - self._last_call_at
            self._call_interval_s = interval if self._call_interval_s is None else \
                0.8 * self._call_interval_s + 0.2 * interval
        self._last_call_at = now
        if self._posted is not None and self._stop_after is None:
            self._stop_at_call(self._posted)
        self._calls += 1
        if self._stop_after is not None and self._calls >= self._stop_after > 0:
            self.preempted = True

    def _calls_ahead(self) -> int:
        """How many finalize() calls from now every rank will have seen the board: two polls and
        STOP_AHEAD_S at the loop's pace (at least 2: the ranks' loops are a call apart at most)."""
        poll_s = board_poll_s(self._group.size)
        interval = self._call_interval_s or 0.1
        return 2 + math.ceil((2 * poll_s + STOP_AHEAD_S) / max(interval, 1e-3))

    def _stop_at_call(self, posted: Posted) -> None:
        self._stop_after = posted.stop_after if self._calls < posted.stop_after else -1  # (-1: too late)
        if self._stop_after < 0 and not self.preempted:
            log.warning("rank %d learned of rank %d's preemption signal after finalize call %d, where every rank "
                        "stops; it stops at the next agreement (a save) or when the grace ends", self._group.rank,
                        posted.rank, posted.stop_after)

    @property
    def taking_over(self) -> bool:
        """Whether this is the thread that closes for the loop."""
        return self._takeover is not None and threading.current_thread() is self._takeover

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had (where ours is still the one installed).
        Not when closing for the loop: the watchdog goes on counting the grace, and the handlers
        stay (a second signal still ends the process); the loop's close() gives them back."""
        if self.taking_over:
            return
        self._closed.set()
        if self._wake is not None:
            self._wake_watchdog()  # (it ends: nothing to watch any more)
            os.close(self._wake[1])
            self._wake = None
        if threading.current_thread() is not threading.main_thread():
            return  # (a close on another thread: the handlers stay, and only record)
        for number, previous in self._previous.items():
            if signal.getsignal(number) == self._handle:
                signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def bound_s(self, timeout_s: float) -> float:
        """A wait's bound in close(): timeout_s, or at most what is left of the grace after a signal."""
        return timeout_s if not self._armed else max(0.1, min(timeout_s, self._at + self.grace_s - time.monotonic()))

    def committed(self, report, staged_only) -> None:
        """A save committed: `report`; `staged_only`: its InFlightSave if it was memory-only."""
        self.newest, self.staged_only = report, staged_only

    def closing(self, finalize: Callable[[], list], memory_tier: bool, persist: Callable[[object], list]) -> list:
        """close()'s wait for the save in flight: as ever (after a signal the watchdog bounds it
        by the grace). After a signal, a newest save that was memory-only is written to disk from
        the worker's copy and committed (`persist`), and what was saved is said on stderr (and logged)."""
        if self.signum is None and not self.preempted:
            return finalize()
        name = signal.Signals(self.signum).name if self.signum is not None else "a signal to another rank"
        if self.taking_over:
            name += f"; the loop did not call close() within {TAKEOVER_AT * self.grace_s:g}s, closed for it"
        try:
            reports = finalize()
        except Exception as exc:
            _say(f"asyncckpt: preempted ({name}): {exc}; the last committed checkpoint is intact")
            raise
        problem = ""
        if self.preempted and self.newest is not None and self.newest.memory_only:  # (agreed: every rank persists)
            memory_only = self.newest.step
            try:
                staged, self.staged_only = self.staged_only, None
                reports = reports + persist(staged)
                self.persisted = memory_only
            except Exception as exc:  # the copy stays in the memory tier; what is on disk is intact
                problem = f"writing it to disk failed: {exc}"
        _say(f"asyncckpt: preempted ({name}): {self.describe(memory_tier, problem)}")
        self.told = True  # (the grace's end must not then say the save was given up)
        return reports

    def describe(self, memory_tier: bool, problem: str = "") -> str:
        newest = self.newest
        if newest is None:
            return "no save was in flight; the last committed checkpoint is unchanged"
        what = f"step {newest.step}" if newest.step is not None else "the newest save"
        if newest.memory_only:
            where = "kept in the memory tier (a restart on this node restores it)" if memory_tier else ""
            return "; ".join(part for part in (f"{what} was memory-only: not on disk", problem, where) if part)
        how = ", written from the memory tier's copy" if self.persisted == newest.step else ""
        return f"{what} committed ({newest.path}{how})"

    @property
    def keeps_memory(self) -> bool:  # close() must not remove a memory-only newest save's file
        return (self.signum is not None or self.preempted) and self.newest is not None and self.newest.memory_only


def end_now(signum: int, kill_worker: Callable[[], None], why: str, after: str = "") -> None:
    """A second preemption signal, or the grace ran out: SIGKILL the worker and exit at once,
    with 128 + signal. `after`: what was done before (else: the save in flight is given up)."""
    try:
        kill_worker()
    except Exception:
        pass
    after = after or "the save in flight is given up, the last committed checkpoint is intact"
    try:  # (straight to the descriptor: this may run in a signal handler)
        os.write(2, f"asyncckpt: preempted: {why}: exiting now; {after}\n".encode())
    except OSError:
        pass
    os._exit(128 + signum)


def _say(message: str) -> None:
    if log.hasHandlers():
        log.warning(message)
    print(message, file=sys.stderr, flush=True)
