"""What every part of the save benchmark shares: paths, method names, log lines, progress, Skip."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Optional


BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(BENCH_DIR)
for _path in (REPO_ROOT, BENCH_DIR):  # asyncckpt from this checkout; pss_sampler beside this file
    if _path not in sys.path:
        sys.path.insert(0, _path)


KiB, MiB = 1 << 10, 1 << 20
ALL_METHODS = (
    "raw_write",
    "memcpy",
    "torch.save+fsync",
    "dcp.save",
    "dcp.async_save thread",
    "dcp.async_save process",
    "dcp.async_save process+gloo",
    "asyncckpt thread",
    "asyncckpt process",
    "asyncckpt lazy",
    "asyncckpt no-checksums",
    "asyncckpt nice0",
    "asyncckpt safetensors",
    "asyncckpt budget",
    "asyncckpt s3",
    "asyncckpt s3 proxy",
    "asyncckpt s3 1% 503",
)


def log(message: str) -> None:
    """A log line on stderr (the table goes to stdout)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Progress:
    """One status line on stderr, e.g. `[bench] 23/84 saves  asyncckpt thread save 3/5  02:41 elapsed`.

    On a terminal it is redrawn in place (log lines go above it); otherwise it is printed as a plain
    line when a method starts and at most every `interval_s` seconds. Redrawn only when something
    happens (no ticker thread: it would take GIL time from the methods being measured)."""

    def __init__(self, total: int, stream=None, interval_s: float = 10.0) -> None:
        self.total = total
        self.done = 0
        self.label = ""
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s
        self.start = time.monotonic()
        self._last_print = -math.inf
        self._shown = False  # a status line is on the terminal's last line

    def line(self) -> str:
        elapsed = int(time.monotonic() - self.start)
        return f"[bench] {self.done}/{self.total} saves  {self.label}  {elapsed // 60:02d}:{elapsed % 60:02d} elapsed"

    def update(self, label: Optional[str] = None, done: Optional[int] = None, force: bool = False) -> None:
        """Set the label and/or the saves done, and show the line (on a non-terminal: if `force`
        or `interval_s` has passed since the last one)."""
        if label is not None:
            self.label = label
        if done is not None:
            self.done = done
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line())
            self.stream.flush()
            self._shown = True
        elif force or now - self._last_print >= self.interval_s:
            print(self.line(), file=self.stream, flush=True)
            self._last_print = now

    def saved(self) -> None:
        """One more save done."""
        self.update(done=self.done + 1)

    def log(self, message: str) -> None:
        """A log line, kept above the status line on a terminal."""
        if self._shown:
            self.stream.write("\r\x1b[K")
        log(message)
        if self._shown:
            self.stream.write(self.line())
            self.stream.flush()

    def close(self) -> None:
        """Leave the final status on a line of its own."""
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line() + "\n")
            self.stream.flush()
            self._shown = False
        else:
            print(self.line(), file=self.stream, flush=True)


class Skip(Exception):
    """The method cannot be measured here; the row keeps the reason."""
