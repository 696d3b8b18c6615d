"""The 4-rank DDP restart rows of bench_load.py: every rank loads the whole checkpoint, shared
(asyncckpt.load with the job's process group: `.metadata` and every item read from storage by one
rank, sent to the others over gloo) against every rank reading on its own (`no_dist=True`), taken
in turns in one run of the same ranks. Figures: seconds from a barrier to the last rank done
(median of the rounds), and the storage bytes all ranks read together over the checkpoint's size
(counted in each rank at the reader's positional reads and the storage's whole-file reads)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("every rank reads", "shared (read once)")


@dataclass
class DdpRow:
    method: str
    ranks: int
    cold_s: Optional[float]
    warm_s: Optional[float]
    bytes_over_checkpoint: float  # storage bytes all ranks read / the checkpoint's item bytes


def _count_reads(counts: dict) -> None:
    from asyncckpt.loading.byte_sources import LocalFiles
    from asyncckpt.storage.local import LocalStorage

    read_bytes, read, read_into = LocalStorage.read_bytes, LocalFiles.read, LocalFiles.read_into

    def counted_read_bytes(storage, path, offset=0, length=None):
        data = read_bytes(storage, path, offset, length)
        if not path.endswith("latest"):
            counts["bytes"] += len(data)
        return data

    def counted_read(source, path, offset, n):
        data = read(source, path, offset, n)
        counts["bytes"] += len(data)
        return data

    def counted_read_into(source, path, offset, buffers, what):
        counts["bytes"] += sum(len(b) for b in buffers)
        return read_into(source, path, offset, buffers, what)

    LocalStorage.read_bytes, LocalFiles.read, LocalFiles.read_into = counted_read_bytes, counted_read, counted_read_into


def _target(path: str) -> dict:
    """Empty tensors (and None for objects) of every entry the checkpoint holds."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from asyncckpt.loading.opened import open_checkpoint

    metadata = open_checkpoint(path).metadata
    return {fqn: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
            for fqn, meta in metadata.state_dict_metadata.items()}


def _drop_cache(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _rank(rank: int, world: int, store: str, path: str, rounds: int, out: str) -> None:
    import asyncckpt

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    counts = {"bytes": 0}
    _count_reads(counts)
    target = _target(path)
    times: dict[str, dict[str, list[float]]] = {m: {"cold": [], "warm": []} for m in MODES}
    read: dict[str, list[int]] = {m: [] for m in MODES}
    loads = {MODES[0]: lambda: asyncckpt.load(target, path, no_dist=True), MODES[1]: lambda: asyncckpt.load(target, path)}
    for _ in range(rounds):
        for mode in ("cold", "warm"):
            for method, load in loads.items():
                if mode == "cold" and rank == 0:
                    _drop_cache(path)
                dist.barrier()
                counts["bytes"] = 0
                started = time.perf_counter()
                load()
                elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the job restarts when its last rank did
                times[method][mode].append(float(elapsed))
                read[method].append(counts["bytes"])
    totals = [None] * world
    dist.all_gather_object(totals, read)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "read": {m: [sum(t[m][i] for t in totals) for i in range(len(read[m]))] for m in MODES}}, f)
    dist.barrier()
    dist.destroy_process_group()


def ddp_rows(path: str, ranks: int = 4, rounds: int = 3) -> list[DdpRow]:
    """Run `ranks` gloo ranks loading the checkpoint at `path`, both ways, in turns."""
    from asyncckpt.loading.opened import open_checkpoint

    stored = sum(info.length for info in open_checkpoint(path).metadata.storage_data.values())
    work = tempfile.mkdtemp(prefix="bench_load-ddp-")
    try:
        out = os.path.join(work, "out.json")
        mp.start_processes(_rank, args=(ranks, os.path.join(work, "store"), path, rounds, out), nprocs=ranks,
                           start_method="spawn")
        with open(out) as f:
            found = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [
        DdpRow(f"{ranks}-rank DDP restart, {method}", ranks, statistics.median(found["times"][method]["cold"]),
               statistics.median(found["times"][method]["warm"]), max(found["read"][method]) / stored)
        for method in MODES
    ]


def render(rows: list[DdpRow]) -> str:
    lines = ["| restart | cold s | warm s | storage bytes / checkpoint |", "|---|---:|---:|---:|"]
    lines += [f"| {r.method} | {r.cold_s:.3f} | {r.warm_s:.3f} | {r.bytes_over_checkpoint:.2f}x |" for r in rows]
    return "\n".join(lines)
