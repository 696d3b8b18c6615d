"""Preemption (issue 44): from a SIGTERM to a committed checkpoint, beside the disk's raw write.

One state of --size-mib (savebench.state.build_state) in one process with
`preemption_signals=(SIGTERM,)`. Each round: a warm save is committed, the next is scheduled
(staged: its writes start), and SIGTERM is sent to this process at once -- the worst moment, with
the whole save still to be written. The loop sees `ckpt.preempted`, calls `close()`: the time from
the signal to `close()` returning (the save written, fsynced, committed, the worker stopped) is
compared with a raw write + fsync of as many bytes to the same disk, alternating in the same run
(goal: <= 1.2x). The memory-only row: the newest save was staged into the memory tier only
(`memory_only=True`, /dev/shm) when the signal came; close() has the worker write that copy and
commits it (the time to its commit). Also, with no signal: the cost of reading `ckpt.preempted`
once per step (goal < 1 us); of `finalize()` with nothing pending, which counts the loop's calls for
several ranks' stop (preemption.py); and of one check of the store's board (a loopback TCPStore),
which a thread of each rank makes twice a second, off the loop.

    python benchmarks/bench_preemption.py --size-mib 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import timeit
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from savebench.state import build_state  # noqa: E402

from asyncckpt import AsyncCheckpointer, CheckpointConfig  # noqa: E402

CHUNK = 16 << 20


def raw_write(path: str, nbytes: int) -> float:
    """Seconds to write `nbytes` sequentially and fsync them (the disk's ceiling for one save).
    Each run measures one right before the save it measures, and both must find the same memory:
    on a virtual machine, writing into page cache just freed costs much less than into memory
    the guest has not touched lately (measured here: 0.5 s against 1.7 s of system time per GiB
    written). So a scratch file of as many bytes is written and removed first (its pages freed
    for this write), and this file is removed after (its pages freed for the save's)."""
    block = os.urandom(CHUNK)

    def write(name: str, fsync: bool) -> None:
        with open(name, "wb", buffering=0) as f:
            left = nbytes
            while left > 0:
                left -= f.write(block[: min(CHUNK, left)])
            if fsync:
                os.fsync(f.fileno())

    write(path + ".scratch", fsync=False)
    os.unlink(path + ".scratch")
    started = time.perf_counter()
    write(path, fsync=True)
    elapsed = time.perf_counter() - started
    os.unlink(path)
    return elapsed


def signal_to_committed(root: str, state: dict, raw: Callable[[], None]) -> tuple[float, float, int]:
    """One preempted run: seconds from the signal to the commit, to close() returning (the worker
    stopped too), and the step committed. `raw` runs right before the measured save."""
    config = CheckpointConfig(preemption_signals=(signal.SIGTERM,), worker_nice=None, worker_ionice=None)
    ckpt = AsyncCheckpointer(root, config, no_dist=True)
    ckpt.prepare(state)
    ckpt.schedule_save(state, step=0)
    ckpt.finalize(blocking=True)
    raw()
    ckpt.schedule_save(state, step=1)  # staged: its writes are all still to come
    signalled = time.perf_counter()
    os.kill(os.getpid(), signal.SIGTERM)
    while not ckpt.preempted:  # (the handler runs between bytecodes of this thread)
        time.sleep(0)
    reports = ckpt.finalize(blocking=True)  # what close() does first
    committed = time.perf_counter() - signalled
    ckpt.close()
    return committed, time.perf_counter() - signalled, reports[-1].step if reports else -1


def memory_only_to_committed(root: str, memory_dir: str, state: dict, raw: Callable[[], None]) -> tuple[float, int]:
    """One preempted run whose newest save is memory-only: seconds from the signal to the commit
    of that save's copy, written by close(); and the step committed. `raw` runs before the signal."""
    committed: list[tuple[float, int]] = []
    config = CheckpointConfig(preemption_signals=(signal.SIGTERM,), worker_nice=None, worker_ionice=None,
                              memory_tier=True, memory_dir=memory_dir,
                              on_commit=lambda r: None if r.memory_only else committed.append((time.perf_counter(), r.step)))
    ckpt = AsyncCheckpointer(root, config, no_dist=True)
    ckpt.prepare(state)
    ckpt.schedule_save(state, step=0)
    ckpt.finalize(blocking=True)
    ckpt.schedule_save(state, step=1, memory_only=True)
    ckpt.finalize(blocking=True)  # staged and sealed: the newest save, on no disk
    raw()
    signalled = time.perf_counter()
    os.kill(os.getpid(), signal.SIGTERM)
    while not ckpt.preempted:
        time.sleep(0)
    ckpt.close()
    at, step = committed[-1]
    return at - signalled, step


def preempted_cost_ns(root: str) -> float:
    ckpt = AsyncCheckpointer(root, CheckpointConfig(preemption_signals=(signal.SIGTERM,)), no_dist=True)
    try:
        n = 1_000_000
        best = min(timeit.repeat(lambda: ckpt.preempted, number=n, repeat=5))
        empty = min(timeit.repeat(lambda: None, number=n, repeat=5))
        return (best - empty) / n * 1e9
    finally:
        ckpt.close()


def finalize_cost_ns(root: str) -> tuple[float, float]:
    """finalize() with no save pending (one rank: no count), and the count of calls several ranks add
    (Preemption.finalize_called with a board)."""
    ckpt = AsyncCheckpointer(root, CheckpointConfig(preemption_signals=(signal.SIGTERM,)), no_dist=True)
    try:
        n = 200_000
        empty = min(timeit.repeat(lambda: None, number=n, repeat=5))
        call = min(timeit.repeat(ckpt.finalize, number=n, repeat=5))
        preemption = ckpt._preemption
        preemption._board = object()  # (counted only with several ranks' board: this stands in for one)
        try:
            count = min(timeit.repeat(preemption.finalize_called, number=n, repeat=5))
        finally:
            preemption._board = None
        return (call - empty) / n * 1e9, (count - empty) / n * 1e9
    finally:
        ckpt.close()


def board_check_us() -> float:
    """One check of the board's key on a loopback TCPStore (what each rank's thread does twice a second)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    n = 2000
    best = min(timeit.repeat(lambda: store.check(["asyncckpt/preempted/x/signal"]), number=n, repeat=5))
    return best / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder in the cwd)")
    parser.add_argument("--memory-dir", default="/dev/shm", help="the memory tier's folder (a tmpfs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="bench_preemption_", dir=args.dir or os.getcwd())
    try:
        state = build_state(args.size_mib * (1 << 20))
        raw, preempt, closed, memory = [], [], [], []
        shm = tempfile.mkdtemp(prefix="bench_preemption_", dir=args.memory_dir)
        try:
            for n in range(args.rounds):
                print(f"round {n + 1}/{args.rounds}", file=sys.stderr, flush=True)
                measure_raw = lambda: raw.append(raw_write(os.path.join(base, "raw.bin"), args.size_mib << 20))
                committed, elapsed, step = signal_to_committed(os.path.join(base, f"root{n}"), state, measure_raw)
                assert step == 1, f"the save in flight was not committed (step {step})"
                preempt.append(committed)
                closed.append(elapsed)
                shutil.rmtree(os.path.join(base, f"root{n}"))
                committed, step = memory_only_to_committed(os.path.join(base, f"mem{n}"), shm, state, measure_raw)
                assert step == 1, f"the memory-only save was not written (step {step})"
                memory.append(committed)
                shutil.rmtree(os.path.join(base, f"mem{n}"))
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        cost = preempted_cost_ns(os.path.join(base, "cost"))
        finalize_ns, count_ns = finalize_cost_ns(os.path.join(base, "finalize"))
        check_us = board_check_us()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    raw_s, pre_s, close_s = statistics.median(raw), statistics.median(preempt), statistics.median(closed)
    mem_s = statistics.median(memory)
    rows = [
        ("raw write + fsync", raw_s, 1.0),
        ("SIGTERM -> committed (eager, disk save in flight)", pre_s, pre_s / raw_s),
        ("SIGTERM -> committed (newest save memory-only)", mem_s, mem_s / raw_s),
        ("SIGTERM -> close() returned (disk save in flight)", close_s, close_s / raw_s),
    ]
    print(f"\n{args.size_mib} MiB, medians of {args.rounds} runs each (raw: of {len(raw)}, one before each signal)\n")
    print(f"| {'what':<50} | {'seconds':>8} | {'x raw':>6} |\n|{'-' * 52}|{'-' * 10}|{'-' * 8}|")
    for what, seconds, ratio in rows:
        print(f"| {what:<50} | {seconds:8.3f} | {ratio:6.2f} |")
    print(f"\n`ckpt.preempted` with no signal: {cost:.0f} ns per read (goal < 1000 ns)")
    print(f"`finalize()` with nothing pending: {finalize_ns:.0f} ns per call on one rank; several ranks add "
          f"{count_ns:.0f} ns counting the call (their stop between saves)")
    print(f"one check of the signal board (loopback TCPStore): {check_us:.0f} us, twice a second per rank, "
          "on a thread of its own")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"size_mib": args.size_mib, "raw_s": raw, "preempt_s": preempt, "close_s": closed,
                       "memory_only_s": memory, "preempted_ns": cost, "finalize_ns": finalize_ns,
                       "finalize_count_ns": count_ns, "board_check_us": check_us}, f)


if __name__ == "__main__":
    main()
