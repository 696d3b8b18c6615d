"""Measuring: memory (PSS of the trainer and its children), the compute loop that shows interference, file helpers."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import psutil
import torch
from pss_sampler import pss_bytes

from .common import BENCH_DIR



def family_pss(exclude: frozenset[int] = frozenset()) -> int:
    """PSS of this process plus all its descendants (asyncckpt workers, forked writers, daemons),
    leaving out the processes in `exclude` and their descendants (services such as a local S3
    server, which are not the trainer's memory)."""
    me = psutil.Process()
    left_out = set(exclude)
    for pid in exclude:
        try:
            left_out.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            pass
    try:
        children = [c for c in me.children(recursive=True) if c.pid not in left_out]
    except psutil.Error:
        children = []
    return pss_bytes(me.pid) + sum(pss_bytes(c.pid) for c in children)


@dataclass
class PeakMemory:
    """Peak PSS of the trainer and its descendants over a sampling window."""

    peak: int = 0
    trainer: int = 0  # at the peak
    descendants: int = 0  # at the peak
    samples: int = 0


class PeakSampler:
    """Peak PSS of the trainer + descendants, sampled every `interval_s` by a separate process
    (benchmarks/pss_sampler.py), so sampling never holds this process's GIL, at the lowest CPU
    priority, so it takes no core from what is measured (a peak lasts far longer than a sample)."""

    SCRIPT = os.path.join(BENCH_DIR, "pss_sampler.py")

    def __init__(self, interval_s: float = 0.02, exclude: frozenset[int] = frozenset()) -> None:
        self.interval_s = interval_s
        self.exclude = exclude  # descendants left out, with their subtrees (see family_pss)
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        exclude = ",".join(str(pid) for pid in sorted(self.exclude))
        self._proc = subprocess.Popen(
            [sys.executable, self.SCRIPT, str(os.getpid()), str(self.interval_s), exclude],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        # nice 19 before it samples: at nice 0, on two cores, it took CPU from the saves it measured
        # (a first save 1.11 s with it, 0.61 s with it sampling ten times less often)
        os.setpriority(os.PRIO_PROCESS, self._proc.pid, 19)
        self._proc.stdout.readline()  # "ready": it samples from now on

    def stop(self) -> PeakMemory:
        proc, self._proc = self._proc, None
        if proc is None:
            return PeakMemory()
        try:
            out, _ = proc.communicate("stop\n", timeout=30)
            data = json.loads(out.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            proc.kill()
            proc.wait()
            return PeakMemory()
        return PeakMemory(data["peak"], data["root"], data["descendants"], data["samples"])


class ComputeLoop:
    """A fixed "training step" (matmuls) whose time shows interference: on the CPU by default,
    or on a GPU (`device="cuda"`, e.g. bf16), where each step ends with a synchronize, as a
    step that reads its loss does.

    It runs with `threads` torch threads (default 1): with 2 threads on a 2-core box, any other
    runnable thread turns every parallel matmul into a barrier stall, and the ratio measures the
    scheduler more than the save."""

    def __init__(self, dim: int = 256, target_step_s: float = 0.025, threads: int = 1,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.dim = dim
        self.threads = threads
        self.device = torch.device(device)
        self.a = torch.randn(dim, dim, device=self.device).to(dtype)
        self.b = torch.randn(dim, dim, device=self.device).to(dtype)
        self.c = torch.empty(dim, dim, device=self.device, dtype=dtype)
        self.iters = 1
        with self.own_threads():
            self.calibrate(target_step_s)

    @contextlib.contextmanager
    def own_threads(self):
        """Run the enclosed steps with this loop's torch thread count, then restore it."""
        saved = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(saved)

    def calibrate(self, target_step_s: float) -> None:
        """Pick the matmul count per step so an uncontended step takes about `target_step_s`.
        Uses the fastest of several batches: other tenants of the box only ever add time."""
        for _ in range(20):
            torch.mm(self.a, self.b, out=self.c)
        self.synchronize()
        batches = []
        for _ in range(15):
            start = time.perf_counter()
            for _ in range(10):
                torch.mm(self.a, self.b, out=self.c)
            self.synchronize()
            batches.append((time.perf_counter() - start) / 10)
        self.iters = max(1, round(target_step_s / min(batches)))

    def synchronize(self) -> None:
        """Wait for the device's queued matmuls (a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> float:
        start = time.perf_counter()
        for _ in range(self.iters):
            torch.mm(self.a, self.b, out=self.c)
        self.synchronize()
        return time.perf_counter() - start

    def run(self, steps: int) -> list[float]:
        return [self.step() for _ in range(steps)]

    def run_for(self, seconds: float) -> list[float]:
        """Steps until `seconds` have passed (a training loop before its first save)."""
        end, steps = time.perf_counter() + seconds, []
        while time.perf_counter() < end:
            steps.append(self.step())
        return steps


def tensor_bytes_view(tensor: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU tensor. Not via `.numpy()`: that marks the storage
    non-resizable for good, which makes asyncckpt copy it into fresh shared memory every save."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def fsync_path(path: str) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(path: str) -> int:
    """Bytes on disk under `path` (a file or a directory tree)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def remove(path: str) -> None:
    """Delete a file or a directory tree if it exists."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def short_error(exc: BaseException) -> str:
    """The exception's class and message on one line (DCP wraps the cause; keep its last line)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    tail = [line for line in lines if "Error" in line or "Exception" in line]
    message = tail[-1] if tail else (lines[0] if lines else type(exc).__name__)
    return message if len(message) <= 240 else message[:237] + "..."
