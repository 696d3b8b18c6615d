"""A shared segment the library creates itself (the first save's packed copy) reserves its pages
first: on a full /dev/shm that is a CheckpointError, never a SIGBUS that kills the process."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, pid_of_an_exited_process

SCRIPT = textwrap.dedent("""
    import os, torch
    from asyncckpt.errors import CheckpointError
    from asyncckpt.save.sharing import new_reserved_shared
    for strategy in ("file_descriptor", "file_system"):
        torch.multiprocessing.set_sharing_strategy(strategy)
        fits = new_reserved_shared(8 << 20)
        torch.empty(0, dtype=torch.uint8).set_(fits).fill_(7)  # reserved and writable
        try:
            new_reserved_shared(100 << 20)  # more than the 64 MiB tmpfs holds
        except CheckpointError as exc:
            print(strategy, "refused:", exc, flush=True)
        del fits
""")


def test_a_segment_larger_than_a_full_dev_shm_is_a_checkpoint_error_not_sigbus():
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here to give the test its own small /dev/shm")
    mount = "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$0\" -c \"$1\""
    done = subprocess.run(["unshare", "--mount", "sh", "-c", mount, sys.executable, SCRIPT], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    if done.returncode != 0 and ("unshare" in done.stderr or "mount" in done.stderr) and "Traceback" not in done.stderr:
        pytest.skip(f"cannot mount a small /dev/shm here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr  # (a SIGBUS: -7)
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    for strategy, line in zip(("file_descriptor", "file_system"), lines):
        assert line.startswith(f"{strategy} refused:") and "/dev/shm" in line and "104857600 bytes" in line, line


def test_segment_names_left_by_killed_processes_are_removed(tmp_path, monkeypatch):
    """A segment's name exists for a moment before it is unlinked; a trainer killed then leaves it
    in /dev/shm for good. The next process to make a segment there removes the names of processes
    that are gone, and nothing else."""
    import os

    import torch

    import asyncckpt.save.sharing as sharing

    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        pytest.skip("segments are torch's own under this sharing strategy")
    monkeypatch.setattr(sharing, "_SWEPT", set())
    left = tmp_path / f"asyncckpt-{pid_of_an_exited_process()}-140000000000-0"
    mine = tmp_path / f"asyncckpt-{os.getpid()}-140000000000-7"  # (a live process's: being created now)
    tier = tmp_path / "asyncckpt-root-0123456789-rank0.slab"  # the memory tier's: not a segment
    for path in (left, mine, tier):
        path.write_bytes(b"")
    segment = sharing.shared_segment(4096, str(tmp_path))
    assert segment.nbytes() == 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, tier.name])
