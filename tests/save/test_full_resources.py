"""Full resources: a full disk, an oversized file, a full /dev/shm and too few open files end as a
CheckpointError naming the cause (checked before anything moves where it can be), committed
checkpoints survive, and the next save recovers."""


from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointError
from asyncckpt.save import sharing as sharing_module
from asyncckpt.layout import read_latest_marker
from asyncckpt.save.sharing import SHM_DIR, SharingNeeds, check_shm_space, ensure_fd_room, shared_memory_needed
from conftest import REPO, clone_state, step_path

from faults import MiB, assert_loads, big_state, bump, committed_steps, config


# 4. full disk ---------------------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 16 MiB filesystem (tmpfs), where this container allows mounting one."""
    mount_point = tmp_path / "small_fs"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}); the RLIMIT_FSIZE test covers it")
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_full_disk_mid_save_names_the_file_keeps_the_previous_checkpoint_and_recovers(small_tmpfs):
    root = os.path.join(small_tmpfs, "ckpt")
    state = big_state(4, tensors=4)
    filler = os.path.join(small_tmpfs, "filler")
    with AsyncCheckpointer(root, config(io_workers=2, timeout_s=30.0)) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        expected_1 = clone_state(state)
        bump(state, 1.0)

        st = os.statvfs(small_tmpfs)
        with open(filler, "wb") as f:  # leave 1 MiB: the 4 MiB save runs out mid-write
            f.write(b"\0" * (st.f_bavail * st.f_frsize - MiB))
        with pytest.raises(CheckpointError) as raised:
            ckpt.schedule_save(state, step=2)
            ckpt.finalize(blocking=True)
        message = str(raised.value)
        print(f"\nfull disk: {message}")
        assert "ENOSPC" in message and step_path(root, 2) in message and ".distcp" in message
        assert read_latest_marker(root) == "step_00000001"
        assert committed_steps(root) == [1]
        assert not os.path.exists(step_path(root, 2))  # the partial files went with the save
        assert_loads(root, 1, expected_1)

        os.remove(filler)  # space is back
        expected_3 = clone_state(state)
        ckpt.schedule_save(state, step=3)
        assert [r.step for r in ckpt.finalize(blocking=True)] == [3]
        assert read_latest_marker(root) == "step_00000003"
        assert_loads(root, 3, expected_3)
        assert_loads(root, 1, expected_1)


@pytest.mark.parametrize("io", ["thread", "process"])
def test_file_size_limit_in_the_worker_gives_efbig_and_recovers(ckpt_root, io):
    """Unprivileged stand-in for a full disk: RLIMIT_FSIZE lowered on the live worker (prlimit).
    Python ignores SIGXFSZ, so an oversized write fails with EFBIG like a real write error."""
    state = big_state(4, tensors=4)
    with AsyncCheckpointer(ckpt_root, config(io=io, io_workers=1, timeout_s=30.0)) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        expected_1 = clone_state(state)
        bump(state, 1.0)
        worker = psutil.Process(ckpt.worker_pid)
        tree = [worker, *worker.children()]  # forked writers inherit the limit of the fork server
        limits = worker.rlimit(psutil.RLIMIT_FSIZE)
        for process in tree:
            process.rlimit(psutil.RLIMIT_FSIZE, (MiB, limits[1]))
        try:
            with pytest.raises(CheckpointError) as raised:
                ckpt.schedule_save(state, step=2)
                ckpt.finalize(blocking=True)
        finally:
            for process in tree:
                process.rlimit(psutil.RLIMIT_FSIZE, limits)
        message = str(raised.value)
        print(f"\n[{io}] file size limit: {message}")
        assert "EFBIG" in message and os.path.join(step_path(ckpt_root, 2), "__0_0.distcp") in message
        assert read_latest_marker(ckpt_root) == "step_00000001"
        assert committed_steps(ckpt_root) == [1]
        assert_loads(ckpt_root, 1, expected_1)

        expected_3 = clone_state(state)
        ckpt.schedule_save(state, step=3)
        [report] = ckpt.finalize(blocking=True)
        assert report.worker_pid == worker.pid  # a write error is not a worker death
        assert_loads(ckpt_root, 3, expected_3)


# 7. shared memory ---------------------------------------------------------------------------
def test_shm_check_decides_on_needed_versus_free_bytes():
    check_shm_space(0, free=0)  # nothing to move: no check
    check_shm_space(10 * MiB, free=20 * MiB)
    with pytest.raises(CheckpointError) as raised:
        check_shm_space(30 * MiB, free=20 * MiB)
    message = str(raised.value)
    assert SHM_DIR in message and str(30 * MiB) in message and str(20 * MiB) in message
    assert "--shm-size" in message and "SIGBUS" in message
    with pytest.raises(CheckpointError):  # within the headroom counts as too little
        check_shm_space(20 * MiB, free=20 * MiB)


def test_shared_memory_needed_counts_storages_once_and_skips_shared_tensors():
    base = torch.zeros(1000, dtype=torch.float32)  # 4000 bytes -> one page
    views = [(base[:10], False), (base[500:], False)]  # two views, one storage, moved in place
    assert shared_memory_needed(views) == SharingNeeds(nbytes=4096, segments=1)
    big = torch.zeros(3 * MiB, dtype=torch.uint8)
    assert shared_memory_needed([(big, False)]) == SharingNeeds(3 * MiB, 1)
    assert shared_memory_needed([(big[:10], True)]) == SharingNeeds(4096, 1)  # a fresh copy: the view's bytes
    assert shared_memory_needed([(big[:10], True), (big[10:20], True)]) == SharingNeeds(8192, 2)  # a copy each
    shared = torch.zeros(MiB, dtype=torch.uint8).share_memory_()
    assert shared_memory_needed([(shared, False)]) == SharingNeeds(0, 0)


def test_schedule_save_refuses_to_overfill_shm_and_moves_nothing(ckpt_root, monkeypatch):
    state = big_state(8)
    with AsyncCheckpointer(ckpt_root, config(timeout_s=30.0)) as ckpt:
        monkeypatch.setattr(sharing_module, "shm_free_bytes", lambda path=SHM_DIR: 4 * MiB)
        with pytest.raises(CheckpointError, match=r"must move into /dev/shm, which has 4194304 bytes"):
            ckpt.schedule_save(state, step=1)
        assert not any(t.is_shared() for t in state["weights"].values())  # nothing was moved
        assert not os.path.exists(step_path(ckpt_root, 1))
        monkeypatch.undo()
        ckpt.schedule_save(state, step=2)
        assert [r.step for r in ckpt.finalize(blocking=True)] == [2]
        assert_loads(ckpt_root, 2, clone_state(state))


SHM_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError
    root = sys.argv[1]
    print("shm bytes free", os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize, flush=True)
    with AsyncCheckpointer(root, CheckpointConfig(timeout_s=30.0)) as ckpt:
        try:
            ckpt.schedule_save({"w": torch.ones(32 << 20, dtype=torch.uint8)}, step=1)  # 32 MiB
            print("UNEXPECTED: saved", flush=True)
        except CheckpointError as exc:
            print("refused:", exc, flush=True)
        ckpt.schedule_save({"w": torch.ones(4 << 20, dtype=torch.uint8)}, step=2)  # 4 MiB fits
        print("committed", [r.step for r in ckpt.finalize(blocking=True)], flush=True)
    """
)


def test_small_real_dev_shm_end_to_end(tmp_path):
    """A trainer in its own mount namespace with a 16 MiB /dev/shm (needs root and unshare)."""
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here ({probe.stderr.strip()})")
    script = tmp_path / "shm_trainer.py"
    script.write_text(SHM_SCRIPT)
    inner = f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} {script} {tmp_path / 'ckpt'}"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    print("\n" + done.stdout + done.stderr[-2000:])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: not enough shared memory" in done.stdout and "must move into /dev/shm" in done.stdout
    assert "committed [2]" in done.stdout


# open-file limit ------------------------------------------------------------------------------
def test_fd_room_decision():
    ensure_fd_room(0, open_fds=10_000, limits=(256, 256))  # nothing new to share
    ensure_fd_room(100, open_fds=50, limits=(1024, 1024))
    ensure_fd_room(2000, open_fds=50, limits=(1024, 65536))  # the soft limit can be raised
    with pytest.raises(CheckpointError, match=r"2000 shared-memory segments.*the hard limit is 1024.*ulimit -n"):
        ensure_fd_room(2000, open_fds=50, limits=(1024, 1024))


FD_SCRIPT = textwrap.dedent(
    """
    import os, resource, sys, psutil, torch
    from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    with AsyncCheckpointer(sys.argv[1], CheckpointConfig(timeout_s=60.0)) as ckpt:  # its worker starts with 256
        state = {f"p{i}": torch.full((4,), float(i)) for i in range(600)}  # 600 tensors > 256 files
        ckpt.schedule_save(state, step=1)
        print("committed", [r.step for r in ckpt.finalize(blocking=True)], flush=True)
        worker_soft, worker_hard = psutil.Process(ckpt.worker_pid).rlimit(psutil.RLIMIT_NOFILE)
        print("limits", hard, resource.getrlimit(resource.RLIMIT_NOFILE)[0], worker_soft, worker_hard, flush=True)
        limit = len(os.listdir("/proc/self/fd")) + 100  # the held tensors keep theirs open
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))  # now it cannot be raised
        try:
            ckpt.schedule_save({f"q{i}": torch.full((4,), float(i)) for i in range(600)}, step=2)
            print("UNEXPECTED: saved", flush=True)
        except CheckpointError as exc:
            print("refused:", exc, flush=True)
    """
)


def test_more_tensors_than_the_open_file_limit(tmp_path):
    """Each shared CPU tensor holds a descriptor in the trainer and in the worker: 600 tensors
    with `ulimit -n 256` commit (soft limits raised), and with a hard limit too low fail with a
    CheckpointError that says what to do, instead of a RuntimeError deep in torch."""
    script = tmp_path / "fd_trainer.py"
    script.write_text(FD_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    print("\n" + done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "committed [1]" in done.stdout
    [limits] = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("limits ")]
    hard, trainer_soft, worker_soft, worker_hard = (int(x) for x in limits)
    assert trainer_soft >= 600  # the trainer raised its own soft limit for the 600 shared tensors
    assert worker_soft == worker_hard == hard  # the worker, started with 256, took its hard limit
    assert "refused: too many tensors to share with the checkpoint worker: 600 shared-memory segments" in done.stdout


