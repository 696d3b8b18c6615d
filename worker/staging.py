"""The host staging pool: one reused slab, carved into compact per-item storages.

Each staged tensor is a `torch.frombuffer` view over its own slice of the slab, so it owns a
storage of exactly its size: `torch.save` then writes just that chunk, never the whole slab.
The slab is allocated once and grown only when a larger structure arrives (pinned on GPU).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from asyncckpt.protocol import TENSOR, ItemSpec

ALIGNMENT = 64


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class StagingPool:
    def __init__(self, pin_memory: bool = False) -> None:
        self._pin = pin_memory
        self._slab: Optional[torch.Tensor] = None
        self.generation = 0  # bumps when the slab is replaced; views of older generations are stale
        self._stream = None

    @property
    def capacity(self) -> int:
        return 0 if self._slab is None else self._slab.numel()

    def layout(self, items: Sequence[ItemSpec]) -> list[Optional[torch.Tensor]]:
        """Compact staging tensors for every tensor item (None for objects)."""
        offsets, total = [], 0
        for spec in items:
            offsets.append(total)
            if spec.kind == TENSOR:
                total += _align(spec.nbytes)
        self._ensure_capacity(total)
        buffer = self._slab.numpy()
        views: list[Optional[torch.Tensor]] = []
        for spec, start in zip(items, offsets):
            if spec.kind != TENSOR:
                views.append(None)
            elif spec.nbytes == 0:
                views.append(torch.empty(spec.shape, dtype=spec.dtype))
            else:
                flat = torch.frombuffer(buffer[start : start + spec.nbytes], dtype=torch.uint8)
                views.append(flat.view(spec.dtype).view(spec.shape))
        return views

    def _ensure_capacity(self, nbytes: int) -> None:
        if self._slab is not None and self._slab.numel() >= nbytes:
            return
        self._slab = None  # drop the old slab before allocating the new one
        self._slab = torch.empty(max(nbytes, ALIGNMENT), dtype=torch.uint8, pin_memory=self._pin)
        self.generation += 1

    def copy_in(self, sources: Sequence[Optional[torch.Tensor]], views: Sequence[Optional[torch.Tensor]]) -> int:
        """Copy every source tensor into its staging view; return the bytes copied.

        GPU sources are copied with non-blocking copies on a side stream and one synchronize."""
        copied = 0
        on_gpu = any(s is not None and s.is_cuda for s in sources)
        if on_gpu:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            with torch.cuda.stream(self._stream):
                for src, dst in zip(sources, views):
                    if src is not None:
                        dst.copy_(src, non_blocking=src.is_cuda)
                        copied += dst.nbytes
            self._stream.synchronize()
        else:
            for src, dst in zip(sources, views):
                if src is not None:
                    dst.copy_(src)
                    copied += dst.nbytes
        return copied

