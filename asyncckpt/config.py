"""CheckpointConfig: every knob in one frozen dataclass, validated when it is built."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .protocol import WriteOptions

_CHOICES = {
    "io": ("thread", "process"),
    "staging": ("eager", "lazy"),
    "format": ("torch_save", "safetensors"),
    "worker_ionice": (None, "idle", "best-effort"),
}


@dataclass(frozen=True)
class CheckpointConfig:
    """How saves are staged, written and kept.

    io: "thread" writes buckets with threads inside the worker; "process" forks one writer child
        per bucket.
    io_workers: buckets (files), and threads or child processes, per rank.
    staging: "eager" makes schedule_save return once the snapshot is staged; "lazy" returns at once
        and `wait_staged()` / `guard(optimizer, model)` block before the state may change.
    cache_structure: send only a structure key to the worker when nothing was reallocated.
    format: "torch_save" (stock DCP reader) or "safetensors" (one safetensors file per bucket).
    fsync: fsync every data file, the metadata and the directories.
    checksums: record a CRC32C per item, checked by `load(..., verify=True)` and `verify`.
    keep_last: keep this many newest committed checkpoints (None keeps all).
    timeout_s: bound on waiting for staging and, separately, for the writes of one save (a save
        handed to a worker still starting waits at most worker_start_timeout_s + timeout_s for
        its staging: the start-up, then the copy).
    worker_start_timeout_s: bound on a fresh worker's start-up (an interpreter importing torch:
        seconds on a local disk, minutes where thousands of ranks import from one network file
        system at once); a worker not up by then fails the save waiting for it.
    worker_nice: nice increment for the worker's writer threads/processes (None: the trainer's);
        staging, which the trainer waits for, always keeps the trainer's priority.
    worker_ionice: "best-effort" (lowest level, the default) or "idle" I/O class for the worker,
        where the OS allows; "idle" can starve checkpoint writes on a disk the trainer keeps busy.
    separation_hint: item names starting with this prefix go into files of their own.
    staging_budget_bytes: stage and write in chunks of at most this many bytes (None: whole state).
    metrics_path: append one JSON line per committed save to this file.
    on_commit: called with the SaveReport of every committed save.
    incremental: write only tensors whose bytes changed since this rank's last committed save (or
        the checkpoint load_latest resumed from); unchanged ones stay in their files, hard-linked
        into the new directory (server-side copies on object stores), so every checkpoint is still
        complete; see docs/usage.md.
    memory_tier: keep each rank's staging slab in a file under `memory_dir` (one per rank, 0600), so
        the newest staged save outlives the trainer and its worker (not the node): `load_latest`
        restores from it when it is newer than the disk (docs/guarantees.md, "Memory tier").
        Needs a root; not with staging_budget_bytes (the slab must hold the whole state).
    memory_dir: where the memory tier's files live (a tmpfs: /dev/shm by default).
    memory_keep: a clean `close()` leaves the memory tier's file in place (removed by default,
        except while it holds a copy newer than the disk: that one is never dropped unpersisted).
    memory_persist_restored: when `load_latest` restores a copy from memory that is newer than the
        disk (a memory-only save, or one whose disk save never committed), write and commit it in the
        background right away (True, default: `load_latest` waits only for it to be staged; the write
        commits at a later `finalize`, and `resume_report.persisted` turns True). False: it stays in
        memory only until the next disk save.
    memory_replicas: with memory_tier, each rank's worker also sends every copy it sealed to the
        workers of this many ranks on other nodes (0, default: the copies stay on their node), so a
        restart after losing up to this many nodes restores from memory (docs/usage.md, "Restart from
        memory"). Nodes come from `node_of`; needs a process group of several nodes to do anything.
    node_of: rank -> node (any hashable) for memory_replicas; default: the host name each rank runs on.
    replica_host: the address the workers receive copies on (default: the address the host name
        resolves to); every connection is authenticated with a secret of the job's.
    prefixes: spread each save's data files over this many data folders of the step directory
        (rank r's in `p{r % prefixes}`), each a key prefix of its own on an object store; 1: every
        file directly in the step directory. None (default): on an object store, as many as keep
        every folder under 3,500 writes per save (layout.prefix_count); on a filesystem, 1.
    preemption_signals: signals that mean "the job is being preempted" (e.g. `(signal.SIGTERM,)`;
        default none: a signal does what it did before). On one, `ckpt.preempted` turns true and the
        worker ignores it, so the save in flight still ends; the loop then calls `close()` and
        `asyncckpt.requeue_exit()` (docs/usage.md, "Preemption"). Handlers are installed by the
        checkpointer's constructor, which must then run on the main thread.
    grace_s: after a preemption signal, `close()` waits at most this long for the save in flight
        (then gives it up: the last committed checkpoint stays as it was); a loop that has not
        called `close()` at 3/4 of it is closed for, and the process ends at its end.
    """

    io: str = "thread"
    io_workers: int = 4
    staging: str = "eager"
    cache_structure: bool = True
    format: str = "torch_save"
    fsync: bool = True
    checksums: bool = True
    keep_last: Optional[int] = None
    timeout_s: float = 600.0
    worker_start_timeout_s: float = 300.0
    worker_nice: Optional[int] = 10
    worker_ionice: Optional[str] = "best-effort"
    separation_hint: Optional[str] = None
    staging_budget_bytes: Optional[int] = None
    metrics_path: Optional[str] = None
    on_commit: Optional[Callable[[Any], None]] = None
    incremental: bool = False
    memory_tier: bool = False
    memory_dir: str = "/dev/shm"
    memory_keep: bool = False
    memory_persist_restored: bool = True
    memory_replicas: int = 0
    node_of: Optional[Callable[[int], Any]] = None
    replica_host: Optional[str] = None
    prefixes: Optional[int] = None
    preemption_signals: tuple = ()
    grace_s: float = 25.0

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"CheckpointConfig.{name}={value!r} is not one of {allowed}")
        _require_int(self, "io_workers", minimum=1)
        if self.keep_last is not None:
            _require_int(self, "keep_last", minimum=1)
        if self.staging_budget_bytes is not None:
            _require_int(self, "staging_budget_bytes", minimum=1 << 20)
        if self.prefixes is not None:
            _require_int(self, "prefixes", minimum=1)
        if self.worker_nice is not None:
            _require_int(self, "worker_nice", minimum=0)
        object.__setattr__(self, "preemption_signals", _signals_of(self.preemption_signals))
        for name in ("timeout_s", "worker_start_timeout_s", "grace_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"CheckpointConfig.{name}={value!r} must be a positive number of seconds")
        for name in ("cache_structure", "fsync", "checksums", "incremental", "memory_tier", "memory_keep",
                     "memory_persist_restored"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CheckpointConfig.{name}={getattr(self, name)!r} must be True or False")
        if self.separation_hint is not None and not (isinstance(self.separation_hint, str) and self.separation_hint):
            raise ValueError(f"CheckpointConfig.separation_hint={self.separation_hint!r} must be a non-empty string")
        if self.incremental and self.staging_budget_bytes is not None:
            raise ValueError("CheckpointConfig.incremental needs the whole state staged: staging_budget_bytes must be None")
        if self.memory_tier and self.staging_budget_bytes is not None:
            raise ValueError("CheckpointConfig.memory_tier keeps the whole state in its staging slab: "
                             "staging_budget_bytes must be None")
        if not (isinstance(self.memory_dir, str) and os.path.isabs(self.memory_dir)):
            raise ValueError(f"CheckpointConfig.memory_dir={self.memory_dir!r} must be an absolute path")
        _require_int(self, "memory_replicas", minimum=0)
        if self.memory_replicas and not self.memory_tier:
            raise ValueError("CheckpointConfig.memory_replicas sends the memory tier's copies: it needs memory_tier=True")
        if self.node_of is not None and not callable(self.node_of):
            raise ValueError("CheckpointConfig.node_of must be callable: rank -> node")
        if self.replica_host is not None and not (isinstance(self.replica_host, str) and self.replica_host):
            raise ValueError(f"CheckpointConfig.replica_host={self.replica_host!r} must be a host name or address")
        if self.on_commit is not None and not callable(self.on_commit):
            raise ValueError("CheckpointConfig.on_commit must be callable")


_NOT_CATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def _signals_of(value: Any) -> tuple[signal.Signals, ...]:
    """CheckpointConfig.preemption_signals as a tuple of signals, or ValueError naming the bad one."""
    if isinstance(value, (int, str)) or not isinstance(value, (tuple, list, set, frozenset)):
        raise ValueError(f"CheckpointConfig.preemption_signals={value!r} must be a tuple of signals, "
                         "e.g. (signal.SIGTERM,)")
    signals = []
    for item in value:
        try:
            number = signal.Signals(item) if isinstance(item, int) and not isinstance(item, bool) else None
        except ValueError:
            number = None
        if number is None:
            raise ValueError(f"CheckpointConfig.preemption_signals: {item!r} is not a signal number")
        if number in _NOT_CATCHABLE:
            raise ValueError(f"CheckpointConfig.preemption_signals: {number.name} cannot be caught; "
                             "nothing can be saved when it comes first")
        if number == signal.SIGINT:
            raise ValueError("CheckpointConfig.preemption_signals: SIGINT is Ctrl-C, which has its own "
                             "handling (docs/guarantees.md, \"Ctrl-C\")")
        if number not in signals:
            signals.append(number)
    return tuple(signals)


def _require_int(config: CheckpointConfig, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"CheckpointConfig.{name}={value!r} must be an integer >= {minimum}")


def hand_off_bound_s(config: CheckpointConfig) -> float:
    """The bound on handing a save to a worker that has not started up yet, until it is staged:
    its start-up (worker_start_timeout_s), then the staging (timeout_s). Their sum: a bound
    shorter than the waits it covers would time out a hand-off that was going to succeed."""
    return config.worker_start_timeout_s + config.timeout_s


def write_options(c: CheckpointConfig) -> WriteOptions:
    """What the worker needs of the configuration to write one save."""
    return WriteOptions(
        c.io, c.io_workers, c.format, c.fsync, c.checksums, c.separation_hint, c.staging_budget_bytes,
        staging_threads=eager_staging_threads() if c.staging == "eager" else 1, timeout_s=c.timeout_s,
        incremental=c.incremental,
    )


def eager_staging_threads() -> int:
    """Threads copying a CPU snapshot in eager mode: the trainer waits idle for the copy, so its
    cores are free; a copy is memory-bound, and more than four threads gain nothing."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, usable or 1))
