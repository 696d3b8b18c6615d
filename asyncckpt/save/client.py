"""WorkerClient: spawns the worker, talks to it, and notices when it dies.

Every wait here is bounded and checks the worker's liveness, so a dead or stuck worker becomes a
CheckpointError instead of a hang.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from typing import Optional

import torch.multiprocessing as tmp
from multiprocessing.reduction import ForkingPickler

from ..errors import CheckpointTimeoutError, WorkerDiedError
from ..protocol import WORKER_ENTRY, Ready, SaveFailed, SaveRequest, Shutdown, WorkerSettings, WriteStaged, run_worker

log = logging.getLogger(__name__)

POLL_SLICE_S = 0.05
DIRECT_SEND_BYTES = 64 << 10  # well under a Unix socket's send buffer (about 200 KiB on Linux)
SHUTDOWN_SEND_S = 2.0  # a Shutdown message is tiny; a worker that does not take it gets killed
WORKER_EXIT_S = 10.0  # a worker that said it exits (SaveFailed.worker_exits) does so at once
_spawn_lock = threading.Lock()


class WorkerClient:
    def __init__(self, settings: WorkerSettings, start_timeout_s: float) -> None:
        self.settings = settings
        self.start_timeout_s = start_timeout_s  # the bound on waits while the worker starts up
        self._process = None
        self._stopping = None  # the process stop() is letting go of (signal_kill reaches it meanwhile)
        self._conn = None
        self._inbox: list = []
        self.ready = False  # the worker said Ready (its start-up is over)
        self.torn = False  # a Ctrl-C cut a message short: the connection is unusable (the worker must go)
        self._unfetched: set = set()  # descriptors our last request offered that the worker may not have taken

    # lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        ctx = tmp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=run_worker, args=(WORKER_ENTRY, child_conn, self.settings), name=f"asyncckpt-worker-{self.settings.rank}", daemon=True
        )
        with _spawn_lock, _main_module_hidden(), _sigint_blocked(self.settings.ignored_signals):
            process.start()
        child_conn.close()  # so a dead worker shows up as EOF on our end
        self._process, self._conn, self._inbox = process, parent_conn, []
        self.ready = self.torn = False
        log.debug("started worker pid %d for rank %d", process.pid, self.settings.rank)

    def poll_ready(self) -> bool:
        """Whether the worker has said Ready, taking in what it sent so far (never waits)."""
        try:
            while not self.ready and self._process is not None and self._receive(0):
                pass
        except WorkerDiedError:
            return False
        return self.ready

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid if self._process is not None else None

    def is_alive(self) -> bool:
        """False once the worker is dead or dying. A SIGKILLed process stays unreapable for a
        moment while its threads and memory are torn down; its main thread already shows as a
        zombie then, and a request sent in that window would be lost."""
        return self._process is not None and self._process.is_alive() and not _exiting(self._process.pid)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to exit; kill it if it does not within `timeout_s`."""
        process, conn = self._process, self._conn
        self._process, self._conn, self._inbox = None, None, []
        if process is None:
            return
        self._stopping = process
        try:
            self._stop(process, conn, timeout_s)
        finally:
            self._stopping = None
            _drop_offered_fds(self._unfetched)  # a worker that is gone will never fetch them
            self._unfetched = set()
            free_released_cuda_blocks()  # it let go of our CUDA tensors before it exited

    def _stop(self, process, conn, timeout_s: float) -> None:
        if process.is_alive() and not self.torn:
            try:
                _send_bounded(conn, process, Shutdown(), min(timeout_s, SHUTDOWN_SEND_S))
            except (OSError, EOFError, TimeoutError):
                pass
            process.join(timeout_s)
        if process.is_alive():
            if not self.torn:
                log.warning("worker pid %d did not exit in %.0fs; killing it", process.pid, timeout_s)
            process.kill()
            process.join(5)
        conn.close()
        if not process.is_alive():  # (one not reaped yet is left to multiprocessing, which reaps it later)
            process.close()

    def signal_kill(self) -> None:
        """SIGKILL the worker and return at once (Ctrl-C at exit; whoever waits on it sees it gone),
        also while stop() waits for it to exit (a second Ctrl-C during close(): a worker that hangs
        must not outlive the trainer)."""
        process = self._process or self._stopping
        try:
            if process is not None and process.is_alive():
                process.kill()
        except (ValueError, OSError):  # closed meanwhile by a thread that saw it die
            pass

    def kill(self) -> None:
        """Stop the worker now, without waiting for what it is doing."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()
        self.stop(timeout_s=5)

    # messages ------------------------------------------------------------------------------
    def send(self, request: SaveRequest | WriteStaged, timeout_s: float = 600.0) -> None:
        """Hand `request` to the worker, waiting at most `timeout_s` for it to be taken in.

        A request bigger than the socket buffer blocks until the worker reads it, and a plain
        send would block forever on a worker that stopped reading. Past the timeout the worker
        is killed (a half-sent message leaves the stream unusable) and the next save starts a
        fresh one."""
        if not self.is_alive():
            raise self._died("before the request could be sent")
        while not self.ready and self._receive(0):  # a worker still starting reads nothing yet
            pass
        offered_before = _offered_fds()
        try:
            _send_bounded(self._conn, self._process, request, self.allowance(timeout_s))
        except TimeoutError:
            pid = self.pid
            self._process.kill()
            self._process.join(5)
            raise CheckpointTimeoutError(
                f"rank {self.settings.rank}: worker pid {pid} did not take the save request "
                f"{self.bound_text(timeout_s)}; killed it"
            ) from None
        except (OSError, EOFError) as exc:
            raise self._died(f"while sending the request ({exc})") from exc
        finally:
            self._unfetched = _offered_fds() - offered_before

    def take(self, save_id: int, kinds: tuple[type, ...], timeout_s: Optional[float]) -> Optional[object]:
        """Return the first message for `save_id` of one of `kinds`, waiting at most `timeout_s`
        (0: do not wait; None is not allowed: every wait is bounded). Returns None on timeout 0;
        raises CheckpointTimeoutError past a positive timeout and WorkerDiedError if the worker
        exits first."""
        deadline = time.monotonic() + (self.allowance(timeout_s) if timeout_s else 0)
        while True:
            for i, message in enumerate(self._inbox):
                unreadable = isinstance(message, SaveFailed) and message.save_id is None
                if isinstance(message, kinds) and (getattr(message, "save_id", None) == save_id or unreadable):
                    if unreadable:  # it could not unpickle the request: what it did not fetch, it never will
                        _drop_offered_fds(self._unfetched)
                    self._unfetched = set()  # it answered, so it unpickled the request and took them all
                    return self._inbox.pop(i)
            remaining = deadline - time.monotonic()
            was_ready = self.ready
            got = self._receive(min(max(remaining, 0.0), POLL_SLICE_S))
            if self.ready and not was_ready and timeout_s:
                deadline = time.monotonic() + timeout_s  # the worker is up: the save's clock starts now
            if not got:
                if timeout_s == 0:
                    return None
                if remaining <= 0:
                    names = "/".join(k.__name__ for k in kinds)
                    raise CheckpointTimeoutError(
                        f"rank {self.settings.rank}: no {names} from worker pid {self.pid} {self.bound_text(timeout_s)}"
                    )

    def _receive(self, wait_s: float) -> bool:
        """Move one message into the inbox; False if none came within `wait_s`."""
        if self._conn is None:
            raise self._died("(no worker running)")
        if self.torn:
            raise self._died("(its connection was cut short by Ctrl-C)")
        try:
            if not self._conn.poll(wait_s):
                if not self._process.is_alive():
                    raise self._died("")
                return False
            try:
                message = self._conn.recv()
            except KeyboardInterrupt:  # Ctrl-C may have cut the message short: what follows is garbage
                self.torn = True
                raise
            if isinstance(message, Ready):
                self.ready = True
            else:
                self._inbox.append(message)
            if isinstance(message, SaveFailed) and message.worker_exits:  # let the next save see it gone
                self._process.join(WORKER_EXIT_S)
            return True
        except (EOFError, OSError) as exc:
            raise self._died("") from exc

    def allowance(self, timeout_s: float) -> float:
        """A wait's bound: `timeout_s`, after the worker's start-up while it has not said Ready
        yet (the wait cannot begin before; config.hand_off_bound_s)."""
        return timeout_s if self.ready else self.start_timeout_s + timeout_s

    def bound_text(self, timeout_s: float) -> str:
        """The bound a timed-out wait had, for its error (which setting to raise)."""
        if self.ready:
            return f"within {timeout_s:.1f}s (CheckpointConfig.timeout_s)"
        return (f"within {self.start_timeout_s + timeout_s:.1f}s: it had not started up "
                f"(CheckpointConfig.worker_start_timeout_s={self.start_timeout_s:g} for its start-up "
                f"+ timeout_s={timeout_s:g})")

    def _died(self, when: str) -> WorkerDiedError:
        process = self._process
        code = None
        if process is not None:
            process.join(1)
            code = process.exitcode
        reason = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
        pid = process.pid if process is not None else None
        return WorkerDiedError(f"rank {self.settings.rank}: checkpoint worker pid {pid} died ({reason}) {when}".rstrip())


def free_released_cuda_blocks() -> None:
    """Free the CUDA blocks of tensors this process freed while a worker still held them (torch
    keeps such blocks "in limbo" until the worker lets go, and warns at exit about any left).
    Without CUDA in use here, nothing to do (and CUDA is not initialised for it)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


def _offered_fds() -> set:
    """Keys of the descriptors this process currently offers through multiprocessing's resource
    sharer (torch registers one for every shared CPU storage it pickles)."""
    from multiprocessing import resource_sharer

    cache = getattr(resource_sharer._resource_sharer, "_cache", None)
    return set(cache) if isinstance(cache, dict) else set()


def _drop_offered_fds(keys: set) -> None:
    """Close the duplicates offered for a request its worker never unpickled: the sharer keeps
    them until fetched, so each dead worker would leak one descriptor (and the shared memory
    behind it) per tensor it was sent."""
    if not keys:
        return
    from multiprocessing import resource_sharer

    sharer = resource_sharer._resource_sharer
    cache = getattr(sharer, "_cache", None)
    if not isinstance(cache, dict):
        return
    with sharer._lock:
        entries = [cache.pop(key) for key in keys if key in cache]
    for _, close in entries:
        try:
            close()
        except OSError:
            pass
    if entries:
        log.debug("closed %d descriptors offered to a worker that never took them", len(entries))


def _exiting(pid: int) -> bool:
    """The process's main thread has exited (state Z or X in /proc); False where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"Z", b"X")


def _send_bounded(conn, process, message, timeout_s: float) -> None:
    """`conn.send(message)`, bounded: a payload that fits in the socket buffer is written at
    once (a steady-state request, a few KB); a larger one is written on a helper thread, waited
    for at most `timeout_s` and only while `process` lives. Raises TimeoutError past the timeout,
    BrokenPipeError if the worker died first, or whatever the send itself raised. A send still
    blocked is left to fail on its own once the worker is gone (its end of the socket closes)."""
    payload = ForkingPickler.dumps(message)  # what Connection.send does; torch shares storages here
    if len(payload) <= DIRECT_SEND_BYTES:
        conn.send_bytes(payload)
        return
    failure: list[BaseException] = []

    def deliver() -> None:
        try:
            conn.send_bytes(payload)
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)

    sender = threading.Thread(target=deliver, name="asyncckpt-send", daemon=True)
    sender.start()
    deadline = time.monotonic() + timeout_s
    sender.join(min(timeout_s, POLL_SLICE_S))
    while sender.is_alive() and process.is_alive() and time.monotonic() < deadline:
        sender.join(POLL_SLICE_S)
    if sender.is_alive():
        if process.is_alive():
            raise TimeoutError(f"send not taken within {timeout_s:.1f}s")
        sender.join(1)  # the reader is gone: the blocked send fails with EPIPE
        if sender.is_alive() or not failure:
            raise BrokenPipeError("worker exited while the message was being sent")
    if failure:
        raise failure[0]


class _sigint_blocked:
    """Start the worker with SIGINT blocked, so that a Ctrl-C while it starts (a terminal sends it
    to the whole process group) cannot end it before it ignores SIGINT (protocol.run_worker). The
    mask is this thread's: a Ctrl-C meanwhile reaches the trainer through another thread, or
    once the mask is restored. The preemption signals the worker ignores are blocked the same way."""

    def __init__(self, also: tuple[int, ...] = ()):
        self.signals = {signal.SIGINT, *also}

    def __enter__(self):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()  # first: starting it unblocks SIGINT (for spawn, in process.start())
        self.old = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        return self

    def __exit__(self, *exc):
        signal.pthread_sigmask(signal.SIG_SETMASK, self.old)
        return False


class _main_module_hidden:
    """Start the worker without re-importing the user's __main__ in it.

    spawn normally re-runs the training script's top level inside the child, which would start
    training there (or fail without an `if __name__ == "__main__"` guard). The worker needs none of
    it: its entry point and messages live in importable modules.
    """

    def __enter__(self):
        self.main = sys.modules.get("__main__")
        self.saved = {}
        for name in ("__file__", "__spec__"):
            if self.main is not None and hasattr(self.main, name):
                self.saved[name] = getattr(self.main, name)
        if "__file__" in self.saved:
            del self.main.__file__
        if "__spec__" in self.saved:
            self.main.__spec__ = None
        return self

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(self.main, name, value)
        return False


