"""AsyncCheckpointer: the API a training loop calls.

schedule_save plans, snapshots and hands the save to the worker; finalize commits saves whose
writes ended; close waits for the last one. One save is in flight at a time: scheduling the next
first finishes the previous, which keeps commits in order and lets one staging pool serve all.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ..config import CheckpointConfig
from ..errors import CheckpointError
from ..layout import new_file_tag, save_directory
from ..loading.restart import restart
from ..loading.resume import ResumeReport
from ..protocol import CACHE_SLOTS
from ..report import SaveReport, publish
from ..storage import storage_for
from ..storage.requests import COUNTER
from . import at_exit
from .commit import CommitMemory, RankOutcome, SaveTarget, finish_save
from .first_save import HandOff, hand_off_from_copy, hands_off
from .guard import GuardHandles, guard_calls
from .incremental import Continuation
from .inflight import InFlightSave
from .integration_hooks import IntegrationHooks
from .interrupted import InterruptedExit
from .job_lock import FolderLocks, take_root
from .memory_tier import MemoryTier
from .planning import Planning
from .preempted_close import PreemptedClose, one_call_at_a_time
from .preemption import Preemption
from .prefixes import data_folder_for, expected_writes
from .rank_worker import RankWorker
from .ranks import RankGroup, finalize_bound_s
from .retention import Janitor, ReadyDirectory, discard_uncommitted, raise_start_failure, ready_directory
from .snapshot import SaveWarnings, take_snapshot

log = logging.getLogger("asyncckpt")


class AsyncCheckpointer(InterruptedExit, IntegrationHooks, PreemptedClose):
    """Asynchronous DCP checkpoints of one training process, written by a persistent worker.

    All ranks of a job must call schedule_save and finalize at the same points.
    """

    def __init__(
        self,
        root: Optional[str | os.PathLike] = None,
        config: Optional[CheckpointConfig] = None,
        *,
        process_group: Optional[Any] = None,
        planner_factory: Callable[[], Any] = DefaultSavePlanner,
        no_dist: bool = False,
        memory_folder: Optional[str] = None,
    ) -> None:
        """`root` holds `step_N` checkpoints, `latest` and keep_last retention; without one, every
        save names its directory. The root is created if needed and taken for this job (every
        rank of it): CheckpointError if it cannot be written or another job holds it.
        `memory_folder` keys the memory tier where there is no root (the doors: where their checkpoints go).
        `no_dist=True`: this process saves alone even inside a distributed job (no collectives,
        no process group)."""
        if config is None:
            config = CheckpointConfig()
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"config must be a CheckpointConfig, not {type(config).__name__}")
        self.root = os.fspath(root) if root is not None else None
        if self.root is not None:
            storage_for(self.root)  # an unsupported URL fails here, not at the first save
        self._config = config
        self._calls = threading.RLock()  # held by every call (one_call_at_a_time)
        self._group = RankGroup(process_group, config, no_dist=no_dist)
        self.rank = self._group.rank
        self._planning = Planning(planner_factory)
        self._in_flight: Optional[InFlightSave] = None
        self._committed: list[SaveReport] = []
        self._closed = False
        self._warnings = SaveWarnings()
        self.resume_report: Optional[ResumeReport] = None  # what load_latest resumed from, what it skipped
        self._folders = FolderLocks()  # the root and the folders of explicit directories, held by the coordinator
        self._janitor = Janitor(self._folders.confirm)  # retention, after each commit's verdict
        self._commit_memory = CommitMemory()  # what a steady save's commit reuses
        self._incremental = Continuation(config.incremental, self.rank)
        self._preemption = Preemption(config.preemption_signals, config.grace_s, lambda: self._worker.abandon(), self._group,
                                      self._close_for_the_loop)
        if self.root is not None:
            take_root(self._folders, self.root, self._group, self._config.fsync)
        try:
            self._memory = MemoryTier(config, self.root, self._group, memory_folder) if config.memory_tier else None
            # a copy waiting in memory: the worker starts once load_latest has read it (its start-up
            # would take the cores the restore reads with), or at the first call that needs it
            waiting = self._memory is not None and self._memory.holds_copy
            self._worker = RankWorker(config, self.rank, self._memory and self._memory.worker_settings(), defer=waiting)
        except BaseException:
            self._folders.release()
            raise
        self._preemption.install()
        at_exit.track(self)  # once whole: a constructor that failed leaves nothing to close at exit

    @property
    def config(self) -> CheckpointConfig:
        return self._config

    @config.setter
    def config(self, config: CheckpointConfig) -> None:  # one configuration: this rank's worker reads it too
        self._config = self._worker.config = config

    # public API ------------------------------------------------------------------------------
    @one_call_at_a_time
    def schedule_save(
        self,
        state_dict: dict[str, Any],
        step: Optional[int] = None,
        *,
        checkpoint_dir: Optional[str] = None,
        wait: bool = True,
        cache_slot: int = 0,
        memory_only: bool = False,
    ) -> None:
        """Snapshot `state_dict` as of now and write it in the background: as `ROOT/step_N` for
        `step` (then `latest` moves and keep_last applies), or into `checkpoint_dir` when given
        (a local path, msc:// or s3://; `step` is then only a label, and the caller manages its
        directories). Re-saving a committed checkpoint replaces it at commit, never before.

        Eager staging returns once the worker holds its copy (or, while it starts, this process
        holds a private one: first_save.py); lazy staging returns at once and the state must not
        change before `wait_staged()` (or the `guard` hook) returns. `wait=False`: no wait for
        staging in eager mode either, for a state nobody changes afterwards (a private copy).
        `cache_slot` (0 or 1): the worker keeps one structure and its tensors cached per slot; a
        caller whose saves alternate between two sets of tensors (its model's, a held copy of
        them) gives each set its own slot, and neither is sent again. `memory_only=True` (memory_tier):
        stage into the memory tier and write nothing; the next disk save persists the state.
        With several ranks every rank must call this at the same point."""
        self._check_open()
        step, name, step_dir = save_directory(self.root, step, checkpoint_dir)  # step: an int from here on
        self._scheduling = f"step {step}" if checkpoint_dir is None else f"checkpoint {os.fspath(checkpoint_dir)!r}"
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, not {type(state_dict).__name__}")
        if cache_slot not in range(CACHE_SLOTS) or type(cache_slot) is not int:
            raise ValueError(f"cache_slot must be an int in 0..{CACHE_SLOTS - 1}, not {cache_slot!r}")
        if memory_only and self._memory is None:
            raise ValueError("memory_only=True needs CheckpointConfig(memory_tier=True)")
        started = time.perf_counter()
        collectives_before = self._group.collectives
        if self._in_flight is not None:
            self._finish_in_flight(blocking=True)
        backpressure_s = time.perf_counter() - started
        requests_before = COUNTER.snapshot()  # this save's object-store requests start here

        storage = storage_for(step_dir)
        label = f"step {step}" if name is not None else f"checkpoint {step_dir!r}"
        local, problem, writes, ready = None, None, 0, ReadyDirectory()
        try:  # before anything is written: the folder may be another job's
            ready_directory(ready, storage, step_dir, name is not None, not memory_only, self._group, self._folders,
                            self._janitor, self.config)
            local = self._planning.local(state_dict, self._group.is_coordinator)
            writes = 0 if memory_only else expected_writes(self.config, storage, step_dir, local.plan)  # spreading
        except OSError as exc:
            problem = CheckpointError(f"checkpoint directory {step_dir!r} is not usable: {exc}")
        except Exception as exc:  # every rank must reach the agreement, whatever went wrong here
            problem = exc
        changed, overwrite_any, failed, writes = self._group.agree(
            [local is None or self._planning.changed(local), int(ready.overwrite), int(problem is not None), writes],
            "schedule_save", -1 if step is None else step,
        )
        owns_dir = (name is not None or ready.created) and not memory_only
        if failed:
            raise_start_failure(self._group, problem, label, step_dir, owns_dir, ready.in_our_folder)
        file_tag = ""
        if overwrite_any:  # new files get other names; the old checkpoint stays committed until ours is
            file_tag = self._group.broadcast(new_file_tag())
            log.info("replacing committed checkpoint %s at commit (new files *%s)", step_dir, file_tag)
        bases = self._incremental.bases_for(step_dir)
        if bases and not file_tag:  # its new files and the links it makes never take the name of a base's
            file_tag = new_file_tag()  # file; and after the commit, files a torn save left there are removed
        planned = self._planning.build(local, self._group) if changed else self._planning.reuse(local)
        flight = InFlightSave(
            0, step, name, step_dir, planned.entries_plan, started, 0, planned.reused_plan,
            backpressure_s=backpressure_s, collectives_before=collectives_before, file_tag=file_tag,
            label=label, owns_dir=owns_dir, replaces=bool(overwrite_any),
            base_dirs=tuple(base.checkpoint_dir for base in bases), requests_before=requests_before,
            data_folder=data_folder_for(self.config, self._group.rank, self._group.size, writes, step_dir),
            memory=self._memory.next_save(planned, step, memory_only) if self._memory is not None else None,
        )
        self._preemption.staged_only = None  # the worker's slab takes this save
        try:
            hand_off = wait and hands_off(self.config, self._worker, cache_slot, self._memory)
            mapped = self._memory.restored_snapshot(planned) if hand_off and self._memory is not None else None
            if mapped is not None:  # the persist of a restored copy: from the tier's file, off this thread
                flight.hand_off = HandOff(self._worker, flight, mapped, None, bases, cache_slot)
            else:
                snapshot = take_snapshot(planned, keep_old_pages=hand_off)  # (the pages moved tensors leave: the copy)
                self._warnings.about(snapshot)
                if hand_off:  # a first save to its worker: handed over from a private copy, off this thread
                    flight.hand_off = hand_off_from_copy(self._worker, flight, snapshot, bases, cache_slot)
            if flight.hand_off is None:
                self._worker.ensure_alive()
                self._worker.send(flight, snapshot, bases, cache_slot)
        except Exception as exc:  # e.g. an entry that cannot be resolved or shared
            if self._group.size == 1:
                discard_uncommitted(storage, step_dir, file_tag, owns_dir)
                raise
            flight.error = f"{type(exc).__name__}: {exc}"  # raised on every rank by the next finalize
        snapshot = None  # noqa: F841 -- its copies made for this save alone must not outlive the staging
        self._in_flight = flight
        if self.config.staging == "eager" and wait:
            self.wait_staged()
        flight.blocked_s, self._scheduling = time.perf_counter() - started, None

    @one_call_at_a_time
    def prepare(self, state_dict: dict[str, Any]) -> None:
        """Do a save's one-time work now, so the first `schedule_save` of this state costs what a
        later one does. Call it where nothing changes the state (e.g. before the training loop): it
        plans the save (a collective with several ranks: every rank calls it at the same point), moves
        CPU tensors into shared memory in place (~0.3 s/GiB, once) and hands them to the worker, which
        readies its slab in the background; a save that comes before the worker is ready copies into
        memory faulted in here (~0.3 s/GiB more). Optional: else the first save does this (first_save.py).
        While a save is being handed over by a thread (the persist of a copy load_latest restored
        from memory), that thread owns the worker: the tensors are moved now, the save is not
        waited for, and the next save hands them over."""
        self._check_open()
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, not {type(state_dict).__name__}")
        flight = self._in_flight
        handing_off = flight is not None and flight.hand_off is not None and not flight.hand_off.finished(wait=False)
        if flight is not None and not handing_off:
            self._finish_in_flight(blocking=True)
        local, problem = None, None
        try:
            local = self._planning.local(state_dict, self._group.is_coordinator)
        except Exception as exc:  # every rank must reach the agreement, whatever went wrong here
            problem = exc
        changed, failed = self._group.agree(
            [local is None or self._planning.changed(local), int(problem is not None)], "prepare", -1
        )
        if failed:
            causes = self._group.all_gather(None if problem is None else f"{type(problem).__name__}: {problem}")
            if self._group.size == 1 and problem is not None:
                raise problem
            raise CheckpointError("prepare failed: " + "; ".join(f"rank {r}: {p}" for r, p in enumerate(causes) if p))
        planned = self._planning.build(local, self._group) if changed else self._planning.reuse(local)
        snapshot = take_snapshot(planned)
        self._warnings.about(snapshot)
        if not handing_off:
            self._worker.ensure_alive()
            self._preemption.staged_only = None  # (the worker may lay its slab out anew)
            self._worker.prepare(snapshot)

    @one_call_at_a_time
    def wait_staged(self) -> None:
        """Block until the in-flight save's snapshot is copied (bounded by timeout_s)."""
        flight = self._in_flight
        if flight is None or flight.staged is not None or flight.error is not None or flight.hand_off is not None:
            return  # (a private copy was handed over: nothing of the caller's is read after the call)
        self._worker.await_staged(flight)
        if flight.error is not None and self._group.size == 1:  # one rank: say it now; several: at finalize
            self._in_flight = None
            discard_uncommitted(storage_for(flight.step_dir), flight.step_dir, flight.file_tag, flight.owns_dir)
            raise CheckpointError(f"rank {self.rank} {flight.label}: {flight.error}")

    def guard(self, *owners: torch.optim.Optimizer | torch.nn.Module) -> GuardHandles:
        """Lazy staging: `optimizer.step()` and `module.forward` wait for staging first (see
        guard.py for exactly what that covers). Returns handles: `.remove()` undoes it."""
        return guard_calls(owners, self.wait_staged)

    @one_call_at_a_time
    def finalize(self, blocking: bool = False) -> list[SaveReport]:
        """Commit the in-flight save if its writes ended on every rank (or, blocking, once they
        end). Returns the reports of every save committed since the last call (saves committed
        inside schedule_save or close included). Raises CheckpointError on every rank if a save
        failed on any. Non-blocking, it costs one small all-reduce while a save is pending."""
        self._preemption.finalize_called()
        if self._in_flight is not None:
            self._finish_in_flight(blocking)
        reports, self._committed = self._committed, []
        return reports

    @one_call_at_a_time
    def load_latest(
        self, state_dict: dict[str, Any], *, trusted: bool = False, strict: bool = False, checksums: bool = True,
        allow_partial: bool = False,
    ) -> Optional[int]:
        """Load the newest committed checkpoint into `state_dict` in place; return its step, or
        None when there is none (a fresh start). A damaged one is skipped with a WARNING for the
        next older that loads (`resume_report` says which, and why); `strict=True` raises instead.
        Objects load with `weights_only=True` unless `trusted=True` (needed for e.g. custom
        classes or NumPy RNG states in the state). `checksums=False` checks no checksums (for an
        intact checkpoint whose checksums sidecar is damaged). `allow_partial`: as `load`'s strict=False."""
        if self.root is None:
            raise CheckpointError("load_latest needs a checkpoint root: AsyncCheckpointer(root, ...)")
        try:
            return self._restart(state_dict, trusted=trusted, strict=strict, checksums=checksums,
                                 allow_partial=allow_partial)
        finally:
            if self._worker_free():  # (a persist's hand-off starts it itself, off this thread)
                self._worker.start_deferred()

    def _restart(self, state_dict: dict[str, Any], **options: Any) -> Optional[int]:
        restarted = restart(state_dict, self.root, self._group, self._memory, **options)  # memory (the history rule), else disk
        report = self.resume_report = restarted.report
        if report is None:
            return None
        if report.source == "disk":  # (the memory tier's restore logs its own line)
            self._incremental.resumed(report.path)  # the next save continues from it
            skipped = f", {len(report.skipped)} newer damaged checkpoints skipped" if report.skipped else ""
            log.info("resumed from %s (step %d)%s", report.path, report.step, skipped)
        elif restarted.persist and self.config.memory_persist_restored:  # newer than the disk: persisted in the
            self._memory.persist_restored(lambda: self.schedule_save(state_dict, step=report.step))  # background
            self._in_flight.persists_restore = True
        return report.step

    worker_pid = property(lambda self: self._worker.pid)
    planning_counters = property(lambda self: self._planning.counters)
    preempted = property(lambda self: self._preemption.preempted)  # a preemption signal came: close(), then exit

    @one_call_at_a_time
    def close(self) -> list[SaveReport]:
        """Wait for the in-flight save, commit it, wait (at most timeout_s) for retention to end,
        and stop the worker. Idempotent. After a preemption signal every wait is bounded by grace_s
        and what was saved is said on stderr (preemption.py)."""
        if self._closed:
            self._preemption.uninstall()  # (the loop's close after the watchdog closed for it)
            return []
        try:
            return self._preemption.closing(lambda: self.finalize(blocking=True), bool(self._memory), self._persist)
        except KeyboardInterrupt:  # Ctrl-C while close() waits: as at an interrupted exit (interrupted.py)
            self._close_after_ctrl_c()
            raise
        finally:
            self._release()

    def _release(self) -> None:
        """What close() lets go of, once: retention's thread, the worker, the tier's file, the lock."""
        if not self._closed:
            self._closed = True
            at_exit.forget(self)
            self._preemption.uninstall()
            self._janitor.close(self._preemption.bound_s(self.config.timeout_s))
            self._worker.stop(self._preemption.bound_s(10.0))
            if self._memory is not None:
                self._memory.close(keep=self._preemption.keeps_memory)
            self._folders.release()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    __exit__ = lambda self, *exc: self.close()  # noqa: E731

    def _finish_in_flight(self, blocking: bool) -> None:
        flight = self._in_flight
        if self._worker_free(wait=blocking) and flight.outcome is None:  # (a first save's hand-off sets it)
            flight.outcome = self._worker.outcome(flight, blocking)
        ident = -1 if flight.step is None else flight.step
        bound, pending = finalize_bound_s(self.config, flight.to_starting_worker), flight.outcome is None
        not_done, gave_up = self._group.agree_finished(pending, blocking, ident, bound)
        if not_done and not gave_up:
            return
        if flight.outcome is None:  # another rank's blocking finalize waited its bound for this one
            self._worker.reset(kill=True)
            flight.outcome = RankOutcome(self.rank, error="unfinished when another rank's finalize stopped waiting")
        memory = flight.memory
        target = SaveTarget(
            self.root, flight.step, flight.name, flight.step_dir, flight.entries_plan, flight.file_tag, flight.owns_dir,
            flight.replaces, memory and memory.token, bool(memory and memory.memory_only),
        )
        verdict = finish_save(self._group, storage_for(flight.step_dir), target, flight.outcome, self.config.fsync,
                              self.config.keep_last, self._janitor, self._commit_memory, self._folders.confirm)
        self._in_flight = None
        if not verdict.committed:
            raise CheckpointError(f"{flight.label} not committed: {verdict.error}")
        if not target.memory_only:
            self._incremental.committed(flight.step_dir, flight.outcome.written.items, verdict.save_id)
        report = flight.report(self.rank, verdict, flight.outcome, self._group.collectives, self._memory)
        if self._memory is not None:  # what the next copy descends from; a copy that could not be sealed
            self._memory.committed(flight, verdict.save_id)
        if flight.persists_restore:  # the copy restored from memory is on disk now
            report = dataclasses.replace(report, persisted_restore=True)
            self.resume_report = dataclasses.replace(self.resume_report, persisted=True, persisted_at=time.time())
        self._committed.append(report)
        self._preemption.committed(report, flight if target.memory_only else None)
        publish(report, self.config.metrics_path, self.config.on_commit)
