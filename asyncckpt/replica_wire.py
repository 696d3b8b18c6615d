"""The memory tier between nodes (CheckpointConfig(memory_replicas=R)): a worker pushes each copy
it sealed to the workers of ranks on other nodes, and a restart reads what it needs of a copy its
node lacks from a rank of a node that holds one, straight into its targets. Plain TCP; every
connection is authenticated (HMAC-SHA256 of a fresh nonce under the job's secret, which rank 0
makes and the process group hands out), the bytes go with sendfile (no pickle), and a receiver keeps a pushed copy only once its header and every
item's CRC32C check out, renamed into place: a half-received or damaged copy never bears a copy's
name (a restart's reader checks every item it reads the same way).
The server is replica_server.py.

    server -> client   nonce (32 bytes)
    client -> server   HMAC(secret, nonce) (32 bytes), request (4-byte length, JSON)
    put                request: the copy's "length" and "items" ([offset, length, CRC32C] as its header
                       records them); client -> server: the copy's bytes; server -> client: reply
    get                request: "ranges" ([offset, length]); server -> client: reply {"length": n}
                       (or {"error": ...}), then the n bytes of the ranges, in order
    (a reply is a 4-byte length and JSON: {"ok": true} or {"error": "why"})
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .formats import crc32c
from .memory_file import MemoryCopy, NotACopy, StoredItem, read_copy

NONCE_BYTES = 32
CHUNK = 8 << 20  # sendfile / receive piece: a cancelled push stops within one
_LENGTH = struct.Struct("<I")
MAX_REQUEST = 16 << 20  # a request naming the items of a large copy
SOCKET_BUFFER = 4 << 20  # each way: fewer wake-ups per copy (a loopback pull of 260 MiB: ~15 % sooner)


class ReplicaError(Exception):
    """A push or pull that did not happen; the message says why."""


class Truncated(ReplicaError):
    """A copy whose sender stopped before its last byte (cancelled by a newer save, or gone)."""


class Cancelled(ReplicaError):
    """A push stopped by its sender: a newer save is staging."""


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Expected:
    """What a copy received here must be: of this tier (`root`, `world_size`), under the name its
    rank's file has in `directory` (`name_of(rank)`)."""

    directory: str
    root: str
    world_size: int
    name_of: Callable[[int], str]

    def path_of(self, rank: int) -> str:
        return os.path.join(self.directory, self.name_of(rank))


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def listener(host: str) -> socket.socket:
    """A listening TCP socket on `host`, on a free port."""
    sock = socket.create_server((host, 0), backlog=64)
    sock.set_inheritable(False)
    return sock


# the two ends of a connection -------------------------------------------------------------------

def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def send_message(sock: socket.socket, obj: dict[str, Any]) -> None:
    raw = json.dumps(obj).encode()
    sock.sendall(_LENGTH.pack(len(raw)) + raw)


def receive_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        piece = sock.recv(n - len(data))
        if not piece:
            raise ReplicaError("the peer closed the connection")
        data += piece
    return bytes(data)


def receive_message(sock: socket.socket) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(receive_exactly(sock, _LENGTH.size))
    if length > MAX_REQUEST:
        raise ReplicaError(f"a message of {length} bytes is too long")
    value = json.loads(receive_exactly(sock, length))
    if not isinstance(value, dict):
        raise ReplicaError("a message that is not a JSON object")
    return value


def _connect(address: Address, secret: bytes, request: dict[str, Any], timeout_s: float) -> socket.socket:
    sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
    tune(sock)
    try:
        nonce = receive_exactly(sock, NONCE_BYTES)
        raw = json.dumps(request).encode()
        sock.sendall(hmac.new(secret, nonce, hashlib.sha256).digest() + _LENGTH.pack(len(raw)) + raw)
    except BaseException:
        sock.close()
        raise
    return sock


def receive_file(sock: socket.socket, path: str, size: int, checks: "ItemChecks",
                 deadline: Optional[float] = None) -> None:
    """`size` bytes from `sock` into a new private file at `path`, each item's CRC32C computed
    (`checks`) while its bytes are in the cache: the copy is not read again to be checked.
    Received into one reused buffer and written on with pwrite: a tmpfs then neither zeroes a
    page first nor faults one in (a loopback copy of 256 MiB: 0.17 s, against 0.28 s into a
    reserved, mapped file), and a full one is ENOSPC, never a SIGBUS; too little free room is
    ENOSPC before anything is received. `deadline` (monotonic): Truncated past it, however
    steadily the bytes trickle in (the socket's timeout bounds each receive only)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        _check_room(fd, path, size)
        os.ftruncate(fd, size)
        buffer = memoryview(bytearray(min(CHUNK, size)))
        per_receive_s = sock.gettimeout()
        got = 0
        while got < size:
            filled = min(len(buffer), size - got)
            receive_into(sock, buffer[:filled], deadline, per_receive_s, lambda done: _late(got + done, size))
            checks.feed(got, buffer[:filled])
            written = 0
            while written < filled:
                written += os.pwrite(fd, buffer[written:filled], got + written)
            got += filled
    finally:
        os.close(fd)


class ItemChecks:
    """Every item's CRC32C, computed from a copy's bytes as they arrive (`feed`, in file order),
    against the CRC32C its sender's header records."""

    def __init__(self, items: Sequence[StoredItem]) -> None:
        self.items = tuple(items)
        self._order = sorted(range(len(self.items)), key=lambda n: self.items[n].at)
        self._crcs = [0] * len(self.items)
        self._first = 0  # in _order: the first item not wholly behind the bytes fed so far

    def feed(self, at: int, view: memoryview) -> None:
        end, order = at + len(view), self._order
        while self._first < len(order) and self._end(order[self._first]) <= at:
            self._first += 1
        for k in range(self._first, len(order)):
            n = order[k]
            if self.items[n].at >= end:
                break
            lo, hi = max(self.items[n].at, at), min(self._end(n), end)
            if lo < hi:
                self._crcs[n] = crc32c(view[lo - at:hi - at], self._crcs[n])

    def _end(self, n: int) -> int:
        return self.items[n].at + self.items[n].length

    def damaged(self) -> Optional[StoredItem]:
        """The first item whose bytes did not match its CRC32C; None when every one did."""
        return next((item for item, crc in zip(self.items, self._crcs) if crc != item.crc32), None)


def receive_into(sock: socket.socket, view: memoryview, deadline: Optional[float], per_receive_s: Optional[float],
                 late: Callable[[int], str]) -> None:
    """Fill `view` from `sock`; Truncated when the sender stops first or `deadline` (monotonic)
    passes (`late(bytes received)` says so), each receive bounded by `per_receive_s` too."""
    filled, want = 0, len(view)
    while filled < want:
        if deadline is not None:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise Truncated(late(filled))
            sock.settimeout(left_s if per_receive_s is None else min(per_receive_s, left_s))
        try:
            received = sock.recv_into(view[filled:])
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise Truncated(late(filled)) from None
            raise
        if received == 0:
            raise Truncated(f"the sender stopped with {want - filled} bytes of a piece of {want} to come")
        filled += received


def _late(got: int, n: int) -> str:
    return f"{got} of {n} bytes received when the push's time ran out"


def _check_room(fd: int, path: str, nbytes: int) -> None:
    """ENOSPC now when the file system holding `path` has less than `nbytes` free."""
    stats = os.fstatvfs(fd)
    if stats.f_bavail * stats.f_frsize < nbytes:
        raise OSError(errno.ENOSPC, f"{nbytes} bytes do not fit ({stats.f_bavail * stats.f_frsize} free)", path)


def keep_if_valid(tmp: str, expected: Expected, rank: int, token: str, checks: ItemChecks) -> MemoryCopy:
    """The copy received at `tmp` (its items checked as they arrived: `checks`), renamed to its
    rank's name once its header is whole and records those very items; removed if not."""
    try:
        copy = read_copy(tmp)
        if copy.root != expected.root or copy.rank != rank or copy.world_size != expected.world_size:
            raise ReplicaError(f"it holds rank {copy.rank} of {copy.world_size} of {copy.root!r}, not rank {rank} of "
                               f"{expected.world_size} of {expected.root!r}")
        if copy.token != token:
            raise ReplicaError(f"it holds save {copy.token[:8]}, not {token[:8]}")
        if copy.items != checks.items:
            raise ReplicaError("its header records other items than its sender announced")
        damaged = checks.damaged()
        if damaged is not None:
            raise ReplicaError(f"the copy received is not whole: damaged (the item at {damaged.at}: checksum mismatch)")
        os.rename(tmp, expected.path_of(rank))
        return copy
    except NotACopy as exc:
        raise ReplicaError(f"the copy received is not whole: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def temporary(expected: Expected, rank: int) -> str:
    return os.path.join(expected.directory, f".{expected.name_of(rank)}.{os.getpid()}-{threading.get_ident()}.part")


# clients ----------------------------------------------------------------------------------------

class Push:
    """Send one sealed copy to one peer; `cancel()` (another thread) stops it within a piece."""

    def __init__(self, address: Address, secret: bytes, path: str, rank: int, token: str, timeout_s: float) -> None:
        self.address, self.secret, self.path, self.rank, self.token = address, secret, path, rank, token
        self.timeout_s = timeout_s
        self._cancelled = threading.Event()
        self._sock: Optional[socket.socket] = None

    def cancel(self) -> None:
        self._cancelled.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def run(self) -> int:
        """Bytes sent; ReplicaError when the peer refused or the push was cancelled."""
        if self._cancelled.is_set():
            raise Cancelled("cancelled: a newer save is staging")
        try:
            items = read_copy(self.path).items  # announced: the receiver checks each as it arrives
        except NotACopy as exc:
            if self._cancelled.is_set():  # (the newer save began staging into the file)
                raise Cancelled("cancelled: a newer save is staging") from None
            raise ReplicaError(f"{self.path}: {exc}") from None
        with open(self.path, "rb") as file:
            length = os.fstat(file.fileno()).st_size
            request = {"op": "put", "rank": self.rank, "token": self.token, "length": length,
                       "items": [[item.at, item.length, item.crc32] for item in items]}
            try:
                self._sock = _connect(self.address, self.secret, request, self.timeout_s)
            except OSError as exc:
                raise ReplicaError(f"cannot reach {self.address}: {exc}") from None
            try:
                sent = 0
                while sent < length:
                    if self._cancelled.is_set():
                        raise Cancelled("cancelled: a newer save is staging")
                    sent += self._sock.sendfile(file, sent, min(CHUNK, length - sent))
                reply = receive_message(self._sock)
            except OSError as exc:
                if self._cancelled.is_set():
                    raise Cancelled("cancelled: a newer save is staging") from None
                raise ReplicaError(f"{self.address}: {exc}") from None
            finally:
                self._sock.close()
        if "error" in reply:
            raise ReplicaError(f"{self.address} refused it: {reply['error']}")
        return length


class Ranges:
    """Byte ranges of a copy a peer holds, received straight into the caller's buffers, in order
    (a restart reads another node's copy into its targets: loading/peer_source.py). No file here
    and no second pass: the reader checks each item's CRC32C as it lands. `timeout_s` bounds
    the whole exchange, however steadily the bytes trickle in."""

    def __init__(self, address: Address, secret: bytes, rank: int, token: str, ranges: list[tuple[int, int]],
                 timeout_s: float) -> None:
        self.address = address
        self.deadline = time.monotonic() + timeout_s
        self.left = sum(n for _, n in ranges)
        try:
            self.sock = _connect(address, secret, {"op": "get", "rank": rank, "token": token, "ranges": ranges},
                                 timeout_s)
        except OSError as exc:
            raise ReplicaError(f"cannot reach {address}: {exc}") from None
        try:
            reply = receive_message(self.sock)
            if "error" in reply:
                raise ReplicaError(f"{address}: {reply['error']}")
            if int(reply["length"]) != self.left:
                raise ReplicaError(f"{address} offers {reply['length']} bytes, not the {self.left} asked for")
        except BaseException as exc:
            self.sock.close()
            if isinstance(exc, (OSError, ValueError, KeyError, TypeError, OverflowError)):
                raise ReplicaError(f"{address}: {exc}") from None
            raise
        self._per_receive_s = self.sock.gettimeout()

    def receive(self, view: memoryview) -> None:
        """The next len(view) bytes into `view`; ReplicaError if they do not come in time."""
        if len(view) > self.left:
            raise ReplicaError(f"{len(view)} bytes wanted, {self.left} left of what was asked for")
        try:
            receive_into(self.sock, view, self.deadline, self._per_receive_s,
                         lambda got: f"{got} of {len(view)} bytes received when the read's time ran out")
        except (OSError, ReplicaError) as exc:
            raise ReplicaError(f"{self.address}: {exc}") from None
        self.left -= len(view)

    def close(self) -> None:
        self.sock.close()
