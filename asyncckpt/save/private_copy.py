"""A private copy of a state dict, taken again and again into the same memory, so a save need not
wait for its worker while it is busy with an earlier save (the Lightning plugin's held saves).

A first save to a worker still starting is AsyncCheckpointer's own hand-off (first_save.py), for
every entry point; the plugin holds a copy of this kind then only where that hand-off is not made
(CUDA tensors, the memory tier). The copy lands in ordinary memory, as DCP's own staging copy does:
copying into shared memory directly costs 2-3x more on the caller's thread (tmpfs pages are
allocated, zeroed and faulted in one at a time).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from .sharing import shm_bytes
from .subclasses import local_tensor

_COPYABLE = (torch.Tensor, torch.nn.Parameter, DTensor)


class HeldCopy:
    """A private copy of a state (tensors copied, containers rebuilt, other objects deep-copied: the
    save pickles them later, and they must keep the values they had at the call), taken again and
    again into the same memory: each `take` copies a tensor into the one it copied the same path
    into last time when shape and dtype match. Once a save has moved that memory into shared
    memory, a later take copies at memcpy speed (no page is allocated or faulted in again) and the
    worker, which holds those tensors, is sent none. A copy must not be taken again before the save
    of the previous one is staged."""

    def __init__(self, device_to_host: bool = False) -> None:
        self.device_to_host = device_to_host  # copy tensors on a device (GPU) into host memory too
        self._tensors: dict[tuple, torch.Tensor] = {}  # path -> the plain tensor copied into last time

    def take(self, state: Any) -> Optional[Any]:
        """A copy of `state` in this copy's memory where it fits, or None where a copy is not cheap
        and safe: a tensor off the CPU (unless `device_to_host`), pinned, or a subclass other than
        DTensor (e.g. ShardedTensor) that a copy might not preserve, or an object that cannot be
        deep-copied."""
        if not _copyable(state, self.device_to_host):
            return None
        used: dict[tuple, torch.Tensor] = {}
        try:
            out = self._copy(state, (), used)
        except (TypeError, ValueError, AttributeError, copy.Error, RuntimeError):  # deepcopy refused an object
            return None
        self._tensors = used  # memory no path uses any more is let go
        return out

    def bytes_to_share(self, state: Any, path: tuple = ()) -> int:
        """The bytes of shared memory a save of `take(state)` would newly need: its tensors'
        (page-rounded), except those landing in memory of this copy that is shared already."""
        if isinstance(state, dict):
            return sum(self.bytes_to_share(v, path + (k,)) for k, v in state.items())
        if isinstance(state, (list, tuple)):
            return sum(self.bytes_to_share(v, path + (i,)) for i, v in enumerate(state))
        if not isinstance(state, torch.Tensor):
            return 0
        if type(state) is DTensor:  # cloned afresh by every take: its local shard moves into shared memory
            local = local_tensor(state)
            return shm_bytes(local.numel() * local.element_size()) if local.device.type == "cpu" else 0
        target = self._tensors.get(path)
        if (target is not None and target.shape == state.shape and target.dtype == state.dtype
                and target.untyped_storage().is_shared()):
            return 0
        return shm_bytes(state.numel() * state.element_size())

    def _copy(self, state: Any, path: tuple, used: dict) -> Any:
        if isinstance(state, dict):
            out = copy.copy(state)  # keeps its type (OrderedDict, ...) and order
            for k, v in state.items():
                out[k] = self._copy(v, path + (k,), used)
            return out
        if type(state) in (list, tuple):
            return type(state)(self._copy(v, path + (i,), used) for i, v in enumerate(state))
        if not isinstance(state, torch.Tensor):
            return copy.deepcopy(state)
        if type(state) is DTensor:
            return state.detach().clone().requires_grad_(state.requires_grad)
        # DCP's metadata records dtype, layout, requires_grad (memory format: always contiguous)
        target = self._tensors.get(path)
        if target is None or target.shape != state.shape or target.dtype != state.dtype:
            target = torch.empty(state.shape, dtype=state.dtype)  # host memory, for a device tensor too
        used[path] = target.copy_(state.detach())
        if isinstance(state, torch.nn.Parameter):
            return torch.nn.Parameter(target, requires_grad=state.requires_grad)
        return target.detach().requires_grad_(state.requires_grad)


def _copyable(state: Any, device_to_host: bool = False) -> bool:
    if isinstance(state, dict):
        return all(_copyable(v, device_to_host) for v in state.values())
    if isinstance(state, (list, tuple)):
        return type(state) in (list, tuple) and all(_copyable(v, device_to_host) for v in state)
    if isinstance(state, torch.Tensor):
        if type(state) not in _COPYABLE:
            return False
        if state.device.type != "cpu":
            return device_to_host and type(state) is not DTensor
        return not local_tensor(state).is_pinned()  # never a raw op on the wrapper: a DTensor has none
    return True
