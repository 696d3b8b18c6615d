"""AsyncCheckpointer: the API a training loop calls.

schedule_save plans, snapshots and hands the save to the worker; finalize commits saves whose
writes ended; close waits for the last one. One save is in flight at a time: scheduling the next
first finishes the previous, which keeps commits in order and lets one staging pool serve all.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from .client import WorkerClient
from .commit import apply_retention, commit_checkpoint, move_latest, uncommit
from .config import CheckpointConfig
from .errors import CheckpointError, CheckpointTimeoutError, WorkerDiedError
from .loading import METADATA_FILE, latest_checkpoint, load, step_dir_name
from .planning import Planning
from .protocol import SaveFailed, SaveRequest, Staged, WorkerSettings, WriteDone, WriteOptions
from .snapshot import Snapshot, take_snapshot
from .storage import storage_for

log = logging.getLogger("asyncckpt")


@dataclass(frozen=True)
class SaveReport:
    """Figures of one committed save (seconds unless named otherwise)."""

    step: int
    path: str
    bytes: int
    blocked_s: float  # time schedule_save held the caller (includes waiting for the previous save)
    backpressure_s: float  # part of blocked_s spent finishing the previous save
    staging_s: float  # worker's copy into its staging pool
    write_s: float  # worker's writes, fsync included
    commit_s: float  # sidecar + .metadata + latest + retention
    durable_s: float  # schedule_save call to commit done
    throughput_gbps: float  # bytes / durable_s, in GB/s
    worker_pid: int
    cache_hit: bool  # the worker already held this structure
    tensors_sent: int  # tensors handed over with this save (0 when only the key was sent)
    plan_reused: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _InFlight:
    save_id: int
    step: int
    name: str
    step_dir: str
    metadata: Metadata
    started: float
    tensors_sent: int
    plan_reused: bool
    blocked_s: float = 0.0
    backpressure_s: float = 0.0
    staged: Optional[Staged] = None


@dataclass
class _WorkerHolds:
    """What the worker has cached: a structure, and each tensor with its fingerprint.

    The tensors are kept referenced here on purpose: while they live, their storage cannot be
    freed, so a new tensor can never reuse the address and pass the pointer comparison (a freed
    shared-memory mapping is otherwise handed straight back to the next allocation)."""

    structure_key: str
    fingerprints: list
    tensors: list


_live: "weakref.WeakSet[AsyncCheckpointer]" = weakref.WeakSet()


class AsyncCheckpointer:
    """Asynchronous DCP checkpoints of one training process, written by a persistent worker.

    All ranks of a job must call schedule_save and finalize at the same points.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        config: Optional[CheckpointConfig] = None,
        *,
        planner_factory: Callable[[], Any] = DefaultSavePlanner,
    ) -> None:
        if config is None:
            config = CheckpointConfig()
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"config must be a CheckpointConfig, not {type(config).__name__}")
        self.root = os.fspath(root)
        self.config = config
        self.rank = _rank()
        self._storage = storage_for(self.root)
        self._planning = Planning(planner_factory)
        self._client: Optional[WorkerClient] = None
        self._holds: Optional[_WorkerHolds] = None
        self._in_flight: Optional[_InFlight] = None
        self._committed: list[SaveReport] = []
        self._next_save_id = 0
        self._closed = False
        _live.add(self)
        self._start_worker()  # spawn now, so the first save does not pay for the interpreter start

    # public API ------------------------------------------------------------------------------
    def schedule_save(self, state_dict: dict[str, Any], step: int) -> None:
        """Snapshot `state_dict` as of now and write it as checkpoint `step` in the background.

        Eager staging returns once the worker holds its copy; lazy staging returns at once and
        the state must not change before `wait_staged()` (or the `guard` hook) returns."""
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, not {step!r}")
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, not {type(state_dict).__name__}")
        started = time.perf_counter()
        if self._in_flight is not None:
            self._finish_in_flight(blocking=True)
        backpressure_s = time.perf_counter() - started

        name = step_dir_name(step)
        step_dir = self._storage.join(self.root, name)
        self._prepare_step_dir(step_dir, name)
        try:
            planned = self._planning.plan(_plain_state(state_dict))
            snapshot = take_snapshot(planned)
            self._ensure_worker()
            request = self._request_for(snapshot, step, step_dir)
            if snapshot.has_cuda:
                torch.cuda.current_stream().synchronize()  # the worker must see finished values
            self._client.send(request)
        except BaseException:
            self._discard_step_dir(step_dir)
            raise
        self._holds = _WorkerHolds(snapshot.structure_key, snapshot.fingerprints, snapshot.tensors)
        self._in_flight = _InFlight(
            request.save_id, step, name, step_dir, planned.metadata, started,
            len(request.fresh_tensors), planned.reused_plan, backpressure_s=backpressure_s,
        )
        if self.config.staging == "eager":
            self.wait_staged()
        self._in_flight.blocked_s = time.perf_counter() - started

    def wait_staged(self) -> None:
        """Block until the in-flight save's snapshot is copied (bounded by timeout_s)."""
        flight = self._in_flight
        if flight is None or flight.staged is not None:
            return
        message = self._take(flight, (Staged, SaveFailed), self.config.timeout_s)
        if isinstance(message, SaveFailed):
            self._abandon(flight, self._failure_error(flight, message))
        flight.staged = message

    def guard(self, optimizer: torch.optim.Optimizer):
        """Make `optimizer.step()` wait for staging, so lazy saves cannot see later values.
        Returns the hook handle (call `.remove()` to undo)."""
        return optimizer.register_step_pre_hook(lambda *_: self.wait_staged())

    def finalize(self, blocking: bool = False) -> list[SaveReport]:
        """Commit the in-flight save if its writes ended (or, blocking, once they end).

        Returns the reports of every save committed since the last call (saves committed inside
        schedule_save or close included). Raises CheckpointError if a save failed."""
        if self._in_flight is not None:
            self._finish_in_flight(blocking)
        reports, self._committed = self._committed, []
        return reports

    def load_latest(self, state_dict: dict[str, Any]) -> Optional[int]:
        """Load the newest committed checkpoint into `state_dict` in place; return its step, or
        None when there is none (a fresh start)."""
        info = latest_checkpoint(self.root) if os.path.isdir(self.root) else None
        if info is None:
            return None
        load(state_dict, info.path)
        log.info("resumed from %s (step %d)", info.path, info.step)
        return info.step

    @property
    def worker_pid(self) -> Optional[int]:
        return self._client.pid if self._client is not None else None

    @property
    def planning_counters(self):
        return self._planning.counters

    def close(self) -> list[SaveReport]:
        """Wait for the in-flight save, commit it, and stop the worker. Idempotent."""
        if self._closed:
            return []
        try:
            return self.finalize(blocking=True)
        finally:
            self._closed = True
            _live.discard(self)
            if self._client is not None:
                self._client.stop()
                self._client = None

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # save path -------------------------------------------------------------------------------
    def _request_for(self, snapshot: Snapshot, step: int, step_dir: str) -> SaveRequest:
        held = self._holds
        known = self.config.cache_structure and held is not None and held.structure_key == snapshot.structure_key
        if known:
            fresh = {
                pos: tensor
                for pos, tensor in enumerate(snapshot.tensors)
                if tensor is not None
                and (pos in snapshot.always_fresh or snapshot.fingerprints[pos] != held.fingerprints[pos])
            }
        else:
            fresh = {pos: t for pos, t in enumerate(snapshot.tensors) if t is not None}
        self._next_save_id += 1
        return SaveRequest(
            save_id=self._next_save_id,
            step=step,
            checkpoint_dir=step_dir,
            structure_key=snapshot.structure_key,
            options=self._write_options(),
            items=None if known else snapshot.items,
            fresh_tensors=fresh,
            byte_items=snapshot.objects,
        )

    def _write_options(self) -> WriteOptions:
        c = self.config
        return WriteOptions(c.io, c.io_workers, c.format, c.fsync, c.checksums, c.separation_hint, c.staging_budget_bytes)

    def _finish_in_flight(self, blocking: bool) -> None:
        flight = self._in_flight
        timeout = self.config.timeout_s if blocking else 0
        if flight.staged is None:
            message = self._take(flight, (Staged, SaveFailed), timeout)
            if message is None:
                return
            if isinstance(message, SaveFailed):
                self._abandon(flight, self._failure_error(flight, message))
            flight.staged = message
        message = self._take(flight, (WriteDone, SaveFailed), timeout)
        if message is None:
            return
        if isinstance(message, SaveFailed):
            self._abandon(flight, self._failure_error(flight, message))
        self._commit(flight, message)

    def _take(self, flight: _InFlight, kinds: tuple, timeout: float):
        try:
            return self._client.take(flight.save_id, kinds, timeout)
        except CheckpointTimeoutError as exc:
            self._reset_worker(kill=True)  # it may still be writing; a fresh one serves the next save
            self._abandon(flight, CheckpointTimeoutError(f"step {flight.step}: {exc}"))
        except WorkerDiedError as exc:
            self._reset_worker(kill=True)
            self._abandon(flight, WorkerDiedError(f"step {flight.step}: {exc}"))

    def _commit(self, flight: _InFlight, done: WriteDone) -> None:
        started = time.perf_counter()
        try:
            commit_checkpoint(self._storage, flight.step_dir, flight.metadata, list(done.items), self.config.fsync)
            move_latest(self._storage, self.root, flight.name, self.config.fsync)
        except OSError as exc:
            self._abandon(flight, CheckpointError(f"step {flight.step}: commit failed in {flight.step_dir}: {exc}"))
        self._in_flight = None
        try:
            apply_retention(self._storage, self.root, self.config.keep_last)
        except (OSError, CheckpointError) as exc:
            log.warning("retention in %s failed (the new checkpoint is committed): %s", self.root, exc)
        now = time.perf_counter()
        durable_s = now - flight.started
        report = SaveReport(
            step=flight.step,
            path=flight.step_dir,
            bytes=done.bytes_written,
            blocked_s=flight.blocked_s,
            backpressure_s=flight.backpressure_s,
            staging_s=flight.staged.staging_s,
            write_s=done.write_s,
            commit_s=now - started,
            durable_s=durable_s,
            throughput_gbps=done.bytes_written / durable_s / 1e9 if durable_s > 0 else 0.0,
            worker_pid=flight.staged.worker_pid,
            cache_hit=flight.staged.cache_hit,
            tensors_sent=flight.tensors_sent,
            plan_reused=flight.plan_reused,
        )
        self._committed.append(report)
        self._publish(report)

    def _publish(self, report: SaveReport) -> None:
        log.info(
            "committed step %d: %.1f MB, blocked %.3fs, staging %.3fs, write %.3fs, commit %.3fs, "
            "durable %.3fs (%.2f GB/s), worker %d%s",
            report.step, report.bytes / 1e6, report.blocked_s, report.staging_s, report.write_s,
            report.commit_s, report.durable_s, report.throughput_gbps, report.worker_pid,
            ", cache hit" if report.cache_hit else "",
        )
        if self.config.metrics_path:
            with open(self.config.metrics_path, "a") as f:
                f.write(json.dumps(report.as_dict()) + "\n")
        if self.config.on_commit is not None:
            self.config.on_commit(report)

    def _failure_error(self, flight: _InFlight, failed: SaveFailed) -> CheckpointError:
        if failed.phase == "cache":
            self._holds = None  # resend everything next time
        where = f" ({failed.path})" if failed.path else ""
        return CheckpointError(f"rank {self.rank} step {flight.step}: {failed.phase} failed{where}: {failed.message}")

    def _abandon(self, flight: _InFlight, error: CheckpointError):
        """Forget a failed save, remove what it wrote (it was never committed), and raise."""
        self._in_flight = None
        self._discard_step_dir(flight.step_dir)
        raise error

    # worker and directories --------------------------------------------------------------------
    def _start_worker(self) -> None:
        cuda_device = torch.cuda.current_device() if torch.cuda.is_available() else None
        settings = WorkerSettings(
            rank=self.rank,
            parent_pid=os.getpid(),
            log_level=logging.getLogger("asyncckpt").getEffectiveLevel(),
            nice=self.config.worker_nice,
            ionice=self.config.worker_ionice,
            cuda_device=cuda_device,
        )
        self._client = WorkerClient(settings)
        self._client.start()
        self._holds = None

    def _ensure_worker(self) -> None:
        if self._client is None or not self._client.is_alive():
            if self._client is not None:
                log.warning("checkpoint worker pid %s is gone; starting a new one", self._client.pid)
                self._client.kill()
            self._start_worker()

    def _reset_worker(self, kill: bool) -> None:
        if self._client is not None:
            self._client.kill() if kill else self._client.stop()
        self._client = None
        self._holds = None

    def _prepare_step_dir(self, step_dir: str, name: str) -> None:
        self._storage.prepare_dir(self.root)
        if self._storage.is_dir(step_dir):
            if self._storage.exists(self._storage.join(step_dir, METADATA_FILE)):
                log.warning("overwriting committed checkpoint %s", step_dir)
            uncommit(self._storage, self.root, step_dir, name, self.config.fsync)
        self._storage.prepare_dir(step_dir)

    def _discard_step_dir(self, step_dir: str) -> None:
        try:
            if self._storage.is_dir(step_dir) and not self._storage.exists(self._storage.join(step_dir, METADATA_FILE)):
                self._storage.remove_tree(step_dir)
        except (OSError, CheckpointError) as exc:
            log.warning("could not remove uncommitted %s: %s", step_dir, exc)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this AsyncCheckpointer is closed")


def _plain_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace Stateful values (model/optimizer wrappers) by their state dicts, as DCP does."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            raise CheckpointError("several ranks are not supported yet: run one process per checkpoint root")
        return dist.get_rank()
    return 0


@atexit.register
def _close_all() -> None:
    """A script that exits without close(): commit what is in flight (bounded), stop the workers."""
    for checkpointer in list(_live):
        try:
            checkpointer.close()
        except Exception as exc:
            log.error("closing checkpointer for %s at exit: %s", checkpointer.root, exc)
