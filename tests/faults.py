"""Helpers of the fault tests (tests/save/test_dead_worker.py, test_full_resources.py): small
configs with short bounds, states of a given size, where a state was saved, and a write held up
on purpose."""

from __future__ import annotations

import os
import signal
import time
import select
from dataclasses import replace

import psutil
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, load
from conftest import assert_state_equal, step_path, zeros_like_state

MiB = 1 << 20


def config(**overrides) -> CheckpointConfig:
    """Full priority (the machine is shared; a niced worker makes timings noisy)."""
    return CheckpointConfig(**{"worker_nice": None, "worker_ionice": None, **overrides})


def retime(ckpt: AsyncCheckpointer, timeout_s: float) -> None:
    """Change timeout_s of a live checkpointer (tests tighten it once the worker is known to be
    up; a fresh worker's start-up is bounded by config.worker_start_timeout_s, not timeout_s)."""
    ckpt.config = replace(ckpt.config, timeout_s=timeout_s)


def big_state(mib: int, tensors: int = 8, seed: float = 0.0) -> dict:
    each = mib * MiB // 4 // tensors
    return {
        "weights": {f"t{i}": torch.arange(each, dtype=torch.float32) * 1e-3 + (seed + i) for i in range(tensors)},
        "meta": {"seed": seed},
    }


def bump(state: dict, by: float) -> None:
    with torch.no_grad():
        for tensor in state["weights"].values():
            tensor.add_(by)
    state["meta"]["seed"] += by


def assert_loads(root: str, step: int, expected: dict) -> None:
    target = zeros_like_state(expected)
    load(target, step_path(root, step))
    assert_state_equal(target, expected)


def committed_steps(root: str) -> list[int]:
    return sorted(
        int(name[5:]) for name in os.listdir(root) if os.path.exists(os.path.join(root, name, ".metadata"))
    )


class PinnedWrite:
    """Pins a save mid-write without timing: the data file it will write is made a FIFO first.
    The writer's open succeeds (this reader is open) and its writes block once the pipe is full;
    `read(n)` takes the first n bytes and stops reading, so from then on the writer is provably
    blocked inside the file with the rest of it unwritten (and no WriteDone can have been sent).
    Only this process holds the read end: close it after the writer is gone."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkfifo(path)
        self.path, self.taken = path, 0
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

    def read(self, nbytes: int, timeout_s: float = 120.0) -> None:
        """Read until `nbytes` of the file went through (bounded; the writer starts when the save
        reaches this file)."""
        deadline = time.monotonic() + timeout_s
        while self.taken < nbytes:
            assert time.monotonic() < deadline, f"only {self.taken} bytes of {self.path} written in {timeout_s}s"
            select.select([self._fd], [], [], 0.05)
            try:
                self.taken += len(os.read(self._fd, min(1 << 16, nbytes - self.taken)))
            except BlockingIOError:  # a writer is connected and has not written more yet
                pass

    def close(self) -> None:
        os.close(self._fd)


def stop_tree(pid: int) -> list[psutil.Process]:
    """SIGSTOP a process, then its descendants (it cannot fork new ones once stopped); returns them."""
    os.kill(pid, signal.SIGSTOP)
    descendants = psutil.Process(pid).children(recursive=True)
    for child in descendants:
        child.send_signal(signal.SIGSTOP)
    return descendants
