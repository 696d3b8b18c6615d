"""What the Lightning plugin does with checkpoint files ModelCheckpoint manages: removal during
and after a save (un-committed at once, deleted in the background), replacing last.ckpt, and
incremental saves that link what did not change."""

from __future__ import annotations

import os
import threading

import psutil
import pytest
import torch

L = pytest.importorskip("lightning", reason="Lightning is not installed (pip install lightning; CI installs it)")


from asyncckpt import CheckpointConfig, CheckpointError, verify_checkpoint  # noqa: E402
from asyncckpt.layout import LOCK_FILE
from asyncckpt.doors.lightning import AsyncCheckpointIO  # noqa: E402
from lightning_fits import MiB, _clone, _workers, assert_exactly_equal  # noqa: E402


def test_remove_during_an_in_flight_save_waits_and_it_never_reappears(tmp_path):
    state = {"w": torch.randn(MiB // 4)}
    path = str(tmp_path / "epoch=0-step=2.ckpt")
    plugin = AsyncCheckpointIO(max_in_flight=1)
    try:
        plugin.save_checkpoint(state, str(tmp_path / "warm.ckpt"))
        plugin.teardown()
        plugin.save_checkpoint(state, path)  # staged; its writes are still to come
        assert plugin._saves.saver.in_flight_dir == path
        [worker] = _workers(plugin)
        worker.suspend()  # the save stays in flight until the worker goes on
        resume = threading.Timer(0.5, worker.resume)
        resume.start()
        try:
            plugin.remove_checkpoint(path)
        finally:
            resume.join()
            worker.resume()
        assert not os.path.exists(os.path.join(path, ".metadata"))  # un-committed on return
        plugin.teardown()  # nothing left in flight, nothing failed, the removal ended
        assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "warm.ckpt"]
    finally:
        plugin.close()


def test_remove_returns_uncommitted_and_the_files_go_before_the_path_is_used_again(tmp_path, monkeypatch):
    """Deleting a checkpoint's files (0.1 s for 86 MB here, longer on a store) is not the
    trainer's wait: remove_checkpoint returns once `.metadata` is gone, while the deletion is
    held up here. A save to that path waits for the deletion (its new files are never deleted
    with the old ones); teardown waits for every deletion; one that fails reaches the next call,
    before a save into that path writes anything."""
    from asyncckpt.storage import LocalStorage
    remove_tree, gate = LocalStorage.remove_tree, threading.Event()
    monkeypatch.setattr(LocalStorage, "remove_tree", lambda self, path: gate.wait(60) and remove_tree(self, path))
    old, new = {"w": torch.zeros(MiB // 4)}, {"w": torch.ones(MiB // 4)}
    path = str(tmp_path / "epoch=0-step=2.ckpt")
    plugin = AsyncCheckpointIO()
    try:
        plugin.save_checkpoint(old, path)
        plugin.teardown()
        plugin.remove_checkpoint(path)  # returns with the deletion held up
        assert os.path.isdir(path) and not os.path.exists(os.path.join(path, ".metadata"))
        saved = threading.Event()
        threading.Thread(target=lambda: (plugin.save_checkpoint(new, path), saved.set()), daemon=True).start()
        assert not saved.wait(0.5), "a save to a path being deleted did not wait for the deletion"
        gate.set()
        assert saved.wait(60)
        plugin.teardown()
        assert_exactly_equal(plugin.load_checkpoint(path), new)

        gate.clear()
        plugin.remove_checkpoint(path)
        assert os.path.isdir(path)
        gate.set()
        plugin.teardown()
        assert os.listdir(tmp_path) == [LOCK_FILE]

        monkeypatch.setattr(LocalStorage, "remove_tree", lambda self, path: (_ for _ in ()).throw(PermissionError(13, "denied")))
        plugin.save_checkpoint(old, path)
        plugin.remove_checkpoint(path)
        with pytest.raises(CheckpointError, match="removing .*epoch=0-step=2.ckpt failed.*denied"):
            plugin.save_checkpoint(new, path)  # said before anything is written into the half-deleted path
        plugin.teardown()  # said once
        assert not os.path.exists(os.path.join(path, ".metadata"))
    finally:
        gate.set()
        plugin.close()


def test_a_failed_replace_of_last_ckpt_keeps_the_old_one(tmp_path):
    state = {"state_dict": {"w": torch.randn(2 * MiB // 4), "v": torch.randn(2 * MiB // 4)}}
    path = str(tmp_path / "last.ckpt")
    plugin = AsyncCheckpointIO(CheckpointConfig(io_workers=1, timeout_s=60.0), max_in_flight=1)
    try:
        plugin.save_checkpoint(state, path)
        plugin.teardown()
        expected = _clone(state)
        state["state_dict"]["w"].add_(1.0)
        [worker] = _workers(plugin)
        limits = worker.rlimit(psutil.RLIMIT_FSIZE)
        worker.rlimit(psutil.RLIMIT_FSIZE, (MiB, limits[1]))  # the re-save's data file fails with EFBIG
        try:
            with pytest.raises(CheckpointError, match="EFBIG|File too large"):
                plugin.save_checkpoint(state, path)
                plugin.teardown()
        finally:
            worker.rlimit(psutil.RLIMIT_FSIZE, limits)
        assert_exactly_equal(plugin.load_checkpoint(path), expected)
        assert verify_checkpoint(path) == []
        plugin.save_checkpoint(state, path)  # a successful replace
        assert_exactly_equal(plugin.load_checkpoint(path), _clone(state))
        assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "last.ckpt"]
    finally:
        plugin.close()


def test_incremental_saves_in_lightnings_pattern_reuse_the_frozen_weights(tmp_path):
    """ModelCheckpoint's event (save the new top-k, save last.ckpt, remove the previous best) with
    incremental=True and a mostly frozen model: only the first save is full, every other save
    writes at most the trained tensors (last.ckpt is re-saved in place, continuing from itself),
    and every kept checkpoint loads as saved."""
    reports = []
    plugin = AsyncCheckpointIO(CheckpointConfig(incremental=True, on_commit=reports.append))
    frozen = {f"encoder.{i}": torch.randn(1 << 18) for i in range(4)}  # 4 MiB never trained
    head = torch.zeros(1 << 16)  # 256 KiB trained
    try:
        previous = None
        for step in range(1, 4):
            head.add_(1.0)
            checkpoint = {"state_dict": {**frozen, "head": head}, "global_step": step}
            best = str(tmp_path / f"epoch=0-step={step}.ckpt")
            plugin.save_checkpoint(checkpoint, best)
            plugin.save_checkpoint(checkpoint, str(tmp_path / "last.ckpt"))
            if previous is not None:
                plugin.remove_checkpoint(previous)
            previous = best
        plugin.teardown()
        for path in (best, str(tmp_path / "last.ckpt")):
            assert_exactly_equal(plugin.load_checkpoint(path), checkpoint)
            assert verify_checkpoint(path) == []
    finally:
        plugin.close()
    written = [r.bytes_written for r in reports]
    assert len(written) == 6 and written[0] >= 4 << 20, written  # the first save: everything
    assert all(n < (1 << 18) + (64 << 10) for n in written[1:]), written  # then the trained 256 KiB at most
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=3.ckpt", "last.ckpt"]


def test_incremental_last_ckpt_links_the_top_k_save_of_its_event(tmp_path):
    """Every tensor trained between events: last.ckpt, saved right after the event's top-k
    checkpoint with the same values, writes none of them again (its files are the top-k save's,
    hard-linked) while it replaces its own previous save; removing the previous best returns while
    the event's saves are still in flight (the worker is stopped here); removing the top-k
    checkpoint last.ckpt links leaves last.ckpt whole."""
    reports = []
    plugin = AsyncCheckpointIO(CheckpointConfig(incremental=True, io_workers=1, on_commit=reports.append))
    weights = {f"layer{i}": torch.randn(1 << 18) for i in range(4)}  # 4 MiB, all trained
    try:
        [worker] = _workers(plugin)
        previous = None
        for step in range(1, 4):
            for tensor in weights.values():
                tensor.add_(1.0)
            checkpoint = {"state_dict": dict(weights), "global_step": step}
            best = str(tmp_path / f"epoch=0-step={step}.ckpt")
            plugin.save_checkpoint(checkpoint, best)
            plugin.save_checkpoint(checkpoint, str(tmp_path / "last.ckpt"))
            if previous is not None:
                worker.suspend()  # the event's saves stay in flight
                try:
                    removed = threading.Event()
                    threading.Thread(target=lambda: (plugin.remove_checkpoint(previous), removed.set()), daemon=True).start()
                    assert removed.wait(60), "removing the previous best waited for the event's saves"
                finally:
                    worker.resume()
            previous = best
        plugin.teardown()
        last = str(tmp_path / "last.ckpt")
        best_inodes = {os.stat(os.path.join(best, n)).st_ino for n in os.listdir(best)}
        assert {os.stat(os.path.join(last, n)).st_ino for n in os.listdir(last) if n.endswith(".distcp")} & best_inodes
        plugin.remove_checkpoint(best)
        assert_exactly_equal(plugin.load_checkpoint(last), checkpoint)
        assert verify_checkpoint(last) == []
    finally:
        plugin.close()
    written = [r.bytes_written for r in reports]
    assert len(written) == 6 and all(n >= 4 << 20 for n in written[0::2]), written  # top-k: every tensor
    assert all(n < 64 << 10 for n in written[1::2]), written  # last.ckpt: its objects only
    assert os.listdir(tmp_path) == ["last.ckpt"]


