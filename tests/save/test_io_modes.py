"""I/O modes: threads and forked writer processes write the same bytes, and a writer's OSError
reaches the trainer as a CheckpointError naming the file, with nothing committed."""

from __future__ import annotations

import glob
import os
import threading

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, latest_checkpoint, verify_checkpoint
from asyncckpt.layout import read_latest_marker
from conftest import assert_state_equal, clone_state, make_model_and_optimizer, make_state, step_path, zeros_like_state

MODES = ["thread", "process"]



def small_state() -> dict:
    model, optimizer = make_model_and_optimizer()
    state = make_state(model, optimizer, step=3)
    state["extra"] = {"big": torch.arange(20_000, dtype=torch.float64), "ints": torch.arange(7, dtype=torch.int16)}
    return state


def _data_files(step_dir: str) -> dict[str, bytes]:
    return {
        os.path.basename(p): open(p, "rb").read() for p in sorted(glob.glob(os.path.join(step_dir, "__0_*.distcp")))
    }


def test_thread_and_process_modes_write_identical_files_that_stock_dcp_loads(tmp_path):
    state = small_state()
    expected = clone_state(state)
    files = {}
    for io in MODES:
        root = str(tmp_path / io)
        with AsyncCheckpointer(root, CheckpointConfig(io=io, io_workers=3)) as ckpt:
            ckpt.schedule_save(state, step=1)
            [report] = ckpt.finalize(blocking=True)
        assert report.bytes > 0
        files[io] = _data_files(step_path(root, 1))
        target = zeros_like_state(expected)
        dcp.load(target, checkpoint_id=step_path(root, 1), no_dist=True)
        assert_state_equal(target, expected)
    assert len(files["thread"]) == 3
    assert files["thread"].keys() == files["process"].keys()
    for name in files["thread"]:
        assert files["thread"][name] == files["process"][name], f"{name} differs between io modes"


@pytest.mark.parametrize("io", MODES)
def test_oserror_in_one_writer_names_the_file_and_commits_nothing(ckpt_root, io):
    state = small_state()
    expected = clone_state(state)
    step_dir = step_path(ckpt_root, 4)
    os.makedirs(os.path.join(step_dir, "__0_1.distcp"))  # opening this "file" for writing fails
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(io=io, io_workers=3)) as ckpt:
        pid = ckpt.worker_pid
        with pytest.raises(CheckpointError, match=r"__0_1\.distcp") as raised:
            ckpt.schedule_save(state, step=4)
            ckpt.finalize(blocking=True)
        assert "EISDIR" in str(raised.value) or "directory" in str(raised.value).lower()
        assert not os.path.exists(os.path.join(step_dir, ".metadata"))
        assert not os.path.exists(os.path.join(ckpt_root, "latest"))
        assert ckpt.worker_pid == pid  # the worker survived and serves the next save

        ckpt.schedule_save(state, step=4)
        [report] = ckpt.finalize(blocking=True)
    assert report.step == 4
    target = zeros_like_state(expected)
    dcp.load(target, checkpoint_id=step_dir, no_dist=True)
    assert_state_equal(target, expected)


@pytest.mark.parametrize("io", MODES)
def test_failed_resave_of_a_committed_step_keeps_it_committed(ckpt_root, io):
    """Re-saving a step that is already committed (a resumed run saves the step it loaded): a save
    that fails, by bad input or by a write error, leaves the old checkpoint committed, loadable and
    named by `latest`; one that succeeds replaces it at its commit and leaves no old file."""
    state = {"w": torch.arange(1000.0), "b": torch.ones(10)}
    expected_old = clone_state(state)
    step_dir = step_path(ckpt_root, 2)
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(io=io, io_workers=2)) as ckpt:
        ckpt.schedule_save(state, step=2)
        ckpt.finalize(blocking=True)
        old_files = sorted(os.listdir(step_dir))
        state["w"].add_(1.0)

        with pytest.raises(CheckpointError, match="lock"):  # bad input: refused before any write
            ckpt.schedule_save({**state, "lock": threading.Lock()}, step=2)
        worker = psutil.Process(ckpt.worker_pid)
        tree = [worker, *worker.children()]  # forked writers inherit the limit of the fork server
        limits = worker.rlimit(psutil.RLIMIT_FSIZE)
        for process in tree:
            process.rlimit(psutil.RLIMIT_FSIZE, (4096, limits[1]))  # the data files cannot be written
        try:
            with pytest.raises(CheckpointError, match="EFBIG"):
                ckpt.schedule_save(state, step=2)
                ckpt.finalize(blocking=True)
        finally:
            for process in tree:
                process.rlimit(psutil.RLIMIT_FSIZE, limits)
        assert sorted(os.listdir(step_dir)) == old_files  # nothing of the failed saves is left
        assert read_latest_marker(ckpt_root) == "step_00000002"
        assert latest_checkpoint(ckpt_root).step == 2
        assert not verify_checkpoint(step_dir)
        _assert_stock_load(step_dir, expected_old)

        expected_new = clone_state(state)
        ckpt.schedule_save(state, step=2)
        assert [r.step for r in ckpt.finalize(blocking=True)] == [2]
    assert not set(os.listdir(step_dir)) & {f for f in old_files if f.startswith("__")}
    assert not verify_checkpoint(step_dir)
    _assert_stock_load(step_dir, expected_new)


def _assert_stock_load(step_dir: str, expected: dict) -> None:
    target = {"w": torch.zeros(1000), "b": torch.zeros(10)}
    dcp.load(target, checkpoint_id=step_dir, no_dist=True)
    assert torch.equal(target["w"], expected["w"]) and torch.equal(target["b"], expected["b"])


@pytest.mark.parametrize("io", MODES)
def test_symlink_planted_as_a_data_file_is_never_written_through(ckpt_root, tmp_path, io):
    """A torn step directory with a data file name pointing elsewhere: the save refuses to open it
    (ELOOP), names the file, commits nothing, and the file elsewhere is untouched."""
    state = small_state()
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    step_dir = step_path(ckpt_root, 6)
    os.makedirs(step_dir)
    os.symlink(str(victim), os.path.join(step_dir, "__0_2.distcp"))
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(io=io, io_workers=3)) as ckpt:
        with pytest.raises(CheckpointError, match=r"__0_2\.distcp.*ELOOP"):
            ckpt.schedule_save(state, step=6)
            ckpt.finalize(blocking=True)
        assert not os.path.exists(os.path.join(step_dir, ".metadata"))
        ckpt.schedule_save(state, step=6)
        assert [r.step for r in ckpt.finalize(blocking=True)] == [6]
    assert victim.read_text() == "keep me"
