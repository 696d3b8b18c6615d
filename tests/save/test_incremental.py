"""Incremental saves (CheckpointConfig(incremental=True)): only tensors whose bytes changed are
written; unchanged ones stay in their files, hard-linked into the new directory, and every
checkpoint stays complete: stock `dcp.load`, `verify`, retention and `cleanup` all keep working."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import AsyncCheckpointer, CheckpointConfig, cleanup, list_checkpoints, load, verify_checkpoint
from conftest import assert_state_equal, clone_state, step_path, zeros_like_state

MiB = 1 << 20
FROZEN_BYTES, HOT_BYTES = 9 * MiB, 1 * MiB  # 90 % of the tensor bytes never change


def frozen_state() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "encoder": {f"layer{i}": torch.randn(FROZEN_BYTES // 4 // 3, generator=generator) for i in range(3)},
        "head": torch.zeros(HOT_BYTES // 4 // 2),
        "adapter": torch.zeros(HOT_BYTES // 2 // 2, dtype=torch.bfloat16),
        "progress": {"step": 0},
    }


def train(state: dict, step: int) -> None:
    state["head"].add_(1.0)
    state["adapter"].add_(1.0)
    state["progress"] = {"step": step}


def new_bytes(directory: str, older: list[str]) -> int:
    """Bytes of the files in `directory` that no older checkpoint directory shares (by inode)."""
    shared = {os.stat(os.path.join(d, n)).st_ino for d in older for n in os.listdir(d)}
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
               if os.stat(os.path.join(directory, n)).st_ino not in shared)


def read_back(path: str, expected: dict, fmt: str) -> dict:
    target = zeros_like_state(expected)
    if fmt == "torch_save":
        dcp.load(target, checkpoint_id=path, no_dist=True)  # stock DCP reads an incremental checkpoint
    else:
        load(target, path)
    return target


@pytest.mark.parametrize("io, fmt", [("thread", "torch_save"), ("process", "safetensors")])  # each mode once
def test_a_mostly_frozen_state_writes_only_what_changed_and_every_checkpoint_is_whole(tmp_path, io, fmt):
    """From the second save on (safetensors: the third, as the second writes again the unchanged
    tensors that shared a file with changed ones) each checkpoint costs at most 1.25x the changed
    bytes (plus metadata) of new files; an element changed through a NumPy view (no version bump)
    is saved; every checkpoint loads bitwise-equal to the state it saved and verifies."""
    root = str(tmp_path / "ckpt")
    state, saved = frozen_state(), {}
    changed = HOT_BYTES
    with AsyncCheckpointer(root, CheckpointConfig(incremental=True, io=io, format=fmt, io_workers=2)) as ckpt:
        for step in range(4):
            train(state, step)
            if step == 3:
                state["encoder"]["layer1"].numpy()[12345] += 1.0  # behind torch's back
            ckpt.schedule_save(state, step=step)
            saved[step] = clone_state(state)
            [report] = ckpt.finalize(blocking=True)
            assert report.bytes >= FROZEN_BYTES + HOT_BYTES
            if step == 2 or (step == 1 and fmt == "torch_save"):
                assert report.bytes_written <= 1.25 * changed + 64 * 1024, (step, report)
                older = [step_path(root, s) for s in range(step)]
                assert new_bytes(step_path(root, step), older) <= 1.25 * changed + 64 * 1024
            elif step != 1:  # the first save, and the one after layer1 changed: layer1 is written again
                assert report.bytes_written >= FROZEN_BYTES // 3, (step, report)
    for step, expected in saved.items():
        path = step_path(root, step)
        assert_state_equal(read_back(path, expected, fmt), expected)
        assert verify_checkpoint(path) == [], step


def test_a_file_kept_only_for_a_small_part_is_written_again_and_safetensors_readers_see_new_values(tmp_path):
    """One data file holding a small frozen tensor and a large changing one: the next save does not
    keep the mostly stale file alive, it writes the frozen tensor again, apart, and the save after
    reuses that file whole. In safetensors format DCP's HuggingFaceStorageReader (it indexes every
    file's header, not `.metadata`) reads each checkpoint's own values."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    root = str(tmp_path / "ckpt")
    state = {"frozen": torch.randn(MiB // 4), "hot": torch.zeros(4 * MiB // 4)}
    written = []
    with AsyncCheckpointer(root, CheckpointConfig(incremental=True, io_workers=1, format="safetensors")) as ckpt:
        for step in range(3):
            state["hot"].add_(1.0)
            ckpt.schedule_save(state, step=step)
            written.append(ckpt.finalize(blocking=True)[0].bytes_written)
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            dcp.load(target, storage_reader=HuggingFaceStorageReader(step_path(root, step)), no_dist=True)
            assert_state_equal(target, state)
    assert written[1] >= 5 * MiB and written[2] < 4.5 * MiB, written  # rewritten apart, then reused


def test_keep_last_and_cleanup_leave_the_newest_whole(tmp_path):
    """Retention deletes the checkpoints whose files the newest one links: it still loads and
    verifies, and after `cleanup(root)` too."""
    root = str(tmp_path / "ckpt")
    state = frozen_state()
    with AsyncCheckpointer(root, CheckpointConfig(incremental=True, keep_last=1)) as ckpt:
        for step in range(3):
            train(state, step)
            ckpt.schedule_save(state, step=step)
            ckpt.finalize(blocking=True)
        assert ckpt.wait_tidy()
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000002"]
    cleanup(root)
    newest = step_path(root, 2)
    assert all(os.stat(os.path.join(newest, n)).st_nlink == 1 for n in os.listdir(newest))
    assert_state_equal(read_back(newest, state, "torch_save"), state)
    assert verify_checkpoint(newest) == []


def test_a_resumed_run_continues_incrementally(tmp_path, caplog):
    """load_latest reads the digests back from the loaded checkpoint's sidecar: the resumed run's
    first save writes only what changed since it."""
    root = str(tmp_path / "ckpt")
    state = frozen_state()
    config = CheckpointConfig(incremental=True)
    with AsyncCheckpointer(root, config) as ckpt:
        train(state, 0)
        ckpt.schedule_save(state, step=0)
        ckpt.finalize(blocking=True)
    resumed = zeros_like_state(state)
    with AsyncCheckpointer(root, config) as ckpt:
        assert ckpt.load_latest(resumed) == 0
        assert_state_equal(resumed, state)
        train(resumed, 1)
        ckpt.schedule_save(resumed, step=1)
        [report] = ckpt.finalize(blocking=True)
    assert report.bytes_written <= 1.25 * HOT_BYTES + 64 * 1024, report
    assert_state_equal(read_back(step_path(root, 1), resumed, "torch_save"), resumed)

    with AsyncCheckpointer(str(tmp_path / "elsewhere"), config) as ckpt, caplog.at_level(logging.INFO, "asyncckpt"):
        ckpt.schedule_save(resumed, step=2)  # a new root: nothing to continue from
        [report] = ckpt.finalize(blocking=True)
    assert report.bytes_written == report.bytes
    assert "is a full save: no committed checkpoint" in caplog.text


def test_re_saving_the_same_directory_keeps_unchanged_files_in_place(tmp_path):
    """A save into the directory of the last one (Lightning's last.ckpt) writes only what changed;
    once tidied, the directory holds just the files its `.metadata` names, and loads whole."""
    path = str(tmp_path / "last.ckpt")
    state = frozen_state()
    with AsyncCheckpointer(config=CheckpointConfig(incremental=True)) as ckpt:
        for step in range(2):
            train(state, step)
            ckpt.schedule_save(state, checkpoint_dir=path)
            [report] = ckpt.finalize(blocking=True)
        assert ckpt.wait_tidy()
    assert report.bytes_written <= 1.25 * HOT_BYTES + 64 * 1024, report
    named = {info.relative_path for info in dcp.FileSystemReader(path).read_metadata().storage_data.values()}
    assert {n for n in os.listdir(path) if not n.startswith(".")} == named
    assert_state_equal(read_back(path, state, "torch_save"), state)
    assert verify_checkpoint(path) == []


def test_a_base_saved_again_by_someone_else_is_not_reused(tmp_path, caplog):
    """The directory of the last save is removed and saved again by someone else (here stock
    `dcp.save`, under the same file names): the next save, into another directory, links none of
    its files (they hold other bytes now) but writes the state whole, and loads and verifies."""
    state = frozen_state()
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    with AsyncCheckpointer(config=CheckpointConfig(incremental=True, io_workers=1)) as ckpt:
        ckpt.schedule_save(state, checkpoint_dir=first)
        ckpt.finalize(blocking=True)
        other = frozen_state()
        for tensor in other["encoder"].values():
            tensor.mul_(-1.0)
        shutil.rmtree(first)
        dcp.save(other, checkpoint_id=first, no_dist=True)
        with caplog.at_level(logging.INFO, "asyncckpt"):
            ckpt.schedule_save(state, checkpoint_dir=second)
            [report] = ckpt.finalize(blocking=True)
    assert_state_equal(read_back(second, state, "torch_save"), state)
    assert verify_checkpoint(second) == []
    assert report.bytes_written >= FROZEN_BYTES, report
    assert "saved again by someone else" in caplog.text


def test_a_save_into_a_torn_directory_never_writes_through_a_link(tmp_path):
    """A crashed incremental save leaves hard links to a committed checkpoint's files in a torn
    directory; a later save into that directory replaces the names, and the committed files'
    bytes never change."""
    root = str(tmp_path / "ckpt")
    state = frozen_state()
    with AsyncCheckpointer(root, CheckpointConfig(incremental=True)) as ckpt:
        ckpt.schedule_save(state, step=0)
        ckpt.finalize(blocking=True)
    committed = step_path(root, 0)
    digests = {n: hashlib.sha256(open(os.path.join(committed, n), "rb").read()).hexdigest() for n in os.listdir(committed)}
    torn = step_path(root, 1)
    os.makedirs(torn)
    for name in os.listdir(committed):
        if name.endswith(".distcp"):
            os.link(os.path.join(committed, name), os.path.join(torn, name))
    for tensor in state["encoder"].values():
        tensor.mul_(-1.0)  # every tensor changed: the save writes every file again
    with AsyncCheckpointer(root, CheckpointConfig()) as ckpt:  # a full save, the same file names
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
    assert {n: hashlib.sha256(open(os.path.join(committed, n), "rb").read()).hexdigest() for n in os.listdir(committed)} == digests
    assert verify_checkpoint(committed) == [] and verify_checkpoint(torn) == []
    assert_state_equal(read_back(torn, state, "torch_save"), state)


@pytest.mark.all_backends
def test_object_storage_copies_unchanged_files_server_side(ckpt_root, ckpt_backend):
    """On an object store unchanged files are server-side copies (nothing uploaded from here):
    with keep_last=1 the newest checkpoint, all that is left, loads whole and verifies."""
    if ckpt_backend == "local":
        pytest.skip("local roots are covered above")
    state = frozen_state()
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(incremental=True, keep_last=1)) as ckpt:
        for step in range(2):
            train(state, step)
            ckpt.schedule_save(state, step=step)
            [report] = ckpt.finalize(blocking=True)
        assert ckpt.wait_tidy()
    assert report.bytes_written <= 1.25 * HOT_BYTES + 64 * 1024, report
    newest = step_path(ckpt_root, 1)
    assert [c.path for c in list_checkpoints(ckpt_root)] == [newest]
    target = zeros_like_state(state)
    load(target, newest)
    assert_state_equal(target, state)
    assert verify_checkpoint(newest) == []


def test_incremental_needs_the_whole_state_staged():
    with pytest.raises(ValueError, match="incremental needs the whole state staged"):
        CheckpointConfig(incremental=True, staging_budget_bytes=64 * MiB)


def _two_ranks_save_incrementally(rank: int, world_size: int, root: str) -> None:
    generator = torch.Generator().manual_seed(rank)
    state = {f"frozen{rank}": torch.randn(2 * MiB // 4, generator=generator), f"hot{rank}": torch.zeros(MiB // 16)}
    with AsyncCheckpointer(root, CheckpointConfig(incremental=True)) as ckpt:
        for step in range(2):
            state[f"hot{rank}"].add_(1.0)
            ckpt.schedule_save(state, step=step)
            [report] = ckpt.finalize(blocking=True)
    hot_bytes = world_size * MiB // 4
    assert report.bytes_written <= 1.25 * hot_bytes + 64 * 1024, report  # every rank's, after the first save
    target = zeros_like_state(state)
    dcp.load(target, checkpoint_id=step_path(root, 1))
    assert_state_equal(target, state)
    assert verify_checkpoint(step_path(root, 1)) == []


def test_each_rank_writes_only_its_own_changes(tmp_path):
    from multirank import run_ranks
    run_ranks(_two_ranks_save_incrementally, 2, str(tmp_path / "ckpt"))
