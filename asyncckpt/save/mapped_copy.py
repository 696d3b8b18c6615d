"""The persist of a copy `load_latest` restored from memory, taken from the memory tier's file.

A restored copy newer than the disk is written in the background (MemoryTier.persist_restored).
Its bytes are in the tier's file, checked (CRC32C) by the restore, and nothing changes them until
the new worker seals a save of its own: that goes into a fresh file (a new inode) renamed over
this one, so a mapping of the old file keeps its pages. The persist's snapshot is therefore views
of that file, mapped: `load_latest` moves nothing into shared memory and copies nothing, and the
training steps after it may change the state at once. The hand-off thread packs the views into
one shared segment for the worker (first_save.HandOff), off the trainer's path. The trainer's own
tensors reach the worker at the job's first save (or `prepare`), as in any new job. A rank whose
copy a restart read from another node (memory_replicas) has no such file here: its persist
snapshots the state just loaded, as any save does.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from ..memory_file import NotACopy, read_copy
from ..protocol import BYTES, TENSOR, ItemIndex, ItemSpec
from .planning import PlannedSave, is_tensor_item
from .snapshot import Snapshot, pickled_object


def mapped_snapshot(planned: PlannedSave, path: str, token: str) -> Optional[Snapshot]:
    """A snapshot of `planned` whose tensors are views of the copy in `path` (the save `token`).
    None when the file no longer holds that save or a tensor of the plan is not there with its
    dtype and size: the caller then snapshots the trainer's tensors, as for any save."""
    try:
        copy = read_copy(path)
        rows = json.loads(copy.plan)["items"]
    except (NotACopy, ValueError, KeyError, TypeError):
        return None
    if copy.token != token or len(rows) != len(copy.items):
        return None
    where = {(row["fqn"], _offset(row["offset"])): (row, stored) for row, stored in zip(rows, copy.items)}
    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path)))  # (lazy: no read)
    items, tensors, objects = [], [], {}
    for pos, item in enumerate(planned.plan.items):
        index = ItemIndex.of(item.index)
        if not is_tensor_item(item):
            objects[pos] = pickled_object(planned, item)
            items.append(ItemSpec(index, BYTES))
            tensors.append(None)
            continue
        dtype, shape = item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes)
        spec = ItemSpec(index, TENSOR, dtype, shape)
        row, stored = where.get((item.index.fqn, _offset(item.index.offset)), (None, None))
        if (row is None or row.get("dtype") != str(dtype).removeprefix("torch.") or stored.length != spec.nbytes
                or stored.at % dtype.itemsize):
            return None
        items.append(spec)
        tensors.append(whole[stored.at:stored.at + spec.nbytes].view(dtype).view(shape))
    return Snapshot(planned.structure_key, tuple(items), tensors, [None] * len(tensors),
                    always_fresh=frozenset(pos for pos, t in enumerate(tensors) if t is not None),  # the worker keeps none
                    objects=objects, cuda_devices=(), mapped_from=path)


def _offset(offset) -> Optional[tuple[int, ...]]:
    return None if offset is None else tuple(int(x) for x in offset)
