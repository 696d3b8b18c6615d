"""The bound on handing a save to a worker still starting covers both waits in it: the worker's
start-up and then the staging (issue 41, item 4). A shorter one (the longer of the two, before)
fails a hand-off that was going to succeed."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig
from asyncckpt.config import hand_off_bound_s
from asyncckpt.layout import list_checkpoints


def test_the_hand_off_bound_is_the_sum_of_start_up_and_staging():
    config = CheckpointConfig(worker_start_timeout_s=300.0, timeout_s=600.0)
    assert hand_off_bound_s(config) == 900.0


@pytest.mark.timeout(120)
def test_a_save_to_a_slow_starting_worker_is_not_timed_out_before_start_up_plus_staging(ckpt_root):
    """The worker needs about worker_start_timeout_s to start (frozen 7.5 of 8 s, as on a busy
    network file system, then importing torch), then stages; the save goes out with wait=False
    and is polled with non-blocking finalize() calls, which time a save out against its deadline.
    It commits: the deadline is start-up + staging (16 s), not the longer of the two (8 s)."""
    config = CheckpointConfig(worker_start_timeout_s=8.0, timeout_s=8.0, worker_nice=None, worker_ionice=None)
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    with AsyncCheckpointer(ckpt_root, config) as ckpt:
        pid = ckpt.worker_pid
        os.kill(pid, signal.SIGSTOP)  # spawned by the constructor: still starting
        sent = time.monotonic()
        ckpt.schedule_save(state, step=1, wait=False)
        time.sleep(7.5)
        os.kill(pid, signal.SIGCONT)
        reports = []
        while not reports and time.monotonic() - sent < 60:
            reports = ckpt.finalize()  # non-blocking: raises once the save is past its bound
            time.sleep(0.05)
        took = time.monotonic() - sent
        print(f"\nstart-up + staging + writes took {took:.1f}s; bound {hand_off_bound_s(config):.0f}s")
        assert [r.step for r in reports] == [1]
        assert ckpt.worker_pid == pid
    assert [c.step for c in list_checkpoints(ckpt_root) if c.committed] == [1]
