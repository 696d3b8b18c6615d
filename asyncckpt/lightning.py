"""Lightning's CheckpointIO on asyncckpt: `Trainer(plugins=[AsyncCheckpointIO()])`.

Each `.ckpt` path Lightning names becomes a DCP checkpoint directory, written by asyncckpt's
worker and committed when its `.metadata` lands. `save_checkpoint` returns once the snapshot is
staged; a commit thread of the plugin commits saves as their writes end (no collective: Lightning
calls the plugin on global rank 0 only). The checkpoint dict goes through `nested.flatten_exact`,
so `load_checkpoint` returns exactly the dict that was saved, without a template.

One worker serves every save. A save that comes while it is busy with an earlier one
(ModelCheckpoint with `save_last=True` saves twice per event) is copied into a held copy and
handed over once the worker is free: the trainer does not wait for the first save's writes, and
the held copy's memory is taken again by the next such save (its pages already in shared memory,
its tensors already held by the worker in a cache slot of their own), so a steady save sends no
tensors. `max_in_flight` bounds the saves outstanding (in flight plus held); `max_in_flight=1`
makes the second save wait instead, without the held copy's memory.

This module imports Lightning; `import asyncckpt` does not import this module.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as exc:  # asyncckpt itself does not depend on Lightning
    raise ImportError("asyncckpt.lightning needs Lightning: pip install lightning") from exc

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import at_exit
from .checkpointer import AsyncCheckpointer
from .config import CheckpointConfig
from .errors import CheckpointError
from .loading import METADATA_FILE, is_checkpoint_file, load, read_metadata
from .nested import flatten_exact, map_tensors, unflatten_exact
from .private_copy import HeldCopy
from .snapshot import SHM_DIR, SHM_HEADROOM_BYTES, shared_memory_needed, shm_free_bytes
from .storage import check_writable_without_writing, is_remote, storage_for

log = logging.getLogger("asyncckpt")

COMMIT_POLL_S = 0.02  # how often the commit thread looks for finished writes while a save is in flight

__all__ = ["AsyncCheckpointIO"]

_live: "weakref.WeakSet[AsyncCheckpointIO]" = weakref.WeakSet()


class AsyncCheckpointIO(CheckpointIO):
    """Asynchronous DCP checkpoints for `lightning.Trainer`.

    `config`: a CheckpointConfig (its `on_commit` sees every committed save; `keep_last` is not
    used: ModelCheckpoint's `save_top_k` decides what is kept). Without one, saves are
    incremental (DEFAULT_CONFIG): ModelCheckpoint saves each event's state twice (top-k, then
    last.ckpt), and the second then writes none of its tensors. `trusted=True` unpickles objects
    in a checkpoint fully (needed for e.g. custom classes in `hyper_parameters`); a call's
    explicit `weights_only=` decides for that call."""

    def __init__(self, config: Optional[CheckpointConfig] = None, *, trusted: bool = False, max_in_flight: int = 2):
        super().__init__()
        if config is None:
            config = DEFAULT_CONFIG
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"config must be a CheckpointConfig, not {type(config).__name__}")
        if config.keep_last is not None:
            raise ValueError("AsyncCheckpointIO does not use keep_last: ModelCheckpoint(save_top_k=...) decides what is kept")
        if config.staging != "eager":
            raise ValueError("AsyncCheckpointIO needs CheckpointConfig.staging='eager': Lightning's next optimizer step "
                             "changes the weights right after save_checkpoint returns, before a lazy copy would end")
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an integer >= 1, not {max_in_flight!r}")
        self.config, self.trusted, self.max_in_flight = config, bool(trusted), max_in_flight
        self._init_runtime()
        if _launched_as_global_rank_zero():  # start the worker now: the first save need not wait for it
            with self._lock:
                self._ensure_saver()

    def _init_runtime(self) -> None:
        self._lock = threading.RLock()  # every use of the checkpointer holds it
        self._wake = threading.Event()  # a save was scheduled: the commit thread has work
        self._stop = threading.Event()  # closed: the commit thread ends
        self._saver: Optional[AsyncCheckpointer] = None  # created with the worker, on rank 0 only
        self._held: deque[_HeldSave] = deque()  # saves copied while the worker was busy or starting, in order
        self._spare: list[HeldCopy] = []  # held copies no save uses now, taken again by the next one
        self._in_flight_copy: Optional[HeldCopy] = None  # the held copy the save in flight was scheduled from
        self._failures: list[str] = []  # failed saves not yet raised to Lightning
        self._committer: Optional[threading.Thread] = None
        self._said_no_shm = False  # the warning that held copies do not fit in /dev/shm is given once
        self._closed = False

    def __getstate__(self) -> dict:
        """Strategies that spawn processes pickle the plugin: send the settings, not the worker."""
        return {"config": self.config, "trusted": self.trusted, "max_in_flight": self.max_in_flight}

    def __setstate__(self, state: dict) -> None:
        self.config, self.trusted, self.max_in_flight = state["config"], state["trusted"], state["max_in_flight"]
        self._init_runtime()

    # CheckpointIO ------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        """Snapshot `checkpoint` as of now into the DCP directory `path`; returns once staged (or
        copied, while the worker is busy or starting). Saving to a path again replaces its
        checkpoint at commit, never before."""
        if storage_options is not None:
            raise TypeError("AsyncCheckpointIO.save_checkpoint takes no storage_options (configure it with a CheckpointConfig)")
        if not isinstance(checkpoint, dict):
            raise TypeError(f"checkpoint must be a dict, not {type(checkpoint).__name__}")
        target = _target(path)
        flat = flatten_exact(checkpoint)
        with self._lock:
            self._check_open()
            self._raise_failures()
            saver = self._ensure_saver()
            while True:
                self._advance(blocking=False)
                if not self._held and saver.in_flight_dir is None and saver.worker_ready:
                    saver.schedule_save(flat, checkpoint_dir=target)
                    break
                if self._may_hold(saver) and self._hold(flat, target):
                    break
                if not self._held and saver.in_flight_dir is None:  # no copy possible (e.g. GPU tensors)
                    saver.schedule_save(flat, checkpoint_dir=target)  # waits for the worker's start
                    break
                self._advance(blocking=True)  # the save in flight commits; the next held one goes in
            self._start_committer()
            self._wake.set()

    def load_checkpoint(self, path, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> dict:
        """The dict saved to `path`, read without a template and safely: `.metadata` through the
        restricted unpickler, objects with weights_only unless trusted. Tensors load on the CPU,
        or on the device `map_location` names. Waits for a save of `path` still in flight."""
        target = _target(path)
        with self._lock:
            self._finish_saves_of(target)
            self._raise_failures()
        storage = storage_for(target)
        if storage.exists(target):  # a file
            raise CheckpointError(
                f"{target!r} is a file, not a DCP checkpoint directory (saved by Lightning's default IO?): "
                "load it without AsyncCheckpointIO"
            )
        if not storage.is_dir(target):
            raise FileNotFoundError(f"Checkpoint not found: {target}")
        trusted = self.trusted if weights_only is None else not weights_only
        if not storage.exists(storage.join(target, METADATA_FILE)):
            raise CheckpointError(f"{target!r} is not a committed checkpoint (no {METADATA_FILE})")
        metadata = read_metadata(target, trusted=trusted)
        flat = {
            key: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else meta
            for key, meta in metadata.state_dict_metadata.items()
        }
        load(flat, target, trusted=trusted, no_dist=True)
        return map_tensors(unflatten_exact(flat, target), _mover(map_location))

    def remove_checkpoint(self, path) -> None:
        """Remove the checkpoint directory `path` (after its save, if one is held or in flight, so
        it can never reappear). Anything but a checkpoint directory is refused."""
        target = _target(path)
        with self._lock:
            self._finish_saves_of(target)
            _remove_checkpoint_dir(target)
            self._raise_failures()

    def teardown(self) -> None:
        """Commit every save held or in flight (Lightning calls this at the end of each fit). The
        plugin, and its worker, stay ready for the next fit."""
        with self._lock:
            self._drain()
            if self._saver is not None:  # a replaced last.ckpt's old files too: the directories are final now
                self._saver.wait_tidy()
            self._raise_failures()

    # beyond CheckpointIO -----------------------------------------------------------------------
    def wait(self, path=None) -> None:
        """Block until the save of `path` (or every save) is committed; raise if one failed."""
        with self._lock:
            if path is None:
                self.teardown()
            else:
                self._finish_saves_of(_target(path))
                self._raise_failures()

    def close(self) -> None:
        """Commit what is held or in flight and stop the worker. The plugin is unusable afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _live.discard(self)
            if self._saver is not None:
                self._drain()
                try:
                    self._saver.close()
                except Exception as exc:
                    self._failed(str(exc))
                self._saver = None
            self._spare, self._in_flight_copy = [], None
            self._stop.set()
            self._wake.set()
            self._raise_failures()

    # internals ---------------------------------------------------------------------------------
    def _ensure_saver(self) -> AsyncCheckpointer:
        if self._saver is None:
            self._saver = AsyncCheckpointer(config=self.config, no_dist=True)  # spawns its worker, without waiting
            _live.add(self)
        return self._saver

    def _may_hold(self, saver: AsyncCheckpointer) -> bool:
        """Whether one more save may be held: the saves outstanding stay within max_in_flight,
        except that a first save never waits for the worker's start."""
        outstanding = len(self._held) + (saver.in_flight_dir is not None)
        return outstanding < self.max_in_flight or (outstanding == 0 and not saver.worker_ready)

    def _hold(self, flat: dict, target: str) -> bool:
        """Copy `flat` for a save handed over later; False where no copy can be taken, or where
        /dev/shm has no room for it at hand-over (the save then waits for the worker instead of
        failing later: the trainer's own tensors are in shared memory already)."""
        check_writable_without_writing(target)
        spare = self._spare.pop() if self._spare else None
        held_copy = spare or HeldCopy(device_to_host=True)
        if not self._shm_room_for(held_copy.bytes_to_share(flat)):  # asked before copying anything
            state = None
        else:
            state = held_copy.take(flat)  # GPU tensors land in host memory: the save must not wait for a write
        if state is None:
            if spare is not None:  # its memory is as it was: still the one to take again
                self._spare.append(spare)
            return False
        self._held.append(_HeldSave(state, target, held_copy))
        return True

    def _shm_room_for(self, copy_bytes: int) -> bool:
        """Whether /dev/shm can take `copy_bytes` of a new held copy, besides the held copies not
        handed over yet (free space does not count them until then), leaving its headroom."""
        held = [v for h in self._held for v in h.state.values() if isinstance(v, torch.Tensor)]
        needed = copy_bytes + shared_memory_needed((tensor, False) for tensor in held).nbytes
        free = shm_free_bytes()
        if needed == 0 or free is None or needed + SHM_HEADROOM_BYTES <= free:
            return True
        if not self._said_no_shm:
            self._said_no_shm = True
            log.warning("asyncckpt: %s free in %s cannot take a held copy of %.1f MiB: saves that come while the "
                        "worker is busy wait for it instead (enlarge %s, e.g. docker --shm-size, to avoid the wait)",
                        f"{free / 2**20:.1f} MiB", SHM_DIR, needed / 2**20, SHM_DIR)
        return False

    def _advance(self, blocking: bool) -> None:
        """Commit the save in flight once its writes end (`blocking`: wait for them), then hand
        the next held save to the worker (once it is up, unless `blocking`). A failure reaches
        Lightning at its next call."""
        saver = self._saver
        if saver.in_flight_dir is not None:
            try:
                saver.finalize(blocking=blocking)
            except Exception as exc:  # the failed save removed its own files; Lightning hears of it next call
                self._failed(str(exc))
        if saver.in_flight_dir is not None:
            return
        if self._in_flight_copy is not None:  # staged and written: its memory serves the next held save
            if not self._spare:  # one is kept; another (two saves held at once) is let go
                self._spare.append(self._in_flight_copy)
            self._in_flight_copy = None
        if self._held and not saver.worker_alive:  # it died or was killed: start the next one now
            saver.ensure_worker()
        if self._held and (blocking or saver.worker_ready):  # not before: the hand-off would hold the lock
            held = self._held.popleft()
            try:
                saver.schedule_save(held.state, checkpoint_dir=held.target, wait=False, cache_slot=HELD_SLOT)
                self._in_flight_copy = held.copy
            except Exception as exc:
                self._failed(str(exc))

    def _drain(self) -> None:
        """Commit every save held or in flight."""
        while self._saver is not None and (self._held or self._saver.in_flight_dir is not None):
            self._advance(blocking=True)

    def _finish_saves_of(self, target: str) -> None:
        """Commit the saves writing `target` (and those before them), and (incremental) the one in
        flight if it reuses its files."""
        saver = self._saver
        while saver is not None and (
            any(held.target == target for held in self._held)
            or saver.in_flight_dir == target
            or target in saver.in_flight_base_dirs
        ):
            self._advance(blocking=True)

    def _failed(self, message: str) -> None:
        log.error("asynchronous checkpoint failed: %s", message)
        self._failures.append(message)

    def _raise_failures(self) -> None:
        if self._failures:
            failures, self._failures = self._failures, []
            raise CheckpointError("; ".join(failures))

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this AsyncCheckpointIO is closed")

    def _start_committer(self) -> None:
        if self._committer is None or not self._committer.is_alive():
            self._committer = threading.Thread(target=self._commit_loop, name="asyncckpt-lightning-commit", daemon=True)
            self._committer.start()

    def _commit_loop(self) -> None:
        """Commit saves as their writes end and hand held saves over as the worker frees up, so a
        checkpoint exists (and on_commit runs) without waiting for Lightning's next call. Polls
        while a save is held or in flight; sleeps otherwise."""
        while True:
            with self._lock:
                if self._closed:
                    return
                if self._saver is not None:
                    self._advance(blocking=False)
                pending = self._saver is not None and (bool(self._held) or self._saver.in_flight_dir is not None)
                if not pending:
                    self._wake.clear()  # under the lock: a save scheduled after this sets it again
            if pending:
                self._stop.wait(COMMIT_POLL_S)
            else:
                self._wake.wait(1.0)


HELD_SLOT = 1  # the worker's cache slot for held copies (the trainer's own tensors use slot 0)
# last.ckpt hard-links the files of the top-k save just before it (the same values): an event writes
# its state once, not twice (in-fit overhead with both cores busy 14.2 % -> 6.6 % in bench_lightning)
DEFAULT_CONFIG = CheckpointConfig(incremental=True)


@dataclass
class _HeldSave:
    """A save copied while the worker was busy or starting, handed over in order."""

    state: dict
    target: str
    copy: HeldCopy


def _launched_as_global_rank_zero() -> bool:
    """Whether the launcher's environment says this process is global rank 0 (or a single
    process). Lightning calls the plugin on rank 0 only, so other ranks start no worker; where
    the environment does not say (e.g. a strategy that spawns its ranks later), workers start
    at the first save."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" in env:  # torchrun, SLURM
        return env.get("RANK", env.get("SLURM_PROCID")) == "0"
    return env.get("LOCAL_RANK", "0") == "0" and env.get("NODE_RANK", "0") == "0"  # Lightning's own launcher


def _target(path) -> str:
    """The checkpoint directory for a path Lightning gives (local paths made absolute)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    target = os.fspath(path)
    if not target:
        raise ValueError("path must not be empty")
    return target if is_remote(target) else os.path.abspath(target)


def _remove_checkpoint_dir(target: str) -> None:
    """Delete a checkpoint directory: un-commit it first (a crash mid-delete leaves a torn
    directory, never a broken checkpoint). Refuses a file, a symlink, and a directory holding
    anything a save does not write."""
    storage = storage_for(target)
    if storage.is_symlink(target):
        raise CheckpointError(f"refusing to remove {target!r}: it is a symlink, not a checkpoint directory")
    if storage.exists(target):  # a file
        raise CheckpointError(f"refusing to remove {target!r}: it is a file, not a checkpoint directory")
    if not storage.is_dir(target):
        log.debug("remove_checkpoint: %s does not exist", target)
        return
    names = storage.list_dir(target)
    foreign = [n for n in names if not is_checkpoint_file(n) or storage.is_dir(storage.join(target, n))]
    if foreign or not names:
        what = f"it holds {', '.join(sorted(foreign)[:3])}, which a save does not write" if foreign else "it is empty"
        raise CheckpointError(f"refusing to remove {target!r}: {what}")
    if METADATA_FILE in names:
        storage.remove_file(storage.join(target, METADATA_FILE))
    storage.remove_tree(target)
    log.debug("removed checkpoint %s", target)


def _mover(map_location: Any):
    """What `map_location` means for tensors loaded on the CPU (torch.load's forms, minus callables)."""
    if map_location is None:
        return lambda t: t
    if isinstance(map_location, dict):
        map_location = map_location.get("cpu", "cpu")
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        return lambda t: t.to(device)
    raise TypeError(f"map_location must be None, a device, a str or a dict, not {type(map_location).__name__}")


@atexit.register
def _close_all() -> None:
    """Registered after asyncckpt.checkpointer's, so it runs first: commit through the plugin's
    lock (its commit thread may be polling) before the checkpointers are closed."""
    for plugin in list(_live):
        try:
            plugin.close()
        except Exception as exc:  # said, with exit status 1, by at_exit.close_all (it runs next)
            at_exit.report_failure(f"AsyncCheckpointIO: {exc}")
