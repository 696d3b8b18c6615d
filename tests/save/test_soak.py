"""Soak: 100 saves of a 64 MiB state through one checkpointer (200 with ASYNCCKPT_STRESS=1).
Memory, open file descriptors, threads and child processes of the trainer and of the worker at the
last save stay where they were at save 20 (numbers printed and asserted). Forked writers
(io="process") get 40 saves (80): a fork of a worker holding a 64 MiB slab costs more, and the
point (children reaped, no fd carried over) shows as well."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, load
from conftest import step_path, stress_size

MiB = 1 << 20
BASELINE_AT = 20
THREAD_SAVES = stress_size("SOAK", ci=100, full=200)
RSS_TOLERANCE = 16 * MiB  # allocator noise; leaking one staged copy a save would add 64 MiB each


def snapshot(process: psutil.Process) -> dict:
    with process.oneshot():
        return {
            "rss_mib": process.memory_info().rss / MiB,
            "fds": process.num_fds(),
            "threads": process.num_threads(),
            "children": len(process.children(recursive=True)),
        }


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("io,saves", [("thread", THREAD_SAVES), ("process", THREAD_SAVES * 2 // 5)])
def test_many_saves_leak_no_memory_fds_threads_or_processes(tmp_path, io, saves):
    root = str(tmp_path / "ckpt")
    state = {
        "weights": {f"layer{i}": torch.full((MiB,), float(i)) for i in range(16)},  # 16 x 4 MiB
        "meta": {"step": 0, "history": list(range(100))},
    }
    # fsync off: this is about resources, not durability, and keeps CI disks out of the timing
    config = CheckpointConfig(io=io, keep_last=2, fsync=False, worker_nice=None, worker_ionice=None)
    trainer = psutil.Process()
    figures: dict[int, dict] = {}
    started = time.monotonic()
    with AsyncCheckpointer(root, config) as ckpt:
        worker = psutil.Process(ckpt.worker_pid)
        for step in range(1, saves + 1):
            with torch.no_grad():
                for tensor in state["weights"].values():
                    tensor.add_(1.0)
            state["meta"]["step"] = step
            ckpt.schedule_save(state, step=step)
            ckpt.finalize()
            if step in (BASELINE_AT, saves // 2, saves) or step % 50 == 0:
                ckpt.finalize(blocking=True)
                # retention runs after the verdict on its own thread and holds a directory fd
                # while it lists and deletes: count once it is idle, not a transient fd
                assert ckpt._janitor.wait(timeout_s=60)
                figures[step] = {"trainer": snapshot(trainer), "worker": snapshot(worker)}
        assert ckpt.worker_pid == worker.pid  # one worker served every save
        expected = {k: v.clone() for k, v in state["weights"].items()}
    elapsed = time.monotonic() - started

    print(f"\n[{io}] {saves} saves of 64 MiB in {elapsed:.1f}s ({elapsed / saves * 1000:.0f} ms a save)")
    print(f"{'save':>5} {'process':>8} {'rss MiB':>8} {'fds':>4} {'threads':>7} {'children':>8}")
    for step, by_process in figures.items():
        for name, f in by_process.items():
            print(f"{step:>5} {name:>8} {f['rss_mib']:>8.1f} {f['fds']:>4} {f['threads']:>7} {f['children']:>8}")

    for name in ("trainer", "worker"):
        first, last = figures[BASELINE_AT][name], figures[saves][name]
        assert last["rss_mib"] - first["rss_mib"] < RSS_TOLERANCE / MiB, (name, first, last)
        assert last["fds"] <= first["fds"], (name, first, last)
        assert last["threads"] <= first["threads"] + 1, (name, first, last)
        assert last["children"] <= first["children"], (name, first, last)

    names = sorted(os.listdir(root))
    assert names == ["latest", f"step_{saves - 1:08d}", f"step_{saves:08d}"], names
    target = {"weights": {k: torch.zeros_like(v) for k, v in expected.items()}, "meta": {}}
    load(target, step_path(root, saves), strict=False)  # the target holds the tensors only, on purpose
    for key, tensor in expected.items():
        assert torch.equal(target["weights"][key], tensor), key
