"""`asyncckpt.async_save`: a drop-in for `torch.distributed.checkpoint.async_save`.

    torch.distributed.checkpoint.async_save = asyncckpt.async_save

switches an unchanged program (torchtitan's CheckpointManager included) over to asyncckpt's
worker. The call returns once the snapshot is staged; the returned future completes with the
DCP `Metadata` once the checkpoint is committed, without the caller polling anything.

Threads and collectives (why every rank issues the same collectives in the same order):
- Each process keeps one `_Door` per process group (one more for saves without collectives:
  `no_dist`, or no torch.distributed). A door owns an AsyncCheckpointer (its worker, and a gloo
  group of its own over the group's ranks) and a commit thread. The checkpointer is not
  thread-safe: every use of it holds the door's lock.
- A save k issues collectives in two batches: S_k inside `schedule_save` (agreement, plan gather
  when the plan changed, file tag), then F_k when it is finished (agreement, gather of write
  results, verdict). F_k always runs blocking, so how many agreements it issues never depends on
  timing (a non-blocking poll would: the ranks could see different answers).
- F_k runs on whichever thread takes the lock first after S_k: the commit thread (normally), the
  caller's thread at the top of the next async_save, or `shutdown`. Each of them runs F_k only
  while save k is pending, and S_{k+1} only starts once nothing is pending, so on every rank the
  order is S_1 F_1 S_2 F_2 ..., whatever thread issued each batch.
- They run on the door's own gloo group, so they never interleave with the trainer's collectives
  on its own groups (its main thread may be in an all-reduce at the same moment).
- Outcomes are queued under the lock in commit order and only the commit thread completes the
  futures, outside the lock: futures complete in call order, and a done-callback may call
  async_save again without deadlocking.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat
from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from ..save.checkpointer import AsyncCheckpointer
from ..config import CheckpointConfig
from .door_config import check_door_config
from ..errors import CheckpointError
from ..loading.load import load as load_checkpoint
from ..loading.broadcast import load_group, open_shared
from ..loading.opened import OpenCheckpoint
from ..loading.safe_reader import read_metadata
from ..layout import METADATA_FILE
from ..save.ranks import collective_timeout_s
from ..report import SaveReport
from ..storage import check_writable_without_writing, storage_for

log = logging.getLogger(__name__)

SHUTDOWN_JOIN_S = 30.0


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: Optional[str | os.PathLike] = None,
    storage_writer: Optional[Any] = None,
    planner: Optional[Any] = None,
    process_group: Optional[Any] = None,
    async_checkpointer_type: Optional[AsyncCheckpointerType] = None,
    async_stager: Optional[Any] = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Future | AsyncSaveResponse:
    """Save `state_dict` as a DCP checkpoint in `checkpoint_id` (or the FileSystemWriter's path)
    through asyncckpt's persistent worker. Returns once the snapshot is staged: a Future whose
    result is the committed checkpoint's `Metadata` (it raises CheckpointError if the save failed
    on any rank), or, when torch would (`async_stager` a DefaultStager with async staging), an
    AsyncSaveResponse whose `staging_completion` is done and whose `upload_completion` is that
    future. Options asyncckpt cannot honour are refused with a CheckpointError, never ignored."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, not {type(state_dict).__name__}")
    path = _checkpoint_path(checkpoint_id, storage_writer)
    _check_planner(planner)
    if async_checkpointer_type is not None and not isinstance(async_checkpointer_type, AsyncCheckpointerType):
        raise CheckpointError(f"async_checkpointer_type must be an AsyncCheckpointerType, not {async_checkpointer_type!r}")
    respond = _staging_response_wanted(async_stager)
    door = _door_for(process_group, no_dist, use_collectives)
    state = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}
    upload = door.save(state, path)
    if not respond:
        return upload
    staged: Future = Future()
    staged.set_result(None)  # the call returned: the snapshot is taken, the state may change
    return AsyncSaveResponse(staging_completion=staged, upload_completion=upload)


def load(
    state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike, process_group: Optional[Any] = None,
    no_dist: bool = False, trusted: bool = False,
) -> None:
    """Load a checkpoint async_save wrote into `state_dict` in place (the resume's call, as
    torch.distributed.checkpoint.load): from the memory tier when it is configured and holds that
    very save, else from its files (asyncckpt.load: objects with weights_only unless `trusted`)."""
    # resume at scale: .metadata read by one rank, sent to the others (loading/broadcast.py)
    opened = open_shared(os.fspath(checkpoint_id), trusted=trusted, group=load_group(process_group, no_dist))
    if _config.memory_tier and _door_for(process_group, no_dist, True).load_saved(state_dict, opened, trusted):
        return
    load_checkpoint(state_dict, opened, trusted=trusted, process_group=process_group, no_dist=no_dist)


def configure(config: CheckpointConfig) -> None:
    """The CheckpointConfig of the checkpointers async_save creates (io, io_workers, timeout_s,
    on_commit, ...). Call before the first async_save, or after `shutdown()`."""
    global _config
    check_door_config(config, "async_save", "its caller (each checkpoint_id is a directory it names)", CheckpointError)
    with _doors_lock:
        if _doors:
            raise CheckpointError("async_save has started already; call asyncckpt.torch_dcp.shutdown() first")
        _config = config


def shutdown() -> None:
    """Commit every save in flight (their futures complete) and stop the workers. Optional: at
    exit this runs by itself. async_save works again afterwards (with fresh workers)."""
    with _doors_lock:
        doors = list(_doors.values())
        _doors.clear()
    for door in doors:
        door.close()


def last_report(process_group: Optional[Any] = None, no_dist: bool = False) -> Optional[SaveReport]:
    """The SaveReport of the last save committed through the door of `process_group` (figures:
    blocked and durable seconds, tensors sent, cache hit, ...)."""
    door = _doors.get(_door_key(process_group, no_dist))
    return door.last_report if door is not None else None


# arguments ---------------------------------------------------------------------------------------
def _checkpoint_path(checkpoint_id, storage_writer) -> str:
    """Where the checkpoint goes: `checkpoint_id` wins over the writer's path, as in DCP."""
    if storage_writer is not None:
        _check_writer(storage_writer)
    if checkpoint_id is None:
        if storage_writer is None:
            raise CheckpointError("async_save needs a checkpoint_id or a FileSystemWriter")
        checkpoint_id = str(storage_writer.path)  # a Path, or msc's MultiStoragePath (str: its URL)
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint_id must be a path or URL, not {type(checkpoint_id).__name__}")
    path = os.fspath(checkpoint_id)
    if not path:
        raise CheckpointError("checkpoint_id is empty")
    storage_for(path)  # an unsupported URL scheme is refused here
    if storage_writer is not None and not storage_writer.overwrite:
        storage = storage_for(path)
        if storage.exists(storage.join(path, METADATA_FILE)):
            raise CheckpointError(f"checkpoint {path!r} already exists and the FileSystemWriter has overwrite=False")
    return path


def _is_msc_writer(writer) -> bool:
    """multi-storage-client's DCP writer (its own FileSystemWriter subclass), without importing it."""
    kind = type(writer)
    return kind.__name__ == "MultiStorageFileSystemWriter" and kind.__module__.startswith("multistorageclient.")


def _check_writer(writer) -> None:
    """A stock FileSystemWriter (or msc's MultiStorageFileSystemWriter) means its path. Its layout knobs (single_file_per_rank,
    thread_count, per_thread_copy_ahead, cache_staged_state_dict) do not change what a reader
    gets: asyncckpt writes io_workers files per rank. sync_files=False is made stricter (every
    file is fsynced). What would change the checkpoint itself is refused."""
    if type(writer) is not FileSystemWriter and not _is_msc_writer(writer):
        raise CheckpointError(
            f"storage_writer {type(writer).__name__} is not supported by asyncckpt.async_save: it writes "
            "only what a stock FileSystemWriter writes (pass checkpoint_id=PATH, or a FileSystemWriter)"
        )
    if writer.serialization_format != SerializationFormat.TORCH_SAVE:
        raise CheckpointError(
            f"FileSystemWriter(serialization_format={writer.serialization_format}) is not supported by "
            "asyncckpt.async_save (it writes SerializationFormat.TORCH_SAVE files)"
        )
    if getattr(writer.transforms, "extensions", ()):
        raise CheckpointError("FileSystemWriter(_extensions=...) stream transforms are not supported by asyncckpt.async_save")


def _check_planner(planner) -> None:
    """DCP's default planner with its default options is what the worker's plan cache keys on."""
    if planner is None:
        return
    if type(planner) is not DefaultSavePlanner or not (
        planner.flatten_state_dict and planner.flatten_sharded_tensors and not planner.dedup_save_to_lowest_rank
    ):
        raise CheckpointError(
            f"planner {type(planner).__name__} is not supported by asyncckpt.async_save: only "
            "DefaultSavePlanner() with its default flatten/dedup options (or planner=None)"
        )


def _staging_response_wanted(stager) -> bool:
    """True where torch would return an AsyncSaveResponse. asyncckpt stages in its worker, so the
    stager itself is never called; one that could transform the state is refused."""
    if stager is None or isinstance(stager, BlockingAsyncStager):
        return False
    if type(stager) is DefaultStager:
        return bool(stager._config.use_async_staging)
    raise CheckpointError(
        f"async_stager {type(stager).__name__} is not supported by asyncckpt.async_save (it stages in its "
        "own worker): pass a DefaultStager, or none"
    )


# doors -------------------------------------------------------------------------------------------
_config = CheckpointConfig()
_doors: dict[Any, "_Door"] = {}
_doors_lock = threading.Lock()


def _door_key(process_group, no_dist: bool) -> Any:
    if no_dist or not (dist.is_available() and dist.is_initialized()):
        return "local"
    return process_group if process_group is not None else dist.distributed_c10d._get_default_group()


def _door_for(process_group, no_dist: bool, use_collectives: bool) -> "_Door":
    if no_dist and process_group is not None:
        raise CheckpointError("no_dist=True saves without collectives; it cannot be combined with a process_group")
    distributed = dist.is_available() and dist.is_initialized()
    if process_group is not None and not distributed:
        raise CheckpointError("a process_group was given but torch.distributed is not initialized")
    if not use_collectives and distributed and not no_dist:
        raise CheckpointError(
            "use_collectives=False is not supported by asyncckpt.async_save: it commits one checkpoint "
            "across the ranks (pass no_dist=True to save this process's state alone)"
        )
    key = _door_key(process_group, no_dist)
    with _doors_lock:  # group creation is collective: every rank makes its door at the same call
        door = _doors.get(key)
        if door is None:
            door = _doors[key] = _Door(_group_for(key), _config)
        return door


def _group_for(key) -> Optional[Any]:
    """The door's own gloo group (None for a door without collectives). Made on the caller's
    thread: groups must be created in the same order on every rank."""
    if key == "local":
        return None
    from datetime import timedelta

    timeout = timedelta(seconds=collective_timeout_s(_config))
    return dist.new_group(dist.get_process_group_ranks(key), backend="gloo", timeout=timeout, use_local_synchronization=True)


@dataclass
class _Outcome:
    future: Future
    metadata: Any = None
    error: Optional[BaseException] = None


class _Door:
    """One checkpointer, its lock and the commit thread that completes the futures."""

    def __init__(self, group: Optional[Any], config: CheckpointConfig) -> None:
        self.group, self.config = group, config
        self._ckpt: Optional[AsyncCheckpointer] = None  # made (and its worker spawned) at first use
        self.folder: Optional[str] = None  # where the first save or load was: it keys the memory tier
        self.cond = threading.Condition()  # the lock every use of the checkpointer holds
        self.pending: Optional[tuple[Future, str]] = None  # the save in flight: its future and path
        self.outcomes: collections.deque[_Outcome] = collections.deque()  # finished, not yet delivered
        self.closing = False
        self.last_report: Optional[SaveReport] = None
        self.thread = threading.Thread(target=self._run, name="asyncckpt-commit", daemon=True)
        self.thread.start()

    @property
    def ckpt(self) -> AsyncCheckpointer:
        if self._ckpt is not None:
            return self._ckpt
        with self.cond:
            if self._ckpt is None:
                if self.group is None:
                    self._ckpt = AsyncCheckpointer(config=self.config, no_dist=True, memory_folder=self.folder)
                else:
                    self._ckpt = AsyncCheckpointer(config=self.config, process_group=self.group, memory_folder=self.folder)
            return self._ckpt

    def save(self, state: dict[str, Any], path: str) -> Future:
        """Schedule the save of `state` into `path` and return its future. A first save that finds
        the worker still starting returns once this process holds a private copy (the core's
        hand-off, save/first_save.py), as a direct AsyncCheckpointer's does."""
        future: Future = Future()
        future.set_running_or_notify_cancel()  # it cannot be cancelled: the save is under way
        with self.cond:
            if self.closing:
                raise CheckpointError("asyncckpt.torch_dcp is shutting down")
            self._finish_pending()  # save k's verdict goes to save k's future, not to this call
            self.folder = self.folder or os.path.dirname(path)
            if self.group is None:  # a bad path fails before its folder is taken (under a group: every rank
                check_writable_without_writing(path)  # alike, in schedule_save's agreement)
            self.ckpt.schedule_save(state, checkpoint_dir=path)
            self.pending = (future, path)
            self.cond.notify_all()
        return future

    def load_saved(self, state: dict[str, Any], checkpoint: OpenCheckpoint, trusted: bool) -> bool:
        """Load `checkpoint` from the memory tier if it holds that very save (MemoryTier.load_saved),
        once the save in flight is committed (its collectives come first on the door's group)."""
        with self.cond:
            self._finish_pending()
            self.folder = self.folder or os.path.dirname(checkpoint.path)
            tier = self.ckpt.memory_tier
            return tier is not None and tier.load_saved(state, checkpoint, trusted)

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self._finish_pending()
            self.cond.notify_all()
        self.thread.join(SHUTDOWN_JOIN_S)
        with self.cond:
            if self._ckpt is None:
                return
            try:
                self._ckpt.close()
            except CheckpointError as exc:
                log.error("closing the async_save checkpointer: %s", exc)

    def _finish_pending(self) -> None:
        """Commit the save in flight (blocking: see the module docstring), queue its outcome.
        Called with the lock held."""
        if self.pending is None:
            return
        (future, path), self.pending = self.pending, None
        outcome = _Outcome(future)
        try:
            reports = self.ckpt.finalize(blocking=True)
            if reports:
                self.last_report = reports[-1]
            outcome.metadata = read_metadata(path, trusted=True)  # our own commit's
        except CheckpointError as exc:
            outcome.error = exc
        except Exception as exc:
            outcome.error = CheckpointError(f"checkpoint {path!r}: {type(exc).__name__}: {exc}")
        self.outcomes.append(outcome)
        self.cond.notify_all()

    def _run(self) -> None:
        """Commit what is in flight; complete the futures in order, outside the lock."""
        while True:
            with self.cond:
                while self.pending is None and not self.outcomes and not self.closing:
                    self.cond.wait()
                self._finish_pending()
                batch = list(self.outcomes)
                self.outcomes.clear()
                stop = self.closing and not batch
            for outcome in batch:
                if outcome.error is not None:
                    outcome.future.set_exception(outcome.error)
                else:
                    outcome.future.set_result(outcome.metadata)
            if stop:
                return


atexit.register(shutdown)  # runs before checkpointer's own exit hook (registered earlier)
