"""A shared segment the library creates itself (the first save's packed copy) reserves its pages
first: on a full /dev/shm that is a CheckpointError, never a SIGBUS that kills the process."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

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
