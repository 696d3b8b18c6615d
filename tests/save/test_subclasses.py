"""Tensor subclasses in a saved state: each kind is saved as the plain values DCP's metadata
describes, or refused with an error naming the entry; a refused save leaves nothing committed.
(DTensors: tests/doors/test_torch_dcp.py and tests/save/test_multirank.py, with raw ops failing as on CUDA.)"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils._pytree import tree_map

from asyncckpt import AsyncCheckpointer, CheckpointError
from asyncckpt.report import SaveReport
from conftest import clone_state


class Wrapper(torch.Tensor):
    """A wrapper subclass, as float8 training weights are: its values live in an inner tensor
    and its own __torch_dispatch__ unwraps them; it has no storage of its own."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Wrapper) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class Uncopyable(Wrapper):
    """A wrapper whose values cannot be read through ordinary ops."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.copy_.default):
            raise NotImplementedError(f"{func} is not implemented for Uncopyable")
        return super().__torch_dispatch__(func, types, args, kwargs)


class BadDequantize(Wrapper):
    """Its dequantize() changes the dtype the planner recorded from the tensor."""

    def dequantize(self):
        return self.inner.to(torch.float16)


class Tagged(torch.Tensor):
    """A storage-backed subclass (`as_subclass`), as some libraries tag parameters."""


class Scaled(torch.Tensor):
    """An FP8-style wrapper: stored values times a scale; `dequantize` gives the real values."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: float):
        wrapped = data.as_subclass(cls)
        wrapped.scale = scale
        return wrapped

    def dequantize(self):
        return self.as_subclass(torch.Tensor) * self.scale


@pytest.fixture(scope="module")
def ckpt():
    with AsyncCheckpointer() as checkpointer:
        yield checkpointer


def saved(ckpt, state: dict, path: str) -> tuple[dict, SaveReport]:
    """Save `state` into `path`; what stock DCP reads back, and the save's report."""
    ckpt.schedule_save(state, checkpoint_dir=path)
    [report] = ckpt.finalize(blocking=True)
    out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    return out, report


def test_parameters_are_not_mistaken_for_quantized_wrappers(ckpt, tmp_path):
    """nn.Parameter has Tensor's own `dequantize`: it must be shared once, not copied per save."""
    state = {"w": torch.nn.Parameter(torch.randn(256)), "b": torch.nn.Parameter(torch.randn(8))}
    for step in range(2):
        with torch.no_grad():
            state["w"].add_(1.0)
        expected = clone_state(state)
        out, report = saved(ckpt, state, str(tmp_path / f"step{step}"))
    assert report.tensors_sent == 0 and report.cache_hit, report
    assert torch.equal(out["w"], expected["w"].detach()) and torch.equal(out["b"], expected["b"].detach())


def test_a_subclass_with_its_own_dequantize_is_stored_dequantized(ckpt, tmp_path):
    raw = torch.arange(16, dtype=torch.float32)
    out, _ = saved(ckpt, {"q": Scaled(raw, 0.5)}, str(tmp_path / "c"))
    assert torch.equal(out["q"], raw * 0.5)


def test_a_wrapper_subclass_is_saved_as_its_values(ckpt, tmp_path):
    inner = torch.randn(4, 5)
    out, _ = saved(ckpt, {"w": Wrapper(inner.clone()), "plain": torch.ones(3)}, str(tmp_path / "c"))
    assert torch.equal(out["w"], inner) and torch.equal(out["plain"], torch.ones(3))


def test_a_storage_backed_subclass_is_shared_in_place_and_not_sent_again(ckpt, tmp_path):
    tagged = torch.randn(64).as_subclass(Tagged)
    out, _ = saved(ckpt, {"t": tagged}, str(tmp_path / "a"))
    assert torch.equal(out["t"], tagged.as_subclass(torch.Tensor))
    with torch.no_grad():
        tagged.add_(1)  # in place: the worker reads the new values from the memory it holds
    out, report = saved(ckpt, {"t": tagged}, str(tmp_path / "b"))
    assert report.tensors_sent == 0  # no copy per save: the worker holds the subclass's own memory
    assert torch.equal(out["t"], tagged.as_subclass(torch.Tensor))


@pytest.mark.parametrize(
    "entry, says",
    [
        (Uncopyable(torch.ones(3)), "cannot be copied into a plain tensor"),
        (BadDequantize(torch.ones(3)), "has dtype torch.float16, but the checkpoint's metadata records torch.float32"),
    ],
    ids=["uncopyable", "dequantize-changes-dtype"],
)
def test_a_subclass_that_cannot_be_saved_faithfully_is_refused_naming_the_entry(ckpt, tmp_path, entry, says):
    path = str(tmp_path / "c")
    with pytest.raises(CheckpointError) as caught:
        ckpt.schedule_save({"model": {"layer": entry}, "ok": torch.ones(2)}, checkpoint_dir=path)
    assert "'model.layer'" in str(caught.value) and says in str(caught.value)
    assert not os.path.exists(os.path.join(path, ".metadata"))
    ckpt.schedule_save({"ok": torch.ones(2)}, checkpoint_dir=path)  # the checkpointer goes on
    ckpt.finalize(blocking=True)
    assert os.path.exists(os.path.join(path, ".metadata"))


def _mapped_sizes(pid: int) -> list[int]:
    """Sizes of the shared-memory mappings of process `pid` (torch's shared storages and the slab)."""
    sizes = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and ("/dev/shm" in line or "memfd:" in line or "torch_" in line):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                sizes.append(end - start)
    return sizes


@pytest.mark.parametrize("staging", ["eager", "lazy"])
def test_a_copy_made_for_one_save_is_let_go_once_staged(tmp_path, monkeypatch, staging):
    """A subclass's values are copied for each save (on a GPU: a device copy). Neither the trainer
    nor the worker may hold that copy past the save's staging: it would cost +1x those tensors'
    memory until the next save (#41 item 6)."""
    import weakref

    from asyncckpt import CheckpointConfig
    from asyncckpt.save import snapshot as snapshot_module

    copies = []
    real = snapshot_module.shareable_tensor

    def recorded(tensor, fresh, fqn):
        shared, copied = real(tensor, fresh, fqn)
        if copied:
            copies.append(weakref.ref(shared))
        return shared, copied

    monkeypatch.setattr(snapshot_module, "shareable_tensor", recorded)
    numel = 300_001  # a size no other mapping has: 1,200,004 bytes, 294 pages
    page_rounded = -(-numel * 4 // 4096) * 4096
    with AsyncCheckpointer(str(tmp_path), CheckpointConfig(staging=staging)) as ckpt:
        state = {"w": Wrapper(torch.randn(numel)), "plain": torch.ones(3)}
        ckpt.schedule_save(state, step=0)  # a first save: its hand-off thread holds its copy until it ends
        ckpt.finalize(blocking=True)
        for step in range(1, 3):
            ckpt.schedule_save(state, step=step)
            ckpt.wait_staged()
            assert copies and all(ref() is None for ref in copies), "the trainer still holds a save's copy"
            assert page_rounded not in _mapped_sizes(ckpt.worker_pid), "the worker still maps a save's copy"
            ckpt.finalize(blocking=True)
    out = {"w": torch.zeros(numel), "plain": torch.zeros(3)}
    dcp.load(out, checkpoint_id=str(tmp_path / "step_00000002"), no_dist=True)
    assert torch.equal(out["w"], state["w"].inner)
