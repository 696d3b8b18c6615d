"""The scale simulator (benchmarks/bench_scale.py) at a small rank count: its simulated coordinator
commits what real ranks wrote into a checkpoint stock `dcp.load` reads, and what it counts for
a save holds (the commit's bytes, the `.metadata` against DCP's own)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from scalesim.measure import measure  # noqa: E402
from scalesim.shapes import TINY, FabricatedPlanner, JobShape  # noqa: E402
from scalesim.wire import SimulatedGroup  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt import CheckpointConfig  # noqa: E402
from asyncckpt.layout import step_dir_name  # noqa: E402
from asyncckpt.save.commit import CommitMemory, SaveTarget, finish_save, rank_share  # noqa: E402
from asyncckpt.save.inflight import InFlightSave  # noqa: E402
from asyncckpt.save.planning import Planning  # noqa: E402
from asyncckpt.save.rank_worker import RankWorker  # noqa: E402
from asyncckpt.save.retention import Janitor  # noqa: E402
from asyncckpt.save.snapshot import take_snapshot  # noqa: E402
from asyncckpt.storage import storage_for  # noqa: E402


def _full_state(shape: JobShape) -> dict:
    """Every tensor and object of the job, flat by fqn, with distinct values."""
    plan = shape.local_plan(1, 0)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for item in plan.items:
        if item.tensor_data is None:
            state[item.index.fqn] = {"lr": 1e-3, "eps": 1e-8}.get(item.index.fqn.rsplit(".", 1)[-1], item.index.fqn)
        else:
            state[item.index.fqn] = torch.randn(tuple(item.tensor_data.size), generator=gen)
    return state


def _shard(full: torch.Tensor, item) -> torch.Tensor:
    chunk = item.tensor_data.chunk
    index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
    return full[index].clone()


def test_a_simulated_commit_of_two_real_ranks_files_loads_with_stock_dcp(tmp_path):
    """Two ranks of an FSDP job: each plans, snapshots and writes its shards through a real
    worker; the simulated coordinator plans for both and commits both ranks' write results;
    stock dcp.load reads every tensor and object back."""
    shape, ranks = JobShape(TINY, "fsdp"), 2
    full = _full_state(shape)
    plans = [shape.local_plan(ranks, r) for r in range(ranks)]
    planners = [FabricatedPlanner(plan, tensors={i.index.fqn: _shard(full[i.index.fqn], i)
                                                 for i in plan.items if i.tensor_data is not None},
                                  objects={k: v for k, v in full.items() if not isinstance(v, torch.Tensor)})
                for plan in plans]
    coordinator = SimulatedGroup(ranks)
    coordinator.inbox = [pickle.dumps(plans[1])]
    planning = [Planning(lambda p=p: p) for p in planners]
    planned = [planning[0].build(planning[0].local({}, True), coordinator)]
    other = SimulatedGroup(ranks, rank=1, reply=coordinator.replies[1])
    planned.append(planning[1].build(planning[1].local({}, False), other))

    root = str(tmp_path / "ckpt")
    step_dir = os.path.join(root, step_dir_name(1))
    storage = storage_for(root)
    storage.prepare_dir(step_dir)
    config = CheckpointConfig(io_workers=2)
    workers = [RankWorker(config, rank) for rank in range(ranks)]
    try:
        outcomes = []
        for rank, worker in enumerate(workers):
            flight = InFlightSave(0, 1, step_dir_name(1), step_dir, planned[rank].entries_plan, time.perf_counter(), 0,
                                  False)
            worker.ensure_alive()
            worker.send(flight, take_snapshot(planned[rank]), ())
            outcomes.append(worker.outcome(flight, blocking=True))
    finally:
        for worker in workers:
            worker.stop()
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    assert {w.relative_path[:4] for o in outcomes for w in o.written.items} == {"__0_", "__1_"}

    targets = [SaveTarget(root, 1, step_dir_name(1), step_dir, planned[rank].entries_plan) for rank in range(ranks)]
    share, _ = rank_share(storage, targets[1], outcomes[1], True, CommitMemory(), own_part=True)  # rank 1's own code
    coordinator.inbox = [pickle.dumps(share)]
    janitor = Janitor()
    verdict = finish_save(coordinator, storage, targets[0], outcomes[0], True, None, janitor, CommitMemory())
    janitor.close(10.0)
    assert verdict.committed, verdict.error
    assert asyncckpt.verify_checkpoint(step_dir) == []  # rank 1's items checked through its checksums part

    loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in full.items()}
    dcp.load(loaded, checkpoint_id=step_dir, no_dist=True)
    for fqn, value in full.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[fqn], value), fqn
        else:
            assert loaded[fqn] == value, fqn


def test_the_simulator_counts_a_steady_commit_and_matches_dcps_metadata(tmp_path):
    """At 8 ranks of each job shape: both methods commit the same entries; our `.metadata` is no
    larger than DCP's; a steady save gathers no plans and no entries (the layout is unchanged);
    with DDP (rank 0 writes everything) a rank that writes nothing sends only its small share,
    not rank 0's write results (gather_object pads every message to the largest one)."""
    rows = {}
    for parallel, tp in (("fsdp", 1), ("fsdp_tp", 2), ("ddp", 1)):
        ours, theirs = measure(JobShape(TINY, parallel, tp), 8, str(tmp_path / parallel))
        assert ours.chunks == theirs.chunks > 0
        assert ours.metadata_bytes <= theirs.metadata_bytes
        assert ours.steady_rank_sent < ours.first_rank_sent  # no local plan travels on a steady save
        assert ours.steady_rank_sent < 1024, ours  # nor any entry or checksum: a few numbers
        rows[parallel] = ours
    fsdp, ddp = rows["fsdp"], rows["ddp"]
    assert ddp.steady_coordinator_received < 7 * 1024, ddp
    assert fsdp.steady_coordinator_received < 7 * 1024, fsdp
    assert fsdp.steady_beyond_results < 8 * 1024, fsdp


def test_the_benchmark_runs_and_writes_its_table_json_and_plot(tmp_path):
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    command = [sys.executable, os.path.join(REPO, "benchmarks", "bench_scale.py"), "--shapes", "tiny FSDP",
               "--ranks", "2,4", "--targets", "16", "--out", str(out), "--plot", str(png), "--no-memory",
               "--write-gib", "0.05", "--steady-ranks", "8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tiny FSDP" in done.stdout and "~16" in done.stdout
    assert png.stat().st_size > 0
    result = json.loads(out.read_text())
    assert [(r["ranks"], r["method"]) for r in result["rows"]] == [(2, "asyncckpt"), (2, "dcp"), (4, "asyncckpt"),
                                                                     (4, "dcp")]
    assert {r["ranks"] for r in result["extrapolated"]} == {16}
    costs = {c["method"]: c for c in result["metadata_write_cost"]}  # a large .metadata written both ways
    assert set(costs) == {"image", "pieces"} and all(c["cpu_s"] > 0 and c["wall_s"] > 0 for c in costs.values())
    assert "tiny FSDP at ~16 ranks: .metadata" in done.stdout
    assert [(r["shape"], r["ranks"]) for r in result["steady_at_scale"]] == [("70B-1L FSDP", 8)] * 2  # both methods
