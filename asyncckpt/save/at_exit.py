"""Checkpointers a script never closed: at interpreter exit each one's in-flight save is committed
(bounded by timeout_s) and its worker stopped. A save that fails there must not pass unnoticed:
an ERROR log line, a message on stderr, and exit status 1 (docs/guarantees.md
says exactly what that skips)."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref

log = logging.getLogger("asyncckpt")

_live: "weakref.WeakSet" = weakref.WeakSet()


def track(checkpointer) -> None:
    _live.add(checkpointer)


def forget(checkpointer) -> None:
    _live.discard(checkpointer)


_reported: list[str] = []  # failures of exit handlers that run before close_all (the Lightning plugin's)


def report_failure(message: str) -> None:
    """A save that failed in an exit handler registered after this module's (so run before
    close_all): close_all says so with its own failures and makes the exit status 1."""
    _reported.append(message)


@atexit.register
def close_all() -> None:
    """Close every checkpointer still open; if a save fails, say so and make the exit status 1."""
    failures = list(_reported)
    for checkpointer in list(_live):
        try:
            checkpointer.close()
        except Exception as exc:
            failures.append(f"{checkpointer.root}: {exc}")
    if not failures:
        return
    message = ("asyncckpt: a save was NOT committed at interpreter exit (the script did not call close()): "
               + "; ".join(failures))
    log.error(message)
    print(message, file=sys.stderr, flush=True)
    exit_with_failure()


def exit_with_failure() -> None:
    """Make the exit status 1. A script that ended with an uncaught exception exits with 1
    already: nothing more is done. Otherwise stdout, stderr and logging are flushed and the
    process ends with os._exit(1), which skips what would still run: exit handlers registered
    before this module was imported (with AsyncCheckpointer), object finalizers and the flushing
    of files left open."""
    if getattr(sys, "last_value", None) is not None:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(1)
