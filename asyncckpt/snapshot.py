"""Resolve a final plan into what the worker needs: tensors it can reach, and pickled objects.

CPU tensors reach the worker through shared memory: their storage is moved into shared memory in
place once (like `model.share_memory()`), so later saves hand over nothing but a key. A storage
that cannot be moved (not allocated by torch, e.g. `torch.from_numpy`) is copied into shared
memory on every save instead. A fingerprint per tensor (storage pointer, offset, shape, stride)
tells when the user reallocated a tensor, so the worker never reads an old handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .errors import CheckpointError
from .planning import PlannedSave, is_tensor_item
from .protocol import BYTES, TENSOR, ItemSpec

Fingerprint = tuple


@dataclass
class Snapshot:
    structure_key: str
    items: tuple[ItemSpec, ...]
    tensors: list[Optional[torch.Tensor]]
    fingerprints: list[Optional[Fingerprint]]
    always_fresh: frozenset[int]
    objects: dict[int, bytes]
    tensor_bytes: int
    has_cuda: bool


def take_snapshot(planned: PlannedSave) -> Snapshot:
    items, tensors, fingerprints, objects = [], [], [], {}
    always_fresh, tensor_bytes, has_cuda = set(), 0, False
    for pos, item in enumerate(planned.plan.items):
        fqn = item.index.fqn
        if not is_tensor_item(item):
            objects[pos] = _pickled_object(planned, item)
            items.append(ItemSpec(item.index, BYTES))
            tensors.append(None)
            fingerprints.append(None)
            continue
        tensor, fresh = _shareable_tensor(planned.planner.resolve_data(item), fqn)
        expected = tuple(item.tensor_data.chunk.sizes)
        if tuple(tensor.shape) != expected:
            raise CheckpointError(f"state entry {fqn!r}: resolved shape {tuple(tensor.shape)} != planned {expected}")
        if fresh:
            always_fresh.add(pos)
        has_cuda = has_cuda or tensor.is_cuda
        items.append(ItemSpec(item.index, TENSOR, tensor.dtype, tuple(tensor.shape)))
        tensors.append(tensor)
        fingerprints.append(_fingerprint(tensor))
        tensor_bytes += tensor.numel() * tensor.element_size()
    return Snapshot(
        planned.structure_key,
        tuple(items),
        tensors,
        fingerprints,
        frozenset(always_fresh),
        objects,
        tensor_bytes,
        has_cuda,
    )


def _pickled_object(planned: PlannedSave, item) -> bytes:
    try:
        return planned.planner.resolve_data(item).getvalue()
    except Exception as exc:
        raise CheckpointError(
            f"state entry {item.index.fqn!r} cannot be serialized ({type(exc).__name__}: {exc})"
        ) from exc


def _shareable_tensor(tensor, fqn: str) -> tuple[torch.Tensor, bool]:
    """Return (tensor the worker can reach, whether it is a fresh copy made for this save)."""
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"state entry {fqn!r}: planner resolved {type(tensor).__name__}, not a tensor")
    fresh = False
    if type(tensor).dequantize is not torch.Tensor.dequantize:  # not nn.Parameter: Tensor's own
        tensor, fresh = tensor.dequantize(), True  # FP8-style wrappers are stored dequantized
    tensor = tensor.detach()
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise CheckpointError(f"state entry {fqn!r}: layout {tensor.layout} is not supported")
    if tensor.is_cuda:
        return tensor, fresh
    if tensor.device.type != "cpu":
        raise CheckpointError(f"state entry {fqn!r}: device {tensor.device} is not supported (cpu or cuda)")
    if tensor.is_shared():
        return tensor, fresh
    if not fresh and tensor.untyped_storage().resizable():
        try:
            tensor.share_memory_()
            return tensor, False
        except RuntimeError:
            pass
    copy = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
    copy.copy_(tensor)
    return copy, True


def _fingerprint(tensor: torch.Tensor) -> Fingerprint:
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.device,
    )
