"""The one save in flight: what the trainer knows of it until it is committed or failed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .commit import RankOutcome, Verdict
from .metadata_bytes import EntriesPlan
from ..protocol import MemorySave, Staged
from ..report import SaveReport
from ..storage.requests import COUNTER, RETRIES


@dataclass
class InFlightSave:
    save_id: int
    step: Optional[int]  # None: a save into a directory the caller named, without a step label
    name: Optional[str]  # the step directory's name; None when the caller named the directory
    step_dir: str
    entries_plan: EntriesPlan  # how its `.metadata` is put together (planning.PlannedSave)
    started: float
    tensors_sent: int
    plan_reused: bool
    blocked_s: float = 0.0
    backpressure_s: float = 0.0
    collectives_before: int = 0
    file_tag: str = ""  # set when the save replaces a committed checkpoint of the same step, or links files (incremental)
    deadline: float = 0.0  # monotonic: past it, a poll that finds no answer fails the save (timeout_s)
    deadline_says: str = ""  # the bound behind `deadline`, as its timeout error says it
    to_starting_worker: bool = False  # sent before the worker was up: its bounds include the start-up
    staged: Optional[Staged] = None
    error: Optional[str] = None  # this rank's part failed before the worker could report
    outcome: Optional[RankOutcome] = None  # kept until every rank has finished its part
    label: str = ""  # how errors name this save: "step 5" or "checkpoint '/path'"
    owns_dir: bool = True  # the save created its directory (a failed save may remove all of it)
    replaces: bool = False  # a committed checkpoint was in its directory (agreed by every rank)
    base_dirs: tuple[str, ...] = ()  # incremental: the checkpoints whose files it may reuse
    memory: Optional[MemorySave] = None  # the memory tier's record of it (memory_only: not written)
    requests_before: dict = field(default_factory=dict)  # this process's object-store requests before the save
    data_folder: str = ""  # this rank's data files go in this folder of step_dir (layout.py: prefix spreading)
    persists_restore: bool = False  # it writes the copy load_latest restored from memory (newer than the disk)
    hand_off: Optional[Any] = None  # a first save's first_save.HandOff: the worker is its thread's until it ends

    def report(self, rank: int, verdict: Verdict, outcome: RankOutcome, collectives_now: int, memory_tier) -> SaveReport:
        """The figures of this save, once committed (a memory-only one names this rank's memory file)."""
        memory_only = self.memory is not None and self.memory.memory_only
        durable_s = time.perf_counter() - self.started
        requests, commit_requests = dict(outcome.written.requests), COUNTER.since(self.requests_before)
        retries = requests.pop(RETRIES, 0) + commit_requests.pop(RETRIES, 0)
        return SaveReport(
            step=self.step,
            rank=rank,
            path=memory_tier.path if memory_only else self.step_dir,
            bytes=verdict.total_bytes,
            bytes_written=verdict.written_bytes,
            blocked_s=self.blocked_s,
            backpressure_s=self.backpressure_s,
            staging_s=self.staged.staging_s,
            write_s=outcome.written.write_s,
            commit_s=verdict.commit_s,
            durable_s=durable_s,
            throughput_gbps=verdict.total_bytes / durable_s / 1e9 if durable_s > 0 else 0.0,
            worker_pid=self.staged.worker_pid,
            cache_hit=self.staged.cache_hit,
            tensors_sent=self.tensors_sent,
            plan_reused=self.plan_reused,
            collectives=collectives_now - self.collectives_before,
            memory_only=memory_only,
            retries=retries,
            requests=requests,
            commit_requests=commit_requests,
        )
