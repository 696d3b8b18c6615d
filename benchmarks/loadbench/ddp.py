"""The 4-rank DDP restart rows of bench_load.py: every rank loads the whole checkpoint, shared
(asyncckpt.load with the job's process group: `.metadata` read by one rank, each item by one rank
for the ranks of other nodes; on one node with a file system the ranks read through the page
cache, on an object store through the reader's /dev/shm file) against every rank reading on its
own (`no_dist=True`) and against stock `dcp.load` with the job's process group (every rank reads
`.metadata` and every item, DCP's collectives, no checksums: what a DDP job resumes with
otherwise; local checkpoints only), taken in turns in one run of the same ranks. Figures: seconds from a barrier
to the last rank done (median of the rounds); the bytes all ranks asked the storage for together
over the checkpoint's size (counted in each rank at the reader's positional reads and the
storage's whole-file reads: above the page cache); and, cold, the bytes the ranks' reads fetched
from the disk (/proc/self/io read_bytes, summed over the ranks: below the page cache). With an
s3:// checkpoint (--s3), warm only, every byte asked for is a GET."""

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

MODES = ("every rank reads", "shared (read once)", "stock dcp.load (process group)")


@dataclass
class DdpRow:
    method: str
    ranks: int
    cold_s: Optional[float]
    warm_s: Optional[float]
    bytes_over_checkpoint: Optional[float]  # storage bytes all ranks read / the checkpoint's item bytes
    disk_over_checkpoint: Optional[float] = None  # cold: bytes fetched from the disk / the checkpoint's


def _count_reads(counts: dict) -> None:
    from asyncckpt.loading.byte_sources import LocalFiles
    from asyncckpt.storage.local import LocalStorage
    from asyncckpt.storage.msc import MscStorage

    def counting(read_bytes):
        def counted_read_bytes(storage, path, offset=0, length=None):
            data = read_bytes(storage, path, offset, length)
            if not path.endswith("latest"):
                counts["bytes"] += len(data)
            return data
        return counted_read_bytes

    read, read_into = LocalFiles.read, LocalFiles.read_into

    def counted_read(source, path, offset, n):
        data = read(source, path, offset, n)
        counts["bytes"] += len(data)
        return data

    def counted_read_into(source, path, offset, buffers, what):
        counts["bytes"] += sum(len(b) for b in buffers)
        return read_into(source, path, offset, buffers, what)

    LocalStorage.read_bytes = counting(LocalStorage.read_bytes)
    LocalFiles.read, LocalFiles.read_into = counted_read, counted_read_into
    MscStorage.read_bytes = counting(MscStorage.read_bytes)


def _disk_bytes() -> Optional[int]:
    """What this process's reads fetched from the storage layer so far (None where not told)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None


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
    disk: dict[str, list[Optional[int]]] = {m: [] for m in MODES}  # cold loads only
    import torch.distributed.checkpoint as dcp

    local = "://" not in path
    loads = {MODES[0]: lambda: asyncckpt.load(target, path, no_dist=True), MODES[1]: lambda: asyncckpt.load(target, path)}
    if local:
        loads[MODES[2]] = lambda: dcp.load(target, checkpoint_id=path)
    for _ in range(rounds):
        for mode in ("cold", "warm") if local else ("warm",):
            for method, load in loads.items():
                if mode == "cold" and rank == 0:
                    _drop_cache(path)
                dist.barrier()
                counts["bytes"], disk_before = 0, _disk_bytes()
                started = time.perf_counter()
                load()
                elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
                disk_after = _disk_bytes()
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the job restarts when its last rank did
                times[method][mode].append(float(elapsed))
                read[method].append(counts["bytes"])
                if mode == "cold":
                    disk[method].append(None if disk_before is None or disk_after is None else disk_after - disk_before)
    totals = [None] * world
    dist.all_gather_object(totals, (read, disk))
    if rank == 0:
        def summed(which: int, method: str) -> list:
            rows = [t[which][method] for t in totals]
            return [None if any(r[i] is None for r in rows) else sum(r[i] for r in rows) for i in range(len(rows[0]))]
        with open(out, "w") as f:
            json.dump({"times": times, "read": {m: summed(0, m) for m in loads}, "disk": {m: summed(1, m) for m in loads}}, f)
    dist.barrier()
    dist.destroy_process_group()


def ddp_rows(path: str, ranks: int = 4, rounds: int = 3, stored_at: Optional[str] = None) -> list[DdpRow]:
    """Run `ranks` gloo ranks loading the checkpoint at `stored_at` (default `path`, its local
    copy: an s3:// URL loads warm only), both ways, in turns."""
    from asyncckpt.loading.opened import open_checkpoint

    stored = sum(info.length for info in open_checkpoint(path).metadata.storage_data.values())
    where = stored_at or path
    work = tempfile.mkdtemp(prefix="bench_load-ddp-")
    try:
        out = os.path.join(work, "out.json")
        mp.start_processes(_rank, args=(ranks, os.path.join(work, "store"), where, rounds, out), nprocs=ranks,
                           start_method="spawn")
        with open(out) as f:
            found = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def median(values: list) -> Optional[float]:
        return statistics.median(values) if values and None not in values else None
    on = " (s3)" if "://" in where else ""
    return [  # (stock DCP's reads are not counted above the page cache: it reads every item on every rank)
        DdpRow(f"{ranks}-rank DDP restart{on}, {method}", ranks, median(found["times"][method]["cold"]),
               median(found["times"][method]["warm"]), None if method == MODES[2] else max(found["read"][method]) / stored,
               None if median(found["disk"][method]) is None else median(found["disk"][method]) / stored)
        for method in MODES if method in found["read"]
    ]


def render(rows: list[DdpRow]) -> str:
    def shown(value: Optional[float], unit: str = "") -> str:
        return "-" if value is None else f"{value:.3f}" if not unit else f"{value:.2f}{unit}"
    lines = ["| restart | cold s | warm s | bytes asked of storage / checkpoint | cold: disk bytes / checkpoint |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r.method} | {shown(r.cold_s)} | {shown(r.warm_s)} | {shown(r.bytes_over_checkpoint, 'x')} | "
              f"{shown(r.disk_over_checkpoint, 'x')} |" for r in rows]
    return "\n".join(lines)
