"""How many object-store requests this process issued, by kind, and how many were retries.

Counted where they leave: a hook on each boto3 S3 client that multi-storage-client made (its
`before-send` event, once per HTTP attempt, so botocore's own retries count too), plus the calls
`retries.py` repeats. A save's figures are the difference of two snapshots (`since`), so the
worker (data files) and the trainer (probe, sidecar, `.metadata`, `latest`) each count their own.
"""

from __future__ import annotations

import re
import threading
from typing import Optional
from urllib.parse import parse_qs, urlsplit

# every kind a save or a load issues; the fault proxy (asyncckpt/testing/s3_faults.py) uses the same names
KINDS = ("put", "part", "create", "complete", "abort", "copy", "get", "head", "list", "delete")
RETRIES = "retries"  # the snapshot's key for attempts that repeated a failed one
_ATTEMPT = re.compile(r"attempt=(\d+)")


def request_kind(method: str, url: str, headers) -> str:
    """The kind of one S3 request (path-style or virtual-hosted URL): `put` an object, `part` of
    a multipart upload, `create` / `complete` / `abort` a multipart upload, `copy` server-side,
    `get` (ranged or whole), `head`, `list` (objects or uploads), `delete` (one or a batch)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query, keep_blank_values=True)
    has_key = parts.path.strip("/").count("/") >= 1 or not _path_style(parts)
    method = method.upper()
    if method == "PUT":
        if "partNumber" in query:
            return "part"
        return "copy" if _header(headers, "x-amz-copy-source") else "put"
    if method == "POST":
        if "uploads" in query:
            return "create"
        if "uploadId" in query:
            return "complete"
        return "delete" if "delete" in query else "put"
    if method == "DELETE":
        return "abort" if "uploadId" in query else "delete"
    if method == "HEAD":
        return "head"
    if "list-type" in query or "uploads" in query or "prefix" in query or not has_key:
        return "list"
    return "get"


def _path_style(parts) -> bool:
    """An endpoint given as host:port or IP (moto, MinIO) puts the bucket first in the path."""
    host = parts.hostname or ""
    return parts.port is not None or host.replace(".", "").isdigit() or host == "localhost"


def _header(headers, name: str) -> Optional[str]:
    for key, value in headers.items():
        if key.lower() == name:
            return value.decode() if isinstance(value, bytes) else value
    return None


class RequestCounter:
    """Requests by kind, and retries, of this process (every thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def since(self, before: dict[str, int]) -> dict[str, int]:
        """What was counted after `before` was taken (kinds with none left out)."""
        now = self.snapshot()
        return {k: n - before.get(k, 0) for k, n in sorted(now.items()) if n > before.get(k, 0)}


COUNTER = RequestCounter()


def count_requests_of(api) -> None:
    """Count every request a boto3 S3 client sends (once per client; later calls do nothing)."""
    if getattr(api, "_asyncckpt_counted", False):
        return
    api.meta.events.register("before-send.s3", _on_send, unique_id="asyncckpt-count-requests")
    api._asyncckpt_counted = True


def _on_send(request, **_) -> None:
    """botocore's before-send: one HTTP attempt; `amz-sdk-request: attempt=N` says N > 1 is a retry."""
    COUNTER.add(request_kind(request.method, request.url, request.headers))
    attempt = _ATTEMPT.search(_header(request.headers, "amz-sdk-request") or "")
    if attempt and int(attempt.group(1)) > 1:
        COUNTER.add(RETRIES)

