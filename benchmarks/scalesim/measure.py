"""One job shape at one rank count: asyncckpt's save path and DCP's, on the coordinator.

asyncckpt: `Planning` (local plan, the agreement, `build` on the first save: gather, DCP's
global plan, scatter; `reuse` on a steady one) and `finish_save` (gather of every rank's
RankOutcome, `.checksums.json`, `.metadata`, `latest`, the verdict broadcast), as the
checkpointer calls them. DCP: `DefaultSavePlanner.create_global_plan` (plan caching on, so its
steady save is DCP's best: every rank sends an empty plan) and `FileSystemWriter.finish`, with
`_DistWrapper`'s collectives (gather, scatter, and the metadata broadcast to every rank).

A first save costs its planning plus the commit, a steady save the cached planning plus the
same commit; the commit is measured once (it does the same work in both).
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import time
import tracemalloc
from dataclasses import dataclass, field
from typing import Callable, Optional

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from asyncckpt.layout import METADATA_FILE, step_dir_name
from asyncckpt.save.commit import SaveTarget, finish_save
from asyncckpt.save.planning import Planning
from asyncckpt.save.retention import Janitor
from asyncckpt.storage import storage_for

from .results import Results, requests_for
from .shapes import FabricatedPlanner, JobShape
from .wire import SimulatedGroup, Traffic

MiB = 1 << 20


@dataclass
class Phase:
    """One stretch of coordinator work: CPU seconds (the box is shared: wall time measures the
    neighbours), wall seconds, bytes moved, peak memory (None: not traced)."""

    seconds: float
    wall_s: float
    traffic: Traffic
    peak_bytes: Optional[int] = None


@dataclass
class ScaleRow:
    shape: str
    ranks: int
    method: str  # "asyncckpt" | "dcp"
    chunks: int  # entries in .metadata's storage_data
    first_s: float  # coordinator CPU seconds
    steady_s: float
    first_rank_sent: int
    steady_rank_sent: int
    steady_rank_received: int
    first_coordinator_received: int
    steady_coordinator_received: int
    steady_beyond_results: int  # coordinator_received minus the write results' own pickles
    metadata_bytes: int
    metadata_write_s: float
    metadata_read_s: float
    files: int  # in the checkpoint directory
    requests: int  # S3 requests to upload the save (data files, sidecar, .metadata, latest)
    peak_mib: Optional[float] = None  # coordinator, first save (tracemalloc + gather's receive buffer)
    phases: dict = field(default_factory=dict)  # the parts, for the JSON


def measure(shape: JobShape, ranks: int, workdir: str, trace_memory: bool = False) -> list[ScaleRow]:
    """asyncckpt's row and DCP's for `shape` at `ranks` ranks; checkpoints go under `workdir`."""
    shape.check_ranks(ranks)
    plans = _Plans(shape, ranks)
    ours = _measure_ours(shape, ranks, plans, os.path.join(workdir, "asyncckpt"), trace_memory)
    dcp = _measure_dcp(shape, ranks, plans, os.path.join(workdir, "dcp"), trace_memory)
    return [ours, dcp]


class _Plans:
    """Every rank's local plan as the bytes it sends (rank 0's as the object it keeps)."""

    def __init__(self, shape: JobShape, ranks: int) -> None:
        self.first = shape.local_plan(ranks, 0)
        if shape.parallel == "ddp":  # every rank holds the same state: the same plan
            self.others = [pickle.dumps(shape.local_plan(ranks, 1))] * (ranks - 1)
        else:
            self.others = [pickle.dumps(shape.local_plan(ranks, r)) for r in range(1, ranks)]


def _rank_results(make: Callable, final_plans: list[SavePlan]) -> tuple[object, list, list[bytes]]:
    """Rank 0's write results (kept), every rank's files, the other ranks' results as the bytes
    they send (their objects are dropped: the coordinator never holds them, and a heap full of
    them would slow its garbage collector)."""
    own, files, others = None, [], []
    for rank, plan in enumerate(final_plans):
        result, rank_files = make(rank, plan)
        files.append(rank_files)
        if rank == 0:
            own = result
        else:
            others.append(pickle.dumps(result))
    return own, files, others


def _run(work: Callable[[], object], group: SimulatedGroup, trace: bool) -> tuple[object, Phase]:
    gc.collect()  # each phase starts from the same collector state
    if trace:
        tracemalloc.start()
    started, cpu = time.perf_counter(), time.process_time()
    value = work()
    wall_s, seconds = time.perf_counter() - started, time.process_time() - cpu
    peak = None
    if trace:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    traffic = group.take_traffic()
    if peak is not None:
        peak += traffic.coordinator_received  # gather_object's receive buffer (a tensor: not traced)
    return value, Phase(seconds, wall_s, traffic, peak)


def _measure_ours(shape: JobShape, ranks: int, plans: _Plans, root: str, trace: bool) -> ScaleRow:
    shutil.rmtree(root, ignore_errors=True)
    storage = storage_for(root)
    storage.prepare_dir(root)
    planning = Planning(lambda: FabricatedPlanner(plans.first, shape.lowest_rank_writes))
    group = SimulatedGroup(ranks)

    def plan() -> object:
        local = planning.local({}, True)
        changed, _, _ = group.agree([planning.changed(local), 0, 0], "schedule_save", 1)
        return planning.build(local, group) if changed else planning.reuse(local)

    group.inbox = plans.others
    planned, first_plan = _run(plan, group, trace)
    final_plans, group.replies = group.replies, None
    results = Results()
    own, files, others = _rank_results(results.ours, final_plans)
    del final_plans
    results_bytes = sum(map(len, others))  # what the coordinator receives of them (its own stays)
    planned, steady_plan = _run(plan, group, trace)
    assert planned.reused_plan, "the second save must reuse the plan"

    janitor = Janitor()
    step_dir = storage.join(root, step_dir_name(2))
    storage.prepare_dir(step_dir)
    target = SaveTarget(root, 2, step_dir_name(2), step_dir, planned.metadata)

    def commit() -> object:
        group.agree_finished(False, True, 2, 60.0)
        group.inbox = others
        return finish_save(group, storage, target, own, True, None, janitor)

    verdict, commit_phase = _run(commit, group, trace)
    janitor.close(60.0)
    if not verdict.committed:
        raise RuntimeError(f"{shape.name} x {ranks}: the simulated commit failed: {verdict.error}")
    data_files = [size for f in files for size in f.sizes]
    step_files = os.listdir(step_dir)
    sidecar_bytes = sum(os.path.getsize(os.path.join(step_dir, n)) for n in step_files if n.startswith(".checksums"))
    return _row(shape, ranks, "asyncckpt", step_dir, first_plan, steady_plan, commit_phase, results_bytes,
                files=len(data_files) + len(step_files),  # the data files (not written here) + sidecar, .metadata
                requests=requests_for(data_files + [sidecar_bytes, _metadata_size(step_dir), 16]) + 1)  # + HEAD .metadata


def _measure_dcp(shape: JobShape, ranks: int, plans: _Plans, root: str, trace: bool) -> ScaleRow:
    shutil.rmtree(root, ignore_errors=True)
    for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                  SavePlanner._cached_metadata, SavePlanner._cached_final_save_plan):
        cache.clear()  # DCP's plan cache is class-level: start cold
    planner = FabricatedPlanner(plans.first, shape.lowest_rank_writes)
    planner._enable_plan_caching = True  # DefaultSavePlanner(enable_plan_caching=True)
    planner.set_up_planner({}, None, True)
    group = SimulatedGroup(ranks)
    state: dict = {}

    def plan(local: SavePlan) -> Callable[[], object]:
        def work() -> object:
            all_plans = group.gather(local)
            deltas, state["metadata"] = planner.create_global_plan(all_plans)
            return planner.finish_plan(group.scatter(deltas))
        return work

    group.inbox = plans.others
    _, first_plan = _run(plan(plans.first), group, trace)
    final_plans = planner.global_plan
    results = Results()
    own, files, others = _rank_results(results.dcp, final_plans)
    results_bytes = sum(map(len, others))  # what the coordinator receives of them (its own stays)
    unchanged = SavePlan([], usable=False)  # what a rank whose local plan is cached sends
    group.inbox = [pickle.dumps(unchanged)] * (ranks - 1)
    _, steady_plan = _run(plan(unchanged), group, trace)

    step_dir = os.path.join(root, step_dir_name(2))
    os.makedirs(step_dir)
    writer = FileSystemWriter(step_dir)  # sync_files=True: fsync, as ours
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)

    def commit() -> object:
        group.inbox = others
        all_results = group.gather(own)
        writer.finish(metadata=state["metadata"], results=all_results)
        return group.broadcast(state["metadata"])  # _DistWrapper.all_reduce hands every rank the metadata

    _, commit_phase = _run(commit, group, trace)
    data_files = [size for f in files for size in f.sizes]
    return _row(shape, ranks, "dcp", step_dir, first_plan, steady_plan, commit_phase, results_bytes,
                files=len(data_files) + 1, requests=requests_for(data_files + [_metadata_size(step_dir)]))


def _row(shape: JobShape, ranks: int, method: str, step_dir: str, first_plan: Phase, steady_plan: Phase,
         commit: Phase, results_bytes: int, files: int, requests: int) -> ScaleRow:
    read_s, write_s, chunks = _metadata_times(step_dir)
    first, steady = Traffic(), Traffic()
    for total, part in ((first, first_plan.traffic), (first, commit.traffic), (steady, steady_plan.traffic),
                        (steady, commit.traffic)):
        total.add(part)
    peaks = [p.peak_bytes for p in (first_plan, commit) if p.peak_bytes is not None]
    return ScaleRow(
        shape=shape.name, ranks=ranks, method=method, chunks=chunks,
        first_s=first_plan.seconds + commit.seconds, steady_s=steady_plan.seconds + commit.seconds,
        first_rank_sent=first.rank_sent, steady_rank_sent=steady.rank_sent, steady_rank_received=steady.rank_received,
        first_coordinator_received=first.coordinator_received,
        steady_coordinator_received=steady.coordinator_received,
        steady_beyond_results=steady.coordinator_received - results_bytes,
        metadata_bytes=_metadata_size(step_dir), metadata_write_s=write_s, metadata_read_s=read_s,
        files=files, requests=requests, peak_mib=max(peaks) / MiB if peaks else None,
        phases={"first_plan_s": first_plan.seconds, "steady_plan_s": steady_plan.seconds, "commit_s": commit.seconds,
                "first_plan_wall_s": first_plan.wall_s, "commit_wall_s": commit.wall_s, "results_bytes": results_bytes},
    )


def _metadata_size(step_dir: str) -> int:
    return os.path.getsize(os.path.join(step_dir, METADATA_FILE))


def _metadata_times(step_dir: str) -> tuple[float, float, int]:
    """CPU seconds stock DCP takes to read `.metadata` (FileSystemReader.read_metadata: what
    dcp.load does first), wall seconds to pickle it and write it durably, and its entries."""
    gc.collect()
    started = time.process_time()
    metadata = FileSystemReader(step_dir).read_metadata()
    read_s = time.process_time() - started
    started = time.perf_counter()
    storage_for(step_dir).write_atomic(os.path.join(step_dir, METADATA_FILE + ".again"), pickle.dumps(metadata), fsync=True)
    return read_s, time.perf_counter() - started, len(metadata.storage_data)
