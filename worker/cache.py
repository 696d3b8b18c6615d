"""The worker's structure cache: what the trainer sent for the current plan structure.

The trainer sends the item list with a new structure key, and every tensor the worker does not
hold yet (those it holds under the previous structure are named by position); afterwards only the
key, plus the tensors it reallocated. The cache keeps one structure per slot (the request names
its slot): a new key replaces that slot's structure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from asyncckpt.protocol import CACHE_SLOTS, TENSOR, ItemSpec, SaveRequest


class CacheMiss(Exception):
    """The trainer referred to a structure or a tensor this worker does not hold."""


@dataclass
class CachedStructure:
    key: str
    items: tuple[ItemSpec, ...]
    sources: list[Optional[torch.Tensor]]
    views: list[Optional[torch.Tensor]] = field(default_factory=list)
    views_generation: int = -1
    layout_key: tuple = ()  # the staging rounds the views were laid out for
    plan: bytes = b""  # the memory tier: the trainer's description of the items, for the header


    def release(self, positions) -> None:
        """Let go of the tensors at `positions` (copies the trainer made for one save: every
        save sends them again). A CUDA one's block goes back to the trainer when dropped."""
        for pos in positions:
            self.sources[pos] = None


class StructureCache:
    def __init__(self) -> None:
        self.slots: list[Optional[CachedStructure]] = [None] * CACHE_SLOTS

    def apply(self, request: SaveRequest) -> tuple[CachedStructure, bool]:
        """Resolve the request to cached sources. Returns (entry, hit) where hit means the
        structure was already known."""
        slot = request.slot
        if not (isinstance(slot, int) and 0 <= slot < CACHE_SLOTS):
            raise CacheMiss(f"no cache slot {slot!r} (this worker has {CACHE_SLOTS})")
        hit = request.items is None
        if not hit:
            previous, self.slots[slot] = self.slots[slot], None
            if request.kept_tensors and (previous is None or previous.key != request.kept_from):
                held = previous.key[:12] if previous else "nothing"
                raise CacheMiss(f"structure {request.kept_from[:12]} to keep tensors from is not cached (worker holds {held})")
            sources: list[Optional[torch.Tensor]] = [None] * len(request.items)
            for pos, held_pos in request.kept_tensors.items():
                sources[pos] = previous.sources[held_pos]
            del previous  # the handles not kept are released here
            self.slots[slot] = CachedStructure(key=request.structure_key, items=request.items, sources=sources)
        entry = self.slots[slot]
        if entry is None or entry.key != request.structure_key:
            held = entry.key[:12] if entry else "nothing"
            raise CacheMiss(f"structure {request.structure_key[:12]} is not cached (worker holds {held})")
        if request.memory is not None and request.memory.plan is not None:
            entry.plan = request.memory.plan
        for pos, tensor in request.fresh_tensors.items():
            entry.sources[pos] = tensor
        missing = [
            spec.index.fqn for spec, src in zip(entry.items, entry.sources) if spec.kind == TENSOR and src is None
        ]
        if missing:
            self.slots[slot] = None
            raise CacheMiss(f"no tensor held for {missing[:3]}")
        return entry, hit

    def clear(self) -> None:
        self.slots = [None] * CACHE_SLOTS
