"""Lightning's CheckpointIO on asyncckpt: `Trainer(plugins=[AsyncCheckpointIO()])`.

Each `.ckpt` path Lightning names becomes a DCP checkpoint directory, written by asyncckpt's
worker and committed when its `.metadata` lands. `save_checkpoint` returns once the snapshot is
staged (no collective: Lightning calls the plugin on global rank 0 only). The checkpoint dict goes
through `nested.flatten_exact`, so `load_checkpoint` returns exactly the dict that was saved,
without a template. One worker serves every save, in call order (held_saves.HeldSaves: the second
save of an event is copied instead of waiting for the first one's writes).

This module imports Lightning; `import asyncckpt` does not import this module.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as exc:  # asyncckpt itself does not depend on Lightning
    raise ImportError("asyncckpt.lightning needs Lightning: pip install lightning") from exc

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..config import CheckpointConfig
from .door_config import check_door_config
from ..errors import CheckpointError
from .held_saves import HeldSaves
from ..loading.load import load
from ..loading.memory_tier import restore_saved
from ..loading.opened import open_checkpoint
from ..layout import METADATA_FILE, is_checkpoint_file, list_files
from .nested import flatten_exact, map_tensors, unflatten_exact
from ..save.ranks import RankGroup
from ..storage import is_remote, storage_for

log = logging.getLogger("asyncckpt")

__all__ = ["AsyncCheckpointIO"]


class AsyncCheckpointIO(CheckpointIO):
    """Asynchronous DCP checkpoints for `lightning.Trainer`.

    `config`: a CheckpointConfig (its `on_commit` sees every committed save; `keep_last` is not
    used: ModelCheckpoint's `save_top_k` decides what is kept). Without one, saves are
    incremental (DEFAULT_CONFIG): ModelCheckpoint saves each event's state twice (top-k, then
    last.ckpt), and the second then writes none of its tensors. `trusted=True` unpickles objects
    in a checkpoint fully (needed for e.g. custom classes in `hyper_parameters`); a call's
    explicit `weights_only=` decides for that call. Preemption: Lightning's own SIGTERM handling
    stops fit at the end of the batch; its teardown commits every save staged by then."""

    def __init__(self, config: Optional[CheckpointConfig] = None, *, trusted: bool = False, max_in_flight: int = 2):
        super().__init__()
        if config is None:
            config = DEFAULT_CONFIG
        check_door_config(config, "AsyncCheckpointIO", "ModelCheckpoint(save_top_k=...)")
        if config.preemption_signals:  # a handler of ours would compete with Lightning's (docs/usage.md)
            raise ValueError("AsyncCheckpointIO: leave CheckpointConfig.preemption_signals empty: Lightning handles "
                             "SIGTERM itself (fit stops at the end of the batch and tears down, which commits the "
                             "saves this plugin has staged)")
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an integer >= 1, not {max_in_flight!r}")
        self.config, self.trusted, self.max_in_flight = config, bool(trusted), max_in_flight
        self._init_runtime()
        # start the worker now: the first save need not wait for it (with the memory tier it starts
        # at the first save, whose folder keys the tier)
        if _launched_as_global_rank_zero() and not config.memory_tier:
            with self._saves.lock:
                self._saves.ensure_saver()

    def _init_runtime(self) -> None:
        self._saves = HeldSaves(self.config, self.max_in_flight, owner="AsyncCheckpointIO")

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
        checkpoint at commit, never before. The folder holding `path` exists when this returns,
        as with Lightning's own IO (`save_last="link"` makes its link there next)."""
        if storage_options is not None:
            raise TypeError("AsyncCheckpointIO.save_checkpoint takes no storage_options (configure it with a CheckpointConfig)")
        if not isinstance(checkpoint, dict):
            raise TypeError(f"checkpoint must be a dict, not {type(checkpoint).__name__}")
        target = _target(path)
        self._saves.save(flatten_exact(checkpoint), target)
        if not is_remote(target):  # a held save has written nothing yet; save_last="link" links in here next
            os.makedirs(os.path.dirname(target), exist_ok=True)

    def load_checkpoint(self, path, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> dict:
        """The dict saved to `path`, read without a template and safely: `.metadata` through the
        restricted unpickler, objects with weights_only unless trusted. Tensors load on the CPU,
        or on the device `map_location` names. Waits for a save of `path` still in flight. A
        symlink (`save_last="link"` makes last.ckpt one) loads the checkpoint it names, once that
        save is committed."""
        named = _target(path)
        target = _linked(named)
        via = "" if target == named else f" (named by the link {named!r})"
        with self._saves.lock:
            self._saves.finish_saves_of(target)
            self._saves.raise_failures()
        storage = storage_for(target)
        if storage.exists(target):  # a file
            raise CheckpointError(
                f"{target!r} is a file, not a DCP checkpoint directory (saved by Lightning's default IO?): "
                "load it without AsyncCheckpointIO"
            )
        if not storage.is_dir(target):
            raise FileNotFoundError(f"Checkpoint not found: {target}{via}")
        trusted = self.trusted if weights_only is None else not weights_only
        if not storage.exists(storage.join(target, METADATA_FILE)):
            raise CheckpointError(f"{target!r}{via} is not a committed checkpoint (no {METADATA_FILE})")
        opened = open_checkpoint(target, trusted=trusted)
        flat = {
            key: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else meta
            for key, meta in opened.metadata.state_dict_metadata.items()
        }
        if not (self.config.memory_tier and restore_saved(
                flat, opened, os.path.dirname(target), self.config.memory_dir, RankGroup(no_dist=True),
                trusted=trusted)):  # from memory when it holds this very save
            load(flat, opened, trusted=trusted, no_dist=True)
        return map_tensors(unflatten_exact(flat, target), _mover(map_location))

    def remove_checkpoint(self, path) -> None:
        """Remove the checkpoint directory `path` (after its save, if one is held or in flight, so
        it can never reappear). Returns once it is un-committed (its `.metadata` gone); its files
        are deleted in the background, before any later use of `path` and by `teardown`. A
        symlink (`save_last="link"`'s last.ckpt, when its name changes) is removed itself, never
        what it names. Anything else but a checkpoint directory is refused."""
        target = _target(path)
        with self._saves.lock:
            self._saves.check_open()
            if storage_for(target).is_symlink(target):
                storage_for(target).remove_file(target)
                return
            self._saves.finish_saves_of(target)
            self._saves.raise_failures()
            if _uncommit_checkpoint_dir(target):
                self._saves.removals.delete_tree(target)

    def teardown(self) -> None:
        """Commit every save held or in flight (Lightning calls this at the end of each fit). The
        plugin, and its worker, stay ready for the next fit. The directories are final then
        (removed ones are gone, and so are a replaced last.ckpt's old files)."""
        self._saves.settle()

    # beyond CheckpointIO -----------------------------------------------------------------------
    def wait(self, path=None) -> None:
        """Block until the save of `path` (or every save; a symlink: of what it names) is
        committed, and a removal of it (or every removal) has ended; raise if one failed."""
        if path is None:
            self._saves.settle()
            return
        with self._saves.lock:
            self._saves.finish_saves_of(_linked(_target(path)))
            self._saves.raise_failures()

    def close(self) -> None:
        """Commit what is held or in flight and stop the worker. The plugin is unusable afterwards."""
        self._saves.close()


# last.ckpt hard-links the files of the top-k save just before it (the same values): an event writes
# its state once, not twice (in-fit overhead with both cores busy 14.2 % -> 6.6 % in bench_lightning)
DEFAULT_CONFIG = CheckpointConfig(incremental=True)


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


MAX_LINKS = 8  # a longer chain of symlinks is refused (as a cycle would be)


def _linked(target: str) -> str:
    """The checkpoint directory a local symlink names (Lightning writes last.ckpt as a link
    relative to its folder), spelled as its save was: the link's folder joined with the link's
    text, not realpath (a symlinked parent would spell it otherwise and a load through it would
    not wait for that save). Other paths are returned as they are."""
    for _ in range(MAX_LINKS):
        if is_remote(target) or not os.path.islink(target):
            return target
        target = os.path.abspath(os.path.join(os.path.dirname(target), os.readlink(target)))
    raise CheckpointError(f"{target!r}: more than {MAX_LINKS} symbolic links in a row")


def _uncommit_checkpoint_dir(target: str) -> bool:
    """Un-commit a checkpoint directory before its deletion (a crash mid-delete leaves a torn
    directory, never a broken checkpoint); whether there is a directory to delete. Refuses a
    file, a symlink, and a directory holding anything a save does not write."""
    storage = storage_for(target)
    if storage.is_symlink(target):
        raise CheckpointError(f"refusing to remove {target!r}: it is a symlink, not a checkpoint directory")
    if storage.exists(target):  # a file
        raise CheckpointError(f"refusing to remove {target!r}: it is a file, not a checkpoint directory")
    if not storage.is_dir(target):
        log.debug("remove_checkpoint: %s does not exist", target)
        return False
    names = list_files(storage, target)
    foreign = [n for n in names if not is_checkpoint_file(n) or storage.is_dir(storage.join(target, n))]
    if foreign or not names:
        what = f"it holds {', '.join(sorted(foreign)[:3])}, which a save does not write" if foreign else "it is empty"
        raise CheckpointError(f"refusing to remove {target!r}: {what}")
    if METADATA_FILE in names:
        storage.remove_file(storage.join(target, METADATA_FILE))
    return True


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
