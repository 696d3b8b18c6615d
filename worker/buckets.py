"""Size-balanced bucketing: which item goes into which data file."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from asyncckpt.protocol import TENSOR, ItemSpec


@dataclass
class Bucket:
    """One data file and the item positions it holds, in write order."""

    file_name: str
    positions: list[int] = field(default_factory=list)
    nbytes: int = 0


def data_file_name(rank: int, n: int) -> str:
    return f"__{rank}_{n}.distcp"


def make_buckets(
    items: Sequence[ItemSpec],
    object_sizes: dict[int, int],
    rank: int,
    io_workers: int,
    separation_hint: Optional[str] = None,
) -> list[Bucket]:
    """Split items into at most `io_workers` files per group, balancing bytes.

    Tensors go largest first into the lightest bucket; pickled objects are spread round-robin.
    Items whose name starts with `separation_hint` form a group of their own files. File names are
    deterministic for the same items and settings.
    """
    groups: list[list[int]] = [[], []]
    for pos, spec in enumerate(items):
        separate = separation_hint is not None and spec.index.fqn.startswith(separation_hint)
        groups[1 if separate else 0].append(pos)

    buckets: list[Bucket] = []
    for positions in groups:
        if not positions:
            continue
        count = min(io_workers, len(positions))
        group = [Bucket(file_name="") for _ in range(count)]
        tensors = [p for p in positions if items[p].kind == TENSOR]
        objects = [p for p in positions if items[p].kind != TENSOR]
        for pos in sorted(tensors, key=lambda p: (-items[p].nbytes, p)):
            lightest = min(group, key=lambda b: b.nbytes)
            lightest.positions.append(pos)
            lightest.nbytes += items[pos].nbytes
        for i, pos in enumerate(objects):
            bucket = group[i % count]
            bucket.positions.append(pos)
            bucket.nbytes += object_sizes.get(pos, 0)
        buckets.extend(b for b in group if b.positions)

    for n, bucket in enumerate(buckets):
        bucket.file_name = data_file_name(rank, n)
    return buckets
