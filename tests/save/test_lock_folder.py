"""Where a job's lock lands and what it leaves (docs/guarantees.md, "One job per root"): a save
into a directory the caller names locks the folder its saves go into (the run's folder; the
directory itself when its parent is a folder unrelated jobs share, such as /tmp), the lock file is
0600 and goes at a clean close, and a mount whose flock does not reach other hosts is warned about."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import AsyncCheckpointer, CheckpointError
from asyncckpt.layout import LOCK_FILE
from asyncckpt.save import mounts
from asyncckpt.save.job_lock import FolderLocks, folder_to_lock
from asyncckpt.save.mounts import local_flock
from asyncckpt.storage import mounts as storage_mounts
from asyncckpt.storage.mounts import mount_of, parse_mountinfo


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_two_jobs_saving_into_a_shared_folder_lock_only_their_own_directories(tmp_path, monkeypatch):
    """Like two jobs saving /tmp/theirs and /tmp/mine: neither refuses the other (the lock used to
    be /tmp/.asyncckpt.lock, 0644), a save into the other's directory is refused, and after both
    closed nothing but the checkpoint is left."""
    monkeypatch.setenv("ASYNCCKPT_JOB_ID", "this-job")
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # sticky and world-writable, as /tmp
    assert folder_to_lock(str(shared / "mine")) == str(shared / "mine")
    assert folder_to_lock(str(tmp_path / "run" / "step-1")) == str(tmp_path / "run")  # a run's folder: as before
    assert folder_to_lock("s3://bucket/ckpt") == "s3://bucket/ckpt" and folder_to_lock("s3://bucket/run/s1") == "s3://bucket/run"
    other = FolderLocks("other-job")
    other.take_folder_of(str(shared / "theirs"))
    try:
        with AsyncCheckpointer() as ckpt:
            ckpt.schedule_save({"w": torch.ones(4)}, checkpoint_dir=str(shared / "mine"))
            ckpt.finalize(blocking=True)
            assert _mode(shared / "mine" / LOCK_FILE) == 0o600
            with pytest.raises(CheckpointError, match=r"checkpoint directory .*theirs'? is in use by another job: job other-job"):
                ckpt.schedule_save({"w": torch.ones(4)}, checkpoint_dir=str(shared / "theirs"))
            assert os.listdir(shared / "theirs") == [LOCK_FILE]
            with pytest.raises(Exception):  # a save that fails at once leaves no directory once closed
                ckpt.schedule_save({"w": torch.ones(4), "bad": lambda: None}, checkpoint_dir=str(shared / "failed"))
        assert sorted(os.listdir(shared)) == ["mine", "theirs"]
        assert LOCK_FILE not in os.listdir(shared / "mine")  # only the checkpoint is left
        target = {"w": torch.zeros(4)}
        dcp.load(target, checkpoint_id=str(shared / "mine"), no_dist=True)
        assert torch.equal(target["w"], torch.ones(4))
    finally:
        other.release()
    assert os.listdir(shared) == ["mine"]  # the other job's empty directory went with its lock


def test_the_lock_file_is_0600_or_shared_with_the_group_of_a_team_folder(tmp_path):
    for folder_mode, lock_mode in ((0o755, 0o600), (0o2770, 0o660), (0o750, 0o600), (0o1777, 0o660)):
        folder = tmp_path / f"root-{folder_mode:o}"
        folder.mkdir()
        os.chmod(folder, folder_mode)
        locks = FolderLocks("a-job")
        locks.take(str(folder))
        assert _mode(folder / LOCK_FILE) == lock_mode, oct(_mode(folder / LOCK_FILE))
        locks.release()
        assert os.listdir(folder) == []


MOUNTINFO = r"""22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw
36 22 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
25 22 0:22 / /home rw,relatime shared:2 - nfs4 srv:/home rw,vers=4.2,local_lock=none,addr=10.0.0.1
26 22 0:23 / /scratch rw,relatime - nfs srv:/scratch rw,vers=3,local_lock=all,addr=10.0.0.2
27 22 0:24 / /lustre rw - lustre 10.0.0.3@o2ib:/fs rw,localflock,lazystatfs
28 22 0:25 / /lustre2 rw - lustre 10.0.0.3@o2ib:/fs2 rw,flock,lazystatfs
29 22 0:26 / /mnt/with\040space rw,relatime - nfs srv:/x rw,vers=3,nolock
30 22 0:27 / /scratch/inner rw - nfs4 srv:/inner rw,local_lock=flock
31 22 0:28 / /home rw - tmpfs tmpfs rw
"""


def test_mountinfo_says_which_mounts_lock_only_for_their_host():
    found = parse_mountinfo(MOUNTINFO + "a line that is not one\n")
    assert len(found) == 9 and found[1].point == "/mnt2" and "errors=continue" in found[1].options

    def reason(path):
        mount = mount_of(path, found)
        return mount.point, local_flock(mount)

    assert reason("/data/run") == ("/", None)  # a local disk
    assert reason("/home/me/run") == ("/home", None)  # the later mount over /home: tmpfs
    assert reason("/scratch/run/step-1") == ("/scratch", "NFS mounted with local_lock=all")
    assert reason("/scratch/inner/run") == ("/scratch/inner", "NFS mounted with local_lock=flock")
    assert reason("/lustre/run") == ("/lustre", "Lustre mounted with localflock")
    assert reason("/lustre2/run") == ("/lustre2", None)  # mounted with flock: every host's locks agree
    assert reason("/mnt/with space/run") == ("/mnt/with space", "NFS mounted with nolock")


def test_a_root_whose_flock_is_local_to_this_host_is_warned_about_once(tmp_path, monkeypatch, caplog):
    point = os.path.realpath(tmp_path)
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO + f"40 22 0:30 / {point} rw - nfs srv:/t rw,vers=3,local_lock=all\n")
    monkeypatch.setattr(storage_mounts, "MOUNTINFO", str(info))
    monkeypatch.setattr(mounts, "_warned", set())
    locks = FolderLocks("a-job")
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        locks.take(str(tmp_path / "a"))
        locks.take(str(tmp_path / "b"))
    locks.release()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert f"is on {point}, NFS mounted with local_lock=all: its flock locks are this host's only" in warnings[0].getMessage()
