"""Tensor subclasses on the trainer side, in one place.

Raw tensor operations (`is_pinned`, `untyped_storage`, `data_ptr`, `share_memory_`) mean
something only on a tensor that owns its memory. A DTensor is a wrapper: where CUDA is present,
`is_pinned()` on it raises ("no sharding strategy registered"), and its storage is not its data's
on any machine. So the trainer side applies raw operations only to `local_tensor(t)` (a DTensor's
local shard) or to what `plain_tensor` returns for a state entry of any other tensor type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError

PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds `tensor`'s values on this rank: a DTensor's local shard, else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class PlainTensor:
    """What a save stores for one entry: a plain tensor, and whether it is a copy made for this
    save (then it is copied again at every save: nothing of the caller's memory can be kept)."""

    tensor: torch.Tensor
    fresh: bool


def plain_tensor(tensor: torch.Tensor, fqn: str, planned_dtype: torch.dtype) -> PlainTensor:
    """A plain `torch.Tensor` holding `tensor`'s values, as DCP's metadata describes it.

    - `torch.Tensor`, `nn.Parameter`: itself, detached.
    - a subclass with its own `dequantize()` (FP8 / quantized wrappers): its dequantized values,
      which must keep the dtype the plan recorded (`.metadata` promises that dtype to a loader).
    - a wrapper subclass (its own `__torch_dispatch__`, e.g. float8 training weights): a copy,
      taken through the subclass's own dispatch.
    - any other subclass (storage-backed, e.g. made with `as_subclass`): a plain view of its memory.
    Anything else is refused with a CheckpointError naming the entry."""
    kind = type(tensor)
    if kind in PLAIN_TYPES:
        return PlainTensor(tensor.detach(), False)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if kind.dequantize is not torch.Tensor.dequantize:
        try:
            values = tensor.dequantize()
        except Exception as exc:
            raise CheckpointError(f"state entry {fqn!r}: {name}.dequantize() failed ({type(exc).__name__}: {exc})") from exc
        result = PlainTensor(values.detach(), True)
        how = f"{name}.dequantize()"
    elif kind.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        try:
            with torch._C.DisableTorchFunctionSubclass():
                copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
                copy.copy_(tensor.detach())
        except Exception as exc:
            raise CheckpointError(
                f"state entry {fqn!r}: a {name} cannot be copied into a plain tensor ({type(exc).__name__}: {exc}); "
                "give the class a dequantize() that returns a plain tensor of its dtype, or save its inner tensors "
                "(or a plain copy) instead"
            ) from exc
        result = PlainTensor(copy, True)
        how = f"a copy of {name}"
    else:
        with torch._C.DisableTorchFunctionSubclass():
            result = PlainTensor(tensor.detach().as_subclass(torch.Tensor), False)
        how = name
    if type(result.tensor) is not torch.Tensor:
        raise CheckpointError(
            f"state entry {fqn!r}: {how} is a {type(result.tensor).__name__}, not a plain tensor: not supported"
        )
    if result.tensor.dtype != planned_dtype:
        raise CheckpointError(
            f"state entry {fqn!r}: {how} has dtype {result.tensor.dtype}, but the checkpoint's metadata records "
            f"{planned_dtype} (the dtype the {name} reports): a loader would read wrong values. Convert the entry "
            "to a plain tensor of the dtype you want to save"
        )
    return result
