"""Saves into a directory the caller names (what the framework doors build on), and single-process
saves inside a distributed job (`no_dist`)."""

from __future__ import annotations

import os

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, load, verify_checkpoint
from asyncckpt.storage import storage_for
from conftest import assert_state_equal, clone_state, make_model_and_optimizer, make_state, zeros_like_state
from multirank import run_ranks

pytestmark = pytest.mark.all_backends
MiB = 1 << 20


def _bump(state: dict, by: float) -> None:
    with torch.no_grad():
        for tensor in state["model"].values():
            tensor.add_(by)


def _assert_loads(path: str, expected: dict) -> None:
    target = zeros_like_state(expected)
    load(target, path)
    assert_state_equal(target, expected)


def test_save_into_named_directories_commits_each_and_writes_nothing_else(ckpt_root):
    """Two directories of the caller's naming, one worker, no `latest`, no step_N directory;
    the second save sends no tensors; stock dcp.load reads a local one."""
    model, optimizer = make_model_and_optimizer()
    state = make_state(model, optimizer)
    storage = storage_for(ckpt_root)
    first, second = storage.join(ckpt_root, "run", "step-10"), storage.join(ckpt_root, "run", "step-20")
    with AsyncCheckpointer(config=CheckpointConfig(keep_last=1)) as ckpt:
        ckpt.schedule_save(state, checkpoint_dir=first)
        assert ckpt.in_flight_dir == first
        expected_first = clone_state(state)
        _bump(state, 1.0)
        ckpt.schedule_save(state, step=20, checkpoint_dir=second)
        expected_second = clone_state(state)
        reports = ckpt.finalize(blocking=True)
    assert [r.path for r in reports] == [first, second] and [r.step for r in reports] == [None, 20]
    assert reports[1].tensors_sent == 0 and reports[1].cache_hit
    assert storage.list_dir(ckpt_root) == ["run"]  # no `latest`, no temp files beside the directories
    assert storage.list_dir(storage.join(ckpt_root, "run")) == ["step-10", "step-20"]  # keep_last is the step layout's
    _assert_loads(first, expected_first)
    _assert_loads(second, expected_second)
    assert verify_checkpoint(second) == []
    if "://" not in ckpt_root:
        target = zeros_like_state(expected_second)
        dcp.load(target, checkpoint_id=second, no_dist=True)
        assert_state_equal(target["model"], expected_second["model"])


@pytest.mark.local_only
def test_failed_resave_of_a_named_directory_keeps_the_committed_one(ckpt_root):
    state = {"w": torch.randn(4 * MiB // 4), "v": torch.randn(4 * MiB // 4)}
    path = os.path.join(ckpt_root, "last.ckpt")
    with AsyncCheckpointer(config=CheckpointConfig(io_workers=1, timeout_s=30.0)) as ckpt:
        ckpt.schedule_save(state, checkpoint_dir=path)
        ckpt.finalize(blocking=True)
        expected = clone_state(state)
        state["w"].add_(1.0)
        worker = psutil.Process(ckpt.worker_pid)
        limits = worker.rlimit(psutil.RLIMIT_FSIZE)
        worker.rlimit(psutil.RLIMIT_FSIZE, (MiB, limits[1]))  # the next write fails with EFBIG
        try:
            with pytest.raises(CheckpointError, match="EFBIG"):
                ckpt.schedule_save(state, checkpoint_dir=path)
                ckpt.finalize(blocking=True)
        finally:
            worker.rlimit(psutil.RLIMIT_FSIZE, limits)
        _assert_loads(path, expected)
        assert verify_checkpoint(path) == []
        expected = clone_state(state)
        ckpt.schedule_save(state, checkpoint_dir=path)  # a successful re-save replaces it
        ckpt.finalize(blocking=True)
    _assert_loads(path, expected)
    assert sorted(n for n in os.listdir(path) if n.endswith(".distcp")) == sorted(
        {info.relative_path for info in dcp.FileSystemReader(path).read_metadata().storage_data.values()}
    )


@pytest.mark.local_only
def test_failed_save_into_an_existing_directory_removes_only_its_own_files(ckpt_root):
    """A directory the caller made (with their own file in it) is never removed whole."""
    path = os.path.join(ckpt_root, "mine")
    os.makedirs(path)
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("keep me")
    with AsyncCheckpointer() as ckpt:
        with pytest.raises(Exception, match="lambda|pickle|Can't"):
            ckpt.schedule_save({"w": torch.ones(8), "bad": lambda: None}, checkpoint_dir=path)
    assert os.listdir(path) == ["notes.txt"]
    empty = os.path.join(ckpt_root, "fresh")
    with AsyncCheckpointer() as ckpt:
        with pytest.raises(Exception, match="lambda|pickle|Can't"):
            ckpt.schedule_save({"w": torch.ones(8), "bad": lambda: None}, checkpoint_dir=empty)
    assert not os.path.exists(empty)  # one it created goes entirely


@pytest.mark.local_only
def test_bad_targets_are_refused_before_anything_is_written(ckpt_root):
    os.makedirs(ckpt_root)
    a_file = os.path.join(ckpt_root, "model.ckpt")
    with open(a_file, "w") as f:
        f.write("not a directory")
    with AsyncCheckpointer() as ckpt:
        with pytest.raises(CheckpointError, match="model.ckpt.*not writable.*a file"):
            ckpt.schedule_save({"w": torch.ones(4)}, checkpoint_dir=a_file)
        with pytest.raises(ValueError, match="needs a checkpoint root"):
            ckpt.schedule_save({"w": torch.ones(4)}, step=1)
        with pytest.raises(ValueError, match="needs a step .* or a checkpoint_dir"):
            ckpt.schedule_save({"w": torch.ones(4)})
        with pytest.raises(CheckpointError, match="needs a checkpoint root"):
            ckpt.load_latest({"w": torch.ones(4)})
    assert os.listdir(ckpt_root) == ["model.ckpt"]
    with pytest.raises(CheckpointError, match="no_dist=True .* process_group"):
        AsyncCheckpointer(no_dist=True, process_group=object())


def _rank0_saves_alone(rank: int, world_size: int, root: str) -> None:
    groups_before = dist.distributed_c10d._world.group_count
    ckpt = AsyncCheckpointer(root, no_dist=True)  # every rank builds one, as Lightning's plugin is
    assert dist.distributed_c10d._world.group_count == groups_before, "no_dist created a process group"
    if rank == 0:  # only rank 0 saves: any collective would hang or fail here
        state = {"w": torch.full((1000,), 3.0), "meta": {"rank": rank}}
        ckpt.schedule_save(state, step=5)
        [report] = ckpt.finalize(blocking=True)
        assert report.collectives == 0
        ckpt.schedule_save(state, checkpoint_dir=os.path.join(root, "named"))
        ckpt.finalize(blocking=True)
    ckpt.close()


@pytest.mark.local_only
def test_no_dist_saves_on_one_rank_of_a_distributed_job_without_collectives(ckpt_root):
    run_ranks(_rank0_saves_alone, 2, ckpt_root, timeout_s=120)
    target = {"w": torch.zeros(1000), "meta": {"rank": -1}}
    load(target, os.path.join(ckpt_root, "step_00000005"))
    assert torch.equal(target["w"], torch.full((1000,), 3.0)) and target["meta"] == {"rank": 0}
    load(target, os.path.join(ckpt_root, "named"))
