"""When and how an object-store call is tried again.

Below us, botocore retries each HTTP request (standard mode: 3 attempts) and multi-storage-client
retries some calls (its profile's `retry:`); what still fails comes here. A transient failure
(503 SlowDown, 500, 429, a connection reset or timeout, a read cut short, credentials that
expired, a HEAD refused without a reason, a multipart completion whose answer was lost) is tried again after a full-jitter
exponential backoff, at most `attempts` times and never past `window_s` from the first try (or
the caller's deadline): every wait is bounded. Anything else (403 AccessDenied, 404, a bad
request) fails at once. Every call it repeats is counted (requests.COUNTER, "retries").
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .requests import COUNTER, RETRIES

# S3 error codes worth another try (botocore's standard mode retries most of these per request
# already; a call that ends in one here failed all of those tries)
_TRANSIENT_CODES = {
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeoutException", "Throttling",
    "ThrottlingException", "TooManyRequestsException", "RequestLimitExceeded", "PriorRequestNotComplete",
    # a CompleteMultipartUpload retried after its answer was lost finds the upload gone: the whole
    # upload is sent again (same key, same bytes), so the object is published once, whole
    "NoSuchUpload",
}
_TRANSIENT_STATUS = {429, 500, 502, 503, 504}
HEAD_REFUSED = "HEAD refused"  # 400/403 with no reason: expired credentials look like this on a HEAD
_EXPIRED_CODES = {"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired", "RequestExpired"}
# by name, so this module needs neither botocore nor urllib3 to import. Not a refused connection
# (EndpointConnectionError): botocore tried it three times already, and a store that is not there
# should fail the save in seconds
_TRANSIENT_CLASSES = {
    "RetryableError", "ConnectionClosedError", "ReadTimeoutError", "IncompleteReadError", "ResponseStreamingError",
    "ProtocolError", "ConnectionResetError", "BrokenPipeError", "ConnectionAbortedError",
}


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` tries of one call, none started after `window_s`; before retry n
    (0-based) a random wait in [0, min(cap_s, base_s * 2**n)] ("full jitter": ranks that failed
    together do not come back together)."""

    attempts: int = 6
    base_s: float = 0.5
    cap_s: float = 8.0
    window_s: float = 60.0

    @classmethod
    def from_env(cls) -> "RetryPolicy":
        """The defaults, or ASYNCCKPT_RETRY_ATTEMPTS / ASYNCCKPT_RETRY_WINDOW_S (read at each call,
        inherited by the worker process)."""
        attempts = os.environ.get("ASYNCCKPT_RETRY_ATTEMPTS")
        window = os.environ.get("ASYNCCKPT_RETRY_WINDOW_S")
        policy = cls(attempts=int(attempts) if attempts else cls.attempts,
                     window_s=float(window) if window else cls.window_s)
        if policy.attempts < 1 or policy.window_s < 0:
            raise ValueError(f"ASYNCCKPT_RETRY_ATTEMPTS must be >= 1 and ASYNCCKPT_RETRY_WINDOW_S >= 0, not {policy}")
        return policy

    def backoff_s(self, retry: int) -> float:
        return random.uniform(0, min(self.cap_s, self.base_s * 2**retry))


def why_transient(exc: BaseException) -> Optional[str]:
    """What makes `exc` worth another try ("SlowDown", "ExpiredToken", "ConnectionClosedError"...),
    None if nothing does. Looks down the chain: msc and s3transfer wrap botocore's errors."""
    seen = exc
    for _ in range(8):  # chains are short; they can loop
        if seen is None:
            return None
        code, status = _s3_error(seen)
        if code in _EXPIRED_CODES or code in _TRANSIENT_CODES:
            return code
        if getattr(seen, "operation_name", None) == "HeadObject" and status in (400, 403):
            return HEAD_REFUSED  # S3 answers a HEAD without a body, so without saying why
        if status in _TRANSIENT_STATUS:
            return f"HTTP {status}"
        if type(seen).__name__ in _TRANSIENT_CLASSES:
            return type(seen).__name__
        seen = seen.__cause__ or seen.__context__
    return None


def _s3_error(exc: BaseException) -> tuple[Optional[str], Optional[int]]:
    """(error code, HTTP status) of a botocore ClientError; (None, None) for anything else."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None
    return response.get("Error", {}).get("Code"), response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def with_retries(call: Callable[[], Any], deadline: Optional[float] = None,
                 policy: Optional[RetryPolicy] = None) -> Any:
    """`call()`, tried again on transient failures within the policy and the monotonic
    `deadline`. A backoff that would end past the window is cut short at its end, where one last
    try is made (so a fault that ends within the window is outlasted unless the attempts run out
    first). The last failure is raised; one of expired credentials becomes a PermissionError that
    says so."""
    policy = policy or RetryPolicy.from_env()
    started = time.monotonic()
    end = started + policy.window_s if deadline is None else min(started + policy.window_s, deadline)
    for attempt in range(policy.attempts):
        try:
            return call()
        except Exception as exc:
            reason = why_transient(exc)
            left = end - time.monotonic()
            if reason is None or attempt + 1 == policy.attempts or left <= 0:
                tried = (f"{attempt + 1} attempts over {time.monotonic() - started:.1f}s (retries end after "
                         f"{policy.attempts} attempts or {policy.window_s:.0f}s)")
                if reason in _EXPIRED_CODES:
                    raise PermissionError(f"the store's credentials expired ({reason}) and were still refused after "
                                          f"{tried}; refresh them") from exc
                if reason == HEAD_REFUSED:
                    raise PermissionError(f"the store refused a HEAD (HTTP 400/403, which carries no reason) after {tried}: "
                                          f"its credentials expired, or they lack permission") from exc
                raise
            COUNTER.add(RETRIES)
            time.sleep(min(policy.backoff_s(attempt), left))
    raise AssertionError("unreachable")
