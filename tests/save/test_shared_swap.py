"""A first save moves the trainer's CPU storages into shared memory by swapping their pages
(`UntypedStorage._swap_data_ptr_`, a private torch API) and keeps the old pages as its private
copy. The swap's result is checked; any failure or surprise leaves the storage with its own
pages, shared the ordinary way, and the save still holds the values of its call (#41 item 7)."""

from __future__ import annotations

import pytest
import torch

from asyncckpt import AsyncCheckpointer
from asyncckpt.save.sharing import free_shared_pages, move_into_shared_memory, shared_segment, swap_into_shared_memory
from conftest import assert_step_holds, clone_state


has_swap = pytest.mark.skipif(not hasattr(torch.UntypedStorage, "_swap_data_ptr_"),
                              reason="this torch has no UntypedStorage._swap_data_ptr_ (a first save copies instead)")


class Tagged(torch.Tensor):
    """A storage-backed subclass (`as_subclass`)."""


@has_swap
def test_a_swap_gives_the_storage_shared_pages_and_returns_its_old_ones():
    tensor = torch.arange(10_000, dtype=torch.float32)
    before = tensor.clone()
    old = swap_into_shared_memory(tensor.untyped_storage())
    assert old is not None and tensor.untyped_storage().is_shared() and not old.is_shared()
    tensor.add_(1)  # the trainer changes its tensor: the old pages keep the values of the call
    kept = torch.empty(0).set_(old).view(torch.float32)
    assert torch.equal(kept, before) and torch.equal(tensor, before + 1)


@has_swap
def test_views_a_subclass_and_a_tensor_under_two_names_move_once_each_storage():
    base = torch.randn(64, 32)
    views = [base[3:9], base.t(), base]
    tagged = torch.randn(50).as_subclass(Tagged)
    twice = torch.randn(7)
    resolved = [(t, False) for t in (*views, tagged, twice, twice)]
    values = [t.clone() for t, _ in resolved]
    kept = move_into_shared_memory(resolved, keep_old_pages=True)
    assert len(kept) == 3  # one per storage, however many views or names
    for (tensor, _), value in zip(resolved, values):
        assert tensor.untyped_storage().is_shared() and torch.equal(tensor.as_subclass(torch.Tensor), value)
        assert tensor.untyped_storage().data_ptr() in kept


def _raises_type_error(self, other):
    raise TypeError("this torch swaps differently")


def _does_nothing(self, other):
    return None  # "succeeds" without trading the pages


@has_swap
@pytest.mark.parametrize("swap", [_raises_type_error, _does_nothing], ids=["raises-TypeError", "silently-no-op"])
def test_a_failed_or_lying_swap_leaves_the_storage_its_own_pages(monkeypatch, swap):
    monkeypatch.setattr(torch.UntypedStorage, "_swap_data_ptr_", swap)
    tensor = torch.arange(5000, dtype=torch.float64)
    pointer = tensor.untyped_storage().data_ptr()
    assert swap_into_shared_memory(tensor.untyped_storage()) is None
    assert tensor.untyped_storage().data_ptr() == pointer and torch.equal(tensor, torch.arange(5000.0).double())


@pytest.mark.parametrize("swap", [_raises_type_error, _does_nothing], ids=["raises-TypeError", "silently-no-op"])
def test_a_first_save_without_a_working_swap_still_holds_the_values_of_its_call(tmp_path, monkeypatch, swap):
    monkeypatch.setattr(torch.UntypedStorage, "_swap_data_ptr_", swap, raising=False)
    base = torch.randn(128, 16)
    shared = torch.randn(33)
    state = {"view": base[4:20], "whole": base, "tagged": torch.randn(40).as_subclass(Tagged), "a": shared, "b": shared}
    expected = {k: v.as_subclass(torch.Tensor) for k, v in clone_state(state).items()}
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        ckpt.schedule_save(state, step=1)  # right after the constructor: the worker is still starting
        with torch.no_grad():
            base.add_(100.0)
            shared.add_(100.0)
            state["tagged"].add_(100.0)
        ckpt.finalize(blocking=True)
    assert_step_holds(str(tmp_path), 1, expected)


def test_freeing_a_shared_segments_pages_empties_it_without_dropping_it():
    """prepare's spare copy is let go by freeing its pages first (off the GIL), then dropping it."""
    nbytes = 4 << 20
    segment = torch.empty(0, dtype=torch.uint8).set_(shared_segment(nbytes))
    segment.fill_(7)
    assert free_shared_pages(segment.data_ptr(), segment.numel())
    assert segment.count_nonzero().item() == 0  # the pages are gone: a read sees fresh zeros
    assert not free_shared_pages(segment.data_ptr(), 0)


def test_a_segment_made_holding_a_storage_has_its_bytes_and_is_shared():
    """A first save's move writes each storage into its new segment's file (no zeroed pages first)."""
    source = torch.randn(3, 1_000_003).to(torch.bfloat16)  # an odd size: not a whole number of pages
    segment = shared_segment(source.untyped_storage().nbytes(), holding=source.untyped_storage())
    assert segment.is_shared() and segment.nbytes() == source.untyped_storage().nbytes()
    copy = torch.empty(0, dtype=torch.bfloat16).set_(segment, 0, source.shape, source.stride())
    assert torch.equal(copy, source)
