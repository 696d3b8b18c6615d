"""Several ranks (gloo, CPU): DCP planning semantics, resharding on load, the plan cache, and a
failure on one rank reaching every rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import asyncckpt
from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError
from asyncckpt.save.ranks import collective_timeout_s
from conftest import STRESS
from multirank import run_ranks

ROWS, COLS = 8, 12


def full_matrix(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS) + 1000 * step


def rank_state(rank: int, world: int, step: int, mesh) -> dict:
    """Replicated tensors (equal on every rank), per-rank tensors and a DTensor sharded by rows."""
    return {
        "replicated": {"w": torch.linspace(0, 1, 64) + step, "scale": torch.tensor(2.0 + step)},
        f"rank{rank}": {"local": torch.full((5,), float(rank * 100 + step))},
        "sharded": distribute_tensor(full_matrix(step), mesh, [Shard(0)]),
        "meta": {"step": step},
    }


def update_in_place(state: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict):
            update_in_place(state[key], value)
        elif isinstance(value, DTensor):
            state[key].to_local().copy_(value.to_local())
        elif isinstance(value, torch.Tensor):
            state[key].copy_(value)
        else:
            state[key] = value


def _save_steps(rank: int, world: int, root: str, steps: list[int], out: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    reports = []
    state = rank_state(rank, world, steps[0], mesh)
    with AsyncCheckpointer(root, CheckpointConfig(io_workers=2)) as ckpt:
        for step in steps:
            update_in_place(state, rank_state(rank, world, step, mesh))  # as training does
            ckpt.schedule_save(state, step=step)
            reports += ckpt.finalize(blocking=True)
        counters = ckpt.planning_counters
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"reports": [r.as_dict() for r in reports], "plan_gathers": counters.plan_gathers}, f)
    assert [r.step for r in reports] == steps


def _load_resharded(rank: int, world: int, path: str, step: int) -> None:
    """Stock dcp.load and asyncckpt.load (each rank reading only the items its shard overlaps,
    in parallel) into a different sharding (Shard(1)) and possibly a different world size."""
    mesh = init_device_mesh("cpu", (world,))
    for load in (lambda target: dcp.load(target, checkpoint_id=path), lambda target: asyncckpt.load(target, path)):
        target = {
            "replicated": {"w": torch.zeros(64), "scale": torch.tensor(0.0)},
            "sharded": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
            "meta": {"step": -1},
        }
        load(target)
        assert torch.equal(target["sharded"].full_tensor(), full_matrix(step))
        assert torch.equal(target["replicated"]["w"], torch.linspace(0, 1, 64) + step)
        assert torch.equal(target["replicated"]["scale"], torch.tensor(2.0 + step))
        assert target["meta"]["step"] == step


@pytest.mark.timeout(600)  # two run_ranks: 4 ranks save, 2 ranks load
@pytest.mark.parametrize("world", [2, 4] if STRESS else [2])  # 4 ranks: test_torch_dcp
def test_ranks_save_one_checkpoint_that_stock_dcp_loads_resharded(world, tmp_path):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "out.json")
    run_ranks(_save_steps, world, root, [0, 1, 2, 3], out)
    path = os.path.join(root, "step_00000003")
    assert sorted(f for f in os.listdir(path) if f.endswith(".distcp")) == sorted(
        f"__{r}_{n}.distcp" for r in range(world) for n in range(2)
    )  # every rank wrote its own io_workers files

    # one process, no process group, plain full tensors: a different world size
    target = {
        "replicated": {"w": torch.zeros(64), "scale": torch.tensor(0.0)},
        "sharded": torch.zeros(ROWS, COLS),
        "meta": {"step": -1},
        **{f"rank{r}": {"local": torch.zeros(5)} for r in range(world)},
    }
    dcp.load(target, checkpoint_id=path, no_dist=True)
    assert torch.equal(target["sharded"], full_matrix(3))
    assert torch.equal(target["replicated"]["scale"], torch.tensor(5.0))
    for r in range(world):
        assert torch.equal(target[f"rank{r}"]["local"], torch.full((5,), float(r * 100 + 3)))

    # two ranks loading into Shard(1)
    run_ranks(_load_resharded, 2, path, 3)

    with open(out) as f:
        result = json.load(f)
    assert result["plan_gathers"] == 1  # only the first save gathered plans
    for report in result["reports"][2:]:
        assert report["plan_reused"] and report["cache_hit"] and report["tensors_sent"] == 0
    # steady state: the schedule agreement, the finalize agreement, one gather + one broadcast
    assert result["reports"][-1]["collectives"] <= 4, result["reports"][-1]

    # every rank but the coordinator publishes its own checksums part, which the sidecar binds by
    # length and CRC32C; verify checks rank 1's items through it
    step2 = os.path.join(root, "step_00000002")
    with open(os.path.join(step2, ".checksums.json")) as f:
        assert [p["file"] for p in json.load(f)["parts"]] == [f".checksums.r{r}.json" for r in range(1, world)]
    assert asyncckpt.verify_checkpoint(step2) == []
    stray = os.path.join(step2, ".checksums.r9.json")  # a part no sidecar names (another save's)
    with open(stray, "w") as f:
        f.write("{}")
    assert asyncckpt.cleanup(root, dry_run=True) == [stray]  # the named parts are the checkpoint's
    with open(os.path.join(step2, "__1_0.distcp"), "r+b") as f:  # a flipped byte in rank 1's data
        f.seek(-2, os.SEEK_END)
        last = f.read(1)
        f.seek(-2, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert any("__1_0.distcp" in problem and "checksum mismatch" in problem
               for problem in asyncckpt.verify_checkpoint(step2))
    with open(os.path.join(step2, ".checksums.r1.json"), "ab") as f:  # a part that is not the one named
        f.write(b" ")
    with pytest.raises(CheckpointError, match=r"\.checksums\.r1\.json: checksums part is not the one"):
        asyncckpt.verify_checkpoint(step2)
    # a load reads only the parts of the files it reads: rank 0's items still load (checked)
    mine = {"rank0": {"local": torch.zeros(5)}}
    asyncckpt.load(mine, step2)
    assert torch.equal(mine["rank0"]["local"], torch.full((5,), 2.0))
    with pytest.raises(CheckpointError, match=r"\.checksums\.r1\.json"):
        asyncckpt.load({"rank1": {"local": torch.zeros(5)}}, step2)
    run_ranks(_load_own_entry_with_a_damaged_part, 2, step2)  # every rank fails before reading


def _load_own_entry_with_a_damaged_part(rank: int, world: int, path: str) -> None:
    """Rank 1's checksums part is damaged: both ranks fail in DCP's plan phase, so neither
    rank's state changed (the parts are read there, not as each rank reads its data)."""
    target = {f"rank{rank}": {"local": torch.zeros(5)}}
    with pytest.raises(CheckpointError, match="nothing in state_dict was changed|checksums part"):
        asyncckpt.load(target, path)
    assert torch.equal(target[f"rank{rank}"]["local"], torch.zeros(5))


def _failure_on_rank1(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    with AsyncCheckpointer(root, CheckpointConfig(io_workers=1)) as ckpt:
        ckpt.schedule_save(rank_state(rank, world, 1, mesh), step=1)
        ckpt.finalize(blocking=True)
        if rank == 0:  # make rank 1's data file impossible to open: a directory in its place
            os.makedirs(os.path.join(root, "step_00000002", "__1_0.distcp"))
        dist.barrier()
        with pytest.raises(CheckpointError) as failure:
            ckpt.schedule_save(rank_state(rank, world, 2, mesh), step=2)
            ckpt.finalize(blocking=True)
        assert "rank 1" in str(failure.value) and "__1_0.distcp" in str(failure.value), str(failure.value)
        assert not os.path.exists(os.path.join(root, "step_00000002", ".metadata"))
        with open(os.path.join(root, "latest")) as f:
            assert f.read().strip() == "step_00000001"
        dist.barrier()
        ckpt.schedule_save(rank_state(rank, world, 3, mesh), step=3)
        assert [r.step for r in ckpt.finalize(blocking=True)] == [3]


def test_writer_failure_on_one_rank_raises_on_every_rank(tmp_path):
    run_ranks(_failure_on_rank1, 2, str(tmp_path / "ckpt"))


def _wait_for_file(path: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _failed_save_while_store_stalls(rank: int, world: int, root: str, sync: str) -> None:
    with AsyncCheckpointer(root, CheckpointConfig(io_workers=1, timeout_s=30)) as ckpt:
        # fails in the snapshot on every rank (one entry per rank: DCP would give a shared one
        # to one rank only), after the directory was prepared: raised by the next finalize
        ckpt.schedule_save({f"bad{rank}": lambda: None}, step=1)
        dist.barrier()
        if rank == 0:
            open(os.path.join(sync, "ready"), "w").close()
            assert _wait_for_file(os.path.join(sync, "stopped"), 60)
        dist.barrier()
        with pytest.raises(CheckpointError, match="step 1 not committed.*cannot be serialized"):
            ckpt.finalize(blocking=True)  # the coordinator must not delete before the broadcast
        open(os.path.join(sync, f"verdict-{rank}"), "w").close()
        assert _wait_for_file(os.path.join(sync, "resumed"), 120)


def test_a_failed_saves_discard_on_a_stalled_store_does_not_hold_the_verdict(s3_server, tmp_path):
    """Removing a failed save's files on an object store that hangs (here: the S3 server
    stopped) happens after the verdict is broadcast: the other rank gets its CheckpointError
    while the store still hangs, instead of waiting in the collective for the delete."""
    root = s3_server.url("msc", s3_server.unique_prefix("discard-stall"))
    sync = str(tmp_path)
    moto = s3_server.server.process.pid
    seen = {}

    def stall_store() -> None:
        if not _wait_for_file(os.path.join(sync, "ready"), 120):
            return
        os.kill(moto, signal.SIGSTOP)
        try:
            open(os.path.join(sync, "stopped"), "w").close()
            seen["verdict on rank 1"] = _wait_for_file(os.path.join(sync, "verdict-1"), 30)
        finally:
            os.kill(moto, signal.SIGCONT)
            open(os.path.join(sync, "resumed"), "w").close()

    staller = threading.Thread(target=stall_store, daemon=True)
    staller.start()
    try:
        run_ranks(_failed_save_while_store_stalls, 2, root, sync, timeout_s=240)
    finally:
        staller.join(150)
        os.kill(moto, signal.SIGCONT)
    assert seen == {"verdict on rank 1": True}, seen


def _poll_every_step(rank: int, world: int, root: str, out: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    big = {"big": torch.randn(4 << 20), **rank_state(rank, world, 0, mesh)}
    polls, committed, costs = [], [], set()
    with AsyncCheckpointer(root, CheckpointConfig(io_workers=1)) as ckpt:
        for step in range(3):
            ckpt.schedule_save(big, step=step)
            paused = rank == 0  # rank 0's writes cannot end while its worker is stopped
            if paused:
                os.kill(ckpt.worker_pid, signal.SIGSTOP)
            while len(committed) <= step:  # training steps, each polling (bounded by run_ranks)
                before = ckpt._group.collectives
                started = time.perf_counter()
                reports = ckpt.finalize()
                if not reports:
                    polls.append(time.perf_counter() - started)
                    costs.add(ckpt._group.collectives - before)
                committed += [r.step for r in reports]
                if paused and len(polls) >= 10 * (step + 1):  # polls went on while the writes could not end
                    os.kill(ckpt.worker_pid, signal.SIGCONT)
                    paused = False
    assert committed == [0, 1, 2]  # in order, each once, by polls alone
    assert costs == {1}, costs  # a poll that commits nothing costs exactly one collective, the agreement
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"polls": sorted(polls)}, f)


def test_non_blocking_finalize_costs_only_the_agreement(tmp_path):
    """A poll that commits nothing costs one all-reduce and never waits for the writes: rank 0's
    worker stays stopped (its writes cannot end) for ten polls of every save, and each returns."""
    out = str(tmp_path / "polls.json")
    run_ranks(_poll_every_step, 2, str(tmp_path / "ckpt"), out)
    with open(out) as f:
        polls = json.load(f)["polls"]
    print(f"\n{len(polls)} polls: median {polls[len(polls) // 2] * 1e3:.2f} ms, max {polls[-1] * 1e3:.1f} ms")
    assert len(polls) >= 30  # ten or more per save, each while rank 0's writes were stopped


def _save_over_own_group(rank: int, world: int, root: str) -> None:
    group = dist.new_group(backend="gloo")
    with AsyncCheckpointer(root, CheckpointConfig(io_workers=1), process_group=group) as ckpt:
        assert ckpt._group.pg is group
        for step in (1, 2):
            ckpt.schedule_save({f"r{rank}": torch.full((3,), float(step + rank))}, step=step)
            assert [r.step for r in ckpt.finalize(blocking=True)] == [step]


def test_a_process_group_passed_in_carries_the_saves(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks(_save_over_own_group, 2, root)
    target = {"r0": torch.zeros(3), "r1": torch.zeros(3)}
    dcp.load(target, checkpoint_id=os.path.join(root, "step_00000002"), no_dist=True)
    assert torch.equal(target["r0"], torch.full((3,), 2.0)) and torch.equal(target["r1"], torch.full((3,), 3.0))


def test_a_process_group_that_cannot_carry_cpu_collectives_is_refused(tmp_path):
    """An NCCL-only group cannot all-reduce CPU tensors; stand in with torch's fake backend."""
    script = textwrap.dedent(f'''
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        import asyncckpt
        from asyncckpt import AsyncCheckpointer, CheckpointError
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        try:
            AsyncCheckpointer({str(tmp_path / "ckpt")!r}, process_group=dist.group.WORLD)
        except CheckpointError as exc:
            print("refused:", exc)
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused: process group backend 'fake' cannot carry" in done.stdout
    assert "process_group=dist.new_group(backend='gloo')" in done.stdout
    assert not os.path.exists(tmp_path / "ckpt")  # refused before anything was created


def _mismatched_calls(rank: int, world: int, root: str, out: str) -> None:
    """A bug in the training loop: rank 0 calls schedule_save (and finalize) once more than rank 1,
    so its third agreement (schedule_save of step 2) meets rank 1's (schedule_save of step 3)."""
    ckpt = AsyncCheckpointer(root, CheckpointConfig(timeout_s=30))
    state = {"w": torch.full((4,), float(rank))}
    ckpt.schedule_save(state, step=1)
    assert [r.step for r in ckpt.finalize(blocking=True)] == [1]
    steps = [2, 3] if rank == 0 else [3]
    raised = []
    for step in steps:
        try:
            ckpt.schedule_save(state, step=step)
            ckpt.finalize(blocking=True)
        except CheckpointError as exc:
            raised.append((step, str(exc)))
            break
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"raised": raised}, f)
    assert ckpt.finalize() == []  # nothing was started on either rank
    ckpt.schedule_save(state, step=5)  # back in step: saves work again
    assert [r.step for r in ckpt.close()] == [5]


def test_mismatched_call_counts_are_reported_on_every_rank_not_hung(tmp_path):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "calls")
    run_ranks(_mismatched_calls, 2, root, out)
    results = []
    for rank in (0, 1):
        with open(f"{out}.{rank}") as f:
            results.append(json.load(f))
    assert [len(r["raised"]) for r in results] == [1, 1], results  # CheckpointError on every rank
    assert results[0]["raised"][0][0] == 2 and results[1]["raised"][0][0] == 3  # at the mismatched call
    for rank, result in enumerate(results):
        message = result["raised"][0][1]
        assert f"rank {rank}: ranks disagree at schedule_save" in message and "steps 2..3" in message, message
    committed = sorted(n for n in os.listdir(root) if os.path.exists(os.path.join(root, n, ".metadata")))
    assert committed == ["step_00000001", "step_00000005"]  # neither mismatched step was committed


def _one_rank_stops_calling(rank: int, world: int, root: str, out: str) -> None:
    config = CheckpointConfig(timeout_s=2, worker_start_timeout_s=15)  # (the bound, 29 s, is what the test waits)
    bound = collective_timeout_s(config)
    ckpt = AsyncCheckpointer(root, config)
    ckpt.schedule_save({"w": torch.full((4,), float(rank))}, step=1)
    if rank == 1:  # stuck (a hung data loader, a bug): reaches finalize only after rank 0 gave up
        deadline = time.monotonic() + bound + 60
        while not os.path.exists(f"{out}.gave-up") and time.monotonic() < deadline:
            time.sleep(0.05)
    started = time.perf_counter()
    with pytest.raises(CheckpointError) as failure:
        ckpt.finalize(blocking=True)
    waited = time.perf_counter() - started
    if rank == 0:
        open(f"{out}.gave-up", "w").close()
    assert "did not reach finalize in time" in str(failure.value), str(failure.value)
    assert waited < bound + 30, f"rank {rank} waited {waited:.1f}s for a bound of {bound:.1f}s"
    with pytest.raises(CheckpointError, match="no collectives after an earlier failure"):
        ckpt.close()  # refuses at once and still stops the worker
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"waited": waited, "committed": os.path.exists(os.path.join(root, "step_00000001", ".metadata"))}, f)


def test_a_rank_that_stops_calling_fails_the_others_within_the_timeout(tmp_path):
    out = str(tmp_path / "result.json")
    run_ranks(_one_rank_stops_calling, 2, str(tmp_path / "ckpt"), out)
    with open(out) as f:
        result = json.load(f)
    assert not result["committed"]  # no rank committed a save the others never agreed to


def _one_rank_dies(rank: int, world: int, root: str, out: str) -> None:
    ckpt = AsyncCheckpointer(root, CheckpointConfig(timeout_s=60))
    ckpt.schedule_save({"w": torch.full((4,), float(rank))}, step=1)
    assert [r.step for r in ckpt.finalize(blocking=True)] == [1]
    if rank == 1:
        os._exit(0)  # the trainer process is gone (OOM kill, node failure); its worker follows it
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match="collective failed"):  # at schedule_save or finalize
        ckpt.schedule_save({"w": torch.zeros(4)}, step=2)
        ckpt.finalize(blocking=True)
    with open(out, "w") as f:
        json.dump({"waited": time.perf_counter() - started}, f)
    os._exit(0)  # the harness's closing barrier needs rank 1


def test_a_rank_that_dies_fails_the_others_instead_of_hanging(tmp_path):
    out = str(tmp_path / "result.json")
    run_ranks(_one_rank_dies, 2, str(tmp_path / "ckpt"), out)
    with open(out) as f:
        assert json.load(f)["waited"] < 30


def _peer_never_finishes(rank: int, world: int, root: str) -> None:
    """Rank 0 (timeout_s=2) finalizes blocking while rank 1's worker is frozen before it could
    stage and rank 1 (timeout_s=600, lazy) keeps polling: rank 0 gives up after its own bound
    (2 x timeout_s), not rank 1's, and both ranks raise; the next save works on both."""
    timeout_s = 2.0 if rank == 0 else 600.0
    staging = "eager" if rank == 0 else "lazy"
    state = {f"rank{rank}": torch.full((1000,), float(rank))}
    with AsyncCheckpointer(root, CheckpointConfig(io_workers=1, timeout_s=timeout_s, staging=staging)) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        stuck = ckpt.worker_pid
        if rank == 1:
            os.kill(stuck, signal.SIGSTOP)
        ckpt.schedule_save(state, step=2)
        started = time.monotonic()
        try:
            with pytest.raises(CheckpointError) as failure:
                if rank == 0:
                    ckpt.finalize(blocking=True)
                else:
                    while True:  # a training loop's polls: one agreement each, paired with rank 0's
                        ckpt.finalize()
        finally:
            if rank == 1 and psutil.pid_exists(stuck):  # never leave a frozen worker behind
                os.kill(stuck, signal.SIGKILL)
        elapsed = time.monotonic() - started
        message = str(failure.value)
        assert "step 2 not committed" in message and "rank 1" in message and "stopped waiting" in message, message
        if rank == 0:
            print(f"\nrank 0 gave up {elapsed:.1f}s after finalize started (bound {2 * timeout_s:.0f}s)")
            assert elapsed < 2 * timeout_s + 20  # far below rank 1's own bound (600 s)
        else:
            assert ckpt.worker_pid is None  # rank 1 killed its frozen worker; the next save starts one
        ckpt.schedule_save(state, step=3)
        assert [r.step for r in ckpt.finalize(blocking=True)] == [3]


def test_blocking_finalize_gives_up_after_its_own_bound_when_a_rank_never_finishes(tmp_path):
    run_ranks(_peer_never_finishes, 2, str(tmp_path / "ckpt"), timeout_s=120)
