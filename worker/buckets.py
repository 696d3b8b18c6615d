"""Size-balanced bucketing (which item goes into which data file) and staging rounds (which items
are staged together when the staging pool is smaller than the state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from asyncckpt.layout import SAFETENSORS, TORCH_SAVE, data_file_name, in_folder
from asyncckpt.protocol import TENSOR, ItemSpec

ALIGNMENT = 64  # every staged item starts on this boundary in the staging slab


def staged_size(spec: ItemSpec) -> int:
    """Bytes an item takes in the staging slab (objects are not staged: 0)."""
    return (spec.nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT if spec.kind == TENSOR else 0


def staging_need(items: Sequence[ItemSpec]) -> int:
    """Bytes a save of `items` stages at once without a budget: every tensor, aligned."""
    return sum(staged_size(spec) for spec in items)


@dataclass
class Bucket:
    """One data file and the item positions it holds, in write order; `format` says how its
    tensors are written (a safetensors save keeps its objects in a torch_save file of their own)."""

    file_name: str
    positions: list[int] = field(default_factory=list)
    nbytes: int = 0
    format: str = TORCH_SAVE


def make_buckets(
    items: Sequence[ItemSpec],
    object_sizes: dict[int, int],
    rank: int,
    io_workers: int,
    separation_hint: Optional[str] = None,
    fmt: str = TORCH_SAVE,
    tag: str = "",
    positions: Optional[Sequence[int]] = None,
    first: int = 0,
    folder: str = "",
) -> list[Bucket]:
    """Split items into at most `io_workers` files per group, balancing bytes.

    Tensors go largest first into the lightest bucket; pickled objects are spread round-robin.
    Items whose name starts with `separation_hint` form a group of their own files. File names are
    deterministic for the same items and settings. With fmt="safetensors" the bucket files hold
    tensors only and every object goes into one more file, a torch_save `__{rank}_{n}.distcp` after them.
    `positions` limits the files to those items (an incremental save writes only what changed);
    their numbers start at `first`. With a data `folder`, every file name starts with it.
    """
    chosen = range(len(items)) if positions is None else positions
    groups: list[list[int]] = [[], []]
    for pos in chosen:
        spec = items[pos]
        separate = separation_hint is not None and spec.index.fqn.startswith(separation_hint)
        groups[1 if separate else 0].append(pos)

    buckets: list[Bucket] = []
    for members in groups:
        if not members:
            continue
        count = min(io_workers, len(members))
        group = [Bucket(file_name="") for _ in range(count)]
        tensors = [p for p in members if items[p].kind == TENSOR]
        objects = [p for p in members if items[p].kind != TENSOR and fmt != SAFETENSORS]
        if fmt == SAFETENSORS:
            count = min(io_workers, max(len(tensors), 1))
            group = group[:count]
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
        bucket.file_name = in_folder(folder, data_file_name(rank, first + n, fmt, tag))
        bucket.format = fmt
    objects = [p for p in chosen if items[p].kind != TENSOR]
    if fmt == SAFETENSORS and objects:
        name = in_folder(folder, data_file_name(rank, first + len(buckets), TORCH_SAVE, tag))
        buckets.append(Bucket(name, objects, sum(object_sizes.get(p, 0) for p in objects)))
    return buckets


@dataclass
class Round:
    """Items staged together and then written; their staged sizes fit the budget. A `streamed`
    round is one tensor larger than the budget, copied through the slab in pieces as it is written."""

    positions: list[int]
    streamed: bool = False


def plan_rounds(items: Sequence[ItemSpec], buckets: Sequence[Bucket], budget: Optional[int]) -> list[Round]:
    """Cut the save into staging rounds of at most `budget` staged bytes (one round: no budget).

    Items are taken in order of where they start in their file, so every file is written front to
    back, a round's items spread over the files (parallel writes), and each file gets its items in
    bucket order: the files are the same as without a budget."""
    if budget is None:
        return [Round([pos for bucket in buckets for pos in bucket.positions])]
    order = []
    for b, bucket in enumerate(buckets):
        start = 0
        for i, pos in enumerate(bucket.positions):
            order.append((start, b, i, pos))
            start += staged_size(items[pos])
    order.sort()
    rounds: list[Round] = []
    current: list[int] = []
    used = 0
    for _, _, _, pos in order:
        size = staged_size(items[pos])
        if size > budget:
            if current:
                rounds.append(Round(current))
            rounds.append(Round([pos], streamed=True))
            current, used = [], 0
            continue
        if used + size > budget and current:
            rounds.append(Round(current))
            current, used = [], 0
        current.append(pos)
        used += size
    if current or not rounds:
        rounds.append(Round(current))
    return rounds
