"""Forked writers come from a single-threaded fork server, so a child can never inherit a lock
that another thread held at fork time (logging, malloc, OpenMP): many process-mode saves and many
raw forks while other threads log and compute all finish, with exact values; a child whose
parent died before it asked to die with it exits; the slab can grow after the server started."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, load
from conftest import REPO, assert_state_equal, clone_state, stress_size, wait_gone, zeros_like_state

SAVES = stress_size("SAVES", ci=24, full=96)
FORKS = stress_size("FORKS", ci=200, full=1000)

BUSY_FORKS = textwrap.dedent(
    """
    import logging, os, sys, threading, torch
    from asyncckpt_worker.forkserver import ForkServer, split_result

    def target(payload, fds):  # a writer's kind of work: logging, allocation, torch
        logging.getLogger("child").debug("child %d", os.getpid())
        value = int(torch.arange(int(payload)).sum()) + len(bytearray(1 << 20))
        os.write(fds[0], str(value).encode())
        return 0

    server = ForkServer.start(target)  # before any other thread, as the worker does
    logging.basicConfig(level=logging.DEBUG, stream=open(os.devnull, "w"))
    torch.set_num_threads(2)
    stop = threading.Event()

    def busy(n):
        log = logging.getLogger(f"busy{n}")
        while not stop.is_set():
            log.debug("busy %s", "x" * 100)
            torch.mm(torch.rand(64, 64), torch.rand(64, 64))  # torch's OpenMP pool
            bytearray(1 << 16)

    threads = [threading.Thread(target=busy, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    try:
        for n in range(int(sys.argv[1])):
            pid, fd = server.spawn(str(n).encode(), [], timeout_s=30)
            data = b""
            while chunk := os.read(fd, 4096):  # the server closes its copy once it reaped the child
                data += chunk
            os.close(fd)
            result, status = split_result(data)
            assert status == 0 and int(result) == n * (n - 1) // 2 + (1 << 20), (n, result, status)
        server_threads = len(os.listdir(f"/proc/{server.pid}/task"))
        assert server_threads == 1, server_threads
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        server.close()
    print("ok", flush=True)
    """
)


def test_many_forks_from_the_server_while_other_threads_log_and_compute():
    done = subprocess.run(
        [sys.executable, "-c", BUSY_FORKS, str(FORKS)], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_many_process_mode_saves_with_debug_logging_all_exact(tmp_path):
    """SAVES saves (ASYNCCKPT_STRESS_SAVES for more) in io="process" with the worker logging at
    DEBUG and eager staging on several threads; the state grows midway (the slab is reallocated
    after the fork server started, so writers must map the new one); every save commits, its
    values exact; the fork server stays single-threaded throughout."""
    root = str(tmp_path / "ckpt")
    state = {"w": {f"t{i}": torch.full((4096,), float(i)) for i in range(8)}, "meta": {"step": 0}}
    logger = logging.getLogger("asyncckpt")
    level = logger.level
    logger.setLevel(logging.DEBUG)  # the worker takes the trainer's level
    try:
        config = CheckpointConfig(io="process", io_workers=4, keep_last=2, fsync=False)
        with AsyncCheckpointer(root, config) as ckpt:
            for step in range(1, SAVES + 1):
                for tensor in state["w"].values():
                    tensor.add_(1)
                state["meta"]["step"] = step
                if step == SAVES // 2:  # a larger state: a new, larger slab
                    state["w"]["big"] = torch.arange(1 << 20, dtype=torch.float32)
                expected = clone_state(state)
                ckpt.schedule_save(state, step=step)
                [report] = ckpt.finalize(blocking=True)
                assert report.step == step
                if step in (1, SAVES // 2 - 1, SAVES // 2, SAVES):
                    target = zeros_like_state(expected)
                    load(target, os.path.join(root, f"step_{step:08d}"))
                    assert_state_equal(target, expected)
                servers = [p for p in psutil.Process(ckpt.worker_pid).children() if p.name() == "asyncckpt-forks"]
                assert len(servers) == 1 and servers[0].num_threads() == 1
    finally:
        logger.setLevel(level)


def test_writer_whose_parent_died_before_it_asked_to_die_with_it_exits():
    """PR_SET_PDEATHSIG covers only a parent alive when it is set: a child that finds another
    parent than the one that forked it must exit at once instead of writing for nobody."""
    from asyncckpt_worker.forkserver import _die_with_parent

    pid = os.fork()
    if pid == 0:
        try:
            _die_with_parent(os.getppid() + 1)  # as if the forking worker were gone already
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 4


def test_dead_fork_server_fails_one_save_and_the_next_starts_a_fresh_worker(tmp_path):
    """The fork server cannot be restarted safely inside a worker that runs threads: when it is
    gone, the save fails naming a file and the server, the worker exits, and the next save
    commits on a fresh worker."""
    root = str(tmp_path / "ckpt")
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with AsyncCheckpointer(root, CheckpointConfig(io="process", io_workers=2, timeout_s=60.0)) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        old_worker = ckpt.worker_pid
        [server] = [p for p in psutil.Process(old_worker).children() if p.name() == "asyncckpt-forks"]
        server.kill()
        wait_gone(server.pid, 10)  # a zombie until the worker notices
        with pytest.raises(CheckpointError, match=r"step 2 not committed.*__0_\d\.distcp.*fork server"):
            ckpt.schedule_save(state, step=2)
            ckpt.finalize(blocking=True)
        state["w"].add_(1)
        expected = clone_state(state)
        ckpt.schedule_save(state, step=3)
        [report] = ckpt.finalize(blocking=True)
        assert report.worker_pid != old_worker
    target = zeros_like_state(expected)
    load(target, os.path.join(root, "step_00000003"))
    assert_state_equal(target, expected)
