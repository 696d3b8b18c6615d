"""`cleanup(root)` and retention remove only what they identified as this root's own leftovers or
old checkpoints: never a committed checkpoint, never through a symlink, never anything foreign."""

from __future__ import annotations

import os

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, cleanup, latest_checkpoint, list_checkpoints


def save_steps(root: str, steps, **config) -> None:
    ckpt = AsyncCheckpointer(root, CheckpointConfig(**config))
    for step in steps:
        ckpt.schedule_save({"w": torch.full((16,), float(step))}, step)
        ckpt.finalize(blocking=True)
    ckpt.close()


def write(path: str, data: bytes = b"x") -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def outside_checkpoint(tmp_path) -> tuple[str, dict[str, bytes]]:
    """A directory outside the root that looks like a committed checkpoint, with its contents."""
    target = str(tmp_path / "elsewhere")
    files = {".metadata": b"precious metadata", "__0_0.distcp": b"precious data", "notes.txt": b"keep me"}
    for name, data in files.items():
        write(os.path.join(target, name), data)
    return target, files


def assert_intact(target: str, files: dict[str, bytes]) -> None:
    assert sorted(os.listdir(target)) == sorted(files)
    for name, data in files.items():
        with open(os.path.join(target, name), "rb") as f:
            assert f.read() == data


def test_symlinks_in_root_survive_retention_and_cleanup(tmp_path):
    root = str(tmp_path / "root")
    target, files = outside_checkpoint(tmp_path)
    os.makedirs(root)
    os.symlink(target, os.path.join(root, "step_00000001"))  # looks committed, oldest
    os.symlink(target, os.path.join(root, "step_00000002"))

    save_steps(root, [3, 4, 5, 6], keep_last=1, io_workers=1)
    assert [c.name for c in list_checkpoints(root)] == ["step_00000006"]
    assert latest_checkpoint(root).name == "step_00000006"
    assert cleanup(root) == []

    for name in ("step_00000001", "step_00000002"):
        assert os.path.islink(os.path.join(root, name)) and os.readlink(os.path.join(root, name)) == target
    assert_intact(target, files)


def test_symlink_that_looks_torn_survives_cleanup(tmp_path):
    root = str(tmp_path / "root")
    target = str(tmp_path / "elsewhere")
    write(os.path.join(target, "__0_0.distcp"), b"someone's data")  # no .metadata: looks torn
    save_steps(root, [1])
    os.symlink(target, os.path.join(root, "step_00000002"))
    os.symlink(os.path.join(target, "__0_0.distcp"), os.path.join(root, ".latest.tmp-123"))
    assert cleanup(root) == []
    assert os.path.islink(os.path.join(root, "step_00000002")) and os.path.islink(os.path.join(root, ".latest.tmp-123"))
    assert os.listdir(target) == ["__0_0.distcp"]


def test_retention_deletes_a_link_inside_an_old_checkpoint_not_its_target(tmp_path):
    root = str(tmp_path / "root")
    target, files = outside_checkpoint(tmp_path)
    save_steps(root, [1])
    os.symlink(target, os.path.join(root, "step_00000001", "planted"))
    save_steps(root, [2, 3], keep_last=1)
    assert not os.path.lexists(os.path.join(root, "step_00000001"))
    assert_intact(target, files)


def test_cleanup_removes_torn_saves_and_temp_files_and_keeps_committed(tmp_path):
    root = str(tmp_path / "root")
    save_steps(root, [1, 2], io_workers=2)
    committed = {name: sorted(os.listdir(os.path.join(root, name))) for name in ("step_00000001", "step_00000002")}
    torn = os.path.join(root, "step_00000003")
    write(os.path.join(torn, "__0_0.distcp"), b"half a bucket")
    write(os.path.join(torn, "__0_1.distcp"))
    empty_torn = os.path.join(root, "step_00000004")
    os.makedirs(empty_torn)
    stray = [
        write(os.path.join(root, ".latest.tmp-4242")),
        write(os.path.join(root, "step_00000002", "..metadata.tmp-4242")),
        write(os.path.join(root, "step_00000002", "..checksums.json.tmp-77")),
        # an interrupted re-save of step 2: its new files, or the old ones it had replaced
        write(os.path.join(root, "step_00000002", "__0_0.0badc0de.distcp"), b"partial"),
        write(os.path.join(root, "step_00000002", "__0_7.distcp"), b"replaced"),
    ]
    expected = sorted([torn, empty_torn, *stray])

    assert sorted(cleanup(root, dry_run=True)) == expected
    assert all(os.path.lexists(p) for p in expected)  # a dry run removes nothing

    assert sorted(cleanup(root)) == expected
    assert not any(os.path.lexists(p) for p in expected)
    for name, files in committed.items():
        assert sorted(os.listdir(os.path.join(root, name))) == files
    assert [c.name for c in list_checkpoints(root)] == ["step_00000001", "step_00000002"]
    assert cleanup(root) == []


def test_cleanup_keeps_what_it_cannot_identify_as_a_save(tmp_path):
    root = str(tmp_path / "root")
    save_steps(root, [1])
    with_notes = os.path.join(root, "step_00000002")
    write(os.path.join(with_notes, "__0_0.distcp"))
    write(os.path.join(with_notes, "README.txt"), b"user file")
    with_subdir = os.path.join(root, "step_00000003")
    write(os.path.join(with_subdir, "nested", "file.bin"))
    others = [write(os.path.join(root, "other", "__0_0.distcp")), write(os.path.join(root, "step_3")),
              write(os.path.join(root, "notes.tmp-1"))]
    assert cleanup(root) == []
    for path in [os.path.join(with_notes, "README.txt"), os.path.join(with_subdir, "nested", "file.bin"), *others]:
        assert os.path.exists(path)


def test_cleanup_of_a_root_that_is_not_there_says_so(tmp_path):
    """A mistyped root is an error, not an empty list that reads as "nothing to clean"."""
    with pytest.raises(CheckpointError, match="no such checkpoint root"):
        cleanup(str(tmp_path / "nonexistent"))
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint root"):
        cleanup(write(str(tmp_path / "a_file")))
    assert cleanup(str(tmp_path)) == []  # an existing root with nothing to clean
