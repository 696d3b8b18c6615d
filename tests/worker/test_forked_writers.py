"""io="process": what forked writer children may and may not do to a save.

A child that fails mid-file publishes nothing on an object store; a child that stops fails the
save within timeout_s, naming its file, and the worker serves the next save."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, load
from conftest import assert_state_equal, clone_state, wait_gone, zeros_like_state

MiB = 1 << 20


def writer_children(worker_pid: int) -> list[psutil.Process]:
    """The worker's forked writers (its fork server, if any, excluded)."""
    return [p for p in psutil.Process(worker_pid).children(recursive=True) if p.name() != "asyncckpt-forks"]


def two_file_state(step: int) -> dict:
    """One 4 MiB tensor and a few small items: with io_workers=2, a big file and a small one."""
    return {
        "big": torch.arange(MiB, dtype=torch.float32) + step,
        "small": {f"t{i}": torch.full((16,), float(step + i)) for i in range(4)},
        "meta": {"step": step},
    }


def test_child_failing_mid_file_on_object_store_publishes_no_object(s3_server):
    """The writers' file-size limit (set on the worker and its fork server) stops the child writing the 4 MiB
    file at 1 MiB (EFBIG: Python ignores SIGXFSZ): the save fails naming that file, and the S3 server never received a
    request creating any data object of the save (no PUT, no multipart start)."""
    prefix = s3_server.unique_prefix("partial-child") + "/ckpt"
    root = s3_server.url("s3", prefix)
    config = CheckpointConfig(io="process", io_workers=2, timeout_s=120.0)
    with AsyncCheckpointer(root, config) as ckpt:
        ckpt.schedule_save(two_file_state(1), step=1)
        ckpt.finalize(blocking=True)
        worker = psutil.Process(ckpt.worker_pid)
        tree = [worker, *worker.children(recursive=True)]  # and its fork server: writers inherit it
        limits = worker.rlimit(psutil.RLIMIT_FSIZE)
        for process in tree:
            process.rlimit(psutil.RLIMIT_FSIZE, (MiB, limits[1]))  # the soft limit: it can go back up
        log_from = os.path.getsize(s3_server.server.log_path)
        ckpt.schedule_save(two_file_state(2), step=2)
        with pytest.raises(CheckpointError, match=r"step 2 not committed.*__0_\d\.distcp.*File too large"):
            ckpt.finalize(blocking=True)
        with open(s3_server.server.log_path, "rb") as f:
            f.seek(log_from)
            requests = f.read().decode(errors="replace")
        created = [line for line in requests.splitlines() if "step_00000002/__0_" in line and ('"PUT' in line or '"POST' in line)]
        assert created == [], created
        assert s3_server.keys(prefix + "/step_00000002/") == []

        for process in tree:
            process.rlimit(psutil.RLIMIT_FSIZE, limits)
        expected = clone_state(two_file_state(3))
        ckpt.schedule_save(two_file_state(3), step=3)
        [report] = ckpt.finalize(blocking=True)
        assert report.worker_pid == worker.pid  # the worker lived on
    target = zeros_like_state(expected)
    load(target, f"{root}/step_00000003")
    assert_state_equal(target, expected)


def test_stopped_writer_child_fails_the_save_within_timeout_naming_its_file(tmp_path):
    """The child writing `__0_0.distcp` blocks on a FIFO planted under that name (nobody drains
    it) and is then frozen with SIGSTOP: the worker kills it at its own deadline and the save
    fails within timeout_s with the file named; the same worker commits the next save."""
    root = str(tmp_path / "ckpt")
    timeout_s = 6.0
    state = {"w": torch.arange(MiB, dtype=torch.float32)}  # 4 MiB: far more than a pipe holds
    with AsyncCheckpointer(root, CheckpointConfig(io="process", io_workers=1, timeout_s=timeout_s)) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        worker_pid = ckpt.worker_pid
        fifo = os.path.join(root, "step_00000002", "__0_0.distcp")
        os.makedirs(os.path.dirname(fifo))
        os.mkfifo(fifo)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the worker open it for writing
        try:
            started = time.monotonic()
            ckpt.schedule_save(state, step=2)
            children: list[psutil.Process] = []
            while not children:
                assert time.monotonic() - started < timeout_s, "never saw a writer child"
                children = writer_children(worker_pid)
            [child] = children
            child.suspend()
            with pytest.raises(CheckpointError) as failure:
                ckpt.finalize(blocking=True)
            elapsed = time.monotonic() - started
        finally:
            os.close(reader)
        message = str(failure.value)
        print(f"\nsave failed {elapsed:.2f}s after it started (timeout_s={timeout_s}): {message}")
        assert "__0_0.distcp" in message and f"writer process {child.pid} did not finish" in message, message
        assert elapsed < timeout_s
        wait_gone(child.pid, 10)  # killed (the fork server reaps it)
        assert ckpt.worker_pid == worker_pid  # the worker itself was never stuck

        state["w"].add_(1)
        expected = clone_state(state)
        ckpt.schedule_save(state, step=3)
        [report] = ckpt.finalize(blocking=True)
        assert report.worker_pid == worker_pid
    target = zeros_like_state(expected)
    load(target, os.path.join(root, "step_00000003"))
    assert_state_equal(target, expected)
