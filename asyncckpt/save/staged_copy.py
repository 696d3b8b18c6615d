"""A memory-only save written to disk after the fact: a preempted close (preemption.py) has the
worker write the copy it staged (protocol.WriteStaged) into the save's directory. This module
readies that directory on every rank and describes the save for the usual commit."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from ..errors import CheckpointError
from ..layout import METADATA_FILE, new_file_tag
from ..storage import is_remote, storage_for
from ..storage.requests import COUNTER
from .inflight import InFlightSave
from .job_lock import FolderLocks
from .rank_worker import RankWorker
from .ranks import RankGroup
from .retention import Janitor, is_dir_or_unknown, raise_start_failure


def persist_flight(staged: Optional[InFlightSave], group: RankGroup, folders: FolderLocks, janitor: Janitor,
                   worker: RankWorker) -> InFlightSave:
    """Ready `staged`'s directory as schedule_save readies a save's (the folder is this job's, no
    symlink, retention kept out, writable; a committed checkpoint there is replaced at commit,
    never before), agreed by every rank, and send the worker the request to write its copy there.
    Returns the save in flight: no longer memory-only, committed under the copy's save id (a
    restart on this node then knows the copy and the checkpoint are one save). Every rank gets
    here together (`preempted` turns true on all after the same call). CheckpointError on every
    rank if a rank could not ready the directory."""
    if staged is None:  # (the same on every rank: the commits and schedule_save calls are)
        raise CheckpointError("the worker no longer holds its copy (a later save or prepare() took its slab)")
    config = worker.config
    storage = storage_for(staged.step_dir)
    problem, overwrite, created = None, False, False
    try:
        created = not is_dir_or_unknown(storage, staged.step_dir)
        if group.is_coordinator:
            folders.check(staged.step_dir)
            if staged.name is None:
                folders.take_folder_of(staged.step_dir, config.fsync)
        if storage.is_symlink(staged.step_dir):
            raise CheckpointError(f"{staged.step_dir!r} is a symlink; refusing to write a checkpoint through it")
        janitor.claim(staged.step_dir, config.timeout_s)
        if group.is_coordinator or not is_remote(staged.step_dir):
            storage.prepare_dir(staged.step_dir, config.fsync)
        overwrite = group.is_coordinator and storage.exists(storage.join(staged.step_dir, METADATA_FILE))
    except Exception as exc:  # every rank must reach the agreement
        problem = exc
    overwrite_any, failed = group.agree([int(overwrite), int(problem is not None)], "persist",
                                        -1 if staged.step is None else staged.step)
    if failed:
        raise_start_failure(group, problem, staged.label, staged.step_dir, created, True)
    flight = dataclasses.replace(
        staged, started=time.perf_counter(), blocked_s=0.0, backpressure_s=0.0, tensors_sent=0,
        collectives_before=group.collectives, requests_before=COUNTER.snapshot(), owns_dir=created,
        file_tag=group.broadcast(new_file_tag()) if overwrite_any else "", replaces=bool(overwrite_any),
        base_dirs=(), memory=dataclasses.replace(staged.memory, memory_only=False, plan=None),
        staged=None, error=None, outcome=None, hand_off=None, persists_restore=False,
    )
    try:
        worker.write_staged(flight)
    except Exception as exc:  # raised on every rank by the commit's verdict
        flight.error = f"{type(exc).__name__}: {exc}"
    return flight
