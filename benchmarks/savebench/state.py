"""The benchmark state: mixed-size float32/bf16 tensors plus small objects, changed a little between saves."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .common import KiB, MiB


@dataclass
class StateInfo:
    """What the benchmark state holds."""

    tensor_bytes: int
    tensors: int
    float32: int
    bfloat16: int
    smallest: int
    largest: int
    objects: int


def build_state(total_bytes: int, seed: int = 0) -> dict[str, Any]:
    """A DCP state dict of mixed-size float32/bf16 tensors (4 KiB .. 64 MiB) plus small items.

    Half the draws are small (4-256 KiB: biases, norms), half large (256 KiB .. min(64 MiB,
    total/8)), log-uniform; bf16 goes under "model", float32 under "optim"."""
    gen = torch.Generator().manual_seed(seed)
    largest = max(256 * KiB, min(64 * MiB, total_bytes // 8))
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    remaining, i = total_bytes, 0
    while remaining >= 4 * KiB:
        lo, hi = (4 * KiB, 256 * KiB) if i % 2 == 0 else (256 * KiB, largest)
        u = torch.rand(1, generator=gen).item()
        nbytes = min(remaining, int(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))))
        nbytes -= nbytes % 4
        bf16 = torch.rand(1, generator=gen).item() < 0.35
        dtype = torch.bfloat16 if bf16 else torch.float32
        numel = nbytes // (2 if bf16 else 4)
        cols = 1024 if numel >= 1024 * 4 else 1
        tensor = torch.randn(numel // cols, cols, generator=gen, dtype=torch.float32).to(dtype)
        (model if bf16 else optim)[f"layer{i:04d}.weight"] = tensor
        remaining -= tensor.numel() * tensor.element_size()
        i += 1
    return {
        "model": model,
        "optim": optim,
        "step": 0,
        "run_name": "bench_save",
        "lr_schedule": [1e-3, 5e-4, 2.5e-4],
        "extra": {"epoch": 3, "tags": ["bench", "cpu"]},
    }


def fresh_copy(state: dict[str, Any]) -> dict[str, Any]:
    """The same state in new tensors of ordinary memory: what a method's first save meets in a
    new training job. (asyncckpt moves a state's CPU tensors into shared memory in place at its
    first save; a later row on the same tensors would find them moved already.)"""
    copy = dict(state)
    for group in ("model", "optim"):
        copy[group] = {name: tensor.clone() for name, tensor in state[group].items()}
    return copy


def state_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of the state, in a stable order."""
    return [t for group in ("model", "optim") for t in state[group].values()]


def describe_state(state: dict[str, Any]) -> StateInfo:
    """Byte count and composition of the state."""
    tensors = state_tensors(state)
    sizes = [t.numel() * t.element_size() for t in tensors]
    return StateInfo(
        tensor_bytes=sum(sizes),
        tensors=len(tensors),
        float32=sum(t.dtype == torch.float32 for t in tensors),
        bfloat16=sum(t.dtype == torch.bfloat16 for t in tensors),
        smallest=min(sizes),
        largest=max(sizes),
        objects=sum(1 for key in state if key not in ("model", "optim")),
    )


def mutate(state: dict[str, Any], step: int) -> None:
    """Change the state a little, in place, so every save writes new values."""
    state["step"] = step
    for t in state_tensors(state)[step % 16 :: 16]:
        t.add_(1e-3)
