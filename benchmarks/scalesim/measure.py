"""One job shape at one rank count: asyncckpt's save path and DCP's, on the coordinator.

asyncckpt: `Planning` (local plan, the agreement, `build` on the first save: gather, DCP's
global plan, scatter; `reuse` on a steady one) and `finish_save` (gather of every rank's
RankShare, `.checksums.json`, `.metadata`, `latest`, the verdict broadcast), as the
checkpointer calls them. The other ranks' shares come from the rank's own code
(`commit.rank_share`: its encoded entries and its checksums part, written for real), so a first
commit receives every rank's entries and a steady one (same layout) none. DCP:
`DefaultSavePlanner.create_global_plan` (plan caching on, so its steady save is DCP's best: every
rank sends an empty plan) and `FileSystemWriter.finish`, with `_DistWrapper`'s collectives
(gather, scatter, and the metadata broadcast to every rank).

A first save costs its planning plus its commit, a steady save the cached planning plus a steady
commit. DCP's commit does the same work in both and is measured once.
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
from asyncckpt.loading.opened import read_metadata
from asyncckpt.save.commit import CommitMemory, RankOutcome, SaveTarget, finish_save, rank_share
from asyncckpt.save.metadata_bytes import EntriesPlan
from asyncckpt.save.planning import Planning
from asyncckpt.save.retention import Janitor
from asyncckpt.storage import storage_for
from asyncckpt.storage.page_buffer import PageBuffer

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
    metadata_read_s: float  # stock dcp.load's reader
    metadata_our_read_s: float  # asyncckpt's (asyncckpt.load, resume)
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


def _rank_results(make: Callable, final_plans: list[SavePlan], pickled: bool) -> tuple[object, list, list]:
    """Rank 0's write results (kept), every rank's files, the other ranks' results (`pickled`: as
    the bytes they send; a heap full of their objects would slow the coordinator's garbage
    collector, so DCP's are held so)."""
    own, files, others = None, [], []
    for rank, plan in enumerate(final_plans):
        result, rank_files = make(rank, plan)
        files.append(rank_files)
        if rank == 0:
            own = result
        else:
            others.append(pickle.dumps(result) if pickled else result)
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
    final_plans, refs = zip(*group.replies)  # each rank's final plan and its references into the head
    group.replies = None
    entries_plans = [EntriesPlan(r.bind(p)) for p, r in zip(final_plans[1:], refs[1:])]  # what the ranks keep
    results = Results()
    own, files, others = _rank_results(results.ours, final_plans, pickled=False)
    del final_plans, refs
    planned, steady_plan = _run(plan, group, trace)
    assert planned.reused_plan, "the second save must reuse the plan"

    janitor, memory = Janitor(), CommitMemory()
    first_inbox, steady_inbox = _other_ranks_shares(storage, root, (2, 3), entries_plans, others)
    del others, entries_plans  # the coordinator never holds them (and a heap full of them slows its collector)
    first_commit = _commit(storage, root, 2, planned.entries_plan, own, first_inbox, group, janitor, memory, trace)
    steady_commit = _commit(storage, root, 3, planned.entries_plan, own, steady_inbox, group, janitor, memory, trace)
    janitor.close(60.0)
    step_dir = storage.join(root, step_dir_name(3))
    data_files = [size for f in files for size in f.sizes]
    step_files = os.listdir(step_dir)
    sidecars = [os.path.getsize(os.path.join(step_dir, n)) for n in step_files if n.startswith(".checksums")]
    first_plan.traffic.add(first_commit.traffic)
    steady_plan.traffic.add(steady_commit.traffic)
    return _row(shape, ranks, "asyncckpt", step_dir, first_plan, steady_plan, first_commit, steady_commit,
                sum(map(len, first_inbox)), sum(map(len, steady_inbox)),
                files=len(data_files) + len(step_files),  # the data files (not written here) + sidecar, parts, .metadata
                requests=requests_for(data_files + sidecars + [_metadata_size(step_dir), 16]) + 1)  # + HEAD .metadata


def _other_ranks_shares(storage, root: str, steps: tuple[int, int], entries_plans: list[EntriesPlan],
                        outcomes: list[RankOutcome]):
    """What the other ranks send at the commit of a first save and of a steady one (the same
    layout), as bytes, built by each rank's own code (`rank_share`: its encoded entries, and its
    checksums part, written for real into the step directory)."""
    inboxes = []
    memories = [CommitMemory() for _ in outcomes]
    for step in steps:
        step_dir = storage.join(root, step_dir_name(step))
        storage.prepare_dir(step_dir)
        inbox = []
        for outcome, entries_plan, rank_memory in zip(outcomes, entries_plans, memories):
            target = SaveTarget(root, step, step_dir_name(step), step_dir, entries_plan)
            share, entries = rank_share(storage, target, outcome, True, rank_memory, own_part=True)
            rank_memory.own_entries = entries  # as finish_save does once the verdict says committed
            inbox.append(pickle.dumps(share))
        inboxes.append(inbox)
    return inboxes


def _commit(storage, root: str, step: int, entries_plan: EntriesPlan, own: RankOutcome, inbox: list[bytes],
            group: SimulatedGroup, janitor: Janitor, memory: CommitMemory, trace: bool) -> Phase:
    """The coordinator's commit of step `step`, the other ranks' shares in `inbox`."""
    step_dir = storage.join(root, step_dir_name(step))
    target = SaveTarget(root, step, step_dir_name(step), step_dir, entries_plan)

    def work() -> object:
        group.agree_finished(False, True, step, 60.0)
        group.inbox = inbox
        return finish_save(group, storage, target, own, True, None, janitor, memory)

    verdict, phase = _run(work, group, trace)
    if not verdict.committed:
        raise RuntimeError(f"the simulated commit of step {step} failed: {verdict.error}")
    return phase


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
    own, files, others = _rank_results(results.dcp, final_plans, pickled=True)
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
    for plan_phase in (first_plan, steady_plan):
        plan_phase.traffic.add(commit_phase.traffic)
    return _row(shape, ranks, "dcp", step_dir, first_plan, steady_plan, commit_phase, commit_phase, results_bytes,
                results_bytes, files=len(data_files) + 1, requests=requests_for(data_files + [_metadata_size(step_dir)]))


def _row(shape: JobShape, ranks: int, method: str, step_dir: str, first_plan: Phase, steady_plan: Phase,
         first_commit: Phase, steady_commit: Phase, first_results: int, steady_results: int, files: int,
         requests: int) -> ScaleRow:
    """A row from the phases; each plan phase's traffic already includes its commit's."""
    read_s, our_read_s, write_s, chunks = _metadata_times(step_dir, method)
    first, steady = first_plan.traffic, steady_plan.traffic
    peaks = [p.peak_bytes for p in (first_plan, first_commit) if p.peak_bytes is not None]
    return ScaleRow(
        shape=shape.name, ranks=ranks, method=method, chunks=chunks,
        first_s=first_plan.seconds + first_commit.seconds, steady_s=steady_plan.seconds + steady_commit.seconds,
        first_rank_sent=first.rank_sent, steady_rank_sent=steady.rank_sent, steady_rank_received=steady.rank_received,
        first_coordinator_received=first.coordinator_received,
        steady_coordinator_received=steady.coordinator_received,
        steady_beyond_results=steady.coordinator_received - steady_results,
        metadata_bytes=_metadata_size(step_dir), metadata_write_s=write_s, metadata_read_s=read_s, metadata_our_read_s=our_read_s,
        files=files, requests=requests, peak_mib=max(peaks) / MiB if peaks else None,
        phases={"first_plan_s": first_plan.seconds, "steady_plan_s": steady_plan.seconds,
                "first_commit_s": first_commit.seconds, "steady_commit_s": steady_commit.seconds,
                "first_plan_wall_s": first_plan.wall_s, "first_commit_wall_s": first_commit.wall_s,
                "steady_plan_wall_s": steady_plan.wall_s, "steady_commit_wall_s": steady_commit.wall_s, "first_results_bytes": first_results,
                "steady_results_bytes": steady_results},
    )


def _metadata_size(step_dir: str) -> int:
    return os.path.getsize(os.path.join(step_dir, METADATA_FILE))


def _metadata_times(step_dir: str, method: str) -> tuple[float, float, float, int]:
    """CPU seconds stock DCP takes to read `.metadata` (FileSystemReader.read_metadata: what
    dcp.load does first), asyncckpt's loader takes (`read_metadata`: restricted unpickler, the
    collector paused, every entry checked), CPU seconds to write its bytes durably once more the way its commit
    does (asyncckpt: its kept image, O_DIRECT; DCP: a pickle through the page cache; at GiBs:
    write_cost.py), and its entries."""
    gc.collect()
    started = time.process_time()
    metadata = FileSystemReader(step_dir).read_metadata()
    read_s = time.process_time() - started
    chunks = len(metadata.storage_data)
    del metadata
    gc.collect()
    started = time.process_time()
    read_metadata(step_dir)
    our_read_s = time.process_time() - started
    with open(os.path.join(step_dir, METADATA_FILE), "rb") as f:
        data = f.read()
    if method == "asyncckpt":
        image = PageBuffer(len(data))
        image.append(data)
        data = image
    started = time.process_time()
    storage_for(step_dir).write_atomic(os.path.join(step_dir, METADATA_FILE + ".again"), data, fsync=True)
    write_s = time.process_time() - started
    os.unlink(os.path.join(step_dir, METADATA_FILE + ".again"))
    return read_s, our_read_s, write_s, chunks
