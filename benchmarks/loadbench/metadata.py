"""The `.metadata` rows of bench_load.py (--metadata-only): how the bytes one rank read reach the
other ranks of a load, on `ranks` gloo ranks of this machine. Synthetic blobs of the sizes given
(a 70B FSDP `.metadata` is 2.4 MiB at 8 ranks, 14.6 MiB at 64 and grows with the ranks), spread
the three ways open_shared can: the plain gloo broadcast to every rank; a node at a time on one
node (the reader's file in /dev/shm, mapped by the others); and the ranks told they are two nodes
(rank 0 sends to the other node's first rank over gloo, each node shares through /dev/shm). On
one machine the "two nodes" hop is loopback TCP: what it saves is real nodes' network traffic
(one copy a node, not one a rank), which this box cannot show. Figures: the fastest of `repeat`
rounds, seconds from a barrier to the last rank holding the bytes."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

WAYS = ("plain gloo broadcast", "a node at a time, one node", "a node at a time, two nodes")


def _rank(rank: int, world: int, store: str, sizes_mib: list[int], repeat: int, out: str) -> None:
    from asyncckpt.loading.broadcast import broadcast_blobs, load_group
    from asyncckpt.loading.metadata_share import spread_blobs

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = load_group()
    rows = []
    for size in sizes_mib:
        blobs = [None, os.urandom(size << 20), b"checksums", os.urandom(1 << 20)] if rank == 0 else None
        for way, keys in zip(WAYS, (None, ["a"] * world, [f"n{r * 2 // world}" for r in range(world)])):
            times = []
            for _ in range(repeat):
                dist.barrier()
                started = time.perf_counter()
                if keys is None:
                    got = broadcast_blobs(blobs, 4, group, "bench")
                else:
                    got = spread_blobs(blobs, 4, group, "bench", keys, broadcast_blobs)
                dist.barrier()
                times.append(time.perf_counter() - started)
                assert len(got[1]) == size << 20
            rows.append(f"| {way} | {world} | {size} | {min(times):.3f} |")
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(rows))
    dist.barrier()
    dist.destroy_process_group()


def metadata_rows(ranks: int, sizes_mib: list[int], repeat: int) -> str:
    """The table (markdown) of the three ways at each size."""
    scratch = tempfile.mkdtemp(prefix="bench_metadata-")
    try:
        out = os.path.join(scratch, "rows.md")
        mp.start_processes(_rank, args=(ranks, os.path.join(scratch, "store"), sizes_mib, repeat, out),
                           nprocs=ranks, start_method="spawn")
        with open(out) as f:
            body = f.read()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return "| .metadata to the ranks | ranks | MiB | s |\n|---|---:|---:|---:|\n" + body
