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
turns `preempted` true after the same call, so all stop at the same step. Between saves nothing is
exchanged: the others learn of it at the next schedule_save (or the signalled rank's grace ends it).
Memory tier: a newest save that was memory-only is written to disk by close() from the copy the
worker staged (WriteStaged: nothing is copied, and the trainer's state may have moved on since) and
committed under the copy's save id; should that fail, the tier's file is kept (a restart on this
node restores and persists it).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

log = logging.getLogger("asyncckpt")

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143; requeue_exit() uses 128 + the signal that came
DUPLICATE_WINDOW_S = 1.0  # a second signal sooner than this after the first is the same one, delivered twice

_received: Optional[int] = None  # the first preemption signal this process got (for requeue_exit)


def requeue_exit(code: Optional[int] = None) -> None:
    """End a preempted process: `sys.exit(128 + signal)` (143 for SIGTERM, as if the signal had
    ended it, but after the exit handlers ran), or `code` when given. Call it after `close()`."""
    sys.exit(code if code is not None else 128 + (_received or signal.SIGTERM))


class Preemption:
    """The handlers of one checkpointer's preemption signals, and what its close() does after one."""

    def __init__(self, signals: tuple[int, ...], grace_s: float, kill_worker: Callable[[], None], group) -> None:
        self.signum: Optional[int] = None  # the first signal that came
        self.grace_s = grace_s
        self.newest = None  # the SaveReport of the newest committed save (memory-only ones included)
        self.persisted: Optional[int] = None  # the step of a memory-only newest save written to disk by close()
        self.staged_only = None  # that save's InFlightSave, while the worker's slab holds its copy
        self._at = 0.0
        self._kill_worker = kill_worker
        self._closed = threading.Event()
        self._wake: Optional[tuple[int, int]] = None  # the watchdog's pipe (read end, write end)
        self._group = group  # several ranks: the flag rides on the agreements the saves make anyway (ranks.py)
        group.signalled = lambda: self.signum is not None
        group.on_preempted = self._agreed
        self.preempted = False  # what `ckpt.preempted` reads (a plain attribute: read every step)
        self._previous: dict[int, object] = {}
        if signals and threading.current_thread() is not threading.main_thread():
            names = ", ".join(signal.Signals(n).name for n in signals)
            raise ValueError(f"CheckpointConfig.preemption_signals ({names}): Python installs signal handlers "
                             "only on the main thread; build the AsyncCheckpointer there")
        self._signals = signals

    def _agreed(self) -> None:
        """Several ranks: an agreement said a rank got a signal (ranks.py). `preempted` turns true
        on every rank after the same call, so they stop at the same step; one rank: at the signal."""
        self.preempted = True

    def install(self) -> None:
        if not self._signals:
            return
        self._wake = os.pipe()
        os.set_blocking(self._wake[1], False)
        threading.Thread(target=self._watch, args=(self._wake[0],), name="asyncckpt-preemption", daemon=True).start()
        for number in self._signals:
            self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, signum: int, frame) -> None:
        global _received
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._at = signum, now
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
        """The watchdog: waits for the handler's byte, then for close() to end within the grace."""
        try:
            os.read(wake_r, 1)
        finally:
            os.close(wake_r)
        if self.signum is None or self._closed.wait(max(0.0, self._at + self.grace_s - time.monotonic())):
            return
        end_now(self.signum, self._kill_worker, f"grace_s ({self.grace_s:g}s) ran out")

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had (where ours is still the one installed)."""
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
        return timeout_s if self.signum is None else max(0.1, min(timeout_s, self._at + self.grace_s - time.monotonic()))

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
        return reports

    def describe(self, memory_tier: bool, problem: str = "") -> str:
        newest = self.newest
        if newest is None:
            return "no save was in flight; the last committed checkpoint is unchanged"
        if newest.memory_only:
            where = "kept in the memory tier (a restart on this node restores it)" if memory_tier else ""
            return "; ".join(part for part in (f"step {newest.step} was memory-only: not on disk", problem, where) if part)
        how = ", written from the memory tier's copy" if self.persisted == newest.step else ""
        return f"step {newest.step} committed ({newest.path}{how})"

    @property
    def keeps_memory(self) -> bool:  # close() must not remove a memory-only newest save's file
        return (self.signum is not None or self.preempted) and self.newest is not None and self.newest.memory_only


def end_now(signum: int, kill_worker: Callable[[], None], why: str) -> None:
    """A second preemption signal, or the grace ran out: SIGKILL the worker and exit at once,
    with 128 + signal."""
    try:
        kill_worker()
    except Exception:
        pass
    try:  # (straight to the descriptor: this may run in a signal handler)
        os.write(2, f"asyncckpt: preempted: {why}: exiting now; the save in flight is given up, "
                    "the last committed checkpoint is intact\n".encode())
    except OSError:
        pass
    os._exit(128 + signum)


def _say(message: str) -> None:
    if log.hasHandlers():
        log.warning(message)
    print(message, file=sys.stderr, flush=True)
