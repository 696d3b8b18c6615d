"""The commit path: the verdict says what is on disk, a re-save never leaves the committed
checkpoint without its own checksums, and retention runs after the verdict, off the collective
path, without ever deleting a directory a save is writing into.

Failures are real failures of a storage backend installed for the trainer's side (a subclass
of the real backend whose chosen call fails or waits on an event); the worker writes as usual."""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, load, verify_checkpoint
from asyncckpt.cli import commands as cli
from asyncckpt import storage as storage_module
from asyncckpt.layout import list_checkpoints, read_latest_marker
from asyncckpt.storage import LocalStorage, is_remote
from conftest import assert_state_equal, clone_state, zeros_like_state


def step_path(root: str, step: int) -> str:
    return f"{root}/step_{step:08d}"


def install(monkeypatch, root: str, backend) -> None:
    """Make `backend` the storage every trainer-side call for `root` goes through."""
    monkeypatch.setitem(storage_module._backends, "msc" if is_remote(root) else "local", backend)


def backend_class(root: str) -> type:
    if is_remote(root):
        from asyncckpt.storage.msc import MscStorage

        return MscStorage
    return LocalStorage


def state_of(value: float) -> dict:
    return {"w": torch.full((1000,), value), "b": torch.arange(10.0) + value, "meta": {"v": value}}


def committed_ok(path: str, expected: dict, capsys) -> None:
    """Loads with verification, and the CLI's verify checks every item against a checksum."""
    assert verify_checkpoint(path) == []
    target = zeros_like_state(expected)
    load(target, path, verify=True)
    assert_state_equal(target, expected)
    capsys.readouterr()
    assert cli.main(["verify", "-q", path]) == 0
    out = capsys.readouterr().out
    assert f"OK, {len(list(_items(expected)))} items" in out and "without a checksum" not in out, out


def _items(state: dict, prefix: str = ""):
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _items(value, f"{prefix}{key}.")
        else:
            yield prefix + key


# 1. the verdict matches what is on disk ---------------------------------------------------------
class SyncFailsAfterCommit(LocalStorage):
    """fsync of a step directory fails once `.metadata` is in it (as a real EIO would)."""

    def sync_dir(self, path: str) -> None:
        if os.path.basename(path).startswith("step_") and os.path.exists(os.path.join(path, ".metadata")):
            raise OSError(errno.EIO, "directory fsync failed", path)
        super().sync_dir(path)


def test_directory_fsync_failing_after_the_rename_reports_the_save_committed(ckpt_root, monkeypatch, caplog, capsys):
    install(monkeypatch, ckpt_root, SyncFailsAfterCommit())
    state = state_of(1.0)
    with caplog.at_level(logging.ERROR, logger="asyncckpt"):
        with AsyncCheckpointer(ckpt_root) as ckpt:
            ckpt.schedule_save(state, step=1)
            [report] = ckpt.finalize(blocking=True)  # .metadata is in place: the save is committed
    assert report.step == 1
    assert os.path.exists(os.path.join(step_path(ckpt_root, 1), ".metadata"))
    assert read_latest_marker(ckpt_root) == "step_00000001"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("committed" in m and "durable" in m and "directory fsync failed" in m for m in errors), errors
    committed_ok(step_path(ckpt_root, 1), state, capsys)


class MetadataPutLosesItsAnswer:
    """`.metadata` is stored, then the call fails (an object store's reply lost after the PUT)."""

    def write_atomic(self, path: str, data: bytes, fsync: bool = True) -> None:
        super().write_atomic(path, data, fsync)
        if path.endswith("/.metadata"):
            raise OSError(errno.ETIMEDOUT, "no reply to the PUT", path)


@pytest.mark.parametrize("ckpt_backend", ["local", "s3"])
def test_metadata_written_but_its_call_failing_reports_the_save_committed(ckpt_root, monkeypatch, capsys):
    install(monkeypatch, ckpt_root, type("Lossy", (MetadataPutLosesItsAnswer, backend_class(ckpt_root)), {})())
    state = state_of(2.0)
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.schedule_save(state, step=1)
        assert [r.step for r in ckpt.finalize(blocking=True)] == [1]
    assert [c.step for c in list_checkpoints(ckpt_root) if c.committed] == [1]
    committed_ok(step_path(ckpt_root, 1), state, capsys)


class Recording(LocalStorage):
    """Every directory sync and every atomic publish, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def sync_dir(self, path: str) -> None:
        self.events.append(("sync", os.path.normpath(path)))
        super().sync_dir(path)

    def write_atomic(self, path: str, data: bytes, fsync: bool = True) -> None:
        self.events.append(("publish", os.path.basename(path)))
        super().write_atomic(path, data, fsync)


def test_root_is_synced_when_a_step_directory_is_created_and_when_it_is_committed(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    recording = Recording()
    install(monkeypatch, root, recording)
    with AsyncCheckpointer(root) as ckpt:
        ckpt.schedule_save(state_of(1.0), step=1)
        assert ("sync", root) in recording.events  # the new step directory's entry is durable
        assert ("sync", str(tmp_path)) in recording.events  # and the new root's
        recording.events.clear()
        ckpt.finalize(blocking=True)
    events = recording.events
    published, latest = events.index(("publish", ".metadata")), events.index(("publish", "latest"))
    assert ("sync", root) in events[published:latest], events  # committed before `latest` moves


# 2. a re-save never strips the committed checkpoint of its checksums ---------------------------
class MetadataPublishFails:
    """While `failing`, publishing `.metadata` fails before anything is written."""

    failing = False

    def write_atomic(self, path: str, data: bytes, fsync: bool = True) -> None:
        if self.failing and path.endswith("/.metadata"):
            raise OSError(errno.EIO, "cannot publish", path)
        super().write_atomic(path, data, fsync)


def sidecars(storage, path: str) -> list[str]:
    return [n for n in storage.list_dir(path) if n.startswith(".checksums")]


@pytest.mark.parametrize("ckpt_backend", ["local", "s3"])
def test_failed_resave_after_its_files_are_written_keeps_the_old_checksums(ckpt_root, monkeypatch, capsys):
    storage = type("Failing", (MetadataPublishFails, backend_class(ckpt_root)), {})()
    install(monkeypatch, ckpt_root, storage)
    step_dir = step_path(ckpt_root, 2)
    old, new, newer = state_of(1.0), state_of(2.0), state_of(3.0)
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(io_workers=2)) as ckpt:
        ckpt.schedule_save(old, step=2)
        ckpt.finalize(blocking=True)
        old_names = storage.list_dir(step_dir)

        storage.failing = True  # the re-save writes every data file and its sidecar, then cannot commit
        with pytest.raises(CheckpointError, match="cannot publish"):
            ckpt.schedule_save(new, step=2)
            ckpt.finalize(blocking=True)
        storage.failing = False
        assert storage.list_dir(step_dir) == old_names  # nothing of the failed re-save is left
        committed_ok(step_dir, old, capsys)  # still verified against its own checksums

        ckpt.schedule_save(new, step=2)  # a re-save that commits replaces files and sidecar
        ckpt.finalize(blocking=True)
        ckpt.schedule_save(newer, step=2)
        ckpt.finalize(blocking=True)
    assert len(sidecars(storage, step_dir)) == 1, storage.list_dir(step_dir)
    assert not {n for n in old_names if n.startswith("__")} & set(storage.list_dir(step_dir))
    committed_ok(step_dir, newer, capsys)


# 3. retention after the verdict -----------------------------------------------------------------
class GatedDeletes(LocalStorage):
    """Deleting a checkpoint directory whose name is in `gated` waits for `release` (a slow store)."""

    def __init__(self, *gated: str) -> None:
        self.gated = set(gated)
        self.entered, self.release, self.deleted = threading.Event(), threading.Event(), threading.Event()

    def remove_tree(self, path: str) -> None:
        if os.path.basename(path) in self.gated:
            self.entered.set()
            self.release.wait(30)
            super().remove_tree(path)
            self.deleted.set()
            return
        super().remove_tree(path)


def step_names(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


def test_slow_retention_does_not_hold_up_the_commit(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    gate = GatedDeletes("step_00000001")
    install(monkeypatch, root, gate)
    expected = state_of(3.0)
    try:
        with AsyncCheckpointer(root, CheckpointConfig(keep_last=1)) as ckpt:
            for step in (1, 2):
                ckpt.schedule_save(state_of(float(step)), step=step)
                assert [r.step for r in ckpt.finalize(blocking=True)] == [step]
            assert gate.entered.wait(30)  # retention of step 1 has begun ...
            assert not gate.deleted.is_set()  # ... and is still deleting: the commit did not wait for it
            ckpt.schedule_save(expected, step=3)  # saving goes on meanwhile
            assert [r.step for r in ckpt.finalize(blocking=True)] == [3]
            gate.release.set()
    finally:
        gate.release.set()
    assert step_names(root) == ["step_00000003"]  # close() waited for retention
    assert read_latest_marker(root) == "step_00000003"
    target = zeros_like_state(expected)
    load(target, step_path(root, 3), verify=True)
    assert_state_equal(target, expected)


def test_retention_never_deletes_a_directory_a_resave_is_writing_into(tmp_path, monkeypatch, capsys):
    """Retention decided after step 3's commit would delete step 2, but a re-save of step 2 is in
    flight by the time it runs: step 2 is left alone, and the re-save commits."""
    root = str(tmp_path / "ckpt")
    gate = GatedDeletes("step_00000001")
    install(monkeypatch, root, gate)
    resaved = state_of(20.0)
    try:
        with AsyncCheckpointer(root, CheckpointConfig(keep_last=1)) as ckpt:
            for step in (1, 2, 3):  # retention after step 2 is stuck on step 1; after 3 it is queued
                ckpt.schedule_save(state_of(float(step)), step=step)
                ckpt.finalize(blocking=True)
                if step == 2:
                    assert gate.entered.wait(30)
            ckpt.schedule_save(clone_state(resaved), step=2)  # re-save of a step retention wants gone
            gate.release.set()
            assert ckpt._janitor.wait(30)  # retention has run while the re-save is in flight
            assert [r.step for r in ckpt.finalize(blocking=True)] == [2]
    finally:
        gate.release.set()
    assert step_names(root) == ["step_00000002", "step_00000003"]
    assert read_latest_marker(root) == "step_00000002"
    committed_ok(step_path(root, 2), resaved, capsys)
