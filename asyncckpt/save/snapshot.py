"""Resolve a final plan into what the worker needs: tensors it can reach, and pickled objects.

CPU tensors reach the worker through shared memory: their storage is moved into shared memory in
place once (like `model.share_memory()`), so later saves hand over nothing but a key. A storage
that cannot be moved (not allocated by torch, e.g. `torch.from_numpy`) is copied into shared
memory on every save instead. A fingerprint per tensor (storage pointer, offset, shape, stride)
tells when the user reallocated a tensor, so the worker never reads an old handle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..errors import CheckpointError
from .planning import PlannedSave, is_tensor_item
from ..protocol import BYTES, TENSOR, ItemIndex, ItemSpec
from .sharing import check_shm_space, ensure_fd_room, move_into_shared_memory, shareable_tensor, shared_memory_needed
from .subclasses import plain_tensor
from ..loading.safety import refused_globals, refused_objects_text

log = logging.getLogger(__name__)

Fingerprint = tuple


@dataclass
class Snapshot:
    structure_key: str
    items: tuple[ItemSpec, ...]
    tensors: list[Optional[torch.Tensor]]
    fingerprints: list[Optional[Fingerprint]]
    always_fresh: frozenset[int]
    objects: dict[int, bytes]
    cuda_devices: tuple[int, ...]  # the CUDA devices its tensors are on (each one's work must finish first)
    old_pages: dict[int, torch.UntypedStorage] = field(default_factory=dict)  # keep_old_pages: see take_snapshot
    mapped_from: str = ""  # its tensors are views of this file, mapped (mapped_copy.py): packed for the worker


def take_snapshot(planned: PlannedSave, keep_old_pages: bool = False) -> Snapshot:
    """`keep_old_pages`: the storages moved into shared memory now keep their old pages, with the
    values of this call, in `old_pages` by their new data pointer (first_save.py's private copy)."""
    items, tensors, fingerprints, objects = [], [], [], {}
    always_fresh, cuda_devices = set(), set()
    resolved: dict[int, tuple[torch.Tensor, bool]] = {}
    for pos, item in enumerate(planned.plan.items):  # resolve and check everything before moving anything
        if is_tensor_item(item):
            fqn = item.index.fqn
            tensor, fresh = _reachable_tensor(planned.planner.resolve_data(item), fqn, item.tensor_data.properties.dtype)
            expected = tuple(item.tensor_data.chunk.sizes)
            if tuple(tensor.shape) != expected:
                raise CheckpointError(f"state entry {fqn!r}: resolved shape {tuple(tensor.shape)} != planned {expected}")
            resolved[pos] = (tensor, fresh)
    sharing = shared_memory_needed(resolved.values())
    check_shm_space(sharing.nbytes)  # a full /dev/shm is a SIGBUS, not an error
    ensure_fd_room(sharing.segments)  # each shared storage holds a descriptor
    old_pages = move_into_shared_memory(resolved.values(), keep_old_pages)
    for pos, item in enumerate(planned.plan.items):
        if not is_tensor_item(item):
            objects[pos] = pickled_object(planned, item)
            items.append(ItemSpec(ItemIndex.of(item.index), BYTES))
            tensors.append(None)
            fingerprints.append(None)
            continue
        tensor, fresh = shareable_tensor(*resolved.pop(pos), item.index.fqn)
        if fresh:
            always_fresh.add(pos)
        if tensor.is_cuda:
            cuda_devices.add(tensor.device.index)
        items.append(ItemSpec(ItemIndex.of(item.index), TENSOR, tensor.dtype, tuple(tensor.shape)))
        tensors.append(tensor)
        fingerprints.append(_fingerprint(tensor))
    return Snapshot(
        planned.structure_key,
        tuple(items),
        tensors,
        fingerprints,
        frozenset(always_fresh),
        objects,
        tuple(sorted(cuda_devices)),
        old_pages,
    )


def pickled_object(planned: PlannedSave, item) -> bytes:
    try:
        return planned.planner.resolve_data(item).getvalue()
    except Exception as exc:
        raise CheckpointError(
            f"state entry {item.index.fqn!r} cannot be serialized ({type(exc).__name__}: {exc})"
        ) from exc


def _reachable_tensor(tensor, fqn: str, planned_dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """Check a resolved tensor; return (plain detached tensor, whether it is a fresh copy)."""
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"state entry {fqn!r}: planner resolved {type(tensor).__name__}, not a tensor")
    plain = plain_tensor(tensor, fqn, planned_dtype)
    tensor, fresh = plain.tensor, plain.fresh
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise CheckpointError(f"state entry {fqn!r}: layout {tensor.layout} is not supported")
    if tensor.is_cuda:
        return tensor, fresh
    if tensor.device.type != "cpu":
        raise CheckpointError(f"state entry {fqn!r}: device {tensor.device} is not supported (cpu or cuda)")
    return tensor, fresh


def _fingerprint(tensor: torch.Tensor) -> Fingerprint:
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.device,
    )


def copies_warning(snapshot: Snapshot) -> Optional[str]:
    """What to tell the user when some tensors are copied into shared memory on every save."""
    if not snapshot.always_fresh:
        return None
    names = [snapshot.items[p].index.fqn for p in sorted(snapshot.always_fresh)]
    nbytes = sum(snapshot.items[p].nbytes for p in snapshot.always_fresh)
    return (
        f"{len(names)} tensors ({nbytes / 1e6:.1f} MB, e.g. {', '.join(repr(n) for n in names[:3])}) are copied "
        "into shared memory on every save: their storage was not allocated by torch or was exported to "
        "NumPy (.numpy() makes it non-resizable), so it cannot be moved into shared memory in place"
    )


class SaveWarnings:
    """What a checkpointer tells its user once about the states it saves: tensors copied on every
    save (they cannot be shared in place), and objects that loading refuses by default (found
    otherwise only at resume; their pickles are scanned, never unpickled)."""

    def __init__(self) -> None:
        self._said_copies = False
        self._said_refused: set[str] = set()  # entries already named

    def about(self, snapshot: Snapshot) -> None:
        message = copies_warning(snapshot)
        if message and not self._said_copies:
            self._said_copies = True
            log.warning(message)
        refused = {}
        for pos, data in snapshot.objects.items():
            fqn = snapshot.items[pos].index.fqn
            if fqn not in self._said_refused and (found := refused_globals(data)):
                refused[fqn] = found
        if refused:
            self._said_refused.update(refused)
            log.warning(
                "%d state entries are saved as objects that loading refuses by default (weights_only=True): %s. "
                "Resuming will need trusted=True (load_latest, asyncckpt.load; Lightning: AsyncCheckpointIO(trusted=True)), "
                "only for checkpoints you trust; or keep these entries as tensors or plain Python values "
                "(numbers, strings, lists, dicts)", len(refused), refused_objects_text(refused),
            )
