"""`prepare(state)`: the first save's one-time work done ahead of it. The first save after it is
consistent (every tensor changed right after it returns), hands the worker nothing new, and a
preparation overtaken by events (tensors reallocated, the worker killed) never costs a save."""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointError, load
from asyncckpt.save import sharing
from conftest import assert_step_holds, clone_state, step_path, zeros_like_state
from multirank import run_ranks


def make_state() -> dict:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(256, 64), "b": torch.randn(64)}, "optim": {"m": torch.randn(256, 64)}, "step": 0}


def save_and_change(ckpt: AsyncCheckpointer, state: dict, step: int):
    """Save `state` as `step`, change every tensor right after the call; return what was saved
    (as of the call) and the save's report."""
    state["step"] = step
    expected = clone_state(state)
    ckpt.schedule_save(state, step=step)
    for group in ("model", "optim"):
        for tensor in state[group].values():
            tensor.add_(1000.0)
    [report] = ckpt.finalize(blocking=True)
    return expected, report



def test_the_first_save_after_a_finished_preparation_sends_nothing_and_holds_the_values_of_its_call(ckpt_root):
    state = make_state()
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.prepare(state)
        for tensor in state["model"].values():  # training goes on between prepare and the save
            tensor.mul_(2.0)
        ckpt._worker.settle_preparation()  # the worker has readied its slab: nothing is left to hide
        expected, report = save_and_change(ckpt, state, 1)
    assert report.tensors_sent == 0 and report.cache_hit and report.plan_reused, report
    assert_step_holds(ckpt_root, 1, expected)


def test_the_spare_copy_is_let_go_after_the_first_save_is_staged_and_off_the_callers_thread(ckpt_root):
    """prepare readies memory for a save that would come during the preparation, faulted in before
    it returns (such a save then only copies); once the worker is ready, no save needs it.
    Unmapping it (~0.2 s per GiB) must not land on the first save's blocked time: it goes once
    that save is staged, on a thread of its own."""
    state = make_state()
    freed_on: list[str] = []
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.prepare(state)
        spare = ckpt._worker._spare
        assert not spare._thread.is_alive() and spare._buffer is not None  # faulted in when prepare returned
        weakref.finalize(spare._buffer, lambda: freed_on.append(threading.current_thread().name))
        del spare
        ckpt._worker.settle_preparation()  # the answer is in: the spare is no longer needed ...
        assert not freed_on  # ... but kept until the next save is staged
        expected, _ = save_and_change(ckpt, state, 1)
        deadline = time.monotonic() + 10
        while not freed_on and time.monotonic() < deadline:
            time.sleep(0.01)
    assert freed_on == ["asyncckpt-spare-release"]
    assert_step_holds(ckpt_root, 1, expected)


def test_a_save_during_the_preparation_is_handed_over_from_a_copy_and_the_next_sends_nothing(ckpt_root):
    """What the worker has not finished (its start-up, its slab) does not land on a save that
    comes right after prepare: it returns with a private copy, its values those of its call."""
    state = make_state()
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.prepare(state)
        assert ckpt._worker.preparing  # a worker starts in a second or more: still under way
        expected, report = save_and_change(ckpt, state, 1)
        assert report.tensors_sent > 0  # the copy
        expected2, report2 = save_and_change(ckpt, state, 2)
    assert report2.tensors_sent == 0 and report2.cache_hit, report2
    assert_step_holds(ckpt_root, 1, expected)
    assert_step_holds(ckpt_root, 2, expected2)


def test_a_state_reallocated_after_prepare_is_saved_from_its_new_tensors(ckpt_root):
    state = make_state()
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.prepare(state)
        state["model"]["w"] = torch.randn(256, 64)  # reallocated: the worker holds the old one
        state["optim"]["v"] = torch.randn(32)  # and a new entry: a new structure
        expected, report = save_and_change(ckpt, state, 1)
        assert report.tensors_sent > 0
        expected2, report2 = save_and_change(ckpt, state, 2)  # then steady again
    assert report2.tensors_sent == 0, report2
    assert_step_holds(ckpt_root, 1, expected)
    assert_step_holds(ckpt_root, 2, expected2)


def test_a_worker_killed_after_prepare_costs_nothing_but_the_preparation(ckpt_root):
    state = make_state()
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.prepare(state)
        os.kill(ckpt.worker_pid, signal.SIGKILL)
        expected, report = save_and_change(ckpt, state, 1)  # a fresh worker gets everything
    assert report.tensors_sent > 0
    assert_step_holds(ckpt_root, 1, expected)


def test_prepare_without_room_in_shared_memory_says_so_and_changes_nothing(ckpt_root, monkeypatch):
    state = make_state()
    pointers = [t.untyped_storage().data_ptr() for t in state["model"].values()]
    monkeypatch.setattr(sharing, "shm_free_bytes", lambda path=sharing.SHM_DIR: 4096)
    with AsyncCheckpointer(ckpt_root) as ckpt:
        with pytest.raises(CheckpointError, match="not enough shared memory"):
            ckpt.prepare(state)
    assert [t.untyped_storage().data_ptr() for t in state["model"].values()] == pointers  # nothing moved


def _prepared_ranks(rank: int, world: int, root: str) -> None:
    state = make_state()
    state["model"]["w"] += rank  # each rank's own values (saved under the same names: rank 0's win)
    state["rank_only"] = {f"r{rank}": torch.full((8,), float(rank))}
    with AsyncCheckpointer(root) as ckpt:
        ckpt.prepare(state)
        expected, report = save_and_change(ckpt, state, 1)  # a copy if the preparation is under way
        expected2, report2 = save_and_change(ckpt, state, 2)
        assert report2.tensors_sent == 0, report2
    for step, values in ((1, expected), (2, expected2)):
        target = zeros_like_state(values)
        load(target, step_path(root, step))
        assert torch.equal(target["rank_only"][f"r{rank}"], values["rank_only"][f"r{rank}"])
        assert torch.equal(target["optim"]["m"], values["optim"]["m"])


def test_prepare_on_two_ranks_then_a_consistent_first_save(tmp_path):
    run_ranks(_prepared_ranks, 2, str(tmp_path / "ckpt"), timeout_s=120)


def test_a_prepare_with_no_save_after_it_lets_the_spare_copy_go_at_close(ckpt_root):
    state = make_state()
    freed = threading.Event()
    ckpt = AsyncCheckpointer(ckpt_root)
    ckpt.prepare(state)
    weakref.finalize(ckpt._worker._spare._buffer, freed.set)
    ckpt.close()
    assert freed.wait(10)  # not held while the process goes on without the checkpointer
