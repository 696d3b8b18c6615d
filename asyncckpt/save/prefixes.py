"""How many data folders a save spreads its files over (layout.py, "prefix spreading"): chosen
from the job's size and the write requests its ranks expect, so that no object-store prefix is
asked for more writes than S3 takes in a second. Every rank reaches the same count from the
largest expectation, which rides on the all-reduce a save starts with."""

from __future__ import annotations

import math

from ..config import CheckpointConfig
from ..layout import data_folder, prefix_count
from ..storage import Storage, is_remote


def expected_writes(config: CheckpointConfig, storage: Storage, step_dir: str, plan) -> int:
    """This rank's write requests for a save of its local `plan` into `step_dir`: its bytes split
    evenly over its files, each file a PUT or a multipart upload. 0 where the count is not chosen
    from it (set in the configuration, or a filesystem)."""
    if config.prefixes is not None or not is_remote(step_dir):
        return 0
    sizes = [_item_bytes(item) for item in plan.items]
    files = max(1, _files(config, plan.items))
    return files * storage.writes_to_upload(step_dir, -(-sum(sizes) // files))


def _files(config: CheckpointConfig, items) -> int:
    """The data files a rank writes for `items`, as the worker's make_buckets splits them: up to
    io_workers per group (the separation_hint's items are a group of their own), and with
    safetensors one more for the objects."""
    hint = config.separation_hint
    separate = sum(1 for item in items if hint is not None and item.index.fqn.startswith(hint))
    files = sum(min(config.io_workers, n) for n in (len(items) - separate, separate))
    objects = any(item.tensor_data is None for item in items)
    return files + (1 if config.format == "safetensors" and objects else 0)


def data_folder_for(config: CheckpointConfig, rank: int, ranks: int, most_writes: int, step_dir: str) -> str:
    """The data folder of this rank's files ("": the step directory itself); `most_writes` is
    the largest `expected_writes` of any rank."""
    if config.prefixes is not None:
        return data_folder(rank, config.prefixes)
    return data_folder(rank, prefix_count(ranks, most_writes) if is_remote(step_dir) else 1)


def _item_bytes(item) -> int:
    """A write item's bytes: its chunk's (a pickled object: 0, they are small)."""
    data = item.tensor_data
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
