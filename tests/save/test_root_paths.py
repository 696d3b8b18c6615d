"""Checkpoint roots reached through a symlink work; a step directory that is a symlink is refused."""

from __future__ import annotations

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointError


def test_root_may_be_a_symlink_but_a_step_directory_may_not(tmp_path):
    real = tmp_path / "big_disk"
    real.mkdir()
    root = tmp_path / "ckpt"
    root.symlink_to(real)
    outside = tmp_path / "outside"
    outside.mkdir()
    (real / "step_00000002").symlink_to(outside)
    with AsyncCheckpointer(str(root)) as ckpt:
        ckpt.schedule_save({"w": torch.arange(4.0)}, step=1)
        ckpt.finalize(blocking=True)
        with pytest.raises(CheckpointError, match="symlink"):
            ckpt.schedule_save({"w": torch.arange(4.0)}, step=2)
        target = {"w": torch.zeros(4)}
        assert ckpt.load_latest(target) == 1  # found through the symlinked root
    assert torch.equal(target["w"], torch.arange(4.0))
    assert list(outside.iterdir()) == []
