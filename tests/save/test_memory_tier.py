"""The memory tier (CheckpointConfig(memory_tier=True)): the staging slab is a file per rank under
memory_dir that outlives the trainer; `load_latest` restores from it when every rank holds the same
complete, verified copy newer than the disk (or that very save), else from the disk."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, load, verify_checkpoint
from asyncckpt.layout import list_checkpoints, read_latest_marker
from asyncckpt.memory_file import COMPLETE_AT, FOOTER_BYTES, memory_file_name, read_copy
from conftest import REPO, assert_state_equal, zeros_like_state
from multirank import run_ranks
from test_planning import plan_for

from asyncckpt.save.mapped_copy import mapped_snapshot
from asyncckpt.save.planning import Planning


def state_at(step: int) -> dict:
    """Every value a function of the step: several dtypes and shapes, an empty tensor, objects."""
    base = torch.arange(3000, dtype=torch.float64)
    return {
        "w": {"a": base + step, "b": (base[:600].reshape(20, 30) * step).to(torch.bfloat16),
              "n": torch.arange(17, dtype=torch.int64) * step, "flags": torch.arange(9) % (step + 2) == 0,
              "empty": torch.zeros(0, 4)},
        "meta": {"step": step, "name": f"run-{step}", "milestones": [step, step * 2]},
    }


def config(memory_dir, **kw) -> CheckpointConfig:
    kw.setdefault("memory_tier", True)
    return CheckpointConfig( memory_dir=str(memory_dir), worker_nice=None, worker_ionice=None,
                            timeout_s=60.0, **kw)


def save_then_keep(root: str, memory_dir, disk_steps, memory_step) -> None:
    """Commit `disk_steps`, stage `memory_step` into memory only, close keeping the file."""
    state = state_at(0)
    with AsyncCheckpointer(root, config(memory_dir, memory_keep=True)) as ckpt:
        for step in [*disk_steps, memory_step]:
            state.update(state_at(step))
            ckpt.schedule_save(state, step=step, memory_only=step == memory_step)
            ckpt.finalize(blocking=True)


def step_2_in_memory_only(tmp_path):
    """A root with step 1 committed and step 2 in the memory tier only (its folder `shm`)."""
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    save_then_keep(root, shm, [1], 2)
    return root, shm


def resume(root: str, memory_dir, **kw):
    target = zeros_like_state(state_at(0))
    with AsyncCheckpointer(root, config(memory_dir, **kw)) as ckpt:
        step = ckpt.load_latest(target)
        return step, ckpt.resume_report, target


def test_a_memory_only_save_is_restored_then_persisted_in_the_background(tmp_path):
    root, shm = step_2_in_memory_only(tmp_path)
    assert [c.step for c in list_checkpoints(root)] == [1]  # nothing of step 2 on disk
    copy = read_copy(str(shm / memory_file_name(root, 0)))
    assert (copy.step, copy.memory_only) == (2, True)
    assert oct(os.stat(copy.path).st_mode & 0o777) == "0o600"
    target = zeros_like_state(state_at(0))
    with AsyncCheckpointer(root, config(shm)) as ckpt:
        assert ckpt.load_latest(target) == 2
        assert (ckpt.resume_report.source, ckpt.resume_report.persisted) == ("memory", False)
        assert_state_equal(target, state_at(2))
        target["w"]["a"].add_(1)  # training goes on at once: the persist wrote the restored values
        reports = ckpt.finalize(blocking=True)
        assert [(r.step, r.persisted_restore) for r in reports] == [(2, True)]
        assert ckpt.resume_report.persisted and ckpt.resume_report.persisted_at is not None
    assert read_latest_marker(root) == "step_00000002"
    assert verify_checkpoint(os.path.join(root, "step_00000002")) == []
    assert not os.listdir(shm)  # persisted: a clean close removes the file
    step, report, target = resume(root, shm, memory_tier=False)
    assert (step, report.source) == (2, "disk")
    assert_state_equal(target, state_at(2))


def test_the_persist_of_a_restored_copy_waits_for_no_worker(tmp_path):
    """load_latest returns right after the restore: the persist goes to the new worker from the
    tier's file on a thread (its start-up and staging are not the restart's), and the file keeps
    the copy until the persist's own copy is sealed."""
    root, shm = step_2_in_memory_only(tmp_path)
    target = zeros_like_state(state_at(0))
    with AsyncCheckpointer(root, config(shm)) as ckpt:
        assert ckpt.load_latest(target) == 2
        assert not ckpt.worker_ready  # returned before the worker had started up and staged the persist
        assert read_copy(str(shm / memory_file_name(root, 0))).step == 2  # the copy is kept meanwhile
        target["w"]["a"].add_(1)
        target["w"]["n"].mul_(0)  # training goes on: the persist holds the restored values
        reports = ckpt.finalize(blocking=True)
        assert [(r.step, r.persisted_restore) for r in reports] == [(2, True)]
        assert ckpt.resume_report.persisted
        ckpt.schedule_save(target, step=3)  # the trainer's own tensors, which the worker took after the persist
        ckpt.finalize(blocking=True)
    step, report, loaded = resume(root, shm, memory_tier=False)
    assert (step, report.source) == (3, "disk")
    assert_state_equal(loaded, target)
    loaded = zeros_like_state(state_at(0))
    load(loaded, os.path.join(root, "step_00000002"))
    assert_state_equal(loaded, state_at(2))


def test_with_a_copy_waiting_the_worker_starts_once_the_restore_has_read_it(tmp_path):
    """A copy in memory means a restart: a new worker's start-up (an interpreter, torch) would take
    the cores the restore reads with, so it starts when load_latest has read, or at the first save
    of a checkpointer that does not restore. Without a copy it starts in the constructor."""
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    with AsyncCheckpointer(root, config(shm, memory_keep=True)) as ckpt:
        assert ckpt.worker_pid is not None  # nothing to restore: started at once
        ckpt.schedule_save(state_at(1), step=1)
    target = zeros_like_state(state_at(0))
    with AsyncCheckpointer(root, config(shm, memory_keep=True)) as ckpt:
        assert ckpt.worker_pid is None
        assert ckpt.load_latest(target) == 1 and ckpt.resume_report.source == "memory"
        assert ckpt.worker_pid is not None  # started as load_latest returned, before any save
        assert_state_equal(target, state_at(1))
    with AsyncCheckpointer(root, config(shm)) as ckpt:
        assert ckpt.worker_pid is None
        ckpt.schedule_save(state_at(2), step=2)  # no restore: the save starts it
        assert ckpt.worker_pid is not None
        assert [r.step for r in ckpt.finalize(blocking=True)] == [2]
    step, report, target = resume(root, shm, memory_tier=False)
    assert (step, report.source) == (2, "disk")
    assert_state_equal(target, state_at(2))


def test_the_persist_is_taken_from_the_tier_file_and_leaves_the_trainers_tensors_alone(tmp_path):
    """load_latest copies nothing for the persist: its snapshot is views of the tier's file
    (save/mapped_copy.py), equal to the restored values, and the trainer's tensors stay where
    they are (not moved into shared memory: that is the job's first save's work). A file that
    no longer holds that save, or a plan it cannot serve, gives None (the trainer's tensors are
    snapshotted instead)."""
    root, shm = step_2_in_memory_only(tmp_path)
    path = str(shm / memory_file_name(root, 0))
    target = zeros_like_state(state_at(0))
    with AsyncCheckpointer(root, config(shm)) as ckpt:
        assert ckpt.load_latest(target) == 2
        assert not any(t.untyped_storage().is_shared() for t in target["w"].values())
        ckpt.finalize(blocking=True)
    save_then_keep(root, shm, [3], 4)
    copy = read_copy(path)
    planned = plan_for(Planning(), state_at(4))
    snapshot = mapped_snapshot(planned, path, copy.token)
    assert snapshot is not None and snapshot.mapped_from == path
    values = {spec.index.fqn: t for spec, t in zip(snapshot.items, snapshot.tensors) if t is not None}
    assert set(values) == {"w.a", "w.b", "w.n", "w.flags", "w.empty"}
    for name, tensor in state_at(4)["w"].items():
        assert torch.equal(values[f"w.{name}"], tensor), name
    assert mapped_snapshot(planned, path, "another save") is None
    other = state_at(4)
    other["w"]["a"] = other["w"]["a"].float()  # the trainer's dtype differs from the copy's: not served from it
    assert mapped_snapshot(plan_for(Planning(), other), path, copy.token) is None


def test_prepare_after_a_restore_does_not_wait_for_the_persist(tmp_path):
    """The README's order with the tier: load_latest, prepare, train. prepare moves the trainer's
    tensors and returns without waiting for the persist's writes (its hand-off thread owns the
    worker); the first save then takes them, and both steps are on disk as they were saved."""
    root, shm = step_2_in_memory_only(tmp_path)
    target = zeros_like_state(state_at(0))
    with AsyncCheckpointer(root, config(shm)) as ckpt:
        assert ckpt.load_latest(target) == 2
        ckpt.prepare(target)
        assert ckpt.resume_report.persisted is False  # not waited for (nor committed) by prepare
        assert all(t.untyped_storage().is_shared() for t in target["w"].values() if t.numel())
        target["w"]["a"].add_(1)
        ckpt.schedule_save(target, step=3)  # waits for the persist, as a save waits for the one before
        ckpt.finalize(blocking=True)
        assert ckpt.resume_report.persisted
    for step, expected in [(2, state_at(2)), (3, target)]:
        loaded = zeros_like_state(state_at(0))
        load(loaded, os.path.join(root, f"step_{step:08d}"))
        assert_state_equal(loaded, expected)


def test_a_restored_copy_not_persisted_on_request_stays_in_memory(tmp_path):
    root, shm = step_2_in_memory_only(tmp_path)
    step, report, target = resume(root, shm, memory_persist_restored=False)
    assert (step, report.source, report.persisted) == (2, "memory", False)
    assert read_latest_marker(root) == "step_00000001"  # the next disk save persists it
    assert os.listdir(shm)  # newer than the disk: a clean close keeps it


def corrupt(path: str, how: str) -> None:
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        if how == "incomplete":
            f.seek(size - FOOTER_BYTES + COMPLETE_AT)
            f.write(b"\0\0\0\0")
        else:  # a flipped byte in the first tensor's staged bytes
            f.seek(64)
            byte = f.read(1)
            f.seek(64)
            f.write(bytes([byte[0] ^ 0xFF]))


def test_a_copy_that_is_not_this_saves_whole_newer_copy_is_not_used(tmp_path, caplog):
    """Damaged (a flipped byte), incomplete, another root's, older than the disk: the disk, with a
    WARNING for all but the older one (nothing is wrong with that)."""
    root, shm = step_2_in_memory_only(tmp_path)
    path = str(shm / memory_file_name(root, 0))
    pristine = open(path, "rb").read()
    for case, expected in (("damaged", 1), ("incomplete", 1), ("another root", None), ("older", 3)):
        with open(path, "wb") as f:
            f.write(pristine)
        os.chmod(path, 0o600)
        where = root
        if case in ("damaged", "incomplete"):
            corrupt(path, case)
        elif case == "another root":
            where = root + "-other"
            os.rename(path, shm / memory_file_name(where, 0))
        else:  # the disk moves past the copy
            with AsyncCheckpointer(root, CheckpointConfig(worker_nice=None, worker_ionice=None)) as ckpt:
                ckpt.schedule_save(state_at(3), step=3)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="asyncckpt"):
            step, report, target = resume(where, shm, memory_keep=True)
        assert step == expected and (report is None or report.source == "disk"), case
        if expected is not None:
            assert_state_equal(target, state_at(expected))
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "memory" in r.getMessage()]
        assert bool(warned) == (case != "older"), (case, [r.getMessage() for r in caplog.records])


def test_refused_where_it_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="staging_budget_bytes"):
        CheckpointConfig(memory_tier=True, staging_budget_bytes=64 << 20)
    with pytest.raises(CheckpointError, match="needs a checkpoint root"):
        AsyncCheckpointer(None, config(tmp_path))
    with pytest.raises(CheckpointError, match="not a writable directory"):
        AsyncCheckpointer(str(tmp_path / "ckpt"), config(tmp_path / "missing"))
    with AsyncCheckpointer(str(tmp_path / "ckpt2"), CheckpointConfig()) as ckpt:
        with pytest.raises(ValueError, match="memory_tier"):
            ckpt.schedule_save(state_at(1), step=1, memory_only=True)


def test_a_trainer_killed_after_a_staged_save_restarts_from_memory_and_commits_it(tmp_path):
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    trainer = subprocess.run(
        [sys.executable, "-c", TRAINER, root, str(shm)], cwd=REPO, capture_output=True, text=True, timeout=180,
        env={**os.environ, "ASYNCCKPT_JOB_ID": "memory-tier-test"},
    )
    assert trainer.returncode == -9, trainer.stderr[-3000:]  # SIGKILLed right after step 2 was staged
    assert "staged 2" in trainer.stdout
    assert read_latest_marker(root) == "step_00000001"  # step 2 was never committed
    step, report, target = resume(root, shm)
    assert (step, report.source) == (2, "memory")
    assert_state_equal(target, state_at(2))
    assert read_latest_marker(root) == "step_00000002"  # written and committed before load_latest returned
    assert verify_checkpoint(os.path.join(root, "step_00000002")) == []


TRAINER = textwrap.dedent(
    f"""
    import os, sys
    sys.path.insert(0, {os.path.join(REPO, "tests", "save")!r})
    sys.path.insert(0, {os.path.join(REPO, "tests")!r})
    from test_memory_tier import config, state_at
    from asyncckpt import AsyncCheckpointer
    root, shm = sys.argv[1:3]
    state = state_at(1)
    ckpt = AsyncCheckpointer(root, config(shm))
    ckpt.schedule_save(state, step=1)
    ckpt.finalize(blocking=True)
    state.update(state_at(2))
    ckpt.schedule_save(state, step=2)  # staged: the worker holds it
    print("staged 2", flush=True)
    os.kill(os.getpid(), 9)
    """
)


class Picky:
    """An entry whose load_state_dict refuses what it is given (where `refuse`)."""

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.value = {"step": 0, "name": "", "milestones": []}

    def state_dict(self) -> dict:
        return dict(self.value)

    def load_state_dict(self, state: dict) -> None:
        if self.refuse:
            raise ValueError("refused")
        self.value = state


def _two_ranks(rank: int, world: int, root: str, shm: str) -> None:
    state = state_at(0)
    with AsyncCheckpointer(root, config(shm, memory_keep=True)) as ckpt:
        for step in (1, 2):
            state.update(state_at(step))
            ckpt.schedule_save(state, step=step, memory_only=step == 2)
            ckpt.finalize(blocking=True)
    # a load that fails on one rank only, after the load's collectives (an entry's load_state_dict
    # refuses): every rank leaves the copy alike, at once (the disk overwrites every entry)
    target = {**zeros_like_state(state_at(0)), "meta": Picky(refuse=rank == 1)}
    started = time.monotonic()
    with AsyncCheckpointer(root, config(shm, memory_keep=True)) as ckpt:
        if rank == 1:
            with pytest.raises(CheckpointError, match="refused"):
                ckpt.load_latest(target)
        else:
            assert ckpt.load_latest(target) == 1 and ckpt.resume_report.source == "disk", ckpt.resume_report
            assert_state_equal(target["w"], state_at(1)["w"])
    assert time.monotonic() - started < 30  # (not the group's 60 s timeout)
    dist.barrier()
    target = zeros_like_state(state_at(0))
    with AsyncCheckpointer(root, config(shm, memory_keep=True)) as ckpt:
        assert ckpt.load_latest(target) == 2 and ckpt.resume_report.source == "memory"  # both files here
        assert_state_equal(target, state_at(2))
        dist.barrier()
        if rank == 1:
            os.unlink(os.path.join(shm, memory_file_name(root, 1)))
        dist.barrier()
        target = zeros_like_state(state_at(0))
        assert ckpt.load_latest(target) == 1 and ckpt.resume_report.source == "disk"  # rank 1 lacks it: disk on both
        assert_state_equal(target, state_at(1))


@pytest.mark.timeout(300)
def test_two_ranks_restore_from_memory_and_both_use_the_disk_when_one_lacks_its_file(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    run_ranks(_two_ranks, 2, str(tmp_path / "ckpt"), str(shm))


def _alone_in_one_folder(rank: int, world: int, folder: str, shm: str) -> None:
    from asyncckpt.loading.opened import open_checkpoint

    state = state_at(rank + 1)
    with AsyncCheckpointer(None, config(shm), no_dist=True, memory_folder=folder) as ckpt:
        path = os.path.join(folder, f"rank{rank}")
        ckpt.schedule_save(state, checkpoint_dir=path)
        ckpt.finalize(blocking=True)
        dist.barrier()  # both saved: neither file may have replaced the other
        target = zeros_like_state(state_at(0))
        assert ckpt.memory_tier.load_saved(target, open_checkpoint(path), trusted=True), f"rank {rank}"
        assert_state_equal(target, state)
        dist.barrier()


def test_processes_saving_alone_into_one_folder_keep_a_memory_file_each(tmp_path):
    """async_save(no_dist=True) on every rank into one folder: each process's tier has a file of
    its own (they shared one name, so one copy replaced the other, or creating it raced)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    run_ranks(_alone_in_one_folder, 2, str(tmp_path / "ckpts"), str(shm))


def test_stale_files_of_dead_jobs_are_removed_and_nothing_else(tmp_path):
    from asyncckpt.save.memory_tier import STALE_AFTER_S, remove_stale

    old = time.time() - STALE_AFTER_S - 60
    names = {
        "dead": memory_file_name("/jobs/a", 0),  # no owner alive (no footer: a save was staging when all died)
        "young": memory_file_name("/jobs/b", 0),  # written recently
        "ours": memory_file_name("/jobs/c", 3),  # this root's: a restart restores from it
        "foreign": "not-ours.slab",
    }
    for key, name in names.items():
        path = tmp_path / name
        path.write_bytes(b"\0" * 4096)
        if key != "young":
            os.utime(path, (old, old))
    keep = memory_file_name("/jobs/c", 0).rsplit("-rank", 1)[0] + "-rank"
    assert remove_stale(str(tmp_path), keep) == [str(tmp_path / names["dead"])]
    assert sorted(os.listdir(tmp_path)) == sorted(n for k, n in names.items() if k != "dead")
