"""Writer children forked from a process that never runs a second thread.

A child forked from a multi-threaded process inherits every lock another thread held at that
instant (logging handlers, malloc arenas, the dynamic loader, OpenMP/torch thread pools) and can
deadlock on it. The worker runs threads (staging helpers, writer threads, the parent watchdog,
sends to the trainer), so it never forks writers itself: at start-up, while it still has one
thread, it forks this server, which only forks one child per job and reaps it.

A job goes over a Unix socket: a length-prefixed payload plus descriptors (SCM_RIGHTS): the
result pipe's write end first, then what the job needs (the data file, the staging slab's memfd),
so files opened and slabs allocated after the server started are reachable. The child runs
`target(payload, fds)` and writes its result to the pipe. The server keeps its own copy of the
pipe until it has reaped the child, then appends the exit status and closes it: the worker reads
the pipe to its end and learns both. Server and children die with their parent
(PR_SET_PDEATHSIG, re-checked once set).
"""

from __future__ import annotations

import ctypes
import gc
import os
import select
import signal
import socket
import struct
import threading
from typing import Callable, Optional

_JOB = struct.Struct("!QI")  # payload length, number of descriptors
_PID = struct.Struct("!q")
_STATUS = struct.Struct("!4si")  # appended by the server: magic, wait status
_MAGIC = b"EXIT"
MAX_FDS = 8
SERVER_NAME = b"asyncckpt-forks"
WRITER_NAME = b"asyncckpt-write"

Target = Callable[[bytes, list], int]


class ForkServerError(OSError):
    """The fork server is gone or did not answer in time."""


class ForkServer:
    """The worker's handle on its fork server."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self._sock = sock
        self._closed = False

    @classmethod
    def start(cls, target: Target) -> "ForkServer":
        """Fork the server now. Call it while the calling process has a single thread."""
        # No other Python thread may run yet. The one native thread importing torch starts here
        # (numpy's OpenBLAS pool) is shut down by OpenBLAS's own at-fork handler before the fork.
        if threading.active_count() != 1:
            raise RuntimeError(f"the fork server must start before any other thread: {threading.enumerate()}")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                _serve(theirs, target, parent)
            finally:
                os._exit(70)
        theirs.close()
        return cls(pid, ours)

    def spawn(self, payload: bytes, fds: list, timeout_s: float) -> tuple:
        """Fork a child for one job; return (its pid, the read end of its result pipe)."""
        read_fd, write_fd = os.pipe()
        try:
            self._sock.settimeout(max(timeout_s, 0.001))
            socket.send_fds(self._sock, [_JOB.pack(len(payload), 1 + len(fds))], [write_fd, *fds])
            self._sock.sendall(payload)
            [pid] = _PID.unpack(_recv_exactly(self._sock, _PID.size))
        except (OSError, EOFError) as exc:  # the stream may be cut mid-job: this server is done
            os.close(read_fd)
            self.close()
            raise ForkServerError(f"fork server pid {self.pid} did not start a writer: {exc}") from exc
        finally:
            os.close(write_fd)
        if pid < 0:
            os.close(read_fd)
            raise ForkServerError(f"fork server could not fork a writer: {os.strerror(-pid)}")
        return pid, read_fd

    def alive(self) -> bool:
        if self._closed:
            return False
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def close(self) -> None:
        """Stop the server (its children die with it). Idempotent: a reaped pid may be reused."""
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def split_result(data: bytes) -> tuple:
    """What came through a result pipe -> (the child's result, its wait status or None when the
    server did not report one, e.g. because it died)."""
    if len(data) >= _STATUS.size:
        magic, status = _STATUS.unpack(data[-_STATUS.size :])
        if magic == _MAGIC:
            return data[: -_STATUS.size], status
    return data, None


def _serve(sock: socket.socket, target: Target, parent: int) -> None:
    """The server's loop: fork a child per job, report each exit through its pipe."""
    gc.disable()  # touch as few inherited pages as possible; nothing here makes cycles worth it
    name_process(SERVER_NAME)
    _die_with_parent(parent)
    keep = sock.fileno()
    os.closerange(3, keep)  # nothing of the worker's (the trainer's pipe, files) stays open here
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    pending: dict = {}  # child pid -> our copy of its result pipe
    me = os.getpid()
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            while _drain(wake_r):
                pass
            _reap(pending)
        if sock not in ready:
            continue
        job = _recv_job(sock)
        if job is None:  # the worker closed its end: done
            for pid in pending:
                _kill(pid)
            os._exit(0)
        payload, fds = job
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            sock.sendall(_PID.pack(-(exc.errno or 1)))
            continue
        if pid == 0:
            code = 70
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in [sock.detach(), wake_r, wake_w, *pending.values()]:
                    os.close(fd)  # a sibling's pipe must not stay open in this child
                name_process(WRITER_NAME)
                _die_with_parent(me)
                code = target(payload, fds)
            finally:
                os._exit(code)
        pending[pid] = fds[0]
        for fd in fds[1:]:
            os.close(fd)
        sock.sendall(_PID.pack(pid))
        _reap(pending)


def _reap(pending: dict) -> None:
    while pending:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = pending.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, _STATUS.pack(_MAGIC, status))
            except OSError:  # the worker stopped reading (it gave up on this child)
                pass
            os.close(fd)


def _recv_job(sock: socket.socket) -> Optional[tuple]:
    header, fds, _, _ = socket.recv_fds(sock, _JOB.size, MAX_FDS)
    if not header:
        return None
    header += _recv_exactly(sock, _JOB.size - len(header))
    length, count = _JOB.unpack(header)
    if len(fds) != count:
        raise RuntimeError(f"job came with {len(fds)} descriptors, not {count}")
    return _recv_exactly(sock, length), fds


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("fork server connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_libc = None


def _prctl(option: int, value) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6", use_errno=True)
    _libc.prctl(option, value, 0, 0, 0)


def name_process(name: bytes) -> None:
    """The process name ps and psutil show (PR_SET_NAME, at most 15 bytes)."""
    try:
        _prctl(15, ctypes.c_char_p(name))
    except OSError:
        pass


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when `parent` dies. The request covers only a parent
    alive when it is made: if it died just before, this process is an orphan already, so it
    checks and exits instead of working for nobody."""
    try:
        _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:
        os._exit(4)
