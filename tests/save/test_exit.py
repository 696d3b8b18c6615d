"""A script that exits without close(): its last save is committed at interpreter exit, and if
that fails the script says so (an ERROR log line, a message on stderr) and exits with status 1."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from asyncckpt.layout import list_checkpoints, read_latest_marker
from conftest import REPO


SCRIPT = textwrap.dedent(
    """
    import logging, sys, psutil, torch
    from asyncckpt import AsyncCheckpointer, CheckpointConfig
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    root, fail = sys.argv[1], sys.argv[2] == "fail"
    ckpt = AsyncCheckpointer(root, CheckpointConfig(io_workers=1))
    ckpt.schedule_save({"w": torch.zeros(1 << 20)}, step=1)
    ckpt.finalize(blocking=True)
    if fail:  # the worker cannot write a file over 4 KiB: the last save fails (EFBIG)
        worker = psutil.Process(ckpt.worker_pid)
        worker.rlimit(psutil.RLIMIT_FSIZE, (4096, worker.rlimit(psutil.RLIMIT_FSIZE)[1]))
    ckpt.schedule_save({"w": torch.ones(1 << 20)}, step=2)
    print("scheduled step 2")
    # no close(): the save is finished at interpreter exit
    """
)


def run_script(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, str]:
    script, root = tmp_path / "train.py", str(tmp_path / "ckpt")
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), root, mode], capture_output=True, text=True, timeout=180, cwd=REPO)
    return done, root


def committed_steps(root: str) -> list[int]:
    return [c.step for c in list_checkpoints(root) if c.committed]


def test_last_save_failing_at_exit_is_loud_and_the_exit_status_is_1(tmp_path):
    done, root = run_script(tmp_path, "fail")
    print(f"\nexit status {done.returncode}; stderr:\n{done.stderr[-1500:]}")
    assert done.returncode == 1
    assert "scheduled step 2" in done.stdout  # stdout was flushed before the exit
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR asyncckpt")]
    assert any("NOT committed at interpreter exit" in line and "EFBIG" in line for line in errors), done.stderr
    assert any(line.startswith("asyncckpt: a save was NOT committed") for line in done.stderr.splitlines()), done.stderr
    assert committed_steps(root) == [1] and read_latest_marker(root) == "step_00000001"


def test_last_save_succeeding_at_exit_commits_it_and_exits_0(tmp_path):
    done, root = run_script(tmp_path, "ok")
    assert done.returncode == 0, done.stderr
    assert "NOT committed" not in done.stderr
    assert committed_steps(root) == [1, 2] and read_latest_marker(root) == "step_00000002"


LET_GO_BEFORE_READY = """
import os
from asyncckpt.save.client import WorkerClient
from asyncckpt.protocol import WorkerSettings

client = WorkerClient(WorkerSettings(rank=0, parent_pid=os.getpid()), start_timeout_s=300.0)
client.start()
process = client._process
client._conn.close()  # the trainer lets go of the worker while it is still starting
process.join(120)
print("worker exit status", process.exitcode)
"""


def test_a_worker_let_go_while_starting_exits_quietly():
    """A trainer that closes its checkpointer (or Lightning plugin) before the worker finished
    starting must not get a worker traceback on its stderr: the worker sees the closed
    connection when it says Ready and exits with status 0."""
    done = subprocess.run([sys.executable, "-c", LET_GO_BEFORE_READY], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "worker exit status 0" in done.stdout, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
