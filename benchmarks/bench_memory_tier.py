"""Steady blocked time with the memory tier on and off, side by side (issue #30: on <= 1.05x off).

One state (savebench.state.build_state), two checkpointers on two roots of the same disk, one with
`memory_tier=True` (its slab a file in /dev/shm), one without (an anonymous memfd). After `prepare`
and one warm-up save each, saves alternate off / on / on memory-only (the order rotates each round,
so each follows each), each finalized (blocking) and its retention done before the next, so blocked
time is the staging hand-off alone. Median of --saves.

Then (--restarts) the restart: `load_latest` of a root whose newest save is committed and held by
the tier, cold (the disk's pages dropped, as bench_load.py's restart rows), from memory and from
the disk alternating; median seconds, CPU seconds of this process (its reading threads), ratio.
Beside them, the floor of a restore from memory: every byte of the memory copy's items read into
touched memory and checksummed as the loader does (`os.preadv` of 256 KiB, its CRC32C right
after, on the loader's threads), with no planning and no targets to find: how close the restore
is to what this box allows, and the most "disk / memory" could reach here. The rows of a new
checkpointer restoring a copy newer than the disk (after a crash) are measured in a later phase,
beside a floor and a cold disk restart (a new checkpointer without the tier) of their own, and
compared with those: the box drifts between phases.

    python benchmarks/bench_memory_tier.py --size-mb 1024 --saves 7 --restarts 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from savebench.state import build_state, state_tensors  # noqa: E402
from loadbench.measure import check_equal, drop_cache, empty_like_state, restart_rows  # noqa: E402

from asyncckpt import AsyncCheckpointer, CheckpointConfig  # noqa: E402
from asyncckpt.formats import crc32c  # noqa: E402
from asyncckpt.loading.byte_sources import LocalFiles  # noqa: E402
from asyncckpt.memory_file import memory_file_name, read_copy  # noqa: E402

FLOOR = "floor: preadv + CRC32C, no planning"
CRASH_FLOOR = "floor, beside the three rows below"
CRASH_DISK = "restart from disk, beside them"
KEPT = "from memory, after a clean close (memory_keep)"
CRASHED = "from memory, after a crash (+ persist staged)"
PERSISTED = "from memory, restored copy persisted"
DISK = "restart from disk (load_latest)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--saves", type=int, default=7)
    parser.add_argument("--restarts", type=int, default=7, help="cold restarts from memory and from disk, each")
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-steady", action="store_true", help="only the restart rows")
    args = parser.parse_args()
    os.makedirs("bench_out", exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench_memory_tier-", dir="bench_out")
    state = build_state(args.size_mb << 20)
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(state))
    rows = {"memory_tier=False": [], "memory_tier=True": [], "memory_tier=True, memory_only": []}
    staging = {name: [] for name in rows}
    try:
        off = AsyncCheckpointer(os.path.join(workdir, "off"), CheckpointConfig(keep_last=1))
        on = AsyncCheckpointer(os.path.join(workdir, "on"), CheckpointConfig(keep_last=1, memory_tier=True))
        with off, on:
            for ckpt in () if args.skip_steady else (off, on):
                ckpt.prepare(state)
                ckpt.schedule_save(state, step=0)
                ckpt.finalize(blocking=True)
            configs = [("memory_tier=False", off, False), ("memory_tier=True", on, False),
                       ("memory_tier=True, memory_only", on, True)]
            for step in range(1, 0 if args.skip_steady else args.saves + 1):
                for name, ckpt, memory_only in configs[step % 3:] + configs[:step % 3]:  # each follows each
                    ckpt.schedule_save(state, step=step, memory_only=memory_only)
                    report = ckpt.finalize(blocking=True)[-1]
                    ckpt.wait_tidy()  # retention's deletes would run into the next config's save
                    rows[name].append(report.blocked_s)
                    staging[name].append(report.staging_s)
        restart = restarts(state, workdir, args.restarts) if args.restarts else {}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not args.skip_steady:
        base = statistics.median(rows["memory_tier=False"])
        print(f"\nsteady blocked time, {nbytes / 2**20:.0f} MiB state, {len(state_tensors(state))} tensors, "
              f"median of {args.saves} saves")
        print(f"{'config':<32} {'blocked s':>10} {'staging s':>10} {'vs off':>7}")
        for name, values in rows.items():
            median = statistics.median(values)
            print(f"{name:<32} {median:>10.3f} {statistics.median(staging[name]):>10.3f} {median / base:>6.2f}x")
    ratio = None
    if args.restarts:
        floor = statistics.median(w for w, _ in restart[FLOOR])
        disk = statistics.median(w for w, _ in restart[DISK])
        print(f"\ncold restart (load_latest) of {nbytes / 2**20:.0f} MiB, alternating, median of {args.restarts}")
        print(f"{'from':<48} {'s':>7} {'CPU s':>7} {'/floor':>7} {'disk/':>6}")
        for name, values in restart.items():
            wall = statistics.median(w for w, _ in values)
            later = name in (CRASH_FLOOR, CRASHED, PERSISTED, CRASH_DISK)  # compared within their own phase
            base, cold = (statistics.median(w for w, _ in restart[key]) for key in
                          ((CRASH_FLOOR, CRASH_DISK) if later else (FLOOR, DISK)))
            print(f"{name:<48} {wall:>7.3f} {statistics.median(c for _, c in values):>7.3f} {wall / base:>6.2f}x "
                  f"{cold / wall:>5.2f}x")
        ratio = disk / statistics.median(w for w, _ in restart[KEPT])
        print("(the last four rows: a later phase, compared with the floor and disk restart beside them)")
        print(f"goals: from memory <= 1.3x the floor, and >= 2x faster than the disk (disk/floor here: {disk / floor:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"state_bytes": nbytes, "blocked_s": rows, "staging_s": staging, "restart_s_cpu_s": restart,
                       "restart_ratio": ratio}, f, indent=1)
    return 0


def restarts(state: dict, workdir: str, repeat: int) -> dict[str, list[tuple[float, float]]]:
    """(seconds, CPU seconds) of each cold load_latest, from memory and from the disk in turn."""
    root = os.path.join(workdir, "restart")
    box = [empty_like_state(state)]
    times: dict[str, list[tuple[float, float]]] = {}
    with restart_rows(root, state, box) as rows:
        rows = [(KEPT if name == "restart from memory" else name, load) for name, load in rows]
        rows = [*rows, (FLOOR, floor_read(os.path.join(CheckpointConfig().memory_dir, memory_file_name(root, 0))))]
        for _ in range(repeat):
            for name, load in rows:
                drop_cache(root)
                wall, cpu = time.perf_counter(), time.process_time()
                load()
                times.setdefault(name, []).append((time.perf_counter() - wall, time.process_time() - cpu))
    check_equal(box[0], state)
    times.update(crash_restarts(state, os.path.join(workdir, "crash"), repeat))
    return times


def crash_restarts(state: dict, root: str, repeat: int) -> dict[str, list[tuple[float, float]]]:
    """A copy newer than the disk (a memory-only save, as a crash after staging leaves one):
    load_latest restores it and stages its persist (the write commits in the background, at the
    next finalize); then, once it is committed, load_latest of that very save from memory."""
    config = CheckpointConfig(memory_tier=True, memory_keep=True)
    box = [empty_like_state(state)]
    times: dict[str, list[tuple[float, float]]] = {}
    with AsyncCheckpointer(root, config) as ckpt:
        ckpt.schedule_save(state, step=1)
    tier_file = os.path.join(config.memory_dir, memory_file_name(root, 0))
    for n in range(repeat):
        with AsyncCheckpointer(root, config) as ckpt:
            ckpt.schedule_save(state, step=2 + n, memory_only=True)
        floor = floor_read(tier_file)  # (its buffer touched here, as the target state is)
        wall, cpu = time.perf_counter(), time.process_time()
        floor()  # the floor of this phase, measured beside its rows (the box drifts)
        times.setdefault(CRASH_FLOOR, []).append((time.perf_counter() - wall, time.process_time() - cpu))
        for name, source, persisted in ((CRASHED, "memory", False), (PERSISTED, "memory", None)):
            drop_cache(root)
            with AsyncCheckpointer(root, config) as ckpt:
                wall, cpu = time.perf_counter(), time.process_time()
                ckpt.load_latest(box[0])
                times.setdefault(name, []).append((time.perf_counter() - wall, time.process_time() - cpu))
                assert (ckpt.resume_report.source, ckpt.resume_report.persisted) == (source, persisted), ckpt.resume_report
                ckpt.finalize(blocking=True)
        drop_cache(root)
        with AsyncCheckpointer(root, CheckpointConfig()) as plain:  # no tier: the disk's newest (that save)
            wall, cpu = time.perf_counter(), time.process_time()
            plain.load_latest(box[0])
            times.setdefault(CRASH_DISK, []).append((time.perf_counter() - wall, time.process_time() - cpu))
    check_equal(box[0], state)
    os.unlink(tier_file)
    return times


def floor_read(path: str) -> Callable[[], None]:
    """The least a restore from memory does: every byte of the copy's items (`path`, the tier's
    file) read into a touched buffer of their size, 256 KiB per `os.preadv` with its CRC32C right
    after, in pieces on the loader's threads (the restore reads the same way)."""
    end = max(item.at + item.length for item in read_copy(path).items)
    dest = torch.ones(end, dtype=torch.uint8)
    view = memoryview(dest.numpy())
    step, threads = LocalFiles.step_bytes, LocalFiles.threads
    piece = min(LocalFiles.piece_bytes, max(step, end // (2 * threads)))  # as reader.fetch_items sizes them

    def read_piece(start: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            crc = 0
            for at in range(start, min(start + piece, end), step):
                chunk = view[at:min(at + step, end)]
                if os.preadv(fd, [chunk], at) != len(chunk):
                    raise OSError(f"{path}: short read at {at}")
                crc = crc32c(chunk, crc)
        finally:
            os.close(fd)

    def load() -> None:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(read_piece, range(0, end, piece)))

    return load


if __name__ == "__main__":
    sys.exit(main())
