"""AsyncCheckpointer's part in preemption (preemption.py): its calls take one lock, so the
watchdog's close() for a loop that did not call it never runs beside one of the loop's; that
close; the write of a memory-only newest save at a preempted close; and a closed checkpointer's error."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

from ..errors import CheckpointError
from ..report import SaveReport
from .at_exit import say
from .inflight import InFlightSave
from .preemption import requeue_exit
from .staged_copy import persist_flight

log = logging.getLogger("asyncckpt")


def one_call_at_a_time(method: Callable) -> Callable:
    """A checkpointer call, made under the checkpointer's lock (`_calls`, an RLock)."""

    @functools.wraps(method)
    def locked(self, *args: Any, **kwargs: Any) -> Any:
        with self._calls:
            return method(self, *args, **kwargs)

    return locked


class PreemptedClose:
    """The checkpointer's closes after a preemption signal (its part kept here)."""

    def _close_for_the_loop(self) -> None:
        """The preemption watchdog's close(), for a loop that has not called it near the grace's
        end (preemption.py): once no call of the loop's is under way, within what is left of the
        grace. Sets `closed_for_the_loop` when it closed the checkpointer (failed or not)."""
        if not self._calls.acquire(timeout=self._preemption.bound_s(self.config.timeout_s)):
            return  # a call of the loop's held them all along (its close commits; else the grace ends it)
        closed_here = not self._closed
        try:
            self.close()
        except Exception as exc:  # (closing() has said it on stderr)
            log.debug("closing for the loop after a preemption signal failed: %r", exc)
        finally:  # (failed or not, it is closed: the loop's next save ends the process, as below)
            self._preemption.closed_for_the_loop = closed_here  # (under the lock: the loop's next call sees it)
            self._calls.release()

    def _persist(self, staged: Optional[InFlightSave]) -> list[SaveReport]:
        """A preempted close: the worker writes its copy of a memory-only newest save (staged_copy.py)."""
        self._in_flight = persist_flight(staged, self._group, self._folders, self._janitor, self._worker)
        self._finish_in_flight(blocking=True)
        return self.finalize()

    def _check_open(self) -> None:
        """CheckpointError if closed; after a close for the loop, a call means the loop knows nothing
        of the signal (torchtitan's, through async_save): the process ends now, with 128 + signal."""
        if self._closed and self._preemption.closed_for_the_loop:
            say(logging.WARNING, "asyncckpt: preempted: a save was asked after the checkpointer was closed for the "
                                 "loop (above); exiting now, as requeue_exit() does")
            requeue_exit()
        if self._closed:
            raise CheckpointError("this AsyncCheckpointer is closed")
