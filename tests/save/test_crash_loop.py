"""Crash loop: a trainer that saves back to back is SIGKILLed at a random moment of a save, 8 times
over one root (20 with ASYNCCKPT_STRESS=1). After every kill `load_latest` returns a committed
step whose values are exactly that step's, `latest` names a committed checkpoint, every committed
checkpoint verifies (its bytes never changed), the committed step never goes backwards, and
the killed trainer's worker (and writer children) are gone within 10 seconds. Half the trainers
save incrementally (one tensor never changes: its file is hard-linked from save to save, across
the kills too, since a resumed trainer continues from the checkpoint it loaded).

Each trainer is a real process forked from a small "zygote" script that has already imported torch,
so an iteration pays for one interpreter start (its worker's), not two; and the next trainer is
forked (its worker starting) while the current one still saves, and told to go once the current
one was killed and checked.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import psutil
import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, cleanup, latest_checkpoint, load, verify_checkpoint
from asyncckpt.layout import list_checkpoints, read_latest_marker
from conftest import REPO, stress_size, wait_gone
from zygote import read_line, stop_zygote, zygote_script

ITERATIONS = stress_size("CRASHES", ci=8, full=20)
TENSORS, NUMEL = 4, 1 << 18  # 4 x 2 MiB of float64


def expected_state(step: int) -> dict:
    """The state a trainer holds at `step`: every value a function of the step."""
    return {
        "weights": {
            f"t{i}": torch.arange(NUMEL, dtype=torch.float64) + float(step * 1000 + i if i else 0) for i in range(TENSORS)
        },
        "meta": {"step": step, "tag": f"step-{step}"},
    }


ZYGOTE = zygote_script(
    f"""
    import os, random, signal, sys, time, traceback
    import torch
    from asyncckpt import AsyncCheckpointer, CheckpointConfig

    TENSORS, NUMEL = {TENSORS}, {NUMEL}

    def train(root, io, incremental, go_fd):
        base = torch.arange(NUMEL, dtype=torch.float64)
        state = {{
            "weights": {{f"t{{i}}": torch.zeros(NUMEL, dtype=torch.float64) for i in range(TENSORS)}},
            "meta": {{"step": 0, "tag": ""}},
        }}
        ckpt = AsyncCheckpointer(root, CheckpointConfig(
            io=io, io_workers=2, keep_last=2, worker_nice=None, worker_ionice=None, timeout_s=120.0,
            incremental=incremental == "1"))
        if os.read(go_fd, 1) != b"g":  # the worker starts meanwhile; the root is not touched yet
            return
        resumed = ckpt.load_latest(state)
        step = 0 if resumed is None else resumed + 1
        first = True
        while True:
            for i, tensor in enumerate(state["weights"].values()):
                tensor.copy_(base).add_(float(step * 1000 + i if i else 0))  # t0 never changes
            state["meta"] = {{"step": step, "tag": f"step-{{step}}"}}
            ckpt.schedule_save(state, step=step)
            if first and ckpt.worker_ready:  # (a first save returns before its worker is up)
                print("ready", os.getpid(), ckpt.worker_pid, resumed, flush=True)
                first = False
            ckpt.finalize()
            step += 1

    """
)


def zeros_like(state: dict) -> dict:
    return {
        "weights": {k: torch.zeros_like(v) for k, v in state["weights"].items()},
        "meta": {"step": -1, "tag": ""},
    }


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_trainer_killed_at_random_points_always_leaves_a_loadable_committed_latest(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    # one job restarting: the next trainer takes the root while the last one still holds it (and so does the reader)
    monkeypatch.setenv("ASYNCCKPT_JOB_ID", "crash-loop")
    script = tmp_path / "zygote.py"
    script.write_text(ZYGOTE)
    rng = random.Random(20240605)
    stderr_path = tmp_path / "trainers.stderr"
    zygote = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(stderr_path, "w"),
        text=True, cwd=REPO, bufsize=1,
    )
    reader = AsyncCheckpointer(root, CheckpointConfig(worker_nice=None, worker_ionice=None))
    history, started = [], time.monotonic()

    def command(text: str) -> None:
        zygote.stdin.write(text + "\n")
        zygote.stdin.flush()

    def spawn(iteration: int) -> int:
        """The trainer of `iteration`: io alternates thread/process, incremental two on, two off."""
        io, incremental = ("process" if iteration % 2 else "thread"), int(iteration % 4 >= 2)
        command(f"spawn {root} {io} {incremental}")
        line = read_line(zygote.stdout, 30)
        assert line[:1] == ["spawned"], line
        return int(line[1])

    next_trainer, trainer_pid = spawn(0), None
    try:
        last_step = -1
        for iteration in range(ITERATIONS):
            io = ("process" if iteration % 2 else "thread") + ("+incremental" if iteration % 4 >= 2 else "")
            trainer_pid = next_trainer
            go_at = time.monotonic()
            command(f"go {trainer_pid}")
            # the next trainer's worker starts while this one runs (two cores: it overlaps)
            next_trainer = spawn(iteration + 1) if iteration + 1 < ITERATIONS else None
            line = read_line(zygote.stdout, 120)
            ready_s = time.monotonic() - go_at
            assert line[:2] == ["ready", str(trainer_pid)], line
            worker_pid = int(line[2])
            delay = rng.uniform(0.0, 0.8)
            time.sleep(delay)  # not synchronisation: where in its save loop the trainer is killed is random
            writers = psutil.Process(worker_pid).children(recursive=True)  # the worker must still be up
            os.kill(trainer_pid, 9)
            command(f"reap {trainer_pid}")
            line = read_line(zygote.stdout, 30)
            assert line[:2] == ["exited", str(trainer_pid)], line
            status = int(line[2])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9, (
                f"iteration {iteration}: trainer ended by itself ({status}) before the kill:\n"
                + stderr_path.read_text()[-3000:]
            )
            worker_gone_s = wait_gone(worker_pid, 10)
            for child in writers:
                wait_gone(child.pid, 10)

            target = zeros_like(expected_state(0))
            step = reader.load_latest(target)
            assert step is not None, f"iteration {iteration}: nothing committed"
            expected = expected_state(step)
            assert target["meta"] == expected["meta"]
            for name, tensor in expected["weights"].items():
                assert torch.equal(target["weights"][name], tensor), f"iteration {iteration}: {name} of step {step}"
            assert step >= last_step, f"committed step went back from {last_step} to {step}"
            infos = list_checkpoints(root)
            committed = {c.name for c in infos if c.committed}
            assert read_latest_marker(root) in committed
            for info in infos:  # no save, torn or not, ever wrote into a file a committed one uses
                if info.committed:
                    assert verify_checkpoint(info.path) == [], f"iteration {iteration}: {info.name}"
            torn = [c.name for c in infos if not c.committed]
            check_cleanup(root, infos, dry_run=True)  # after every kill, not only at the end
            history.append((iteration, io, round(ready_s, 2), round(delay, 2), step, len(writers), round(worker_gone_s, 2), torn))
            last_step = step
    finally:
        reader.close()
        stop_zygote(zygote, (trainer_pid, next_trainer))
    print(f"\n{ITERATIONS} kills in {time.monotonic() - started:.1f}s")
    print("iteration, io, go to first save staged s, kill delay s, latest step, writer children at kill, worker gone after s, torn dirs")
    for row in history:
        print("  ", row)
    assert last_step > ITERATIONS // 2  # the trainers made progress between kills

    before = list_checkpoints(root)
    removed = check_cleanup(root, before, dry_run=False)
    print(f"cleanup removed {[os.path.basename(p) for p in removed]}")
    assert [c.name for c in list_checkpoints(root)] == [c.name for c in before if c.committed]
    latest = latest_checkpoint(root)
    assert latest.step == last_step
    target = zeros_like(expected_state(0))
    load(target, latest.path)  # what cleanup kept still loads
    assert torch.equal(target["weights"]["t0"], expected_state(last_step)["weights"]["t0"])


def check_cleanup(root: str, infos, dry_run: bool) -> list[str]:
    """`cleanup(root)` takes every torn step directory and nothing a committed checkpoint holds."""
    removed = cleanup(root, dry_run=dry_run)
    assert {c.path for c in infos if not c.committed} <= set(removed), (removed, infos)
    assert not {c.path for c in infos if c.committed} & set(removed), removed
    return removed
