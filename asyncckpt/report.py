"""The figures of a committed save, and where they go: one INFO log line, an optional JSON-lines
file, an optional callback."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

log = logging.getLogger("asyncckpt")


@dataclass(frozen=True)
class SaveReport:
    """Figures of one committed save (seconds unless named otherwise)."""

    step: Optional[int]  # None for a save into a directory the caller named without a step
    rank: int
    path: str  # the checkpoint directory; a memory-only save: this rank's memory tier file
    bytes: int  # the checkpoint's size, every rank
    bytes_written: int  # of it, written by this save (less than `bytes` when incremental)
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
    collectives: int = 0  # collectives this save issued, from schedule_save to the commit
    memory_only: bool = False  # staged into the memory tier only: nothing was written or committed
    persisted_restore: bool = False  # this save persisted the copy `load_latest` restored from memory
    retries: int = 0  # object-store requests and calls tried again after a transient failure (503, reset, ...)
    # object-store requests by kind (put, part, head...), each attempt counted: this rank's data
    # files (its worker), and this process's own (probe, sidecar, .metadata, latest on the coordinator)
    requests: dict = field(default_factory=dict)
    commit_requests: dict = field(default_factory=dict)

    @property
    def request_count(self) -> int:
        return sum(self.requests.values()) + sum(self.commit_requests.values())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def publish(report: SaveReport, metrics_path: Optional[str], on_commit: Optional[Callable[[SaveReport], None]]) -> None:
    where = f"step {report.step}" if report.step is not None else report.path
    if report.memory_only:  # nothing written: no write, commit or throughput to speak of
        log.info("kept in memory only (nothing written to disk) %s: %.1f MB in %s, blocked %.3fs, staging %.3fs, "
                 "worker %d%s", where, report.bytes / 1e6, report.path, report.blocked_s, report.staging_s,
                 report.worker_pid, ", cache hit" if report.cache_hit else "")
    else:
        log.info(
            "committed %s: %.1f MB (%.1f MB written), blocked %.3fs, staging %.3fs, write %.3fs, commit %.3fs, "
            "durable %.3fs (%.2f GB/s), worker %d%s%s",
            where, report.bytes / 1e6, report.bytes_written / 1e6,
            report.blocked_s, report.staging_s, report.write_s, report.commit_s, report.durable_s, report.throughput_gbps,
            report.worker_pid, ", cache hit" if report.cache_hit else "",
            f", {report.request_count} requests, {report.retries} retries" if report.request_count else "",
        )
    # The save is committed already: a failing side channel is logged, never turned into a
    # failure of this save or of the next schedule_save.
    if metrics_path:
        try:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(report.as_dict()) + "\n")
        except OSError as exc:
            log.warning("could not append save figures to %s: %s", metrics_path, exc)
    if on_commit is not None:
        try:
            on_commit(report)
        except Exception:
            log.exception("on_commit callback failed for %s (the checkpoint is committed)", report.path)
