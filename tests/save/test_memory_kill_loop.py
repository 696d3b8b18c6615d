"""Kill loop with the memory tier: a trainer that saves every step (every other save memory-only,
io alternating thread/process) is SIGKILLed at a random moment, 4 times (24 with ASYNCCKPT_STRESS=1).
Each next trainer resumes from memory at the newest save whose staging had completed (the last one
the killed trainer saw staged, or the one after it when the kill came while it was staging), its
state bitwise that step's; every committed checkpoint verifies.

Trainers are forked from a "zygote" that has imported torch already (as in test_crash_loop.py), the
next one forked while the current one runs.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest

from asyncckpt import verify_checkpoint
from asyncckpt.layout import list_checkpoints
from conftest import REPO, stress_size
from zygote import read_line, stop_zygote, zygote_script

KILLS = stress_size("MEMORY_KILLS", ci=4, full=24)

ZYGOTE = zygote_script(
    """
    import os, sys, traceback
    import torch
    from asyncckpt import AsyncCheckpointer, CheckpointConfig

    def state_at(step):
        return {"w": {f"t{i}": torch.arange(1 << 18, dtype=torch.float64) + step * 10 + i for i in range(4)},
                "meta": {"step": step, "tag": f"step-{step}"}}

    def equal(a, b):
        if isinstance(b, torch.Tensor):
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        if isinstance(b, dict):
            return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in b)
        return a == b

    def train(root, shm, io, go_fd):
        state = state_at(0)
        ckpt = AsyncCheckpointer(root, CheckpointConfig(
            io=io, io_workers=2, keep_last=2, worker_nice=None, worker_ionice=None, timeout_s=60.0,
            memory_tier=True, memory_dir=shm))
        if os.read(go_fd, 1) != b"g":
            return
        resumed = ckpt.load_latest(state)
        source = ckpt.resume_report.source if ckpt.resume_report else "none"
        ok = resumed is None or equal(state, state_at(resumed))
        print("ready", os.getpid(), resumed, source, ok, flush=True)
        step = 0 if resumed is None else resumed + 1
        while True:
            state.update(state_at(step))
            ckpt.schedule_save(state, step=step, memory_only=step % 2 == 1)
            print("staged", os.getpid(), step, flush=True)
            ckpt.finalize()
            step += 1

    """
)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_restart_resumes_from_memory_at_the_newest_staged_save(tmp_path, monkeypatch):
    root, shm = str(tmp_path / "ckpt"), tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("ASYNCCKPT_JOB_ID", "memory-kill-loop")
    script = tmp_path / "zygote.py"
    script.write_text(ZYGOTE)
    stderr_path = tmp_path / "trainers.stderr"
    zygote = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=open(stderr_path, "w"), text=True, cwd=REPO, bufsize=1)
    rng = random.Random(30)

    def command(text: str) -> None:
        zygote.stdin.write(text + "\n")
        zygote.stdin.flush()

    def spawn(n: int) -> int:
        command(f"spawn {root} {shm} {'process' if n % 2 else 'thread'}")
        line = read_line(zygote.stdout, 30)
        assert line[:1] == ["spawned"], line
        return int(line[1])

    history, floor, trainer = [], None, None
    next_trainer = spawn(0)
    try:
        for n in range(KILLS + 1):
            trainer = next_trainer
            next_trainer = spawn(n + 1) if n < KILLS else None  # its worker starts while this one runs
            command(f"go {trainer}")
            line = read_line(zygote.stdout, 120)
            assert line[:2] == ["ready", str(trainer)], (line, stderr_path.read_text()[-3000:])
            resumed = None if line[2] == "None" else int(line[2])
            assert line[4] == "True", f"restart {n}: state is not step {resumed}'s"
            if floor is not None:  # the newest save whose staging completed, or the one it was staging
                assert resumed in (floor, floor + 1), f"restart {n}: resumed {resumed}, last staged {floor}"
                assert line[3] == "memory", f"restart {n}: resumed from {line[3]}"
            if n == KILLS:
                break
            first = read_line(zygote.stdout, 120)  # its first save (the worker's start-up) is staged
            assert first[:2] == ["staged", str(trainer)], first
            delay = rng.uniform(0.0, 0.8)
            time.sleep(delay)  # where in its save loop the trainer dies is random
            os.kill(trainer, 9)
            command(f"reap {trainer}")
            staged = [int(first[2])]
            while (line := read_line(zygote.stdout, 30))[:1] != ["exited"]:
                assert line[:2] == ["staged", str(trainer)], line
                staged.append(int(line[2]))
            floor = staged[-1]
            history.append((n, resumed, round(delay, 2), floor))
    finally:
        stop_zygote(zygote, (trainer, next_trainer))
    print("\nkill, resumed, kill delay s, last staged:", history)
    for info in list_checkpoints(root):
        if info.committed:
            assert verify_checkpoint(info.path) == [], info.name
