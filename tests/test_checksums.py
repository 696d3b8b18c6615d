"""Checksums: a CRC32 per item, written by the writers into .checksums.json, checked by
`verify_checkpoint` and `load(..., verify=True)`."""

from __future__ import annotations

import json
import os

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, load
from asyncckpt.loading import verify_checkpoint
from conftest import assert_state_equal, clone_state, zeros_like_state


def step_path(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def saved_checkpoint(root: str, io: str = "thread") -> tuple[str, dict]:
    state = {
        "model": {"w": torch.randn(64, 64), "b": torch.randn(64), "emb": torch.randn(300, 16)},
        "meta": {"step": 5, "note": "hello"},
    }
    with AsyncCheckpointer(root, CheckpointConfig(io=io, io_workers=2)) as ckpt:
        ckpt.schedule_save(state, step=5)
        ckpt.finalize(blocking=True)
    return step_path(root, 5), clone_state(state)


def checksum_record(path: str, fqn: str) -> dict:
    doc = json.load(open(os.path.join(path, ".checksums.json")))
    [record] = [r for r in doc["items"] if r["fqn"] == fqn]
    return record


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("io", ["thread", "process"])
def test_intact_checkpoint_verifies_clean(ckpt_root, io):
    path, expected = saved_checkpoint(ckpt_root, io)
    assert verify_checkpoint(path) == []
    target = zeros_like_state(expected)
    load(target, path, verify=True)
    assert_state_equal(target, expected)


def test_flipped_byte_is_reported_with_file_and_tensor_name(ckpt_root):
    path, expected = saved_checkpoint(ckpt_root)
    record = checksum_record(path, "model.emb")
    flip_byte(os.path.join(path, record["file"]), record["start"] + record["length"] // 2)

    problems = verify_checkpoint(path)
    assert len(problems) == 1, problems
    assert record["file"] in problems[0] and "model.emb" in problems[0], problems[0]

    with pytest.raises(CheckpointError, match="model.emb"):
        load(zeros_like_state(expected), path, verify=True)

    # without verify the damage goes unnoticed (torch.save's own CRC is off in the worker):
    # the value is simply wrong, which is why verify exists
    target = zeros_like_state(expected)
    load(target, path)
    assert not torch.equal(target["model"]["emb"], expected["model"]["emb"])


def test_damaged_object_item_is_named(ckpt_root):
    path, _ = saved_checkpoint(ckpt_root)
    record = checksum_record(path, "meta.note")
    flip_byte(os.path.join(path, record["file"]), record["start"] + record["length"] - 3)
    problems = verify_checkpoint(path)
    assert len(problems) == 1 and "meta.note" in problems[0] and record["file"] in problems[0], problems


def test_truncated_file_is_reported(ckpt_root):
    path, _ = saved_checkpoint(ckpt_root)
    record = checksum_record(path, "model.w")
    data_file = os.path.join(path, record["file"])
    with open(data_file, "r+b") as f:
        f.truncate(record["start"] + 10)
    problems = verify_checkpoint(path)
    assert any("model.w" in p and record["file"] in p for p in problems), problems


def test_checksums_off_writes_no_sidecar_and_verify_says_so(ckpt_root):
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(checksums=False)) as ckpt:
        ckpt.schedule_save({"w": torch.ones(8)}, step=1)
        ckpt.finalize(blocking=True)
    path = step_path(ckpt_root, 1)
    assert not os.path.exists(os.path.join(path, ".checksums.json"))
    [problem] = verify_checkpoint(path)
    assert "checksums" in problem
