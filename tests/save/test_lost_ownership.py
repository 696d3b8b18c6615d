"""Ownership to the last write (docs/guarantees.md, "One job per root"): a job that lost its root
while a save was in flight (its lease expired and another job took it over, or its lock file was
replaced) fails that save naming the new holder and publishes nothing more: no `.metadata`, no
`latest`, no retention. The new holder's checkpoints survive."""

from __future__ import annotations

import json
import os
import time
import types
import uuid

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, list_checkpoints, load
from asyncckpt.layout import LATEST_FILE, LOCK_FILE, METADATA_FILE
from asyncckpt.save import lease
from asyncckpt.save.job_lock import FolderLocks, Holder
from asyncckpt.storage import storage_for
from asyncckpt.testing.s3_faults import Fault, FaultyS3
from asyncckpt.testing.s3_server import PROFILE, write_msc_config

CONFIG = CheckpointConfig(keep_last=1, io_workers=1, timeout_s=60)


def _state(value: float) -> dict:
    return {"w": torch.full((1024,), value), "step": int(value)}


def _save(ckpt: AsyncCheckpointer, step: int) -> None:
    ckpt.schedule_save(_state(float(step)), step=step)
    ckpt.finalize(blocking=True)


def _the_new_holders_checkpoint_survives(root: str, a_step: int) -> None:
    storage = storage_for(root)
    assert [(c.name, c.committed) for c in list_checkpoints(root) if c.committed] == [("step_00000011", True)]
    assert storage.read_bytes(storage.join(root, LATEST_FILE)).decode().strip() == "step_00000011"
    a_dir = storage.join(root, f"step_{a_step:08d}")
    assert not storage.exists(storage.join(a_dir, METADATA_FILE))  # job A's save was not published
    loaded = _state(0.0)
    load(loaded, storage.join(root, "step_00000011"), no_dist=True)
    assert torch.equal(loaded["w"], torch.full((1024,), 11.0)) and loaded["step"] == 11


def test_a_job_whose_lease_expired_mid_save_publishes_nothing(s3_server, tmp_path, monkeypatch, request):
    """Job A reaches the store through a fault front: its lease reads fail (503) until its lease
    expired; job B, reaching the store directly, takes the root over and saves. When A's store
    comes back, A's save in flight (a later step than B's: an A that did not look again would move
    `latest` to it and remove B's checkpoint by keep_last=1) fails naming B."""
    monkeypatch.setattr(lease, "LEASE_TTL_S", 3.0)
    monkeypatch.setattr(lease, "LEASE_RENEW_S", 0.2)
    proxy = FaultyS3(s3_server.server.endpoint, seed=3)
    profile = f"faulty-{uuid.uuid4().hex[:8]}"
    write_msc_config(str(tmp_path / "msc.yaml"), {PROFILE: s3_server.server.endpoint, profile: proxy.endpoint})
    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "msc.yaml"))
    monkeypatch.setenv("ASYNCCKPT_RETRY_WINDOW_S", "1")
    prefix = s3_server.unique_prefix(request.node.name)
    a_root, root = f"msc://{profile}/{prefix}", s3_server.url("s3", prefix)
    storage = storage_for(root)
    try:
        monkeypatch.setenv("ASYNCCKPT_JOB_ID", "job-a")
        a = AsyncCheckpointer(a_root, CONFIG)
        try:
            a.schedule_save(_state(20.0), step=20)  # staged; its worker writes on
            proxy.inject(Fault("slowdown", kinds=("get",)))  # A's renewals fail from now on
            deadline = time.monotonic() + 20
            while json.loads(storage.read_bytes(storage.join(root, LOCK_FILE)))["expires"] > time.time():
                assert time.monotonic() < deadline, "job A's lease never expired"
                time.sleep(0.1)
            monkeypatch.setenv("ASYNCCKPT_JOB_ID", "job-b")
            with AsyncCheckpointer(root, CONFIG) as b:  # A's lease expired: B takes the root over
                _save(b, 11)
                proxy.clear()  # A reaches the store again
                with pytest.raises(CheckpointError, match=r"checkpoint root .* taken over by job job-b \(host "):
                    a.finalize(blocking=True)
                _the_new_holders_checkpoint_survives(root, 20)
                assert json.loads(storage.read_bytes(storage.join(root, LOCK_FILE)))["job"] == "job-b"
            with pytest.raises(CheckpointError, match="taken over by job job-b"):  # and every later save
                a.schedule_save(_state(21.0), step=21)
        finally:
            a.close()
        _the_new_holders_checkpoint_survives(root, 20)
    finally:
        proxy.close()


def test_a_job_whose_lock_file_was_replaced_mid_save_publishes_nothing(tmp_path, monkeypatch):
    """flock is never taken back by the kernel: a job loses its root when the lock file is removed
    (a cleanup script) and another job locks a new one there without seeing the first."""
    root = str(tmp_path / "ckpt")
    monkeypatch.setenv("ASYNCCKPT_JOB_ID", "job-a")
    with AsyncCheckpointer(root, CONFIG) as a:
        a.schedule_save(_state(20.0), step=20)
        os.remove(os.path.join(root, LOCK_FILE))
        monkeypatch.setenv("ASYNCCKPT_JOB_ID", "job-b")
        with AsyncCheckpointer(root, CONFIG) as b:
            _save(b, 11)
            with pytest.raises(CheckpointError, match=r"checkpoint root .* taken over by job job-b \(host .*"
                                                      r"its lock file .* was removed or replaced"):
                a.finalize(blocking=True)
            _the_new_holders_checkpoint_survives(root, 20)
    _the_new_holders_checkpoint_survives(root, 20)
    assert os.listdir(os.path.join(root, "step_00000020"))  # A's own unpublished files: not deleted either


class _Clock:
    """lease.py's `time` module with a clock that can be moved forward."""

    def __init__(self) -> None:
        self.ahead = 0.0
        self.module = types.SimpleNamespace(time=lambda: time.time() + self.ahead, monotonic=time.monotonic,
                                            sleep=time.sleep, strftime=time.strftime, localtime=time.localtime)


def test_a_lease_is_confirmed_from_the_store_at_each_publishing_write(s3_server, monkeypatch, request):
    """An injected clock: confirm() renews a lease of ours that is about to expire, refuses one
    another job holds (its pid looked gone, or ours expired), and refuses a lease that expired and
    is gone (whoever took it over may have saved and let go)."""
    clock = _Clock()
    monkeypatch.setattr(lease, "time", clock.module)
    monkeypatch.setattr(lease, "LEASE_RENEW_S", 3600.0)  # no renewal thread in the way
    root = s3_server.url("s3", s3_server.unique_prefix(request.node.name))
    storage = storage_for(root)
    lease_path = storage.join(root, LOCK_FILE)

    a = FolderLocks("job-a")
    a.take(root)
    a.confirm(root + "/step_00000001")  # fresh: a read, no write
    clock.ahead = lease.LEASE_TTL_S - 5  # about to expire, nobody took it: renewed
    a.confirm(root + "/step_00000001")
    assert Holder.decode(storage.read_bytes(lease_path)).expires > clock.module.time() + lease.LEASE_TTL_S - 1
    a.confirm("s3://another-bucket/x")  # a path in no folder of ours: nothing to confirm

    clock.ahead += lease.LEASE_TTL_S + 1  # A stalled past its lease: B takes the root over
    b = FolderLocks("job-b")
    b.take(root)
    with pytest.raises(CheckpointError, match=r"checkpoint root|taken over by job job-b \(host "):
        a.confirm(root)
    b.release()
    with pytest.raises(CheckpointError, match="taken over by job job-b"):  # lost stays lost
        a.confirm(root)
    a.release()
    assert not storage.exists(lease_path)  # A removed nothing of another's

    c = FolderLocks("job-c")
    c.take(root)
    clock.ahead += lease.LEASE_TTL_S + 1
    storage.remove_file(lease_path)  # expired, and gone when C comes back
    with pytest.raises(CheckpointError, match=r"taken over by another job \(this job's lease .* expired at .* gone"):
        c.confirm(root)
    c.release()
