"""The memory that object-store uploads of whole files may hold at once (storage/msc.py)."""

from __future__ import annotations

import contextlib
import threading

# msc sends a file at or below the profile's multipart threshold (64 MiB by default) as one PUT of
# the whole file read into memory; such uploads share this budget, so together they never hold
# more than this in memory (larger files stream in multipart chunks)
SINGLE_PUT_MEMORY_BYTES = 128 << 20


class MemoryBudget:
    """Bytes that concurrent uploads may hold in memory at once; a request larger than the whole
    budget waits until the budget is entirely free."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._free = total
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int, timeout_s: float, what: str):
        """Hold `nbytes` of the budget; TimeoutError naming `what` if they are not free within
        `timeout_s` (another upload holding them hangs)."""
        nbytes = min(nbytes, self._total)
        with self._cond:
            if not self._cond.wait_for(lambda: self._free >= nbytes, timeout_s):
                raise TimeoutError(f"{what}: {nbytes} bytes of upload memory not free within {timeout_s:.1f}s")
            self._free -= nbytes
        try:
            yield
        finally:
            with self._cond:
                self._free += nbytes
                self._cond.notify_all()
