"""A save right after the constructor, while the worker is still starting: it returns once this
process holds a private copy, holds the values of its call (every tensor changed right after it
returns), hands the worker the trainer's own tensors for the next save (which sends nothing), and
a worker that never comes up fails it with CheckpointError at finalize, not a hang."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, load
from conftest import assert_step_holds, clone_state, step_path, zeros_like_state
from multirank import run_ranks


def make_state(rank: int = 0) -> dict:
    torch.manual_seed(rank)
    model = {"w": torch.randn(512, 64), "b": torch.randn(64), "emb": torch.randn(100, 32).to(torch.bfloat16)}
    return {"model": model, "optim": {"m": torch.randn(512, 64)}, "rank_only": {f"r{rank}": torch.full((8,), float(rank))},
            "step": 0}


def save_and_change(ckpt: AsyncCheckpointer, state: dict, step: int, *, worker_starting: bool):
    """Save `state` as `step` and change every tensor (in place) right after the call; return the
    values at the call and the save's report."""
    state["step"] = step
    expected = clone_state(state)
    ckpt.schedule_save(state, step=step)
    if worker_starting:  # the call did not wait for the worker's start-up (an interpreter importing torch)
        assert not ckpt.worker_ready
    with torch.no_grad():
        for group in ("model", "optim", "rank_only"):
            for tensor in state[group].values():
                tensor.add_(1000.0)
    [report] = ckpt.finalize(blocking=True)
    return expected, report



@pytest.mark.parametrize("io", ["thread", "process"])
def test_a_save_right_after_the_constructor_holds_the_values_of_its_call_and_the_next_sends_nothing(tmp_path, io):
    root = str(tmp_path / "ckpt")
    state = make_state()
    with AsyncCheckpointer(root, CheckpointConfig(io=io)) as ckpt:
        expected1, first = save_and_change(ckpt, state, 1, worker_starting=True)
        expected2, second = save_and_change(ckpt, state, 2, worker_starting=False)
    assert first.tensors_sent > 0
    assert second.tensors_sent == 0 and second.cache_hit, second  # the trainer's own tensors were handed over
    assert_step_holds(root, 1, expected1)
    assert_step_holds(root, 2, expected2)


def test_a_save_right_after_the_constructor_holds_views_of_one_storage_as_of_its_call(tmp_path):
    """Views of one storage (a slice at an offset, a transposed view, the storage's whole tensor)
    and a bf16 slice: the private copy a save right after the constructor returns with (the pages
    the storages left when they moved into shared memory) holds each one's values as of the call,
    and so does the second save, from the trainer's own tensors."""
    root = str(tmp_path / "ckpt")
    base, half = torch.randn(8, 16), torch.randn(40).to(torch.bfloat16)
    state = {"base": base, "slice": base[3:7], "t": base.t(), "half": half[5:], "step": 1}
    with AsyncCheckpointer(root) as ckpt:
        for step in (1, 2):
            expected = clone_state(state)
            ckpt.schedule_save(state, step=step)
            assert ckpt.worker_ready == (step == 2)
            base.mul_(-2.0).add_(1000.0)  # every view changes
            half.add_(1.0)
            ckpt.finalize(blocking=True)
            assert_step_holds(root, step, expected)


def _first_save_on_ranks(rank: int, world: int, root: str) -> None:
    state = make_state(rank)
    with AsyncCheckpointer(root) as ckpt:
        expected1, _ = save_and_change(ckpt, state, 1, worker_starting=True)
        expected2, second = save_and_change(ckpt, state, 2, worker_starting=False)
        assert second.tensors_sent == 0, second
    for step, expected in ((1, expected1), (2, expected2)):
        target = zeros_like_state(expected)
        load(target, step_path(root, step))
        assert torch.equal(target["rank_only"][f"r{rank}"], expected["rank_only"][f"r{rank}"])
        if rank == 0:  # entries of the same name on every rank are rank 0's
            assert torch.equal(target["model"]["w"], expected["model"]["w"])
        assert target["step"] == step


def test_two_ranks_save_right_after_the_constructor_consistently(tmp_path):
    run_ranks(_first_save_on_ranks, 2, str(tmp_path / "ckpt"), timeout_s=180)


def test_a_worker_that_never_comes_up_fails_the_first_save_at_finalize_and_the_next_save_works(tmp_path):
    root = str(tmp_path / "ckpt")
    state = make_state()
    quick = CheckpointConfig(worker_start_timeout_s=0.2, timeout_s=0.2)  # far less than a worker's start-up
    with AsyncCheckpointer(root, quick) as ckpt:
        ckpt.schedule_save(state, step=1)  # returns: the worker is still starting
        with pytest.raises(CheckpointError, match="step 1 not committed.*(start|Staged)"):
            ckpt.finalize(blocking=True)
        ckpt.config = dataclasses.replace(quick, worker_start_timeout_s=300.0, timeout_s=120.0)
        expected, report = save_and_change(ckpt, state, 2, worker_starting=True)
    assert_step_holds(root, 2, expected)
    assert not (tmp_path / "ckpt" / "step_00000001" / ".metadata").exists()


def _first_save_waits_for_its_worker(root: str, config: CheckpointConfig) -> None:
    """The first save right after the constructor takes no private copy: the call waits for the
    worker's start-up (and stages into it), and the checkpoint holds the values of the call."""
    state = make_state()
    with AsyncCheckpointer(root, config) as ckpt:
        expected = clone_state(state)
        ckpt.schedule_save(state, step=1)
        assert ckpt.worker_ready
        with torch.no_grad():
            state["model"]["w"].add_(1000.0)
        ckpt.finalize(blocking=True)
    assert_step_holds(root, 1, expected)


def test_no_private_copy_under_a_staging_budget(tmp_path):
    """With staging_budget_bytes the user bounds the memory a save takes: a first save to a worker
    still starting waits for it rather than holding a copy of the state."""
    _first_save_waits_for_its_worker(str(tmp_path / "ckpt"), CheckpointConfig(staging_budget_bytes=1 << 20))


def test_no_private_copy_where_memory_is_short(tmp_path, monkeypatch):
    """A copy that would leave less than its own size of memory available is not taken: the save
    waits for the worker, as before."""
    from asyncckpt.save import first_save, sharing

    for module in (first_save, sharing):  # (sharing: the pages the state's move leaves, kept as the copy)
        monkeypatch.setattr(module, "available_memory_bytes", lambda: 64 << 10)  # less than twice the state
    _first_save_waits_for_its_worker(str(tmp_path / "ckpt"), CheckpointConfig())
