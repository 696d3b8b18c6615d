"""The memory tier, on the checkpointer's side (CheckpointConfig(memory_tier=True)).

Each rank's worker stages into a named file under `memory_dir` (asyncckpt/memory_file.py); this
module names it, gives every save an id that is the same on every rank (and becomes the save_id
of its `.metadata`, so a restart knows the memory copy is the committed checkpoint), describes
the plan for the header, restores from the copy at `load_latest`, removes the file at a clean
close, and removes the files of dead jobs: files of this user under `memory_dir` whose trainer
and worker are both gone and that were last written more than STALE_AFTER_S ago.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
import uuid
from typing import Any, Callable, Optional

import torch.distributed as dist

from ..config import CheckpointConfig
from ..errors import CheckpointError
from ..loading.history import Base, RootHistory, root_history
from ..loading.memory_plan import encode_plan
from ..loading.memory_tier import MemoryAttempt, MemoryRestore, restore, restore_saved
from ..loading.opened import OpenCheckpoint
from ..memory_file import PREFIX, SUFFIX, NotACopy, memory_file_name, owner_alive, read_copy, root_key
from ..protocol import CACHE_SLOTS, MemorySave, MemoryTier as MemoryTierSettings
from .inflight import InFlightSave
from .memory_dir import warn_unless_memory
from .mapped_copy import mapped_snapshot
from .planning import PlannedSave
from .replication import set_up
from .snapshot import Snapshot
from .ranks import RankGroup

log = logging.getLogger("asyncckpt")

STALE_AFTER_S = 24 * 3600  # a dead job's file is removed once it has not been written for this long


class MemoryTier:
    def __init__(self, config: CheckpointConfig, root: Optional[str], group: RankGroup, folder: Optional[str] = None) -> None:
        """Refuses a configuration where the tier cannot hold: no root (nor a door's `folder`, which
        keys the tier of a checkpointer whose saves name their directories), no usable `memory_dir`."""
        self.keyed_by_root = root is not None
        root = root if root is not None else folder
        if root is None:
            raise CheckpointError("memory_tier=True needs a checkpoint root: AsyncCheckpointer(root, ...)")
        directory = config.memory_dir
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
            raise CheckpointError(f"memory_tier: memory_dir {directory!r} is not a writable directory")
        warn_unless_memory(directory)
        self.config = config
        self.root = root
        self.key = _tier_key(root, group)  # names its files and is recorded in their headers
        self.group = group
        self.path = os.path.join(directory, memory_file_name(self.key, group.rank))
        history: Optional[RootHistory] | str = None  # a door's tier has none: it restores only a save it names
        if self.keyed_by_root and group.is_coordinator:
            try:
                history = root_history(root, config.fsync)
            except Exception as exc:  # every rank must get the answer
                history = f"memory tier: the history id of root {root!r} cannot be read or written: {exc}"
        self._instance, history = group.broadcast((uuid.uuid4().hex, history))  # save ids agree without a collective
        if isinstance(history, str):
            raise CheckpointError(history)
        self.history: Optional[RootHistory] = history
        self.base: Optional[Base] = history.newest if history is not None else None  # what a copy staged now descends from
        self.unpersisted: Optional[int] = None  # the step of a copy in the file that is newer than the disk
        self.persisting = False  # the save being scheduled persists the copy load_latest restored (first_save.hands_off)
        self._restored: Optional[MemoryRestore] = None  # that copy, while it is being persisted
        self._saves = 0
        self._plans: dict[str, bytes] = {}  # by structure key
        # copies on other nodes (collective: every rank builds its tier, so every rank gets here)
        self.replicas = set_up(config, group) if config.memory_replicas and group.size > 1 else None
        remove_stale(directory, keep=memory_file_name(self.key, 0).rsplit("-rank", 1)[0] + "-rank")

    @property
    def holds_copy(self) -> bool:
        """Whether a copy from an earlier process waits in this rank's file (a restart is likely)."""
        return os.path.exists(self.path)

    def worker_settings(self) -> MemoryTierSettings:
        return MemoryTierSettings(self.path, root_key(self.key), self.group.size, hold_s=self.config.timeout_s,
                                  replication=self.replicas.replication if self.replicas is not None else None)

    def next_save(self, planned: PlannedSave, step: Optional[int], memory_only: bool) -> MemorySave:
        """The header's record of the save being scheduled (the plan is sent when it is new to
        the worker: RankWorker drops it otherwise)."""
        if step is None and self.keyed_by_root:
            raise ValueError("with memory_tier=True every save needs a step")
        self._saves += 1
        plan = self._plans.get(planned.structure_key)
        if plan is None:
            if len(self._plans) >= CACHE_SLOTS:
                self._plans.clear()
            plan = self._plans[planned.structure_key] = encode_plan(planned.plan)
        token = hashlib.md5(f"{self._instance}:{self._saves}".encode()).hexdigest()
        self.unpersisted = step if step is not None else -1  # until a disk save of the root commits
        base = self.base
        return MemorySave(step if step is not None else -1, token, memory_only, plan,  # a door's save may have no step
                          self.history.root_id if self.history else None, base and base.step, base and base.save_id)

    def committed(self, flight: InFlightSave, save_id: Optional[str]) -> None:
        """A save committed (a memory-only one: staged): a disk save of the root is the newest
        committed checkpoint now, what the next copy descends from, and the copy is persisted."""
        if flight.outcome.written is not None and flight.outcome.written.memory_problem:
            log.warning("%s: %s; committed to disk only", flight.label, flight.outcome.written.memory_problem)
        if flight.memory is None or flight.memory.memory_only:
            return
        self.unpersisted = None
        if flight.name is not None and flight.step is not None:
            self.base = Base(flight.step, save_id)

    def attempt(self, state_dict: dict[str, Any], trusted: bool) -> MemoryAttempt:
        """Load the memory copy when the history rule says it is the one to resume from
        (loading/memory_tier.py); loading/restart.py calls this."""
        attempt = restore(state_dict, self.root, self.config.memory_dir, self.group, trusted=trusted,
                          wait_s=self.config.timeout_s, key=self.key, history=self.history,
                          peers=self.replicas.peers if self.replicas is not None else None)
        if self.history is not None:  # the root as it is now (another process may have committed since)
            self.base = attempt.newest
        if attempt.restored is not None and attempt.restored.persist:
            self.unpersisted = attempt.restored.report.step
            self._restored = attempt.restored
        return attempt

    def restored_snapshot(self, planned: PlannedSave) -> Optional[Snapshot]:
        """The persist's snapshot: views of the restored copy in this rank's file (mapped_copy.py),
        or None (then the trainer's tensors are snapshotted)."""
        restored, self._restored = self._restored, None
        if not self.persisting or restored is None:
            return None
        return mapped_snapshot(planned, self.path, restored.token)

    def persist_restored(self, schedule: Callable[[], None]) -> None:
        """Schedule (`schedule`) the save that persists the copy just restored, handed to the worker
        by a thread (first_save.py) from views of this rank's file (mapped_copy.py): the restart
        waits for no worker start-up nor staging, and copies nothing. The file keeps the copy
        meanwhile (a new worker stages into a new file, renamed over this one once sealed), and
        `unpersisted` keeps it at a clean close until the commit. (A rank whose copy was read from
        another node has no such file: its persist snapshots the state just loaded.)"""
        self.persisting = True
        try:
            schedule()
        finally:
            self.persisting, self._restored = False, None

    def drop(self) -> None:
        """The copy belongs to another history and the disk load succeeded: it goes."""
        self._remove()

    def load_saved(self, state_dict: dict[str, Any], checkpoint: OpenCheckpoint, trusted: bool) -> bool:
        """The doors' resumes: load the committed `checkpoint` from memory when this tier holds its
        very save (see loading/memory_tier.restore_saved); False: nothing loaded, read its files."""
        return restore_saved(state_dict, checkpoint, self.key, self.config.memory_dir, self.group, trusted=trusted)

    def close(self, keep: bool = False) -> None:
        """A clean close removes this rank's file, unless memory_keep, `keep` (a preempted close
        whose newest save is memory-only), or its copy is newer than the disk (never dropped before
        it is persisted); so does no exit that follows an uncaught exception (at_exit closes then):
        that is a crash, whose copy a restart needs."""
        if self.replicas is not None:
            self.replicas.replication.listener.close()  # (the worker's copy goes with the worker)
        if keep or self.config.memory_keep or getattr(sys, "last_value", None) is not None:
            return
        if self.unpersisted is not None:
            log.info("memory tier: keeping %s: its copy of step %d is newer than the disk (the next start restores "
                     "it)", self.path, self.unpersisted)
            return
        self._remove()

    def _remove(self) -> None:
        """This rank's file, and with memory_replicas the copies of other nodes' ranks this node
        keeps (received from their workers)."""
        paths = [self.path]
        if self.replicas is not None:
            nodes = self.replicas.peers.nodes
            paths += [os.path.join(self.config.memory_dir, memory_file_name(self.key, rank))
                      for rank, node in enumerate(nodes) if node != nodes[self.group.rank]]
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("memory tier: could not remove %s: %s", path, exc)


def remove_stale(directory: str, keep: str) -> list[str]:
    """Remove memory files of dead jobs in `directory` (see the module's docstring); never one
    whose name starts with `keep` (this root's: a restart of this job restores from it). Returns
    the paths removed."""
    removed = []
    now = time.time()
    for name in os.listdir(directory):
        if not (name.startswith(PREFIX) and name.endswith(SUFFIX)) or name.startswith(keep):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.stat(path, follow_symlinks=False)
            if info.st_uid != os.geteuid() or now - info.st_mtime < STALE_AFTER_S:
                continue
            try:
                copy = read_copy(path)
            except NotACopy as exc:
                if exc.busy_pid and owner_alive(exc.busy_pid):
                    continue
            else:
                if owner_alive(copy.trainer_pid) or owner_alive(copy.worker_pid):
                    continue
            os.unlink(path)
            removed.append(path)
        except OSError:  # gone meanwhile (another rank removed it)
            continue
    if removed:
        log.info("memory tier: removed %d stale files of dead jobs: %s", len(removed), ", ".join(removed))
    return removed


def _tier_key(root: str, group: RankGroup) -> str:
    """What keys a tier: its root (or a door's folder). Processes that save alone (no_dist) inside
    a job of several may save into one folder (async_save(no_dist=True) on every rank), and each
    must keep a file of its own: all but the job's rank 0 add their rank to the key. Rank 0 keeps
    the folder alone, so where only it saves (Lightning's plugin) every rank that loads the
    folder finds its copy under that name."""
    if group.size == 1 and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return f"{root}#process{dist.get_rank()}"
    return root
