"""The memory tier's copy belongs to one history (the root's id and the newest committed checkpoint
it was staged on top of): a wiped, rolled-back or replaced root never gets an old copy back; a
copy newer than the disk is never dropped by a clean path; a full tmpfs is an error, never a
signal; a restore that fails half-way never returns over a mixed state."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError
from asyncckpt.errors import PartialLoadError
from asyncckpt.formats import crc32c
from asyncckpt.layout import read_latest_marker
from asyncckpt.memory_file import FOOTER_BYTES, Footer, NotACopy, memory_file_name, read_copy
from conftest import assert_state_equal, zeros_like_state
from multirank import run_ranks
from test_memory_tier import config, resume, save_then_keep, state_at


def memory_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "memory" in r.getMessage()]


def test_a_wiped_root_starts_fresh_and_ignores_the_old_copy(tmp_path, caplog):
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    save_then_keep(root, shm, [1, 2], 3)  # disk 1-2, memory-only 3: a crash would leave the same
    shutil.rmtree(root)
    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        step, report, target = resume(root, shm, memory_keep=True)
    assert step is None and report is None  # nothing to resume
    assert_state_equal(target, zeros_like_state(state_at(0)))
    assert any("history" in m for m in memory_messages(caplog)), caplog.text
    assert not os.path.exists(shm / memory_file_name(root, 0))  # the other history's copy is gone


@pytest.mark.parametrize("memory_only", [True, False])
def test_a_rolled_back_root_resumes_its_newest_disk_step(tmp_path, caplog, memory_only):
    """Steps 2-3 deleted, step 1 kept (the usual answer to a loss spike): 1, never the copy of 3."""
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    if memory_only:
        save_then_keep(root, shm, [1, 2], 3)
    else:  # the copy is step 3's committed save itself
        state = state_at(0)
        with AsyncCheckpointer(root, config(shm, memory_keep=True)) as ckpt:
            for step in (1, 2, 3):
                state.update(state_at(step))
                ckpt.schedule_save(state, step=step)
    for step in (2, 3):
        shutil.rmtree(os.path.join(root, f"step_{step:08d}"), ignore_errors=True)
    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        step, report, target = resume(root, shm, memory_keep=True)
    assert (step, report.source) == (1, "disk")
    assert_state_equal(target, state_at(1))
    assert any("history" in m or "newest committed" in m for m in memory_messages(caplog)), caplog.text


def test_a_restored_memory_only_copy_survives_a_clean_close(tmp_path):
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    save_then_keep(root, shm, [1], 2)
    step, report, target = resume(root, shm)  # a clean close, memory_keep off
    assert (step, report.source) == (2, "memory")
    step, report, target = resume(root, shm)  # a second restart before any save
    assert step == 2, report
    assert_state_equal(target, state_at(2))


def test_a_copy_of_another_job_on_the_same_path_is_ignored(tmp_path):
    """The root's path is reused by another job (moved away, a new one made in its place): the
    copy's file name and root path match, its history does not."""
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    save_then_keep(root, shm, [1], 2)
    os.rename(root, root + "-moved")
    with AsyncCheckpointer(root, CheckpointConfig(worker_nice=None, worker_ionice=None)) as other:
        other.schedule_save(state_at(7), step=1)  # the other job's step 1
    step, report, target = resume(root, shm, memory_keep=True)
    assert (step, report.source) == (1, "disk")
    assert_state_equal(target, state_at(7))


def test_a_root_used_by_two_runs_in_turn(tmp_path):
    """Run A leaves a copy of step 3, the root is wiped, run B starts fresh, saves step 1 and
    leaves a copy of step 2: a restart gets B's step 2, never A's step 3."""
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    save_then_keep(root, shm, [1, 2], 3)
    shutil.rmtree(root)
    target = zeros_like_state(state_at(0))
    with AsyncCheckpointer(root, config(shm, memory_keep=True)) as ckpt:
        assert ckpt.load_latest(target) is None
        for step in (1, 2):
            ckpt.schedule_save(state_at(step + 10), step=step, memory_only=step == 2)
            ckpt.finalize(blocking=True)
    step, report, target = resume(root, shm, memory_keep=True)
    assert (step, report.source) == (2, "memory")
    assert_state_equal(target, state_at(12))


def damage_last_tensor(path: str) -> None:
    """Flip a byte of the copy's last staged tensor (its CRC32C then fails while reading)."""
    copy = read_copy(path)
    rows = json.loads(copy.plan)["items"]
    tensors = [item for item, row in zip(copy.items, rows) if row["type"] != "BYTE_IO" and item.length]
    last = max(tensors, key=lambda item: item.at)
    with open(path, "r+b") as f:
        f.seek(last.at + last.length - 1)
        byte = f.read(1)
        f.seek(last.at + last.length - 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_half_failed_restore_with_no_disk_checkpoint_raises(tmp_path):
    """The only save is in memory and it fails to load after touching the state: never a
    `None` (fresh start) over a partly overwritten state."""
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    save_then_keep(root, shm, [], 1)
    damage_last_tensor(str(shm / memory_file_name(root, 0)))
    target = zeros_like_state(state_at(0))
    with AsyncCheckpointer(root, config(shm, memory_keep=True)) as ckpt:
        try:
            step = ckpt.load_latest(target)
        except PartialLoadError:
            return
        except CheckpointError as exc:
            assert "nothing in state_dict was changed" in str(exc)
            return
    assert step is not None or all(
        (t == 0).all() for t in target["w"].values() if isinstance(t, torch.Tensor)
    ), "load_latest returned None over a changed state"


def test_a_half_failed_restore_falls_back_to_the_disk_of_its_history(tmp_path):
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    save_then_keep(root, shm, [1], 2)
    damage_last_tensor(str(shm / memory_file_name(root, 0)))
    step, report, target = resume(root, shm, memory_keep=True)
    assert (step, report.source) == (1, "disk")
    assert_state_equal(target, state_at(1))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 MiB tmpfs for the tier (root only); the test is skipped where it cannot be mounted."""
    where = tmp_path / "small-shm"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    os.chmod(where, 0o700)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def big_state(mib: int) -> dict:
    return {"w": torch.ones(mib << 18, dtype=torch.float32), "meta": {"note": "x"}}


def test_a_full_tmpfs_is_a_checkpoint_error_naming_the_mount(tmp_path, small_tmpfs):
    root = str(tmp_path / "ckpt")
    with AsyncCheckpointer(root, config(small_tmpfs)) as ckpt:
        with pytest.raises(CheckpointError) as raised:
            ckpt.schedule_save(big_state(100), step=1)
            ckpt.finalize(blocking=True)
        message = str(raised.value)
        assert str(small_tmpfs) in message and "MiB" in message and "free" in message, message
        assert ckpt.worker_alive  # no SIGBUS killed it
        ckpt.schedule_save(big_state(8), step=2)  # a state that fits saves
        assert [r.step for r in ckpt.finalize(blocking=True)] == [2]


def test_a_copy_that_cannot_be_sealed_never_fails_the_disk_save(tmp_path, small_tmpfs, caplog):
    """The slab fits, its objects and header do not: WARNING, the disk save commits, and no
    incomplete copy is ever restored."""
    root = str(tmp_path / "ckpt")
    state = {"w": torch.ones(40 << 18, dtype=torch.float32), "blob": b"small"}
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        with AsyncCheckpointer(root, config(small_tmpfs, memory_keep=True)) as ckpt:
            ckpt.schedule_save(state, step=1)  # the slab exists now
            ckpt.finalize(blocking=True)
            room = os.statvfs(small_tmpfs)
            with open(small_tmpfs / "filler", "wb") as f:  # 2 MiB left: the slab fits, the 6 MiB object not
                os.posix_fallocate(f.fileno(), 0, max(room.f_bavail * room.f_frsize - (2 << 20), 4096))
            state["blob"] = os.urandom(6 << 20)
            ckpt.schedule_save(state, step=2)
            reports = ckpt.finalize(blocking=True)
    assert [r.step for r in reports] == [2]
    assert read_latest_marker(root) == "step_00000002"
    assert any("seal" in m for m in memory_messages(caplog)), caplog.text
    with pytest.raises(NotACopy):
        read_copy(str(small_tmpfs / memory_file_name(root, 0)))


def rewrite_header(path: str, **fields) -> None:
    """Give a copy another history (as a copy of another job would have), its checksums kept true."""
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size - FOOTER_BYTES)
        footer = f.read(FOOTER_BYTES)
        import struct
        _, _, _, pid, _, at, length, _, _ = struct.unpack("<8sIIIIQQII", footer)
        f.seek(at)
        header = json.loads(f.read(length))
        header.update(fields)
        raw = json.dumps(header, separators=(",", ":")).encode()
        f.seek(at)
        f.write(raw)
        f.write(Footer(True, pid, at, len(raw), crc32c(raw)).encode())
        f.truncate(at + len(raw) + FOOTER_BYTES)


def _one_rank_of_another_history(rank: int, world: int, root: str, shm: str) -> None:
    state = state_at(0)
    with AsyncCheckpointer(root, config(shm, memory_keep=True)) as ckpt:
        for step in (1, 2):
            state.update(state_at(step))
            ckpt.schedule_save(state, step=step, memory_only=step == 2)
            ckpt.finalize(blocking=True)
    dist.barrier()
    if rank == 1:
        rewrite_header(os.path.join(shm, memory_file_name(root, 1)), root_id="another-history")
    dist.barrier()
    target = zeros_like_state(state_at(0))
    with AsyncCheckpointer(root, config(shm, memory_keep=True)) as ckpt:
        assert ckpt.load_latest(target) == 1 and ckpt.resume_report.source == "disk"
        assert_state_equal(target, state_at(1))


@pytest.mark.timeout(300)
def test_two_ranks_load_from_disk_when_one_copy_belongs_to_another_history(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    run_ranks(_one_rank_of_another_history, 2, str(tmp_path / "ckpt"), str(shm))



PERSIST_KILLED = """
import os, sys
sys.path[:0] = sys.argv[3:5]
from test_memory_tier import config, state_at
from conftest import zeros_like_state
from asyncckpt import AsyncCheckpointer
root, shm = sys.argv[1:3]
target = zeros_like_state(state_at(0))
ckpt = AsyncCheckpointer(root, config(shm))
step = ckpt.load_latest(target)
print("restored", step, ckpt.resume_report.source, ckpt.resume_report.persisted, flush=True)
os.kill(os.getpid(), 9)  # while the restored copy is being written to disk
"""


def test_a_trainer_killed_while_the_restored_copy_is_persisted_loses_nothing(tmp_path):
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    save_then_keep(root, shm, [1], 2)
    here = os.path.dirname(os.path.abspath(__file__))
    for _ in range(2):  # killed twice in a row: the copy (or its persisted checkpoint) is still there
        killed = subprocess.run([sys.executable, "-c", PERSIST_KILLED, root, str(shm), here, os.path.dirname(here)],
                                capture_output=True, text=True, timeout=180)
        assert killed.returncode == -9, killed.stderr[-3000:]
        assert "restored 2 memory False" in killed.stdout, killed.stdout + killed.stderr[-3000:]
    step, report, target = resume(root, shm)
    assert step == 2, report
    assert_state_equal(target, state_at(2))
    assert read_latest_marker(root) == "step_00000002"  # persisted by now (in the background, then at close)


def test_prepare_and_a_clean_close_keep_a_restored_copy_not_yet_persisted(tmp_path):
    """Persisting opted out: `prepare` readies a new slab beside the copy (it replaces the copy only
    once a copy of its own is sealed), and a clean close keeps it: the next start resumes it."""
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    save_then_keep(root, shm, [1], 2)
    target = zeros_like_state(state_at(0))
    with AsyncCheckpointer(root, config(shm, memory_persist_restored=False)) as ckpt:
        assert ckpt.load_latest(target) == 2
        ckpt.prepare(target)
        ckpt.finalize(blocking=True)
        ckpt.ensure_worker()
    step, report, target = resume(root, shm)
    assert (step, report.source) == (2, "memory")
    assert_state_equal(target, state_at(2))


def test_the_newest_save_id_is_read_again_once_its_metadata_is_replaced(tmp_path):
    """The root's newest save id is parsed once per version of its `.metadata`: the same step
    committed again (a new file under the same name) is seen with its new id."""
    from asyncckpt.loading.history import newest_committed
    roots = [str(tmp_path / name) for name in ("a", "b")]
    for root in roots:
        with AsyncCheckpointer(root, CheckpointConfig(worker_nice=None, worker_ionice=None)) as ckpt:
            ckpt.schedule_save(state_at(1), step=1)
    first, other = newest_committed(roots[0]), newest_committed(roots[1])
    assert first.step == other.step == 1 and first.save_id != other.save_id
    assert newest_committed(roots[0]) == first
    published = os.path.join(roots[0], "step_00000001", ".metadata")
    shutil.copyfile(os.path.join(roots[1], "step_00000001", ".metadata"), published + ".new")
    os.replace(published + ".new", published)
    assert newest_committed(roots[0]) == other
