"""Steady blocked time with the memory tier on and off, side by side (issue #30: on <= 1.05x off).

One state (savebench.state.build_state), two checkpointers on two roots of the same disk, one with
`memory_tier=True` (its slab a file in /dev/shm), one without (an anonymous memfd). After `prepare`
and one warm-up save each, saves alternate off / on / on memory-only (the order rotates each round,
so each follows each), each finalized (blocking) and its retention done before the next, so blocked
time is the staging hand-off alone. Median of --saves.

    python benchmarks/bench_memory_tier.py --size-mb 1024 --saves 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from savebench.state import build_state, state_tensors  # noqa: E402

from asyncckpt import AsyncCheckpointer, CheckpointConfig  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--saves", type=int, default=7)
    parser.add_argument("--out", default=None)
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
            for ckpt in (off, on):
                ckpt.prepare(state)
                ckpt.schedule_save(state, step=0)
                ckpt.finalize(blocking=True)
            configs = [("memory_tier=False", off, False), ("memory_tier=True", on, False),
                       ("memory_tier=True, memory_only", on, True)]
            for step in range(1, args.saves + 1):
                for name, ckpt, memory_only in configs[step % 3:] + configs[:step % 3]:  # each follows each
                    ckpt.schedule_save(state, step=step, memory_only=memory_only)
                    report = ckpt.finalize(blocking=True)[-1]
                    ckpt.wait_tidy()  # retention's deletes would run into the next config's save
                    rows[name].append(report.blocked_s)
                    staging[name].append(report.staging_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = statistics.median(rows["memory_tier=False"])
    print(f"\nsteady blocked time, {nbytes / 2**20:.0f} MiB state, {len(state_tensors(state))} tensors, "
          f"median of {args.saves} saves")
    print(f"{'config':<32} {'blocked s':>10} {'staging s':>10} {'vs off':>7}")
    for name, values in rows.items():
        median = statistics.median(values)
        print(f"{name:<32} {median:>10.3f} {statistics.median(staging[name]):>10.3f} {median / base:>6.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"state_bytes": nbytes, "blocked_s": rows, "staging_s": staging}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
