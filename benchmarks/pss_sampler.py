"""Peak PSS of a process and all its descendants, sampled from a separate process.

bench_save.py runs this as a child so that sampling costs the trainer no GIL time (an in-process
sampler thread holding the GIL stalls every tensor-by-tensor loop of the method being measured).

    python pss_sampler.py PID INTERVAL_S [EXCLUDE_PID,...]

Descendants named in EXCLUDE_PID (and their own descendants) are left out: services the benchmark
starts beside the trainer (a local S3 server) are not the trainer's memory. Samples until stdin is closed or gets a line, then prints one JSON line:
{"peak": bytes, "root": bytes, "descendants": bytes, "samples": n, "pids": [...]} (at the peak).
"""

from __future__ import annotations

import json
import os
import select
import sys


def pss_bytes(pid: int) -> int:
    """Proportional set size from /proc/PID/smaps_rollup (0 if the process is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children_of(pid: int) -> list[int]:
    """Direct children of every thread of `pid` (/proc/PID/task/TID/children)."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(p) for p in f.read().split())
        except OSError:
            continue
    return found


def descendants(root: int, exclude: set[int]) -> list[int]:
    """Every descendant of `root`, leaving out the processes in `exclude` and their subtrees."""
    out, todo = [], [root]
    while todo:
        for child in children_of(todo.pop()):
            if child not in exclude:
                out.append(child)
                todo.append(child)
    return out


def sample_until_stopped(root: int, interval_s: float, exclude: frozenset[int] = frozenset()) -> dict:
    """Sample every `interval_s` until stdin becomes readable; return the peak."""
    leave_out = {os.getpid(), *exclude}  # this sampler is a descendant too
    best = {"peak": 0, "root": 0, "descendants": 0, "samples": 0, "pids": []}
    while True:
        pids = descendants(root, leave_out)
        root_pss = pss_bytes(root)
        child_pss = sum(pss_bytes(p) for p in pids)
        best["samples"] += 1
        if root_pss + child_pss > best["peak"]:
            best.update(peak=root_pss + child_pss, root=root_pss, descendants=child_pss, pids=pids)
        ready, _, _ = select.select([sys.stdin], [], [], interval_s)
        if ready:
            return best


def main() -> None:
    root, interval_s = int(sys.argv[1]), float(sys.argv[2])
    exclude = frozenset(int(p) for p in sys.argv[3].split(",") if p) if len(sys.argv) > 3 else frozenset()
    print("ready", flush=True)
    print(json.dumps(sample_until_stopped(root, interval_s, exclude)), flush=True)


if __name__ == "__main__":
    main()
