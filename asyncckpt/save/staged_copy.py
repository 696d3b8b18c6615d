"""A memory-only save written to disk after the fact: a preempted close (preemption.py) has the
worker write the copy it staged (protocol.WriteStaged) into the save's directory. This module
readies that directory on every rank and describes the save for the usual commit."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from ..errors import CheckpointError
from ..layout import new_file_tag
from ..storage import storage_for
from ..storage.requests import COUNTER
from .inflight import InFlightSave
from .job_lock import FolderLocks
from .rank_worker import RankWorker
from .ranks import RankGroup
from .retention import Janitor, ReadyDirectory, raise_start_failure, ready_directory


def persist_flight(staged: Optional[InFlightSave], group: RankGroup, folders: FolderLocks, janitor: Janitor,
                   worker: RankWorker) -> InFlightSave:
    """Ready `staged`'s directory as schedule_save readies a save's (retention.ready_directory; a
    committed checkpoint there is replaced at commit, never before), agreed by every rank, and
    send the worker the request to write its copy there. Returns the save in flight: no longer memory-only, committed under the copy's save id (a
    restart on this node then knows the copy and the checkpoint are one save). Every rank gets
    here together (`preempted` turns true on all after the same call). CheckpointError on every
    rank if a rank could not ready the directory."""
    if staged is None:  # (the same on every rank: the commits and schedule_save calls are)
        raise CheckpointError("the worker no longer holds its copy (a later save or prepare() took its slab)")
    config, ready = worker.config, ReadyDirectory()
    problem = None
    try:
        ready_directory(ready, storage_for(staged.step_dir), staged.step_dir, staged.name is not None, True, group,
                        folders, janitor, config)
    except OSError as exc:
        problem = CheckpointError(f"checkpoint directory {staged.step_dir!r} is not usable: {exc}")
    except Exception as exc:  # every rank must reach the agreement
        problem = exc
    overwrite_any, failed = group.agree([int(ready.overwrite), int(problem is not None)], "persist",
                                        -1 if staged.step is None else staged.step)
    owns_dir = staged.name is not None or ready.created  # (as schedule_save's)
    if failed:
        raise_start_failure(group, problem, staged.label, staged.step_dir, owns_dir, ready.in_our_folder)
    flight = dataclasses.replace(
        staged, started=time.perf_counter(), blocked_s=0.0, backpressure_s=0.0, tensors_sent=0,
        collectives_before=group.collectives, requests_before=COUNTER.snapshot(), owns_dir=owns_dir,
        file_tag=group.broadcast(new_file_tag()) if overwrite_any else "", replaces=bool(overwrite_any),
        base_dirs=(), memory=dataclasses.replace(staged.memory, memory_only=False, plan=None),
        staged=None, error=None, outcome=None, hand_off=None, persists_restore=False,
    )
    try:
        worker.write_staged(flight)
    except Exception as exc:  # raised on every rank by the commit's verdict
        flight.error = f"{type(exc).__name__}: {exc}"
    return flight
