"""What writing a large `.metadata` durably costs the coordinator, measured at a size this box
can hold (the simulator's own files are MiBs; at 16,384 ranks the file is GiBs).

Two ways, alternating, on the same disk: **image** is how a steady commit writes it (the image
the coordinator kept, in page-aligned memory, with O_DIRECT: `LocalStorage.write_atomic` of a
`PageBuffer`); **pieces** is how bytes go through the page cache (each rank's entries as one
piece, `writelines`, fsync: asyncckpt's commit before the image, and DCP's `pickle.dump`).
CPU is this process's (user + system); the page cache's writeback runs in kernel threads and is
not in it, so the pieces' figure is a floor.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from dataclasses import dataclass

from asyncckpt.storage import LocalStorage
from asyncckpt.storage.page_buffer import PageBuffer

GiB = 1 << 30
PIECE = 300 << 10  # one 70B FSDP rank's encoded entries


@dataclass
class WriteCost:
    method: str  # "image" | "pieces"
    gib: float
    cpu_s: float  # median over the repeats
    wall_s: float

    @property
    def cpu_s_per_gib(self) -> float:
        return self.cpu_s / self.gib

    @property
    def wall_s_per_gib(self) -> float:
        return self.wall_s / self.gib


def write_cost(workdir: str, gib: float, repeats: int = 3) -> list[WriteCost]:
    size = int(gib * GiB) // PIECE * PIECE
    block = os.urandom(64 << 20)
    starts = range(0, len(block) - PIECE + 1, PIECE)
    pieces = [block[start:start + PIECE] for start, _ in zip(itertools.cycle(starts), range(size // PIECE))]
    image = PageBuffer(size)
    for piece in pieces:
        image.append(piece)
    storage, path = LocalStorage(), os.path.join(workdir, ".metadata")
    times: dict[str, list[tuple[float, float]]] = {"image": [], "pieces": []}
    for _ in range(repeats):
        for method, data in (("image", image), ("pieces", pieces)):
            started, cpu = time.perf_counter(), time.process_time()
            storage.write_atomic(path, data, fsync=True)
            times[method].append((time.process_time() - cpu, time.perf_counter() - started))
            os.unlink(path)
    return [WriteCost(m, size / GiB, statistics.median(c for c, _ in t), statistics.median(w for _, w in t))
            for m, t in times.items()]
