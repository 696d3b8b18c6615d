"""The memory tier between nodes (CheckpointConfig(memory_replicas=R)): a worker pushes each copy
it sealed to the workers of ranks on other nodes, and a restart pulls a copy its node lacks from a
rank of a node that holds one. Plain TCP; every connection is authenticated (HMAC-SHA256 of a fresh
nonce under the job's secret, which rank 0 makes and the process group hands out), the bytes go
with sendfile (no pickle), and a receiver keeps a copy only once its header and every item's
CRC32C check out, renamed into place: a half-received or damaged copy never bears a copy's name.

    server -> client   nonce (32 bytes)
    client -> server   HMAC(secret, nonce) (32 bytes), request (4-byte length, JSON)
    put                client -> server: the copy's bytes; server -> client: reply
    get                server -> client: reply {"length": n} (or {"error": ...}), then n bytes
    (a reply is a 4-byte length and JSON: {"ok": true} or {"error": "why"})
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .formats import crc32c
from .memory_file import MemoryCopy, NotACopy, StoredItem, read_copy, verify_copy

log = logging.getLogger("asyncckpt")

NONCE_BYTES = 32
CHUNK = 8 << 20  # sendfile / receive piece: a cancelled push stops within one
_LENGTH = struct.Struct("<I")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
MAX_REQUEST = 16 << 20  # a request naming the items of a large copy


class ReplicaError(Exception):
    """A push or pull that did not happen; the message says why."""


class Truncated(ReplicaError):
    """A copy whose sender stopped before its last byte (cancelled by a newer save, or gone)."""


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

def _send_message(sock: socket.socket, obj: dict[str, Any]) -> None:
    raw = json.dumps(obj).encode()
    sock.sendall(_LENGTH.pack(len(raw)) + raw)


def _receive_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        piece = sock.recv(n - len(data))
        if not piece:
            raise ReplicaError("the peer closed the connection")
        data += piece
    return bytes(data)


def _receive_message(sock: socket.socket) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(_receive_exactly(sock, _LENGTH.size))
    if length > MAX_REQUEST:
        raise ReplicaError(f"a message of {length} bytes is too long")
    value = json.loads(_receive_exactly(sock, length))
    if not isinstance(value, dict):
        raise ReplicaError("a message that is not a JSON object")
    return value


def _connect(address: Address, secret: bytes, request: dict[str, Any], timeout_s: float) -> socket.socket:
    sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
    try:
        nonce = _receive_exactly(sock, NONCE_BYTES)
        raw = json.dumps(request).encode()
        sock.sendall(hmac.new(secret, nonce, hashlib.sha256).digest() + _LENGTH.pack(len(raw)) + raw)
    except BaseException:
        sock.close()
        raise
    return sock


def _receive_file(sock: socket.socket, path: str, length: int) -> None:
    """`length` bytes from `sock` into a new private file at `path` (room reserved first: a full
    tmpfs is ENOSPC here, never a SIGBUS)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if length:
            os.posix_fallocate(fd, 0, length)
            with mmap.mmap(fd, length, flags=mmap.MAP_SHARED | _POPULATE) as mapped:  # no fault per page
                view = memoryview(mapped)
                try:
                    got = 0
                    while got < length:
                        n = sock.recv_into(view[got:got + CHUNK])
                        if n == 0:
                            raise Truncated(f"the sender stopped after {got} of {length} bytes")
                        got += n
                finally:
                    view.release()
    finally:
        os.close(fd)


def _keep_if_valid(tmp: str, expected: Expected, rank: int, token: Optional[str]) -> MemoryCopy:
    """The copy received at `tmp`, checked whole and renamed to its rank's name; removed if not."""
    try:
        copy = verify_copy(tmp)
        if copy.root != expected.root or copy.rank != rank or copy.world_size != expected.world_size:
            raise ReplicaError(f"it holds rank {copy.rank} of {copy.world_size} of {copy.root!r}, not rank {rank} of "
                               f"{expected.world_size} of {expected.root!r}")
        if token is not None and copy.token != token:
            raise ReplicaError(f"it holds save {copy.token[:8]}, not {token[:8]}")
        os.rename(tmp, expected.path_of(rank))
        return copy
    except NotACopy as exc:
        raise ReplicaError(f"the copy received is not whole: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _temporary(expected: Expected, rank: int) -> str:
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
        with open(self.path, "rb") as file:
            length = os.fstat(file.fileno()).st_size
            request = {"op": "put", "rank": self.rank, "token": self.token, "length": length}
            try:
                self._sock = _connect(self.address, self.secret, request, self.timeout_s)
            except OSError as exc:
                raise ReplicaError(f"cannot reach {self.address}: {exc}") from None
            try:
                sent = 0
                while sent < length:
                    if self._cancelled.is_set():
                        raise ReplicaError("cancelled: a newer save is staging")
                    sent += self._sock.sendfile(file, sent, min(CHUNK, length - sent))
                reply = _receive_message(self._sock)
            except OSError as exc:
                raise ReplicaError("cancelled: a newer save is staging" if self._cancelled.is_set()
                                   else f"{self.address}: {exc}") from None
            finally:
                self._sock.close()
        if "error" in reply:
            raise ReplicaError(f"{self.address} refused it: {reply['error']}")
        return length


def pull(address: Address, secret: bytes, expected: Expected, rank: int, token: str, timeout_s: float) -> int:
    """Fetch rank `rank`'s copy of save `token` from the peer at `address` into its file here;
    bytes received. ReplicaError when it could not (nothing is left under the copy's name)."""
    try:
        sock = _connect(address, secret, {"op": "get", "rank": rank, "token": token}, timeout_s)
    except OSError as exc:
        raise ReplicaError(f"cannot reach {address}: {exc}") from None
    tmp = _temporary(expected, rank)
    try:
        reply = _receive_message(sock)
        if "error" in reply:
            raise ReplicaError(f"{address}: {reply['error']}")
        length = int(reply["length"])
        _receive_file(sock, tmp, length)
    except (OSError, ValueError, KeyError) as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise ReplicaError(f"{address}: {exc}") from None
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        sock.close()
    _keep_if_valid(tmp, expected, rank, token)
    return length


def pull_items(address: Address, secret: bytes, rank: int, token: str, items: list[StoredItem], into: str,
               timeout_s: float) -> int:
    """Fetch only `items` of rank `rank`'s copy of save `token` (a restart that reads a few entries
    of another rank's copy) into a new private file `into`, each at its offset (holes elsewhere),
    every item's CRC32C checked; bytes received. ReplicaError (and no file) when it could not."""
    request = {"op": "get", "rank": rank, "token": token, "ranges": [[item.at, item.length] for item in items]}
    try:
        sock = _connect(address, secret, request, timeout_s)
    except OSError as exc:
        raise ReplicaError(f"cannot reach {address}: {exc}") from None
    try:
        reply = _receive_message(sock)
        if "error" in reply:
            raise ReplicaError(f"{address}: {reply['error']}")
        size = int(reply["size"])
        fd = os.open(into, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            for item in items:
                if item.length:
                    os.posix_fallocate(fd, item.at, item.length)  # room for what is received, no more
            with mmap.mmap(fd, size) as mapped:
                view = memoryview(mapped)
                try:
                    for item in items:
                        got = 0
                        while got < item.length:
                            n = sock.recv_into(view[item.at + got:item.at + item.length])
                            if n == 0:
                                raise Truncated(f"the sender stopped inside the item at {item.at}")
                            got += n
                    for item in items:
                        if item.length and crc32c(view[item.at:item.at + item.length]) != item.crc32:
                            raise ReplicaError(f"the item at {item.at} of rank {rank}'s copy: checksum mismatch")
                finally:
                    view.release()
        finally:
            os.close(fd)
    except (OSError, ValueError, KeyError, ReplicaError) as exc:
        if os.path.exists(into):
            os.unlink(into)
        raise exc if isinstance(exc, ReplicaError) else ReplicaError(f"{address}: {exc}") from None
    finally:
        sock.close()
    return sum(item.length for item in items)


# the server -------------------------------------------------------------------------------------

class CopyServer:
    """Serves one tier's copies on `sock`: `put` (a worker: keep a peer's copy) and/or `get` (a
    restart: hand out one held here). A connection that fails the HMAC is refused and logged,
    and nothing is written."""

    def __init__(self, sock: socket.socket, secret: bytes, expected: Expected, *, put: bool, get: bool,
                 timeout_s: float = 60.0) -> None:
        self.sock, self.secret, self.expected = sock, secret, expected
        self.allowed = {op for op, on in (("put", put), ("get", get)) if on}
        self.timeout_s = timeout_s
        self.received = 0  # copies kept (put)
        self.served = 0  # bytes handed out (get)
        self._active = 0  # connections being served
        self._idle = threading.Condition()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="asyncckpt-replicas", daemon=True)

    def start(self) -> "CopyServer":
        self._thread.start()
        return self

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    def drain(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until no connection is being served; True if none is."""
        with self._idle:
            return self._idle.wait_for(lambda: self._active == 0, timeout_s)

    def stop(self) -> None:
        self._stopped.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(5.0)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                if self._stopped.is_set():
                    return
                continue
            with self._idle:
                self._active += 1
            threading.Thread(target=self._serve, args=(conn, peer), name="asyncckpt-replica", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            self._serve_one(conn, peer)
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def _serve_one(self, conn: socket.socket, peer: Any) -> None:
        with conn:
            conn.settimeout(self.timeout_s)
            try:
                nonce = secrets.token_bytes(NONCE_BYTES)
                conn.sendall(nonce)
                tag = _receive_exactly(conn, 32)
                if not hmac.compare_digest(tag, hmac.new(self.secret, nonce, hashlib.sha256).digest()):
                    log.warning("memory tier: refused a connection from %s: it does not know this job's secret", peer)
                    return
                request = _receive_message(conn)
                op, rank = request.get("op"), request.get("rank")
                if op not in self.allowed or not isinstance(rank, int) or not 0 <= rank < self.expected.world_size:
                    _send_message(conn, {"error": f"not served here: {op!r} of rank {rank!r}"})
                    return
                if op == "put":
                    self._keep(conn, peer, rank, request)
                else:
                    self._hand_out(conn, rank, str(request.get("token")), request.get("ranges"))
            except (OSError, ReplicaError, ValueError) as exc:
                log.debug("memory tier: a connection from %s ended: %s", peer, exc)

    def _keep(self, conn: socket.socket, peer: Any, rank: int, request: dict[str, Any]) -> None:
        tmp = _temporary(self.expected, rank)
        try:
            _receive_file(conn, tmp, int(request["length"]))
            copy = _keep_if_valid(tmp, self.expected, rank, str(request.get("token")))
        except (OSError, ReplicaError, ValueError, KeyError) as exc:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if isinstance(exc, Truncated):  # a newer save cancelled it, or its sender died: the next one counts
                log.info("memory tier: the copy of rank %s from %s was not kept: %s", rank, peer, exc)
            else:
                log.warning("memory tier: the copy of rank %s from %s was not kept: %s", rank, peer, exc)
            try:
                _send_message(conn, {"error": str(exc)})
            except OSError:
                pass
            return
        self.received += 1
        log.debug("memory tier: kept rank %d's copy of step %d from %s", rank, copy.step, peer)
        _send_message(conn, {"ok": True})

    def _hand_out(self, conn: socket.socket, rank: int, token: str, ranges: Any = None) -> None:
        """Send rank `rank`'s copy of save `token`: whole, or only `ranges` ([offset, length], in order)."""
        path = self.expected.path_of(rank)
        try:
            copy = read_copy(path)
            if copy.token != token or copy.root != self.expected.root:
                raise NotACopy(f"it holds save {copy.token[:8]} of {copy.root!r}")
            file = open(path, "rb")
        except (NotACopy, OSError) as exc:
            _send_message(conn, {"error": f"no copy of rank {rank}'s save {token[:8]} here ({exc})"})
            return
        with file:
            size = os.fstat(file.fileno()).st_size
            try:
                pieces = [(0, size)] if ranges is None else [(int(at), int(n)) for at, n in ranges]
            except (TypeError, ValueError):
                pieces = [(-1, 0)]
            if any(at < 0 or n < 0 or at + n > size for at, n in pieces):
                _send_message(conn, {"error": "a range outside the copy"})
                return
            _send_message(conn, {"length": sum(n for _, n in pieces), "size": size})
            for at, n in pieces:
                if n:
                    conn.sendfile(file, at, n)
        self.served += sum(n for _, n in pieces)
