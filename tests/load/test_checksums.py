"""Checksums: a CRC32C per item, written by the writers into .checksums.json, checked by
`verify_checkpoint` and `load(..., verify=True)`."""

from __future__ import annotations

import json
import logging
import os
import zlib

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, PartialLoadError, load
from asyncckpt.loading.load import PARTLY_LOADED, verify_checkpoint
from conftest import flip_byte, assert_state_equal, clone_state, step_path, zeros_like_state



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

    # without verify=True the damage is still caught: each item's CRC32C is checked as it is read
    with pytest.raises(CheckpointError, match="model.emb.*checksum mismatch"):
        load(zeros_like_state(expected), path)


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


def test_plain_load_detects_a_flipped_byte_without_verify(tmp_path):
    """torch's own CRC is off in the worker; ours is checked as each item is read."""
    import json

    from asyncckpt import AsyncCheckpointer, CheckpointError, load

    root = str(tmp_path / "ckpt")
    with AsyncCheckpointer(root) as ckpt:
        ckpt.schedule_save({"w": torch.arange(4096.0)}, step=1)
    step_dir = os.path.join(root, "step_00000001")
    with open(os.path.join(step_dir, ".checksums.json")) as f:
        [entry] = [e for e in json.load(f)["items"] if e["fqn"] == "w"]
    with open(os.path.join(step_dir, entry["file"]), "r+b") as f:
        f.seek(entry["start"] + entry["length"] - 100)  # inside the tensor's data record
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load({"w": torch.zeros(4096)}, step_dir)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "asyncckpt" and r.levelno == logging.WARNING]


def test_load_latest_skips_damaged_checkpoints_and_leaves_the_state_wholly_the_one_it_loads(tmp_path, caplog):
    """A damaged newest checkpoint no longer stops every restart: load_latest warns and resumes
    from the newest one that loads, even after a load that failed half-way into the state."""
    root = str(tmp_path / "ckpt")
    states = {step: {"w": torch.full((4096,), float(step)), "b": torch.full((8,), float(step)), "step": step}
              for step in range(3)}
    target = {"w": torch.full((4096,), -1.0), "b": torch.full((8,), -1.0), "step": -1}
    with AsyncCheckpointer(root) as ckpt:
        for step, state in states.items():
            ckpt.schedule_save(state, step=step)
        ckpt.finalize(blocking=True)
        # a state the checkpoints do not fit is not damage: the newest's error, nothing skipped
        with caplog.at_level(logging.WARNING, logger="asyncckpt"), pytest.raises(CheckpointError, match="extra"):
            ckpt.load_latest({**target, "extra": torch.zeros(2)})
        assert not warnings_of(caplog)

        record = checksum_record(step_path(root, 2), "w")  # found once read into the state: a partial load
        flip_byte(os.path.join(step_path(root, 2), record["file"]), record["start"] + record["length"] - 100)
        with open(os.path.join(step_path(root, 1), ".checksums.json"), "w") as f:
            f.write("{")
        with pytest.raises(PartialLoadError, match="step_00000002.*checksum mismatch"):
            ckpt.load_latest(target, strict=True)  # as before: the newest, or an error

        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            assert ckpt.load_latest(target) == 0
        assert_state_equal(target, states[0])  # nothing left of the partial load of step 2
        report = ckpt.resume_report
        assert (report.step, report.path) == (0, step_path(root, 0))
        assert [(s.step, s.path) for s in report.skipped] == [(2, step_path(root, 2)), (1, step_path(root, 1))]
        first, second = warnings_of(caplog)
        assert step_path(root, 2) in first and "checksum mismatch" in first, first
        assert step_path(root, 1) in second and ".checksums.json" in second and "checksums=False" in second, second

        record = checksum_record(step_path(root, 0), "b")
        flip_byte(os.path.join(step_path(root, 0), record["file"]), record["start"] + record["length"] - 10)
        with pytest.raises(PartialLoadError) as raised:  # none loads: each named, and the state's condition
            ckpt.load_latest(target)
        message = str(raised.value)
        assert all(step_path(root, step) in message for step in range(3)) and message.endswith(PARTLY_LOADED), message


def test_sidecars_of_the_older_crc32_algorithm_still_verify(ckpt_root):
    """Checkpoints written before CRC32C became the default name "crc32" in their sidecar."""
    path, expected = saved_checkpoint(ckpt_root)
    sidecar = os.path.join(path, ".checksums.json")
    doc = json.load(open(sidecar))
    assert doc["algorithm"] == "crc32c"
    for record in doc["items"]:
        with open(os.path.join(path, record["file"]), "rb") as f:
            f.seek(record["start"])
            record["crc32"] = zlib.crc32(f.read(record["length"]))
    doc["algorithm"] = "crc32"
    del doc["save_id"]
    with open(sidecar, "w") as f:
        json.dump(doc, f)
    assert verify_checkpoint(path) == []
    target = zeros_like_state(expected)
    load(target, path, verify=True)
    assert_state_equal(target, expected)
    record = checksum_record(path, "model.w")
    flip_byte(os.path.join(path, record["file"]), record["start"] + record["length"] // 2)
    assert [p for p in verify_checkpoint(path) if "model.w" in p and "checksum mismatch" in p]


def test_a_sidecar_from_another_save_of_the_step_is_not_trusted(ckpt_root):
    """A re-save interrupted between its sidecar and its .metadata leaves the old checkpoint with
    the new save's sidecar: loading ignores it (loads unchecked), verify says so."""
    path, expected = saved_checkpoint(ckpt_root)
    sidecar = os.path.join(path, ".checksums.json")
    doc = json.load(open(sidecar))
    doc["save_id"] = "0" * 32
    for record in doc["items"]:
        record["crc32"] ^= 1  # would all mismatch if they were checked against this checkpoint
    with open(sidecar, "w") as f:
        json.dump(doc, f)
    [problem] = verify_checkpoint(path)
    assert "belongs to another save of this step" in problem
    target = zeros_like_state(expected)
    load(target, path)
    assert_state_equal(target, expected)


def test_resave_without_checksums_leaves_no_stale_sidecar(ckpt_root):
    path, expected = saved_checkpoint(ckpt_root)
    state = clone_state(expected)
    state["model"]["w"].add_(1.0)
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(checksums=False)) as ckpt:
        ckpt.schedule_save(state, step=5)  # replaces the committed step 5
        ckpt.finalize(blocking=True)
    assert not os.path.exists(os.path.join(path, ".checksums.json"))
    target = zeros_like_state(state)
    load(target, path)
    assert_state_equal(target, state)


def _damage(how: str, raw: bytes) -> bytes:
    doc = json.loads(raw)
    if how == "truncated JSON":
        return raw[: len(raw) // 2]
    if how == "not UTF-8":
        return b"\xff\xfe" + raw
    if how == "not an object":
        return b"[1, 2, 3]"
    if how == "no items":
        del doc["items"]
    elif how == "an item without its checksum":
        del doc["items"][0]["crc32"]
    elif how == "a length that is a string":
        doc["items"][0]["length"] = "many"
    elif how == "offsets that are a number":
        doc["items"][0]["offset"] = 5
    elif how == "an item that is a list":
        doc["items"][0] = [1, 2]
    return json.dumps(doc).encode()


DAMAGES = ["truncated JSON", "not UTF-8", "not an object", "no items", "an item without its checksum",
           "a length that is a string", "offsets that are a number", "an item that is a list"]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_sidecar_is_a_checkpoint_error_naming_it(tmp_path, capsys, how):
    """verify_checkpoint, load (with or without verify) and the CLI's verify all refuse it by name."""
    from asyncckpt.cli import commands as cli

    path, expected = saved_checkpoint(str(tmp_path / "ckpt"))
    sidecar = os.path.join(path, ".checksums.json")
    with open(sidecar, "rb") as f:
        raw = f.read()
    with open(sidecar, "wb") as f:
        f.write(_damage(how, raw))
    with pytest.raises(CheckpointError, match=r"\.checksums\.json"):
        verify_checkpoint(path)
    for verify in (True, False):
        with pytest.raises(CheckpointError, match=r"\.checksums\.json"):
            load(zeros_like_state(expected), path, verify=verify)
    with pytest.raises(CheckpointError, match=r"\.checksums\.json.*checksums=False"):
        load(zeros_like_state(expected), path)
    target = zeros_like_state(expected)
    load(target, path, checksums=False)  # the data is intact: it loads unchecked
    assert_state_equal(target, expected)
    capsys.readouterr()
    assert cli.main(["verify", "-q", path]) == cli.EXIT_UNREADABLE
    out, err = capsys.readouterr()
    assert ".checksums.json" in err and "error" in err, (out, err)


def test_crc32c_is_the_standard_checksum_of_any_buffer_and_continues_across_pieces():
    """formats.crc32c (libcrc32c through ctypes, the GIL released) gives CRC32C's check value and
    the same checksum for bytes, a tensor's memory and a run of pieces continued from each other."""
    from asyncckpt.formats import crc32c

    assert crc32c(b"123456789") == 0xE3069283  # RFC 3720's check value
    assert crc32c(b"") == 0 and crc32c(b"", 7) == 7
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    raw = data.numpy().tobytes()
    whole = crc32c(raw)
    crc = 0
    for start in range(0, len(raw), 700_001):
        crc = crc32c(memoryview(data.numpy())[start:start + 700_001], crc)
    assert crc == whole == crc32c(bytearray(raw))


def test_a_ctrl_c_in_an_older_candidate_after_a_partial_load_says_partly_loaded(ckpt_root):
    """load_latest: the newest checkpoint failed half-way into the state (PartialLoadError, the
    next older one is tried); a Ctrl-C in that one's load, before it changed anything, must still
    say the state is PARTLY LOADED (the first attempt left it so), not "nothing was changed"."""
    root = str(ckpt_root)

    class SecondCallInterrupted:
        def __init__(self):
            self.w, self.calls = torch.full((4096,), -1.0), 0

        def state_dict(self):
            self.calls += 1
            if self.calls == 2:  # the older candidate's load
                raise KeyboardInterrupt
            return {"w": self.w}

        def load_state_dict(self, state):
            pass

    with AsyncCheckpointer(root) as ckpt:
        for step in range(2):
            ckpt.schedule_save({"m": {"w": torch.full((4096,), float(step))}}, step=step)
        ckpt.finalize(blocking=True)
        record = checksum_record(step_path(root, 1), "m.w")
        flip_byte(os.path.join(step_path(root, 1), record["file"]), record["start"] + record["length"] - 100)
        with pytest.raises(KeyboardInterrupt, match="step_00000000.*PARTLY LOADED"):
            ckpt.load_latest({"m": SecondCallInterrupted()})
