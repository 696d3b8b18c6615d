"""The GPU benchmark's state: a transformer trained with Adam, on the device, and what a check needs of it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

BYTES_PER_PARAMETER = 14  # bf16 weight (2) + fp32 master weight, exp_avg, exp_avg_sq (3 x 4)


@dataclass
class StateInfo:
    """What the benchmark state holds."""

    tensor_bytes: int
    tensors: int
    parameters: int
    hidden_sizes: list[int]
    blocks: int
    smallest: int
    largest: int


def build_adam_state(total_bytes: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """About `total_bytes` of a model trained with Adam, on `device`: bf16 weights under "model",
    fp32 master weights and both moments under "optim", plus Adam's step counter (a scalar
    tensor) and the loop's step (an int).

    The parameters are transformer blocks (qkv, out, up, down matrices and two norms) cycling
    through three hidden sizes, the largest chosen so there are a dozen or more blocks, and an
    embedding taking what is left."""
    parameters = max(1, total_bytes // BYTES_PER_PARAMETER)
    hidden = max(64, int(math.sqrt(parameters / 144)) // 64 * 64)  # a block of the largest size: ~1/12 of them
    sizes = [hidden, max(64, hidden * 3 // 4 // 64 * 64), max(64, hidden // 2 // 64 * 64)]
    shapes: dict[str, tuple[int, ...]] = {}
    left, block = parameters, 0
    while True:
        h = sizes[block % len(sizes)]
        layer = {"attn.qkv": (3 * h, h), "attn.out": (h, h), "mlp.up": (4 * h, h), "mlp.down": (h, 4 * h),
                 "norm1": (h,), "norm2": (h,)}
        count = sum(math.prod(shape) for shape in layer.values())
        if count > left - hidden:  # keep at least one embedding row
            break
        shapes.update({f"blocks.{block}.{name}": shape for name, shape in layer.items()})
        left -= count
        block += 1
    shapes["embed"] = (max(1, left // hidden), hidden)
    gen = torch.Generator(device=device).manual_seed(seed)
    model, master, exp_avg, exp_avg_sq = {}, {}, {}, {}
    for name, shape in shapes.items():
        master[name] = torch.randn(shape, generator=gen, device=device)
        model[name] = master[name].to(torch.bfloat16)
        exp_avg[name] = torch.randn(shape, generator=gen, device=device).mul_(1e-2)
        exp_avg_sq[name] = torch.randn(shape, generator=gen, device=device).square_().mul_(1e-4)
    return {
        "model": model,
        "optim": {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                  "step": torch.tensor(1.0, device=device)},
        "step": 1,
    }


def state_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) state, in a stable order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state) for t in state_tensors(state[key])]
    return []


def map_tensors(state: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The same nesting with every tensor replaced by fn(tensor); other values kept."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, dict):
        return {key: map_tensors(value, fn) for key, value in state.items()}
    return state


def host_copy(state: Any) -> Any:
    """A copy of the state in host memory (a copy on the CPU too: `.cpu()` there is the same tensor)."""
    return map_tensors(state, lambda t: t.detach().to("cpu", copy=True))


def zeros_like(state: Any) -> Any:
    """A load target of the same structure and devices; objects reset so a load must bring them."""
    target = map_tensors(state, torch.zeros_like)
    target["step"] = 0
    return target


def change_every_tensor(state: dict[str, Any]) -> None:
    """Add 1 to every element in place (values here are well under 128, so bf16 changes too) and
    advance the step: what an optimizer step does to the saved tensors."""
    for tensor in state_tensors(state):
        tensor.add_(1)
    state["step"] += 1


def first_difference(loaded: Any, expected: Any, path: str = "") -> Optional[str]:
    """The first entry where `loaded` differs from `expected` (bit for bit), or None."""
    if isinstance(expected, torch.Tensor):
        same = isinstance(loaded, torch.Tensor) and torch.equal(loaded, expected.to(loaded.device))
        return None if same else path
    if isinstance(expected, dict):
        for key in expected:
            found = first_difference(loaded.get(key) if isinstance(loaded, dict) else None, expected[key],
                                     f"{path}.{key}" if path else key)
            if found is not None:
                return found
        return None
    return None if loaded == expected else f"{path} ({loaded!r} != {expected!r})"


def describe_state(state: dict[str, Any]) -> StateInfo:
    """Byte count and composition of the state."""
    tensors = state_tensors(state)
    sizes = [t.numel() * t.element_size() for t in tensors]
    model = state["model"]
    hidden = sorted({t.shape[-1] for name, t in model.items() if name.endswith("norm1")}, reverse=True)
    return StateInfo(
        tensor_bytes=sum(sizes),
        tensors=len(tensors),
        parameters=sum(t.numel() for t in model.values()),
        hidden_sizes=hidden,
        blocks=sum(1 for name in model if name.endswith("norm1")),
        smallest=min(sizes),
        largest=max(sizes),
    )
