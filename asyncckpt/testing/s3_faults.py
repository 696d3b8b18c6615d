"""A fault-injecting S3 front: an HTTP proxy on loopback in front of the tests' moto server
(s3_server.py) that misbehaves the way real stores do, per request kind, deterministically.

    front = FaultyS3(server.endpoint, seed=1)        # point a msc profile / AWS_ENDPOINT_URL at front.endpoint
    front.inject(Fault("slowdown", rate=0.05))        # 503 SlowDown to 5 % of every kind of request
    front.inject(Fault("reset", kinds=("part",), times=1))
    ...; front.requests()  ->  {"part": 12, "put": 5, ...}; front.injected()  ->  {"slowdown": 3, "reset": 1}

Actions (`Fault.action`):
- "slowdown": answer 503 SlowDown (the request never reaches the server);
- "reset": cut the connection (RST) mid-body: half-way through a request's body, or, for a
  request without one, half-way through the server's answer;
- "stall": wait `stall_s` before passing the request on;
- "expired": answer 403 ExpiredToken to every matching request for `window_s` seconds from the
  first one it meets;
- "drop": pass the request on, let the server act, then cut the connection instead of answering
  (the write happened; the client saw a failure).

Request kinds are those of asyncckpt.storage.requests (put, part, create, complete, abort, copy,
get, head, list, delete): the proxy and the library's own request counts use one classification.
Which matching request a fault hits is drawn from a generator seeded with (seed, the fault's
position), in the order requests arrive: the same run of requests meets the same faults.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import urlsplit

from asyncckpt.storage.requests import KINDS, request_kind

ACTIONS = ("slowdown", "reset", "stall", "expired", "drop")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}
_WITH_BODY = {"put", "part", "complete", "delete"}  # kinds whose requests carry a body (delete: a batch's list)


@dataclass
class Fault:
    """One kind of misbehaviour for some request kinds. `rate` of the matching requests (after the
    first `after`, at most `times` of them) meet it; "expired" meets every one in its window."""

    action: str
    kinds: tuple[str, ...] = KINDS
    rate: float = 1.0
    times: Optional[int] = None
    after: int = 0
    stall_s: float = 2.0
    window_s: float = 5.0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"Fault.action must be one of {ACTIONS}, not {self.action!r}")
        unknown = set(self.kinds) - set(KINDS)
        if unknown or not self.kinds:
            raise ValueError(f"Fault.kinds must be some of {KINDS}, not {self.kinds!r}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"Fault.rate must be within [0, 1], not {self.rate!r}")


@dataclass
class _Armed:
    fault: Fault
    rng: random.Random
    matched: int = 0
    fired: int = 0
    window_start: Optional[float] = None

    def hits(self, kind: str, now: float) -> bool:
        fault = self.fault
        if kind not in fault.kinds:
            return False
        self.matched += 1
        if self.matched <= fault.after or (fault.times is not None and self.fired >= fault.times):
            return False
        if fault.action == "expired":
            self.window_start = now if self.window_start is None else self.window_start
            hit = now - self.window_start < fault.window_s
        else:
            hit = self.rng.random() < fault.rate
        self.fired += hit
        return hit


@dataclass
class _Tally:
    requests: Counter = field(default_factory=Counter)
    injected: Counter = field(default_factory=Counter)


class FaultyS3:
    """The proxy: listens on 127.0.0.1 only, on a port the OS picks; one thread per connection."""

    def __init__(self, target_endpoint: str, seed: int = 0) -> None:
        target = urlsplit(target_endpoint)
        self.target = (target.hostname or "127.0.0.1", target.port or 80)
        self.seed = seed
        self._lock = threading.Lock()
        self._armed: list[_Armed] = []
        self._tally = _Tally()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.front = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="faulty-s3", daemon=True).start()

    def inject(self, fault: Fault) -> None:
        """Add a fault; earlier ones are asked first, and a request meets at most one."""
        with self._lock:
            rng = random.Random(f"{self.seed}:{len(self._armed)}")
            self._armed.append(_Armed(fault, rng))

    def clear(self) -> None:
        """No faults from now on (counts are kept)."""
        with self._lock:
            self._armed = []

    def requests(self) -> dict[str, int]:
        """Requests seen so far, by kind (each attempt of a retried one counts)."""
        with self._lock:
            return dict(self._tally.requests)

    def injected(self) -> dict[str, int]:
        """Faults dealt so far, by action."""
        with self._lock:
            return dict(self._tally.injected)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FaultyS3":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _meet(self, kind: str) -> Optional[Fault]:
        with self._lock:
            self._tally.requests[kind] += 1
            now = time.monotonic()
            for armed in self._armed:
                if armed.hits(kind, now):
                    self._tally.injected[armed.fault.action] += 1
                    return armed.fault
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore expects
    upstream: Optional[http.client.HTTPConnection] = None

    def do_GET(self) -> None:
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def log_message(self, format, *args) -> None:  # quiet: the tests print what matters
        pass

    def finish(self) -> None:
        super().finish()
        if self.upstream is not None:
            self.upstream.close()

    def _proxy(self) -> None:
        front: FaultyS3 = self.server.front
        kind = request_kind(self.command, self.path, self.headers)
        fault = front._meet(kind)
        action = fault.action if fault else None
        length = int(self.headers.get("Content-Length") or 0)
        if action == "reset" and length:
            self.rfile.read(length // 2)
            return self._reset()
        body = self._read_body(length)
        if action == "stall":
            time.sleep(fault.stall_s)
        if action == "slowdown":
            return self._error(503, "SlowDown", "Please reduce your request rate.")
        if action == "expired":
            return self._error(403, "ExpiredToken", "The provided token has expired.")
        status, reason, headers, data = self._forward(body)
        if action == "drop" or (action == "reset" and not data):
            return self._reset()
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP and not (name.lower() == "content-length" and self.command != "HEAD"):
                self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if action == "reset":
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            return self._reset()
        self.wfile.write(data)

    def _read_body(self, length: int) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes):
        """Send the request to the server on this connection's own upstream connection."""
        for attempt in range(2):  # the server may have closed an idle keep-alive connection
            if self.upstream is None:
                self.upstream = http.client.HTTPConnection(*self.server.front.target, timeout=300)
            try:
                self.upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                        self.upstream.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    self.upstream.putheader("Content-Length", str(len(body)))
                self.upstream.endheaders(body or None)
                response = self.upstream.getresponse()
                data = response.read()
                if response.will_close:
                    self.upstream.close()
                    self.upstream = None
                return response.status, response.reason, response.getheaders(), data
            except (http.client.HTTPException, OSError):
                self.upstream.close()
                self.upstream = None
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def _error(self, status: int, code: str, message: str) -> None:
        body = b"" if self.command == "HEAD" else (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>asyncckpt-fault</RequestId></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _reset(self) -> None:
        """Close with a TCP RST (SO_LINGER 0): the client sees "connection reset", not a clean end."""
        self.close_connection = True
        self.wfile.flush()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
