"""Foundation acceptance: round trip, consistency, worker reuse, no stale data, atomic commit,
bad input, close and exit behaviour."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, load
from asyncckpt.storage import is_remote, storage_for
from conftest import REPO, assert_state_equal, clone_state, make_model_and_optimizer, make_state, step_path, train_step, wait_gone, zeros_like_state


pytestmark = pytest.mark.all_backends  # tests taking ckpt_root also run on msc:// and s3:// roots



def test_round_trip_is_bitwise_equal_with_stock_dcp_load(ckpt_root):
    model, optimizer = make_model_and_optimizer()
    state = make_state(model, optimizer, step=7)
    expected = clone_state(state)
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.schedule_save(state, step=7)
        [report] = ckpt.finalize(blocking=True)
    assert report.step == 7 and report.bytes > 0 and report.path == step_path(ckpt_root, 7)

    target = zeros_like_state(expected)
    if is_remote(ckpt_root):  # stock dcp.load, through multi-storage-client's own DCP reader
        from multistorageclient.contrib.torch import MultiStorageFileSystemReader

        dcp.load(target, storage_reader=MultiStorageFileSystemReader(step_path(ckpt_root, 7)), no_dist=True)
    else:
        dcp.load(target, checkpoint_id=step_path(ckpt_root, 7), no_dist=True)
    assert_state_equal(target, expected)

    target = zeros_like_state(expected)
    load(target, step_path(ckpt_root, 7))
    assert_state_equal(target, expected)


@pytest.mark.local_only  # dcp_to_torch_save reads with the stock FileSystemReader: local paths only
def test_dcp_to_torch_save_converts_the_checkpoint(ckpt_root, tmp_path):
    model, optimizer = make_model_and_optimizer()
    state = make_state(model, optimizer)
    expected = clone_state(state)
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.schedule_save(state, step=1)
    out = str(tmp_path / "converted.pt")
    dcp_to_torch_save(step_path(ckpt_root, 1), out)
    converted = torch.load(out, weights_only=False)
    assert_state_equal(converted["model"], expected["model"])
    assert converted["meta"] == expected["meta"]


def test_checkpoint_holds_values_from_schedule_time_not_later_mutations(ckpt_root):
    model, optimizer = make_model_and_optimizer()
    state = make_state(model, optimizer)
    with AsyncCheckpointer(ckpt_root) as ckpt:
        for step in range(3):
            expected = clone_state(state)
            ckpt.schedule_save(state, step=step)
            with torch.no_grad():  # mutate every tensor right away, while the worker writes
                for tensor in _tensors(state):
                    tensor.add_(1000.0)
            ckpt.finalize(blocking=True)
            target = zeros_like_state(expected)
            load(target, step_path(ckpt_root, step))
            assert_state_equal(target, expected)


def test_repeated_saves_reuse_one_worker_and_send_only_the_key(ckpt_root):
    model, optimizer = make_model_and_optimizer()
    state = make_state(model, optimizer)
    expected_by_step, reports = {}, []
    with AsyncCheckpointer(ckpt_root) as ckpt:
        for step in range(5):
            train_step(model, optimizer)
            state = make_state(model, optimizer, step)
            expected_by_step[step] = clone_state(state)
            ckpt.schedule_save(state, step=step)
            reports += ckpt.finalize(blocking=True)
    assert [r.step for r in reports] == list(range(5))
    assert len({r.worker_pid for r in reports}) == 1
    assert reports[0].tensors_sent > 0 and not reports[0].cache_hit
    for r in reports[1:]:
        assert r.tensors_sent == 0 and r.cache_hit and r.plan_reused, r
    for step, expected in expected_by_step.items():
        target = zeros_like_state(expected)
        load(target, step_path(ckpt_root, step))
        assert_state_equal(target, expected)


def test_reallocated_tensor_is_resent_never_stale(ckpt_root):
    weights = {"w": torch.full((256,), 1.0), "b": torch.full((4,), 2.0)}
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.schedule_save({"model": weights}, step=1)
        ckpt.finalize(blocking=True)
        weights["w"] = torch.full((256,), 5.0)  # same shape, new storage
        ckpt.schedule_save({"model": weights}, step=2)
        [report] = ckpt.finalize(blocking=True)
    assert report.tensors_sent == 1
    target = {"model": {"w": torch.zeros(256), "b": torch.zeros(4)}}
    load(target, step_path(ckpt_root, 2))
    assert torch.equal(target["model"]["w"], torch.full((256,), 5.0))
    assert torch.equal(target["model"]["b"], torch.full((4,), 2.0))


def test_a_new_structure_resends_only_the_tensors_the_worker_does_not_hold(ckpt_root):
    """Lightning's checkpoint names its top-k paths in keys, so every event is a new structure:
    the worker keeps the tensors it holds (under any key) and gets only the new ones."""
    weights = {"w": torch.full((256,), 1.0), "b": torch.full((4,), 2.0)}
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.schedule_save({"model": weights, "top_k": {"a.ckpt": torch.tensor(0.5)}}, step=1)
        [first] = ckpt.finalize(blocking=True)
        weights["w"].fill_(3.0)  # changed in place: held, its new values are saved
        top_k = {"a.ckpt": torch.tensor(0.5), "b.ckpt": torch.tensor(0.25)}
        ckpt.schedule_save({"model": weights, "top_k": top_k}, step=2)
        [grown] = ckpt.finalize(blocking=True)
        renamed = {"weight": weights["w"], "bias": torch.full((4,), 7.0)}  # a held tensor under another key
        ckpt.schedule_save({"model": renamed}, step=3)
        [moved] = ckpt.finalize(blocking=True)
    assert first.tensors_sent == 3 and not first.cache_hit
    assert grown.tensors_sent == 2 and not grown.cache_hit  # the two scores are new tensors; w and b are held
    assert moved.tensors_sent == 1  # the new bias
    expected = {"model": {"w": torch.full((256,), 3.0), "b": torch.full((4,), 2.0)},
                "top_k": {"a.ckpt": torch.tensor(0.5), "b.ckpt": torch.tensor(0.25)}}
    target = zeros_like_state(expected)
    load(target, step_path(ckpt_root, 2))
    assert_state_equal(target, expected)
    target = {"model": {"weight": torch.zeros(256), "bias": torch.zeros(4)}}
    load(target, step_path(ckpt_root, 3))
    assert torch.equal(target["model"]["weight"], torch.full((256,), 3.0))
    assert torch.equal(target["model"]["bias"], torch.full((4,), 7.0))


def test_numpy_backed_tensors_are_copied_each_save(ckpt_root):
    import numpy as np

    array = np.zeros(64, dtype=np.float32)
    state = {"t": torch.from_numpy(array)}
    with AsyncCheckpointer(ckpt_root) as ckpt:
        for step in range(2):
            array[:] = step + 1  # the user keeps writing through numpy: the tensor must follow
            ckpt.schedule_save(state, step=step)
            ckpt.finalize(blocking=True)
    target = {"t": torch.zeros(64)}
    load(target, step_path(ckpt_root, 1))
    assert torch.equal(target["t"], torch.full((64,), 2.0))


def test_metadata_appears_only_at_commit_and_retention_keeps_newest(ckpt_root):
    storage = storage_for(ckpt_root)
    torn = step_path(ckpt_root, 0)  # a torn leftover from an earlier crash: never touched
    storage.prepare_dir(torn)
    storage.write_atomic(storage.join(torn, "__0_0.distcp"), b"")
    state = {"w": torch.arange(1000.0)}
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(keep_last=2)) as ckpt:
        for step in range(1, 6):
            ckpt.schedule_save(state, step=step)
            # an object store has no directories: a prefix exists once a key is under it
            assert is_remote(ckpt_root) or storage.is_dir(step_path(ckpt_root, step))
            assert not storage.exists(storage.join(step_path(ckpt_root, step), ".metadata"))
            latest = _read_latest(ckpt_root)
            assert latest is None or storage.exists(storage.join(ckpt_root, latest, ".metadata"))
            ckpt.finalize(blocking=True)
            assert _read_latest(ckpt_root) == f"step_{step:08d}"
    remaining = sorted(n for n in storage.list_dir(ckpt_root) if n.startswith("step_"))
    assert remaining == ["step_00000000", "step_00000004", "step_00000005"]
    assert storage.exists(storage.join(torn, "__0_0.distcp"))


@pytest.mark.parametrize("where", ["a file", "under a file", "/proc", "read-only"])
def test_a_root_that_cannot_be_written_fails_at_construction_naming_it_and_why(tmp_path, where):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if where == "read-only" and os.geteuid() == 0:  # root writes through file modes; not into /sys
        read_only = "/sys"
    root, reason = {
        "a file": (str(blocker), "a path component is a file, not a directory"),
        "under a file": (str(blocker / "ckpt"), "a path component is a file, not a directory"),
        "/proc": ("/proc/asyncckpt/ckpt", r"cannot create it in '/proc' \(No such file or directory\)"),
        "read-only": (f"{read_only}/ckpt", rf"cannot create it in '{read_only}' \((Permission denied|Operation not permitted|Read-only file system)\)"),
    }[where]
    with pytest.raises(CheckpointError, match=f"checkpoint directory '{re.escape(root)}' is not writable: {reason}"):
        AsyncCheckpointer(root)
    assert blocker.read_text() == "not a directory"


def test_unwritable_checkpoint_dir_fails_before_handoff(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with AsyncCheckpointer() as ckpt:
        pid = ckpt.worker_pid
        with pytest.raises(CheckpointError, match="not writable"):
            ckpt.schedule_save({"w": torch.ones(4)}, checkpoint_dir=str(blocker / "ckpt"))
        assert ckpt.worker_pid == pid and psutil.pid_exists(pid)
        assert ckpt.finalize() == []


def test_unknown_config_value_names_the_field():
    with pytest.raises(ValueError, match="io="):
        CheckpointConfig(io="carrier-pigeon")
    with pytest.raises(ValueError, match="io_workers"):
        CheckpointConfig(io_workers=0)
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointConfig(keep_last=-1)
    with pytest.raises(TypeError):
        CheckpointConfig(colour="blue")


def test_unserializable_entry_is_named_and_nothing_is_left(ckpt_root):
    import threading

    with AsyncCheckpointer(ckpt_root) as ckpt:
        with pytest.raises(CheckpointError, match="extra.lock"):
            ckpt.schedule_save({"w": torch.ones(4), "extra": {"lock": threading.Lock()}}, step=3)
        assert not storage_for(ckpt_root).is_dir(step_path(ckpt_root, 3))
        ckpt.schedule_save({"w": torch.ones(4)}, step=4)  # the checkpointer still works
        assert [r.step for r in ckpt.finalize(blocking=True)] == [4]


class _BrokenStateful:
    def state_dict(self):
        raise RuntimeError("state_dict failed")

    def load_state_dict(self, state):
        pass


@pytest.mark.local_only
def test_a_save_that_cannot_start_leaves_no_directory_and_keeps_a_committed_one(ckpt_root):
    with AsyncCheckpointer(ckpt_root) as ckpt:
        with pytest.raises(RuntimeError, match="state_dict failed"):
            ckpt.schedule_save({"m": _BrokenStateful()}, step=7)
        assert not os.path.exists(step_path(ckpt_root, 7))
        ckpt.schedule_save({"w": torch.ones(3)}, step=8)
        ckpt.finalize(blocking=True)
        with pytest.raises(RuntimeError, match="state_dict failed"):
            ckpt.schedule_save({"m": _BrokenStateful()}, step=8)
        target = {"w": torch.zeros(3)}
        load(target, step_path(ckpt_root, 8))
        assert torch.equal(target["w"], torch.ones(3))


def test_close_commits_the_in_flight_save(ckpt_root):
    ckpt = AsyncCheckpointer(ckpt_root)
    ckpt.schedule_save({"w": torch.arange(10.0)}, step=9)
    pid = ckpt.worker_pid
    reports = ckpt.close()
    assert [r.step for r in reports] == [9]
    assert storage_for(ckpt_root).exists(os.path.join(step_path(ckpt_root, 9), ".metadata"))
    wait_gone(pid, 10)
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.schedule_save({"w": torch.ones(1)}, step=10)


def test_script_exiting_without_close_commits_and_leaves_no_worker(ckpt_root, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch
            from asyncckpt import AsyncCheckpointer
            ckpt = AsyncCheckpointer({ckpt_root!r})
            ckpt.schedule_save({{"w": torch.arange(100.0)}}, step=5)
            print(ckpt.worker_pid, flush=True)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    wait_gone(int(done.stdout.split()[-1]), 10)
    assert storage_for(ckpt_root).exists(os.path.join(step_path(ckpt_root, 5), ".metadata"))


def test_load_latest_returns_none_then_the_step(ckpt_root):
    state = {"w": torch.arange(8.0)}
    with AsyncCheckpointer(ckpt_root) as ckpt:
        assert ckpt.load_latest({"w": torch.zeros(8)}) is None
        ckpt.schedule_save(state, step=3)
        ckpt.finalize(blocking=True)
        target = {"w": torch.zeros(8)}
        assert ckpt.load_latest(target) == 3
    assert torch.equal(target["w"], torch.arange(8.0))


class TrainState:
    """Model and optimizer as DCP's own tutorial wraps them: get_state_dict creates the
    optimizer's state entries, so a load into a fresh optimizer fills them."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


@pytest.mark.local_only
def test_resume_restores_optimizer_state_into_a_fresh_optimizer(ckpt_root):
    """A fresh optimizer passed as it is has no state for DCP to load into: its saved moments are
    loaded into it all the same, not dropped. Wrapped with get_state_dict/set_state_dict, they
    come back exactly too."""
    model, optimizer = make_model_and_optimizer(seed=1)
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.schedule_save({"model": model, "optim": optimizer}, step=1)
        ckpt.schedule_save({"train": TrainState(model, optimizer)}, step=2)
        ckpt.finalize(blocking=True)
    expected = clone_state(optimizer.state_dict()["state"])

    fresh_model, fresh_optimizer = make_model_and_optimizer(seed=2)
    fresh_optimizer.state.clear()  # as built, before its first step
    load({"model": fresh_model, "optim": fresh_optimizer}, step_path(ckpt_root, 1))
    assert_state_equal(fresh_optimizer.state_dict()["state"], expected)
    fresh_model, fresh_optimizer = make_model_and_optimizer(seed=2)
    fresh_optimizer.state.clear()
    fresh_optimizer.zero_grad(set_to_none=True)  # as built: no state, no gradients
    load({"train": TrainState(fresh_model, fresh_optimizer)}, step_path(ckpt_root, 2))
    assert_state_equal(fresh_optimizer.state_dict()["state"], expected)
    assert_state_equal(fresh_model.state_dict(), model.state_dict())


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _tensors(v)


def _read_latest(root: str):
    storage = storage_for(root)
    path = storage.join(root, "latest")
    return storage.read_bytes(path).decode().strip() if storage.exists(path) else None


