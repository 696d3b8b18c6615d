"""What a new user meets first: integral steps of any kind, a memory_dir on a disk said out loud,
memory-only saves reported as such, one line per resume, a warning before keep_last=None fills
the disk."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig
from asyncckpt.layout import as_step, list_checkpoints
from asyncckpt.save import disk_space, memory_dir
from conftest import zeros_like_state


def small_state() -> dict:
    return {"w": torch.arange(4096, dtype=torch.float32), "meta": {"name": "run"}}


def config(**kw) -> CheckpointConfig:
    return CheckpointConfig(worker_nice=None, worker_ionice=None, timeout_s=60.0, **kw)


def test_integral_steps_of_numpy_and_torch_are_taken_as_ints(tmp_path):
    assert [as_step(s) for s in (3, np.int64(4), np.uint8(5), torch.tensor(6), torch.tensor(7, dtype=torch.int32))] == \
        [3, 4, 5, 6, 7]
    for bad in (True, 1.0, np.float64(2.0), torch.tensor(2.0), -1, torch.tensor(-3), "3", None):
        with pytest.raises(ValueError, match="step must be a non-negative integer"):
            as_step(bad)
    root = str(tmp_path / "ckpt")
    metrics = str(tmp_path / "metrics.jsonl")
    with AsyncCheckpointer(root, config(metrics_path=metrics)) as ckpt:
        ckpt.schedule_save(small_state(), step=np.int64(3))
        ckpt.schedule_save(small_state(), step=torch.tensor(6))
        reports = ckpt.finalize(blocking=True)
    assert [c.step for c in list_checkpoints(root)] == [3, 6]
    assert [type(r.step) for r in reports] == [int, int]
    assert [json.loads(line)["step"] for line in open(metrics)] == [3, 6]


def fake_mounts(tmp_path, monkeypatch, disk_under: str) -> None:
    table = tmp_path / "mounts"
    table.write_text(f"/dev/sda1 / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n/dev/sdb1 {disk_under} xfs rw 0 0\n")
    monkeypatch.setattr(memory_dir, "MOUNTS", str(table))


def test_a_memory_dir_on_a_disk_is_warned_about_once_and_a_tmpfs_one_is_not(tmp_path, monkeypatch, caplog):
    on_disk = tmp_path / "on_disk"
    on_disk.mkdir()
    fake_mounts(tmp_path, monkeypatch, str(on_disk))
    assert memory_dir.filesystem_type(str(on_disk / "x")) == "xfs"
    assert memory_dir.filesystem_type("/dev/shm") == "tmpfs"
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    for _ in range(2):
        memory_dir.warn_unless_memory(str(on_disk))
    memory_dir.warn_unless_memory("/dev/shm")
    warnings = [r.getMessage() for r in caplog.records if "memory_dir" in r.getMessage()]
    assert len(warnings) == 1 and str(on_disk) in warnings[0] and "xfs" in warnings[0] and "tmpfs" in warnings[0]



def test_a_memory_only_save_reports_its_memory_file_and_a_resume_from_memory_logs_once(tmp_path, monkeypatch, caplog):
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    fake_mounts(tmp_path, monkeypatch, str(shm))  # shm on a disk: warned about, not refused
    caplog.set_level(logging.INFO, logger="asyncckpt")
    state = small_state()
    with AsyncCheckpointer(root, config(memory_tier=True, memory_dir=str(shm), memory_keep=True)) as ckpt:
        assert any("not in memory" in r.getMessage() and str(shm) in r.getMessage() for r in caplog.records)
        ckpt.schedule_save(state, step=1, memory_only=True)
        (report,) = ckpt.finalize(blocking=True)
        assert report.memory_only and os.path.isfile(report.path) and report.path.startswith(str(shm))
    lines = [r.getMessage() for r in caplog.records if "memory only" in r.getMessage()]
    assert len(lines) == 1 and "GB/s" not in lines[0] and "nothing written to disk" in lines[0], lines
    assert report.path in lines[0]

    caplog.clear()
    target = zeros_like_state(small_state())
    with AsyncCheckpointer(root, config(memory_tier=True, memory_dir=str(shm))) as ckpt:
        assert ckpt.load_latest(target) == 1
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from")]
    assert len(resumed) == 1, resumed


def test_keep_last_none_warns_once_before_the_disk_fills(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with AsyncCheckpointer(str(tmp_path / "ckpt"), config()) as ckpt:
        ckpt.schedule_save(small_state(), step=0)  # room for 10 more of these: nothing to say
        ckpt.finalize(blocking=True)
        assert ckpt._janitor.wait(30)
        assert not [r for r in caplog.records if "keep_last" in r.getMessage()]
        monkeypatch.setattr(disk_space, "SAVES_LEFT", 10**15)  # as if the disk had room for < 1e15 more saves
        for step in range(1, 4):
            ckpt.schedule_save(small_state(), step=step)
    warnings = [r.getMessage() for r in caplog.records if "keep_last" in r.getMessage()]
    assert len(warnings) == 1 and "keep_last=None keeps every checkpoint" in warnings[0], warnings
    assert "GB free" in warnings[0] and "CheckpointConfig(keep_last=N)" in warnings[0]
