"""A root belongs to one job (docs/guarantees.md, "One job per root"): a second job's checkpointer
fails at construction naming the holder; the root is free again once the first job closed or died;
the ranks of one job share it; on an object store the same rule holds through a lease."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, cleanup, list_checkpoints
from asyncckpt.save import lease as lease_module
from asyncckpt.cli.commands import main as cli_main
from asyncckpt.save.job_lock import FolderLocks, Holder
from asyncckpt.layout import LOCK_FILE
from asyncckpt.storage import storage_for
from conftest import REPO, wait_gone
from multirank import run_ranks

JOB_VARIABLES = ("ASYNCCKPT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")

HOLDER = textwrap.dedent(
    """
    import sys
    from asyncckpt import AsyncCheckpointer
    ckpt = AsyncCheckpointer(sys.argv[1])
    print("holding", flush=True)
    sys.stdin.read()  # until the test lets go
    ckpt.close()
    """
)


@pytest.fixture
def own_job(monkeypatch):
    """This process is a job of its own (as the holder subprocess is): no job id from the environment."""
    for name in JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_a_second_job_fails_at_construction_naming_the_holder_until_the_first_is_killed(tmp_path, own_job):
    root = str(tmp_path / "ckpt")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(CheckpointError) as refused:
            AsyncCheckpointer(root)
        message = str(refused.value)
        assert f"checkpoint root {root!r} is in use by another job" in message
        assert f"host {socket.gethostname()}, pid {holder.pid}, since " in message
        assert "give this job a folder of its own" in message
        assert os.listdir(root) == [LOCK_FILE]  # the refused one wrote nothing
        os.kill(holder.pid, signal.SIGKILL)
        wait_gone(holder.pid, 10)
        holder.wait(10)
    finally:
        holder.kill()
        holder.wait(10)
    with AsyncCheckpointer(root) as ckpt:  # the dead job's lock file is there, but nobody holds it
        ckpt.schedule_save({"w": torch.ones(4)}, step=1)
        ckpt.finalize(blocking=True)
    assert sorted(os.listdir(root)) == ["latest", "step_00000001"]  # the last one to let go removes it


def test_the_lock_is_no_checkpoint_and_close_frees_the_root(tmp_path, own_job):
    root = str(tmp_path / "ckpt")
    other_job = FolderLocks("other-job")
    with AsyncCheckpointer(root, CheckpointConfig(keep_last=1, io_workers=1)) as ckpt:
        for step in (1, 2):
            ckpt.schedule_save({"w": torch.full((4,), float(step))}, step=step)
            ckpt.finalize(blocking=True)
        assert ckpt.wait_tidy()
        with pytest.raises(CheckpointError, match=f"job {socket.gethostname()}-{os.getpid()} "):
            other_job.take(root)
        # what reads or tidies a root while its job runs takes the lock file for nothing of its own
        assert [c.name for c in list_checkpoints(root)] == ["step_00000002"]
        assert cleanup(root) == [] and os.path.exists(os.path.join(root, LOCK_FILE))
        assert cli_main(["ls", root]) == 0
        target = {"w": torch.zeros(4)}
        assert ckpt.load_latest(target) == 2 and torch.equal(target["w"], torch.full((4,), 2.0))
        target = {"w": torch.zeros(4)}
        dcp.load(target, checkpoint_id=os.path.join(root, "step_00000002"), no_dist=True)
        assert torch.equal(target["w"], torch.full((4,), 2.0))
    other_job.take(root)  # free once closed
    other_job.release()
    assert sorted(os.listdir(root)) == ["latest", "step_00000002"]


def test_a_save_into_another_jobs_folder_is_refused_and_removes_nothing(tmp_path, own_job):
    """A directory named by the caller: its folder is taken at the first save there. The other
    job's save in flight (data files, no .metadata yet) is left alone."""
    folder = tmp_path / "run"
    in_flight = folder / "step-1"
    in_flight.mkdir(parents=True)
    (in_flight / "__0_0.distcp").write_bytes(b"the other job's bytes")
    other_job = FolderLocks("other-job")
    other_job.take(str(folder))
    try:
        with AsyncCheckpointer() as ckpt:
            with pytest.raises(CheckpointError, match=r"step-1'? is in use by another job: job other-job \(host "):
                ckpt.schedule_save({"w": torch.ones(4)}, checkpoint_dir=str(in_flight))
            assert sorted(os.listdir(folder)) == [LOCK_FILE, "step-1"]
            assert os.listdir(in_flight) == ["__0_0.distcp"]
            ckpt.schedule_save({"w": torch.ones(4)}, checkpoint_dir=str(tmp_path / "mine" / "step-1"))  # another folder
            ckpt.finalize(blocking=True)
    finally:
        other_job.release()


def _every_rank_is_refused(rank: int, world_size: int, root: str) -> None:
    os.environ["ASYNCCKPT_JOB_ID"] = "the-ranks"
    with pytest.raises(CheckpointError, match=f"rank {rank}: checkpoint root .* in use by another job: job the-test "):
        AsyncCheckpointer(root)


def test_a_root_another_job_holds_fails_every_rank_at_construction(tmp_path, monkeypatch):
    """The coordinator takes the root for its job; the others learn its answer in the same call."""
    root = str(tmp_path / "ckpt")
    monkeypatch.setenv("ASYNCCKPT_JOB_ID", "the-test")
    held = FolderLocks()
    held.take(root)
    try:
        run_ranks(_every_rank_is_refused, 2, root, timeout_s=120)
    finally:
        held.release()


# object stores: a lease ----------------------------------------------------------------------------
def _write_lease(storage, root: str, job: str, expires_in: float, host: str = "elsewhere") -> None:
    lease = Holder(job, host, 4242, time.time() - 600, time.time() + expires_in)
    storage.write_atomic(storage.join(root, LOCK_FILE), lease.encode())


def _lease(storage, root: str) -> dict:
    return json.loads(storage.read_bytes(storage.join(root, LOCK_FILE)))


def test_an_object_store_root_is_leased_renewed_taken_over_and_lost(s3_server, monkeypatch, caplog):
    root = s3_server.url("s3", s3_server.unique_prefix("lease") + "/ckpt")
    storage = storage_for(root)
    monkeypatch.setenv("ASYNCCKPT_JOB_ID", "job-b")
    monkeypatch.setattr(lease_module, "LEASE_RENEW_S", 0.05)

    _write_lease(storage, root, "job-a", expires_in=60)  # a running job's
    with pytest.raises(CheckpointError, match=r"in use by another job: job job-a \(host elsewhere, pid 4242.*"
                                              r"expires at .*ASYNCCKPT_JOB_ID=job-a"):
        AsyncCheckpointer(root)
    assert not storage.write_if_version(storage.join(root, LOCK_FILE), b"", None)  # only where there is none

    for job, expires_in in (("job-a", -1), ("job-b", 60)):  # expired; or this job's own, restarted
        _write_lease(storage, root, job, expires_in)
        locks = FolderLocks()
        locks.take(root)
        lease = _lease(storage, root)
        assert (lease["job"], lease["pid"]) == ("job-b", os.getpid()) and lease["expires"] > time.time()
        locks.release()
        assert not storage.exists(storage.join(root, LOCK_FILE))

    with AsyncCheckpointer(root) as ckpt:
        first = _lease(storage, root)["expires"]
        deadline = time.monotonic() + 10
        while _lease(storage, root)["expires"] == first and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _lease(storage, root)["expires"] > first  # renewed while the job runs
        _write_lease(storage, root, "job-c", expires_in=60)  # e.g. taken over while this process stalled
        deadline = time.monotonic() + 10
        while "taken over by job job-c" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(CheckpointError, match=r"checkpoint root .* taken over by job job-c \(host elsewhere"):
            ckpt.schedule_save({"w": torch.ones(4)}, step=1)
    assert list_checkpoints(root) == []
    assert _lease(storage, root)["job"] == "job-c"  # another job's lease is not ours to remove
