"""Checkpointers a script never closed: at interpreter exit each one's in-flight save is committed
(bounded by timeout_s) and its worker stopped. A save that fails there must not pass unnoticed:
an ERROR log line, a message on stderr, and exit status 1 (docs/guarantees.md
says exactly what that skips). A script that Ctrl-C ended commits only a save already staged
(interrupted.py); a second Ctrl-C ends it at once."""

from __future__ import annotations

import atexit
import logging
import os
import signal
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
    """Close every checkpointer still open; if a save fails, say so and make the exit status 1.
    After Ctrl-C (the script ended with KeyboardInterrupt) each says what happened to the save it
    had in flight (interrupted.py); a Ctrl-C during this ends the process at once."""
    interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    failures, notes, closing = list(_reported), [], list(_live)
    if closing and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, lambda *_: end_now(closing))  # whatever this waits for, Ctrl-C ends it
    try:
        for checkpointer in closing:
            try:
                if interrupted:
                    note = checkpointer.close_interrupted()  # "" when no save was in flight
                    notes += [f"{checkpointer.root}: {note}"] if note else []
                else:
                    checkpointer.close()
            except Exception as exc:
                failures.append(f"{checkpointer.root}: {exc}")
    except KeyboardInterrupt:
        end_now(closing)
    for note in notes:
        say(logging.WARNING, f"asyncckpt: {note}")
    if not failures:
        return
    cause = "after Ctrl-C" if interrupted else "(the script did not call close())"
    say(logging.ERROR, f"asyncckpt: a save was NOT committed at interpreter exit {cause}: " + "; ".join(failures))
    exit_with_failure()


def say(level: int, message: str) -> None:
    """On stderr once: through logging where the script configured it (the line may go to a file
    as well), else printed (logging's last-resort handler would print it a second time)."""
    if log.hasHandlers():
        log.log(level, message)
    print(message, file=sys.stderr, flush=True)


def end_now(checkpointers: list) -> None:
    """Ctrl-C while close_all runs: kill every worker (SIGKILL, no wait) and end the process by
    SIGINT at once.
    The last committed checkpoint is intact: a commit is one rename, and nothing else is deleted
    first."""
    for checkpointer in checkpointers:
        try:
            checkpointer.kill_worker()
        except Exception:
            pass
    try:  # (straight to the descriptor: this may run in a signal handler, inside a print)
        os.write(2, b"asyncckpt: Ctrl-C again: exiting now; saves not committed are given up, "
                    b"the last committed checkpoint is intact\n")
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)  # (where SIGINT did not end it)


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
