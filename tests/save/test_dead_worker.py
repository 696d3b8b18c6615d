"""A dead or stuck worker, a killed trainer, a script that exits with a stuck worker: each ends
as a CheckpointError within the timeout (never a hang), committed checkpoints survive, and the
next save recovers. Everything here is real: worker processes, SIGKILL/SIGSTOP, files."""


from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, CheckpointTimeoutError
from asyncckpt.layout import read_latest_marker
from conftest import REPO, call_when_waiting, clone_state, step_path, wait_gone

from faults import MiB, PinnedWrite, assert_loads, big_state, bump, committed_steps, config, retime, stop_tree


# 1. worker killed while it writes -------------------------------------------------------------
@pytest.mark.parametrize("io", ["thread", "process"])
def test_worker_killed_while_writing_fails_finalize_within_timeout_and_next_save_recovers(ckpt_root, io):
    """The worker (and its writer children) is stopped while a data file of step 2 is provably
    half written, then SIGKILLed: finalize names the death at once (not after timeout_s)."""
    timeout_s = 30.0
    state = big_state(64)
    with AsyncCheckpointer(ckpt_root, config(io=io, io_workers=1)) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        retime(ckpt, timeout_s)
        expected_1 = clone_state(state)
        bump(state, 1.0)

        pinned = PinnedWrite(os.path.join(step_path(ckpt_root, 2), "__0_0.distcp"))
        try:
            ckpt.schedule_save(state, step=2)  # eager: returns once staged, the worker now writes
            pinned.read(MiB)  # 1 MiB of the 64 MiB file written; the writer blocks in the rest
            old_pid = ckpt.worker_pid
            writers = stop_tree(old_pid)
            if io == "process":
                assert writers, "no writer child while the file is half written"
            assert ckpt.finalize() == []  # no WriteDone: the save is still in flight
            os.kill(old_pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(CheckpointError, match=r"step 2 not committed.*died \(killed by signal 9\)"):
                ckpt.finalize(blocking=True)
            elapsed = time.monotonic() - started
            for child in writers:
                wait_gone(child.pid, 60)  # stopped writers die with the worker (SIGKILL on parent death)
        finally:
            pinned.close()
        print(f"\n[{io}] finalize raised {elapsed:.3f}s after the kill (timeout_s={timeout_s})")
        assert elapsed < timeout_s  # the death was noticed, not waited out (that message differs too)

        assert read_latest_marker(ckpt_root) == "step_00000001"
        assert committed_steps(ckpt_root) == [1]
        assert not os.path.exists(step_path(ckpt_root, 2))  # the torn save was removed
        assert_loads(ckpt_root, 1, expected_1)

        expected_3 = clone_state(state)
        retime(ckpt, 120.0)  # the next save waits for a fresh worker's start-up
        ckpt.schedule_save(state, step=3)
        [report] = ckpt.finalize(blocking=True)
        assert report.worker_pid not in (None, old_pid) and report.step == 3
        assert read_latest_marker(ckpt_root) == "step_00000003"
        assert_loads(ckpt_root, 3, expected_3)
        assert_loads(ckpt_root, 1, expected_1)


# 2. worker killed or stuck while the trainer waits for Staged ---------------------------------
def test_worker_killed_mid_staging_fails_schedule_save_within_timeout(ckpt_root):
    """The kill lands while the worker copies a 256 MiB snapshot (seen as its RSS growing)."""
    timeout_s = 20.0
    state = big_state(256, tensors=4)
    with AsyncCheckpointer(ckpt_root, config(timeout_s=timeout_s)) as ckpt:
        ckpt.schedule_save({"warm": torch.ones(4)}, step=0)  # a started worker, a tiny staging pool
        ckpt.finalize(blocking=True)
        worker = psutil.Process(ckpt.worker_pid)
        baseline = worker.memory_info().rss
        killed_at = []

        def kill_when_staging() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if worker.memory_info().rss > baseline + 24 * MiB:
                    os.kill(worker.pid, signal.SIGKILL)
                    killed_at.append(time.monotonic())
                    return
                time.sleep(0.001)

        watcher = threading.Thread(target=kill_when_staging, daemon=True)
        watcher.start()
        with pytest.raises(CheckpointError, match=r"staging failed.*died \(killed by signal 9\)"):
            ckpt.schedule_save(state, step=1)
        raised_at = time.monotonic()
        watcher.join(5)
        assert killed_at, "the worker was never seen staging"
        print(f"\nschedule_save raised {raised_at - killed_at[0]:.3f}s after the kill mid-staging")
        assert raised_at - killed_at[0] < timeout_s
        assert not os.path.exists(step_path(ckpt_root, 1))

        retime(ckpt, 120.0)
        ckpt.schedule_save(state, step=2)
        [report] = ckpt.finalize(blocking=True)
        assert report.worker_pid != worker.pid
        assert_loads(ckpt_root, 2, clone_state(state))


def test_stopped_worker_killed_while_trainer_waits_for_staged(ckpt_root):
    """Deterministic variant: the worker is frozen (SIGSTOP) so the trainer surely waits for
    Staged, and SIGKILLed once the trainer is seen blocked in that wait; schedule_save names the
    death (not the timeout)."""
    timeout_s = 30.0
    state = big_state(8)
    with AsyncCheckpointer(ckpt_root, config(timeout_s=timeout_s)) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        expected_1 = clone_state(state)
        bump(state, 1.0)
        pid = ckpt.worker_pid
        os.kill(pid, signal.SIGSTOP)
        killed_at = []
        kill = lambda: (killed_at.append(time.monotonic()), os.kill(pid, signal.SIGKILL))
        killer = call_when_waiting(threading.get_ident(), "wait_staged", kill)
        with pytest.raises(CheckpointError, match=r"died \(killed by signal 9\)"):
            ckpt.schedule_save(state, step=2)
        elapsed = time.monotonic() - killed_at[0]
        killer.join()
        print(f"\nschedule_save raised {elapsed:.3f}s after the kill (timeout {timeout_s}s)")
        assert elapsed < timeout_s  # noticed, not waited out
        assert read_latest_marker(ckpt_root) == "step_00000001"
        assert_loads(ckpt_root, 1, expected_1)
        retime(ckpt, 120.0)
        ckpt.schedule_save(state, step=3)
        [report] = ckpt.finalize(blocking=True)
        assert report.worker_pid != pid and report.tensors_sent > 0  # the new worker got everything again
        assert_loads(ckpt_root, 3, clone_state(state))


def assert_recovers_after_stuck_worker(ckpt: AsyncCheckpointer, state: dict, root: str, stuck_pid: int) -> None:
    """Step 2 failed on a stopped worker: the trainer killed it, and step 3 commits on a new one."""
    wait_gone(stuck_pid, 10)
    retime(ckpt, 120.0)
    ckpt.schedule_save(state, step=3)
    assert [r.step for r in ckpt.finalize(blocking=True)] == [3]
    assert ckpt.worker_pid != stuck_pid
    assert committed_steps(root) == [1, 3]


def test_stuck_worker_times_out_is_killed_and_replaced(ckpt_root):
    """A worker that stops answering (SIGSTOP, never resumed) costs timeout_s, not forever."""
    timeout_s = 2.0
    state = big_state(8)
    with AsyncCheckpointer(ckpt_root, config()) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        retime(ckpt, timeout_s)
        pid = ckpt.worker_pid
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=r"no Staged/SaveFailed from worker pid \d+ within 2.0s"):
            ckpt.schedule_save(state, step=2)
        elapsed = time.monotonic() - started
        print(f"\nschedule_save timed out after {elapsed:.3f}s (timeout_s={timeout_s})")
        assert timeout_s <= elapsed < timeout_s + 30  # not before the bound; after it, soon (a busy box)
        assert_recovers_after_stuck_worker(ckpt, state, ckpt_root, pid)


def test_worker_stuck_in_its_start_up_fails_the_save_within_worker_start_timeout_s(ckpt_root):
    """A worker that never finishes starting (frozen while it imports torch, as on an overloaded
    network file system) fails the save waiting for it at worker_start_timeout_s + timeout_s (its
    start-up, then the staging), said so in the error; the next save starts a fresh worker and commits."""
    start_timeout_s = 3.0
    state = big_state(1)
    with AsyncCheckpointer(ckpt_root, config(timeout_s=1.0, worker_start_timeout_s=start_timeout_s)) as ckpt:
        pid = ckpt.worker_pid  # spawned by the constructor, still importing torch
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=r"within 4.0s: it had not started up .CheckpointConfig.worker_start_timeout_s=3 "
                                                  r"for its start-up \+ timeout_s=1\)"):
            ckpt.schedule_save(state, step=1)
            ckpt.finalize(blocking=True)
        elapsed = time.monotonic() - started
        assert start_timeout_s + 1.0 <= elapsed < start_timeout_s + 30  # the start-up bound (+ the wait's own)
        wait_gone(pid, 10)  # killed, not left stopped
        assert committed_steps(ckpt_root) == []
        retime(ckpt, 120.0)  # the fresh worker's start-up may take longer than 3 s on a busy box
        ckpt.schedule_save(state, step=2)
        ckpt.finalize(blocking=True)
        assert ckpt.worker_pid != pid
    assert committed_steps(ckpt_root) == [2]
    assert_loads(ckpt_root, 2, clone_state(state))


def test_worker_start_timeout_s_is_checked():
    for bad in (0, -1.0, float("inf"), "60", True):
        with pytest.raises(ValueError, match="worker_start_timeout_s"):
            CheckpointConfig(worker_start_timeout_s=bad)


def test_non_blocking_finalize_fails_a_save_past_its_timeout(ckpt_root):
    """A training loop that only ever polls finalize() still learns, within timeout_s, that its
    worker stopped answering mid-write; every poll returns at once; the next save recovers."""
    timeout_s = 2.0
    state = big_state(8)
    with AsyncCheckpointer(ckpt_root, config()) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        retime(ckpt, timeout_s)
        ckpt.schedule_save(state, step=2)  # staged: the worker writes now
        pid = ckpt.worker_pid
        os.kill(pid, signal.SIGSTOP)
        started, longest_poll = time.monotonic(), 0.0
        with pytest.raises(CheckpointError, match=rf"no WriteDone from worker pid {pid} within 2.0s"):
            while time.monotonic() - started < timeout_s + 10:
                poll_started = time.monotonic()
                try:
                    ckpt.finalize()
                finally:
                    longest_poll = max(longest_poll, time.monotonic() - poll_started)
                time.sleep(0.05)
        elapsed = time.monotonic() - started
        print(f"\nnon-blocking polls failed the save after {elapsed:.2f}s; longest poll {longest_poll:.3f}s")
        assert elapsed < timeout_s + 10  # the bound (+ slack for a busy box), not forever
        assert longest_poll < timeout_s  # no poll waits out the timeout itself
        assert_recovers_after_stuck_worker(ckpt, state, ckpt_root, pid)


class _FailsToUnpickle:
    """Pickles fine in the trainer; rebuilding it in the worker raises (like a shared tensor
    whose handle cannot be opened there)."""

    def __reduce__(self):
        return (int, ("not a number",))


def test_a_request_the_worker_cannot_read_fails_that_save_only(ckpt_root, monkeypatch):
    """The worker answers SaveFailed and serves on; the trainer forgets what it thought the worker
    held, so the next save sends every tensor again and writes current values, never stale ones."""
    state = big_state(1)
    with AsyncCheckpointer(ckpt_root, config()) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        pid = ckpt.worker_pid
        build_request = ckpt._worker.request_for

        def unreadable_request(*args, **kwargs):
            request = build_request(*args, **kwargs)
            request.poison = _FailsToUnpickle()
            return request

        monkeypatch.setattr(ckpt._worker, "request_for", unreadable_request)
        state["weights"]["t0"] = state["weights"]["t0"] + 1.0  # reallocated: only this request carries it
        with pytest.raises(CheckpointError, match=r"request failed: could not read the save request.*not a number"):
            ckpt.schedule_save(state, step=2)
        monkeypatch.undo()
        ckpt.schedule_save(state, step=3)
        [report] = ckpt.finalize(blocking=True)
        assert report.worker_pid == pid and report.tensors_sent == len(state["weights"])
        assert committed_steps(ckpt_root) == [1, 3]
        assert_loads(ckpt_root, 3, clone_state(state))


@pytest.mark.timeout(90)
def test_request_larger_than_the_socket_buffer_to_a_stuck_worker_times_out(ckpt_root):
    """A first save of many tensors makes a request far bigger than the socket buffer: a plain
    `Connection.send` to a worker that does not read blocks forever. Ours is bounded."""
    timeout_s = 3.0
    state = {"many": {f"p{i}": torch.full((4,), float(i)) for i in range(4000)}}
    trainer = psutil.Process()
    with AsyncCheckpointer(ckpt_root, config(timeout_s=timeout_s)) as ckpt:
        ckpt.schedule_save({"tiny": torch.ones(1)}, step=0)  # the worker is up (a stuck start-up
        ckpt.finalize(blocking=True)  # is bounded by worker_start_timeout_s instead)
        pid = ckpt.worker_pid
        os.kill(pid, signal.SIGSTOP)
        fds_before = trainer.num_fds()
        started = time.monotonic()
        with pytest.raises(CheckpointTimeoutError, match="did not take the save request"):
            ckpt.schedule_save(state, step=1)
        elapsed = time.monotonic() - started
        print(f"\nblocked send gave up after {elapsed:.3f}s (timeout_s={timeout_s})")
        assert elapsed < timeout_s + 30  # planning 4000 items takes a moment on a busy machine
        wait_gone(pid, 10)
        retime(ckpt, 120.0)
        ckpt.schedule_save(state, step=2)
        assert [r.step for r in ckpt.finalize(blocking=True)] == [2]
        assert_loads(ckpt_root, 2, clone_state(state))
        # the shared tensors hold one descriptor each; the duplicates offered to the killed
        # worker (one per tensor, never fetched) must have been closed, not leaked
        fds_after = trainer.num_fds()
        print(f"trainer fds: {fds_before} before, {fds_after} after (4000 shared tensors)")
        assert fds_after < fds_before + 4000 + 100


def test_worker_killed_while_idle_is_replaced_by_the_next_save(ckpt_root):
    state = big_state(4)
    with AsyncCheckpointer(ckpt_root, config()) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        pid = ckpt.worker_pid
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid, 10)
        assert ckpt.finalize(blocking=True) == []  # nothing in flight: nothing to report
        bump(state, 1.0)
        ckpt.schedule_save(state, step=2)
        [report] = ckpt.finalize(blocking=True)
        assert report.worker_pid != pid and not report.cache_hit
        assert_loads(ckpt_root, 2, clone_state(state))


# 5. trainer killed ----------------------------------------------------------------------------
TRAINER = textwrap.dedent(
    """
    import sys, time, torch
    from asyncckpt import AsyncCheckpointer, CheckpointConfig
    mode, io, root = sys.argv[1:4]
    ckpt = AsyncCheckpointer(root, CheckpointConfig(io=io, io_workers=4, keep_last=2))
    state = {f"t{i}": torch.full((4 << 20,), float(i)) for i in range(4)}  # 64 MiB
    ckpt.schedule_save(state, step=0)
    ckpt.finalize(blocking=True)
    print("ready", ckpt.worker_pid, flush=True)
    if mode == "saving" and sys.stdin.readline().strip() == "go":
        ckpt.schedule_save(state, step=1)  # eager: staged, the worker writes; never finalized
        print("scheduled", flush=True)
    time.sleep(300)
    """
)


@pytest.mark.parametrize("mode,io", [("idle", "thread"), ("saving", "thread"), ("saving", "process")])
def test_trainer_killed_takes_its_worker_and_writers_with_it(tmp_path, mode, io):
    """SIGKILL of the trainer, idle or while its save of step 1 is provably half written: the
    worker and every writer child go, step 1 is not committed and step 0 still loads."""
    root = str(tmp_path / "ckpt")
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    trainer = subprocess.Popen(
        [sys.executable, str(script), mode, io, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    pinned = None
    try:
        line = trainer.stdout.readline().split()
        assert line[:1] == ["ready"], line
        worker = psutil.Process(int(line[1]))
        writers: list[psutil.Process] = []
        if mode == "saving":
            pinned = PinnedWrite(os.path.join(step_path(root, 1), "__0_0.distcp"))
            trainer.stdin.write("go\n")
            trainer.stdin.flush()
            assert trainer.stdout.readline().split() == ["scheduled"]
            pinned.read(MiB)  # the writer of one 16 MiB file is blocked in its second MiB
            writers = worker.children(recursive=True)
            if io == "process":
                assert writers, "no writer child while a file is half written"
        trainer.kill()
        trainer.wait(60)
        gone = {"worker": wait_gone(worker.pid, 60)}
        for child in writers:
            gone[f"writer {child.pid}"] = wait_gone(child.pid, 60)
        print(f"\n[{mode}/{io}] gone after trainer SIGKILL: " + ", ".join(f"{k} {v:.2f}s" for k, v in gone.items()))
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if pinned is not None:
            pinned.close()
    assert committed_steps(root) == [0] and read_latest_marker(root) == "step_00000000"
    assert_loads(root, 0, {f"t{i}": torch.full((4 << 20,), float(i)) for i in range(4)})


# 8. bounded exit ------------------------------------------------------------------------------
EXIT_SCRIPT = textwrap.dedent(
    """
    import dataclasses, os, signal, time, torch
    from asyncckpt import AsyncCheckpointer
    ckpt = AsyncCheckpointer({root!r})
    ckpt.schedule_save({{"w": torch.arange(1000.0)}}, step=1)
    ckpt.finalize(blocking=True)
    # after the worker's start-up; lazy: the save below returns without waiting for the worker
    ckpt.config = dataclasses.replace(ckpt.config, timeout_s=2.0, staging="lazy")
    os.kill(ckpt.worker_pid, signal.SIGSTOP)  # stuck before step 2 (stopped after it, it could finish first)
    ckpt.schedule_save({{"w": torch.arange(1000.0)}}, step=2)  # the script exits without close()
    print(time.monotonic(), ckpt.worker_pid, flush=True)  # from here on only the exit runs
    """
)


def test_script_exit_with_a_stuck_worker_is_bounded_by_timeout(ckpt_root, tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT.format(root=ckpt_root))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO)
    exited = time.monotonic()  # CLOCK_MONOTONIC is one clock for every process of the machine
    stuck_at, worker_pid = done.stdout.split()[-2:]
    elapsed = exited - float(stuck_at)
    print(f"\nscript with a stuck worker exited {elapsed:.1f}s after the save got stuck: {done.stderr.strip()[-300:]}")
    assert elapsed < 2.0 + 30  # timeout_s (2 s) for the exit's wait, plus slack for a busy box
    assert done.returncode == 1, done.stderr  # the last save failed at exit: see test_exit.py
    wait_gone(int(worker_pid), 10)
    assert committed_steps(ckpt_root) == [1] and read_latest_marker(ckpt_root) == "step_00000001"
    assert "step 2 not committed" in done.stderr
