"""Helpers to run a function on N gloo ranks (CPU) with a hard timeout.

The ranks meet through a FileStore in a fresh directory, not a TCP port: a port picked free can be
taken by the other pytest process before rank 0 binds it (gloo's own pairs bind port 0).

Ranks are forked from a fork server that imported torch and asyncckpt once (per pytest process),
not spawned: a spawned rank spends ~3 s of CPU importing them, which was minutes of the suite on
2 cores. A forked rank is as fresh (the server never ran a test) but inherits the environment of
the server's start: each rank takes the test's environment as it is at `run_ranks`."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


PRELOADED = ["torch", "torch.distributed", "torch.distributed.checkpoint", "asyncckpt", "multirank", "cuda_like"]
multiprocessing.set_forkserver_preload(PRELOADED)


def _as_the_test(environ: dict, test_pid: int) -> None:
    """A forked rank takes the test's environment and its stdout/stderr (where pytest captures
    them now), not those the fork server was started with (an earlier test's)."""
    os.environ.clear()
    os.environ.update(environ)  # (CUDA reads CUDA_VISIBLE_DEVICES at its first use, after this)
    for fd in (1, 2):
        try:
            now = os.open(f"/proc/{test_pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue  # (no /proc: the fork server's)
        os.dup2(now, fd)
        os.close(now)


def _entry(rank: int, fn, world_size: int, store_path: str, args: tuple, environ: dict, test_pid: int) -> None:
    """Run fn on this rank; on success leave with os._exit(0) once gloo is torn down.

    Why not a normal exit: in torch 2.13 a gloo worker thread can still be releasing a finished
    collective's tensors while the interpreter finalizes; taking the GIL then kills that thread
    inside a noexcept destructor and the rank dies of SIGABRT after its work passed. The result
    is decided by then (a failure raises above and is reported by torch.multiprocessing)."""
    from cuda_like import dtensor_as_on_cuda

    _as_the_test(environ, test_pid)
    dtensor_as_on_cuda()  # as in the pytest process (conftest.py)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # no rank tears gloo down while another is still using it
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout_s: float = 240.0, gpus: bool = False) -> None:
    """Run fn(rank, world_size, *args) on `world_size` ranks (forked; spawned if `gpus`); raise if any rank fails or
    if they do not all finish within `timeout_s` (so a bug fails the test instead of hanging).
    The ranks see no GPU unless `gpus` (the `cuda`-marked tests whose ranks use one).
    The bound is a hang guard, not a speed check: generous, because each rank's worker starts an
    interpreter, and the first call in a pytest process starts the fork server (imports torch)."""
    rendezvous = tempfile.mkdtemp(prefix="asyncckpt-ranks-")
    with pytest.MonkeyPatch.context() as env:
        # CPU ranks see no GPU: on a GPU machine torchtitan and DCP would build pinned-memory
        # stagers there, a CUDA context in every rank, and the tests would take other paths
        if not gpus:
            env.setenv("CUDA_VISIBLE_DEVICES", "")
        context = mp.start_processes(
            _entry, args=(fn, world_size, os.path.join(rendezvous, "store"), args, dict(os.environ), os.getpid()),
            nprocs=world_size, join=False,
            start_method="spawn" if gpus else "forkserver",  # (GPU ranks: no fork anywhere near CUDA)
        )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise AssertionError(f"{world_size} ranks did not finish within {timeout_s}s (hang?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        shutil.rmtree(rendezvous, ignore_errors=True)
