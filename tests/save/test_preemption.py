"""Preemption (issue 44): a SIGTERM never costs more than the steps since the last staged save.

Each run is a real training loop (preempt_child.py) in a session of its own, resumed from a
committed step 0, SIGTERMed at a random moment (during load_latest, staging, a write, a commit,
between saves): to the process alone or to its whole process group (the worker gets it too, as
from Slurm or a terminal). Every run must end with status 143 within a bound and leave a
checkpoint that loads, equal to the newest step staged when the loop saw `ckpt.preempted`.
CI runs 6 at once; ASYNCCKPT_SOAK=1 runs 20.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, load
from asyncckpt.layout import read_latest_marker
from asyncckpt.save.preemption import PREEMPTED_EXIT_CODE
from conftest import REPO

CHILD = os.path.join(os.path.dirname(__file__), "preempt_child.py")
RUNS = 20 if os.environ.get("ASYNCCKPT_SOAK") == "1" else 6
WINDOW_S = 2.5  # signals land uniformly over this long after the checkpointer is built
EXIT_BOUND_S = 90.0  # from the signal to the exit (a loaded 2-core box; a run takes a few seconds)


def child_state(value: float) -> dict:
    return {"w": {f"t{i}": torch.full((512 * 1024,), value) for i in range(8)}, "step": int(value)}


@pytest.fixture(scope="module")
def seed_root(tmp_path_factory) -> str:
    """A root with step 0 committed, as a preempt_child run leaves it."""
    root = str(tmp_path_factory.mktemp("seed") / "root")
    with AsyncCheckpointer(root, CheckpointConfig(worker_nice=None, worker_ionice=None), no_dist=True) as ckpt:
        ckpt.schedule_save(child_state(0.0), step=0)
    return root


def start_child(root: str, grace_s: float = 20.0, steps: int = 100000) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-u", CHILD, root, str(steps), str(grace_s)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = process.stdout.readline()
    assert line.strip() == "STARTED", (line, process.stderr.read() if process.poll() is not None else "")
    return process


def preempt_run(seed_root: str, root: str, delay_s: float, whole_group: bool) -> dict:
    shutil.copytree(seed_root, root)
    process = start_child(root)
    time.sleep(delay_s)
    os.killpg(process.pid, signal.SIGTERM) if whole_group else process.send_signal(signal.SIGTERM)
    try:
        out, err = process.communicate(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"no exit within {EXIT_BOUND_S}s of SIGTERM at {delay_s:.2f}s: {err[-2000:]}")
    return {"rc": process.returncode, "out": out, "err": err, "delay": delay_s, "root": root}


def test_sigterm_at_random_moments_commits_the_newest_staged_step(seed_root, tmp_path):
    rng = random.Random(int(os.environ.get("ASYNCCKPT_SEED", time.time())))
    delays = [WINDOW_S * (i + rng.random()) / RUNS for i in range(RUNS)]  # spread over the window
    with ThreadPoolExecutor(min(RUNS, 6)) as pool:
        runs = list(pool.map(lambda i: preempt_run(seed_root, str(tmp_path / f"run{i}"), delays[i], i % 2 == 1),
                             range(RUNS)))
    for run in runs:
        said = f"SIGTERM at {run['delay']:.2f}s: {run['out']!r} {run['err'][-2000:]}"
        assert run["rc"] == PREEMPTED_EXIT_CODE, said
        staged = int(run["out"].split("STAGED ")[1].split()[0])
        assert read_latest_marker(run["root"]) == f"step_{staged:08d}", said
        state = child_state(-1.0)
        load(state, os.path.join(run["root"], f"step_{staged:08d}"), no_dist=True)
        assert state["step"] == staged and all(bool((t == staged).all()) for t in state["w"].values()), said
        assert f"step {staged} committed" in run["err"] or "checkpoint is unchanged" in run["err"], said


RANK_RUNS = 20 if os.environ.get("ASYNCCKPT_SOAK") == "1" else 3


def preempt_two_ranks(seed_root: str, root: str, store: str, delay_s: float, signalled: tuple) -> list[dict]:
    """preempt_child on two ranks (each in a session of its own), SIGTERM to the ranks `signalled`
    `delay_s` after both installed their handlers."""
    shutil.copytree(seed_root, root)
    processes = [subprocess.Popen([sys.executable, "-u", CHILD, root, "100000", "20", str(r), "2", store], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
                 for r in range(2)]
    try:
        for process in processes:
            line = process.stdout.readline()
            assert line.strip() == "STARTED", (line, process.stderr.read() if process.poll() is not None else "")
        time.sleep(delay_s)
        for rank in signalled:
            processes[rank].send_signal(signal.SIGTERM)
        ends = []
        for process in processes:
            out, err = process.communicate(timeout=EXIT_BOUND_S)
            ends.append({"rc": process.returncode, "out": out, "err": err})
        return ends
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()


def test_two_ranks_sigterm_at_random_moments_stop_together_at_the_newest_staged_step(seed_root, tmp_path):
    """Two ranks, SIGTERM to one of them or both at a random moment (load_latest, staging, writes,
    commits, between saves): both exit 143, having stopped after the same step, and that step's
    save is committed and loads equal. CI runs 3; ASYNCCKPT_SOAK=1 runs 20."""
    rng = random.Random(int(os.environ.get("ASYNCCKPT_SEED", time.time())))
    for i in range(RANK_RUNS):
        delay, signalled = WINDOW_S * (i + rng.random()) / RANK_RUNS, rng.choice([(0,), (1,), (0, 1)])
        root = str(tmp_path / f"run{i}")
        ends = preempt_two_ranks(seed_root, root, str(tmp_path / f"store{i}"), delay, signalled)
        said = f"SIGTERM to {signalled} at {delay:.2f}s: " + " | ".join(f"{e['out']!r} {e['err'][-1500:]}" for e in ends)
        assert [e["rc"] for e in ends] == [PREEMPTED_EXIT_CODE] * 2, said
        staged = {int(e["out"].split("STAGED ")[1].split()[0]) for e in ends}
        assert len(staged) == 1, said
        step = staged.pop()
        assert read_latest_marker(root) == f"step_{step:08d}", said
        state = child_state(-1.0)
        load(state, os.path.join(root, f"step_{step:08d}"), no_dist=True)
        assert state["step"] == step and all(bool((t == step).all()) for t in state["w"].values()), said


def test_a_grace_cut_short_leaves_the_last_committed_checkpoint(seed_root, tmp_path):
    """The worker is stopped (SIGSTOP) mid-save: close() gives the save up when grace_s runs
    out, says so, and the process still exits 143 with a committed checkpoint `latest`: the one
    committed before the stop, or a newer one whose writes had ended before it (the trainer
    commits a save the worker has finished, which may land after the stop)."""
    import psutil

    root = str(tmp_path / "root")
    shutil.copytree(seed_root, root)
    process = start_child(root, grace_s=1.0)
    worker = None
    deadline = time.monotonic() + 60
    while worker is None and time.monotonic() < deadline:  # its worker, once it has saved a step
        workers = [c for c in psutil.Process(process.pid).children() if c.name().startswith("asyncckpt-w")]
        if workers and len(os.listdir(root)) > 3:
            worker = workers[0]
        time.sleep(0.05)
    assert worker is not None
    for proc in [worker, *worker.children(recursive=True)]:
        proc.suspend()
    committed_before = int(read_latest_marker(root)[5:])
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=EXIT_BOUND_S)
    assert process.returncode == PREEMPTED_EXIT_CODE, err
    assert time.monotonic() - started < 30, "the grace did not bound close()"
    assert "last committed checkpoint is intact" in err, err
    step = int(read_latest_marker(root)[5:])  # (the loop may never see `preempted`: stuck in a save's wait)
    assert step >= committed_before, (committed_before, step, err)
    state = child_state(-1.0)
    load(state, os.path.join(root, f"step_{step:08d}"), no_dist=True)
    assert state["step"] == step and all(bool((t == step).all()) for t in state["w"].values())


def test_without_preemption_signals_nothing_changes(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with AsyncCheckpointer(str(tmp_path / "r"), CheckpointConfig(), no_dist=True) as ckpt:
        assert signal.getsignal(signal.SIGTERM) is before and not ckpt.preempted


def test_handlers_are_installed_and_given_back(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    config = CheckpointConfig(preemption_signals=(signal.SIGUSR1,))
    ckpt = AsyncCheckpointer(str(tmp_path / "r"), config, no_dist=True)
    try:
        assert signal.getsignal(signal.SIGUSR1) is not before and not ckpt.preempted
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)  # (the handler runs between bytecodes)
        assert ckpt.preempted
    finally:
        ckpt.close()
    assert signal.getsignal(signal.SIGUSR1) is before


@pytest.mark.parametrize("bad, says", [
    ((signal.SIGKILL,), "cannot be caught"), ((signal.SIGSTOP,), "cannot be caught"), ((12345,), "not a signal"),
    (("SIGTERM",), "not a signal"), (signal.SIGTERM, "must be a tuple"), ((signal.SIGINT,), "Ctrl-C"),
])
def test_bad_preemption_signals_are_refused(bad, says):
    with pytest.raises(ValueError, match=says):
        CheckpointConfig(preemption_signals=bad)


def test_grace_must_be_positive():
    with pytest.raises(ValueError, match="grace_s"):
        CheckpointConfig(grace_s=0)


def test_only_the_main_thread_can_install_handlers(tmp_path):
    failures = []

    def build():
        try:
            AsyncCheckpointer(str(tmp_path / "r"), CheckpointConfig(preemption_signals=(signal.SIGTERM,)), no_dist=True)
        except ValueError as exc:
            failures.append(str(exc))

    thread = threading.Thread(target=build)
    thread.start()
    thread.join(60)
    assert failures and "main thread" in failures[0]
    assert not os.path.exists(tmp_path / "r" / "latest")


def _two_ranks(rank: int, world_size: int, root: str, signal_at: int) -> None:
    import torch.distributed as dist

    state = {f"w{rank}": torch.zeros(1 << 16), "step": -1}  # (a tensor every rank has would be saved once)
    ckpt = AsyncCheckpointer(root, CheckpointConfig(preemption_signals=(signal.SIGTERM,), worker_nice=None,
                                                    worker_ionice=None, timeout_s=60))
    stopped, staged = None, -1
    for step in range(200):
        if ckpt.preempted:
            stopped = step
            break
        ckpt.finalize()
        if rank == 1 and step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # one rank only
        state[f"w{rank}"].fill_(step * 10 + rank)
        state["step"] = step
        time.sleep(0.01)
        if step % 3 == 0:
            ckpt.schedule_save(state, step=step)
            staged = step
    ckpt.close()
    assert stopped is not None, f"rank {rank} never saw preempted"
    assert dist.is_initialized()
    seen = [None] * world_size
    dist.all_gather_object(seen, (stopped, staged))
    assert len(set(seen)) == 1, f"the ranks stopped at different steps: {seen}"
    assert read_latest_marker(root) == f"step_{staged:08d}"
    loaded = {f"w{rank}": torch.zeros(1 << 16), "step": -1}
    load(loaded, os.path.join(root, f"step_{staged:08d}"))
    assert loaded["step"] == staged and bool((loaded[f"w{rank}"] == staged * 10 + rank).all())


def test_a_signal_to_one_rank_stops_both_at_the_same_step(tmp_path):
    from multirank import run_ranks

    run_ranks(_two_ranks, 2, str(tmp_path / "root"), random.Random().randrange(2, 12), timeout_s=180)


def _memory_only_at_step_2(tmp_path, signum=signal.SIGUSR1):
    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    config = CheckpointConfig(preemption_signals=(signum,), memory_tier=True, memory_dir=shm,
                              worker_nice=None, worker_ionice=None)
    ckpt = AsyncCheckpointer(root, config, no_dist=True)
    ckpt.schedule_save(child_state(1.0), step=1)
    state = child_state(2.0)
    ckpt.schedule_save(state, step=2, memory_only=True)
    for tensor in state["w"].values():  # training goes on: the persist must write the copy staged at step 2
        tensor.fill_(3.0)
    state["step"] = 3
    os.kill(os.getpid(), signum)
    time.sleep(0.01)
    assert ckpt.preempted
    return root, shm, config, ckpt


def test_a_memory_only_newest_save_is_written_to_disk_on_close(tmp_path, capfd):
    """Preempted with a memory-only newest save: close() has the worker write the copy it staged
    (not the state as it is now) and commits it; a restart on another node loads it from disk."""
    root, shm, config, ckpt = _memory_only_at_step_2(tmp_path)
    reports = ckpt.close()
    assert (reports[-1].step, reports[-1].memory_only) == (2, False)
    assert "step 2 committed" in capfd.readouterr().err
    assert read_latest_marker(root) == "step_00000002"
    state = child_state(-1.0)
    load(state, os.path.join(root, "step_00000002"))  # from disk: what another node restarts from
    assert state["step"] == 2 and all(bool((t == 2).all()) for t in state["w"].values())
    assert not os.listdir(shm), "a clean close keeps no copy that the disk holds"


def _two_ranks_memory_only(rank: int, world_size: int, root: str, shm: str, signal_at: int) -> None:
    """Saves to memory only after step 0; rank 1 alone is signalled at `signal_at`."""
    state = {f"w{rank}": torch.zeros(1 << 16), "step": -1}
    config = CheckpointConfig(preemption_signals=(signal.SIGTERM,), memory_tier=True, memory_dir=shm,
                              worker_nice=None, worker_ionice=None, timeout_s=60)
    ckpt = AsyncCheckpointer(root, config)
    staged = -1
    for step in range(200):
        if ckpt.preempted:
            break
        if rank == 1 and step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        state[f"w{rank}"].fill_(step * 10 + rank)
        state["step"] = step
        ckpt.schedule_save(state, step=step, memory_only=step > 0)
        staged = step
    state[f"w{rank}"].fill_(-5)  # (what the trainer holds at close is not what is persisted)
    ckpt.close()
    assert read_latest_marker(root) == f"step_{staged:08d}"
    loaded = {f"w{rank}": torch.zeros(1 << 16), "step": -1}
    load(loaded, os.path.join(root, f"step_{staged:08d}"))
    assert loaded["step"] == staged and bool((loaded[f"w{rank}"] == staged * 10 + rank).all())


def test_two_ranks_write_their_memory_only_newest_save_on_a_signal_to_one(tmp_path):
    from multirank import run_ranks

    os.makedirs(tmp_path / "shm")
    run_ranks(_two_ranks_memory_only, 2, str(tmp_path / "root"), str(tmp_path / "shm"),
              random.Random().randrange(2, 8), timeout_s=180)


def test_a_memory_only_newest_save_that_cannot_be_written_stays_in_memory(tmp_path, capfd):
    """Writing it fails (its directory's name is taken by a file): close() says so, the last
    committed checkpoint stays the newest on disk, and the tier keeps the copy for a restart here."""
    root, shm, config, ckpt = _memory_only_at_step_2(tmp_path)
    with open(os.path.join(root, "step_00000002"), "w") as blocker:
        blocker.write("not a directory")
    ckpt.close()
    err = capfd.readouterr().err
    assert "step 2 was memory-only: not on disk; writing it to disk failed" in err and "kept in the memory tier" in err
    assert read_latest_marker(root) == "step_00000001"
    os.unlink(os.path.join(root, "step_00000002"))
    state = child_state(-1.0)
    with AsyncCheckpointer(root, config, no_dist=True) as again:
        assert again.load_latest(state) == 2
        assert again.resume_report.source == "memory"
    assert state["step"] == 2 and all(bool((t == 2).all()) for t in state["w"].values())


STUCK_CHILD = os.path.join(os.path.dirname(__file__), "preempt_stuck_child.py")
STUCK_GRACE_S = 6.0


def run_stuck_loops(tmp_path, kind: str, ranks: int = 1, signalled: tuple = (0,)) -> tuple[str, list[dict]]:
    """preempt_stuck_child on `ranks` ranks (each in a session of its own), SIGTERM to the ranks
    `signalled` once every rank has staged step 2; returns the root and each rank's exit."""
    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    extra = lambda rank: [str(rank), str(ranks), str(tmp_path / "store")] if ranks > 1 else []  # noqa: E731
    processes = [subprocess.Popen([sys.executable, "-u", STUCK_CHILD, root, str(STUCK_GRACE_S), kind, shm, *extra(r)],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True) for r in range(ranks)]
    try:
        for process in processes:
            line = process.stdout.readline()
            assert line.strip() == "STAGED 2", (line, process.stderr.read() if process.poll() is not None else "")
        started = time.monotonic()
        for rank in signalled:
            processes[rank].send_signal(signal.SIGTERM)
        exits = []
        for process in processes:
            out, err = process.communicate(timeout=EXIT_BOUND_S)
            exits.append({"rc": process.returncode, "err": err, "after_s": time.monotonic() - started})
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
    return root, exits


def assert_step_2_committed(root: str, exits: list[dict], ranks: int = 1) -> None:
    for rank, end in enumerate(exits):
        said = f"rank {rank}: {end}"
        assert end["rc"] == PREEMPTED_EXIT_CODE, said
        assert "closed for it" in end["err"] and "step 2 committed" in end["err"], said
        # closed for it; on a busy box the worker's stop may still run at the grace's end, which then
        # says so instead (never that the save was given up: it was committed)
        closed = ("the checkpointer was closed for the loop", "the worker's stop had not ended")
        assert any(words in end["err"] for words in closed), said
        assert "given up" not in end["err"], said
    assert read_latest_marker(root) == "step_00000002"
    state = {f"w{r}": {f"t{i}": torch.zeros(512 * 1024) for i in range(8)} for r in range(ranks)} | {"step": -1}
    load(state, os.path.join(root, "step_00000002"), no_dist=True)  # the copy staged at step 2, not what followed
    assert state["step"] == 2
    assert all(bool((t == 2.0).all()) for r in range(ranks) for t in state[f"w{r}"].values())


def test_a_loop_that_never_closes_still_gets_its_staged_save_committed(tmp_path):
    """The step after the signal never ends (a hang, a step longer than the grace): at 3/4 of
    grace_s the watchdog closes for the loop (the disk save in flight committed; a memory-only
    newest save written from the worker's copy and committed), then the grace ends the process
    (143). The two kinds run at once (each mostly waits for its grace)."""
    with ThreadPoolExecutor(2) as pool:
        ends = list(pool.map(lambda kind: run_stuck_loops(tmp_path / kind, kind), ["disk", "memory"]))
    for root, exits in ends:
        assert_step_2_committed(root, exits)


def test_two_stuck_ranks_commit_their_staged_save_together(tmp_path):
    """Both loops stuck after step 2 was staged (on disk, or memory-only), a signal to both ranks or
    to rank 1 alone (rank 0 learns of it from the job's store, no agreement coming): each rank's
    watchdog closes for its loop, the closes meet in the collectives a loop's would make, and step 2
    is committed for both ranks; both end with 143 (none is left hanging). The two cases run at once."""
    cases = [("disk", (0, 1)), ("memory", (1,))]
    with ThreadPoolExecutor(2) as pool:
        ends = list(pool.map(lambda case: run_stuck_loops(tmp_path / case[0], case[0], 2, case[1]), cases))
    for root, exits in ends:
        assert_step_2_committed(root, exits, ranks=2)


def _two_ranks_between_saves(rank: int, world_size: int, root: str, signal_at: int) -> None:
    """One save at step 0, then a long stretch with none pending (no agreement to carry the signal):
    rank 1 alone is signalled; both must stop after the same step, soon, through the store's board."""
    import torch.distributed as dist

    state = {f"w{rank}": torch.zeros(1 << 10), "step": -1}
    ckpt = AsyncCheckpointer(root, CheckpointConfig(preemption_signals=(signal.SIGTERM,), worker_nice=None,
                                                    worker_ionice=None, timeout_s=60))
    stopped, signalled_at = None, None
    for step in range(2000):
        if ckpt.preempted:
            stopped = step
            break
        ckpt.finalize()
        if rank == 1 and step == signal_at:
            signalled_at = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
        dist.all_reduce(torch.ones(1))  # the training step's collective: the ranks stay a step apart at most
        time.sleep(0.01)
        if step == 0:
            ckpt.schedule_save(state, step=0)
            ckpt.finalize(blocking=True)  # (committed: from here on no save is pending, no agreement is made)
    took_s = time.monotonic() - signalled_at if signalled_at is not None else None
    ckpt.close()
    seen = [None] * world_size
    dist.all_gather_object(seen, stopped)
    assert stopped is not None and len(set(seen)) == 1, f"the ranks stopped at different steps: {seen}"
    assert took_s is None or took_s < 15, f"rank 1 stopped {took_s:.1f}s after its signal"
    assert read_latest_marker(root) == "step_00000000"


def test_a_signal_between_saves_stops_every_rank_after_the_same_step(tmp_path):
    from multirank import run_ranks

    run_ranks(_two_ranks_between_saves, 2, str(tmp_path / "root"), random.Random().randrange(20, 60), timeout_s=180)
