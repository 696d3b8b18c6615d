"""The restart at scale (issue #45): what opening one checkpoint costs a job of N ranks, asyncckpt's
load against stock dcp.load, on the checkpoint `measure()` just wrote (asyncckpt's).

Stock dcp.load: every rank reads and unpickles `.metadata` itself (FileSystemReader.read_metadata):
N reads of the file from storage; the ranks' load plans are gathered and sent back unchanged
(`create_default_global_load_plan`). asyncckpt: rank 0 reads and checks it and sends its bytes to
the others (loading/broadcast.py), which unpickle them (one read from storage); the coordinator
also finds the items several ranks read (loading/read_shares.assign_shared_reads, with every rank's
node) and every plan carries that verdict. Each rank's load plan is fabricated as DCP would make
it for the rank that saved it (the same world): a ReadItem per item of its local save plan (DDP:
every item). No tensor is read.
"""

from __future__ import annotations

import gc
import os
import pickle
import time
from dataclasses import dataclass

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import create_default_global_load_plan
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from asyncckpt.layout import METADATA_FILE
from asyncckpt.loading.opened import opened_from_bytes
from asyncckpt.loading.read_shares import assign_shared_reads, plan_note
from asyncckpt.storage import storage_for

from .report import fit
from .shapes import JobShape

RANKS_PER_NODE = 8


@dataclass
class RestartRow:
    shape: str
    ranks: int
    method: str  # "asyncckpt" | "dcp"
    metadata_bytes: int  # one `.metadata`
    metadata_storage_bytes: int  # read from storage by the whole job
    rank_open_s: float  # CPU seconds a rank spends making `.metadata` a Metadata (read + unpickle, or unpickle)
    coordinator_plan_s: float  # CPU seconds of the coordinator's global load planning
    coordinator_sends: int  # bytes of every rank's plan as the coordinator sends them back (pickled)
    rank_receives: int  # bytes a rank receives: its plan (and asyncckpt: `.metadata`'s bytes)


def restart_rows(shape: JobShape, ranks: int, step_dir: str) -> list[RestartRow]:
    """asyncckpt's restart row and stock dcp.load's for `shape` at `ranks`, from `step_dir`."""
    path = os.path.join(step_dir, METADATA_FILE)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        data = f.read()
    gc.collect()
    started = time.process_time()
    metadata = FileSystemReader(step_dir).read_metadata()
    dcp_open_s = time.process_time() - started
    del metadata
    gc.collect()
    started = time.process_time()
    metadata = opened_from_bytes(step_dir, storage_for(step_dir), data).metadata  # what every rank does with the bytes
    our_open_s = time.process_time() - started
    plans = [_load_plan(shape, ranks, rank) for rank in range(ranks)]

    gc.collect()
    started = time.process_time()
    dcp_plans = create_default_global_load_plan(plans)
    dcp_plan_s = time.process_time() - started
    dcp_sent = [len(pickle.dumps(plan)) for plan in dcp_plans]

    ours_in = [LoadPlan(plan.items, storage_data=plan_note(plan, f"node{rank // RANKS_PER_NODE}"))  # (each rank's own)
               for rank, plan in enumerate(plans)]
    gc.collect()
    started = time.process_time()
    our_plans = assign_shared_reads(create_default_global_load_plan(ours_in), metadata)
    our_plan_s = time.process_time() - started
    our_sent = [len(pickle.dumps(plan)) for plan in our_plans]
    return [
        RestartRow(shape.name, ranks, "asyncckpt", size, size, our_open_s, our_plan_s, sum(our_sent), size + max(our_sent)),
        RestartRow(shape.name, ranks, "dcp", size, size * ranks, dcp_open_s, dcp_plan_s, sum(dcp_sent), max(dcp_sent)),
    ]


def _load_plan(shape: JobShape, ranks: int, rank: int) -> LoadPlan:
    """DCP's local load plan of `rank` restoring what it saved: a ReadItem per item it holds."""
    items = []
    for write in shape.local_plan(ranks, rank).items:
        if write.tensor_data is None:
            items.append(ReadItem(LoadItemType.BYTE_IO, write.index, (0,), write.index, (0,), (0,)))
        else:
            chunk = write.tensor_data.chunk
            zeros = tuple(0 for _ in chunk.sizes)
            items.append(ReadItem(LoadItemType.TENSOR, write.index, zeros, write.index, zeros, tuple(chunk.sizes)))
    return LoadPlan(items)


def restart_table(rows: list[RestartRow]) -> str:
    head = ("| shape | ranks | method | .metadata MiB | read from storage MiB | rank opens it s | coord plans s "
            "| coord sends MiB | rank gets KiB |\n|---|---:|---|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r.shape} | {r.ranks} | {r.method} | {r.metadata_bytes / 2**20:.1f} "
                     f"| {r.metadata_storage_bytes / 2**20:.1f} | {r.rank_open_s:.3f} | {r.coordinator_plan_s:.3f} "
                     f"| {r.coordinator_sends / 2**20:.1f} | {r.rank_receives / 2**10:.0f} |")
    return "\n".join(lines)


def restart_fits(rows: list[RestartRow]) -> dict:
    """(shape, method) -> the fits of the coordinator's planning seconds and of what it sends,
    over the rank counts (report.fit: the exponent is the log-log slope)."""
    groups: dict = {}
    for row in rows:
        groups.setdefault((row.shape, row.method), []).append(row)
    return {key: (fit([(r.ranks, r.coordinator_plan_s) for r in group]), fit([(r.ranks, r.coordinator_sends) for r in group]))
            for key, group in groups.items()}
