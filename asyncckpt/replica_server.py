"""The memory tier's copy server (CheckpointConfig(memory_replicas=R)): a worker keeps the copies
its peers push; a restart hands out byte ranges of the copies its node holds.
replica_wire.py has the wire both ends speak.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Optional

from .memory_file import NotACopy, StoredItem, read_copy
from .replica_wire import (
    NONCE_BYTES, Expected, ItemChecks, ReplicaError, Truncated, keep_if_valid, receive_exactly, receive_file,
    receive_message, send_message, temporary, tune,
)

log = logging.getLogger("asyncckpt")


class CopyServer:
    """Serves one tier's copies on `sock`: `put` (a worker: keep a peer's copy; `keeps`: of these
    ranks only, None: any) and/or `get` (a restart: hand out one held here). A connection that
    fails the HMAC is refused and logged, and nothing is written."""

    def __init__(self, sock: socket.socket, secret: bytes, expected: Expected, *, put: bool, get: bool,
                 timeout_s: float = 60.0, keeps: Optional[frozenset[int]] = None) -> None:
        self.sock, self.secret, self.expected = sock, secret, expected
        self.allowed = {op for op, on in (("put", put), ("get", get)) if on}
        self.timeout_s = timeout_s
        self.keeps = keeps
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
            tune(conn)
            try:
                nonce = secrets.token_bytes(NONCE_BYTES)
                conn.sendall(nonce)
                tag = receive_exactly(conn, 32)
                if not hmac.compare_digest(tag, hmac.new(self.secret, nonce, hashlib.sha256).digest()):
                    log.warning("memory tier: refused a connection from %s: it does not know this job's secret", peer)
                    return
                request = receive_message(conn)
                op, rank = request.get("op"), request.get("rank")
                if (op not in self.allowed or not isinstance(rank, int) or not 0 <= rank < self.expected.world_size
                        or (op == "put" and self.keeps is not None and rank not in self.keeps)):
                    send_message(conn, {"error": f"not served here: {op!r} of rank {rank!r}"})
                    return
                if op == "put":
                    self._keep(conn, peer, rank, request)
                else:
                    self._hand_out(conn, rank, str(request.get("token")), request.get("ranges"))
            except (OSError, ReplicaError, ValueError, TypeError, OverflowError) as exc:
                log.debug("memory tier: a connection from %s ended: %s", peer, exc)

    def _keep(self, conn: socket.socket, peer: Any, rank: int, request: dict[str, Any]) -> None:
        tmp = temporary(self.expected, rank)
        try:
            checks = ItemChecks(tuple(StoredItem(int(at), int(n), int(crc)) for at, n, crc in request["items"]))
            receive_file(conn, tmp, int(request["length"]), checks, deadline=time.monotonic() + self.timeout_s)
            copy = keep_if_valid(tmp, self.expected, rank, str(request.get("token")), checks)
        except (OSError, ReplicaError, ValueError, KeyError, TypeError, OverflowError) as exc:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if isinstance(exc, Truncated):  # a newer save cancelled it, or its sender died: the next one counts
                log.info("memory tier: the copy of rank %s from %s was not kept: %s", rank, peer, exc)
            else:
                log.warning("memory tier: the copy of rank %s from %s was not kept: %s", rank, peer, exc)
            try:
                send_message(conn, {"error": str(exc)})
            except OSError:
                pass
            return
        log.debug("memory tier: kept rank %d's copy of step %d from %s", rank, copy.step, peer)
        send_message(conn, {"ok": True})

    def _hand_out(self, conn: socket.socket, rank: int, token: str, ranges: Any) -> None:
        """Send `ranges` ([offset, length], in order) of rank `rank`'s copy of save `token`."""
        path = self.expected.path_of(rank)
        try:
            copy = read_copy(path)
            if copy.token != token or copy.root != self.expected.root:
                raise NotACopy(f"it holds save {copy.token[:8]} of {copy.root!r}")
            file = open(path, "rb")
        except (NotACopy, OSError) as exc:
            send_message(conn, {"error": f"no copy of rank {rank}'s save {token[:8]} here ({exc})"})
            return
        with file:
            size = os.fstat(file.fileno()).st_size
            try:
                pieces = [(int(at), int(n)) for at, n in ranges]
            except (TypeError, ValueError, OverflowError):
                pieces = [(-1, 0)]
            if any(at < 0 or n < 0 or at + n > size for at, n in pieces):
                send_message(conn, {"error": "a range outside the copy"})
                return
            send_message(conn, {"length": sum(n for _, n in pieces)})
            for at, n in pieces:
                if n:
                    conn.sendfile(file, at, n)
