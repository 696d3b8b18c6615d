"""The history rule of the memory tier: a copy in memory belongs to one history, and a restart
uses it only while that history is still the root's.

A history is the root's id (a random id written into `ROOT/.asyncckpt_root_id` when the root is
first used: a path can be wiped and reused, the id goes with it) and, for one copy, its *base*:
the newest committed checkpoint of the root when the copy was staged (step and save id). A copy
is the one to resume from only when the root still carries its id and that base is still the
root's newest committed checkpoint (then the copy is newer than the disk: persist it), or the
copy *is* that checkpoint (the same save id: the copy is the committed save itself).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Optional

from ..layout import METADATA_FILE, ROOT_ID_FILE, latest_checkpoint
from ..storage import is_remote, storage_for
from .safe_reader import read_metadata


@dataclass(frozen=True)
class Base:
    """A committed checkpoint of the root: its step and the save id its `.metadata` records."""

    step: int
    save_id: Optional[str]


@dataclass(frozen=True)
class RootHistory:
    """The root's id, and its newest committed checkpoint when it was read."""

    root_id: str
    newest: Optional[Base]


def root_history(root: str, fsync: bool = True) -> RootHistory:
    """Read the root's id, writing a new one where it has none (created only where absent: two
    processes opening an empty root at once agree on one). The coordinator calls this once,
    before the root is used, and shares the answer."""
    storage = storage_for(root)
    path = storage.join(root, ROOT_ID_FILE)
    for _ in range(3):
        if storage.exists(path):
            root_id = storage.read_bytes(path).decode().strip()
            if root_id:
                return RootHistory(root_id, newest_committed(root))
        if _create(storage, path, (uuid.uuid4().hex + "\n").encode(), fsync):
            return RootHistory(storage.read_bytes(path).decode().strip(), newest_committed(root))
    raise OSError(f"{path}: cannot read or create the root's id")


def _create(storage, path: str, data: bytes, fsync: bool) -> bool:
    """Publish `path` whole only if it does not exist: False when another writer was first."""
    if is_remote(path):
        return storage.write_if_version(path, data, None)
    temp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    storage.write_atomic(temp, data, fsync)
    try:
        os.link(temp, path)  # fails if it exists: never replaces another writer's id
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(temp)


def newest_committed(root: str) -> Optional[Base]:
    """The root's newest committed checkpoint (the one `latest` names), or None."""
    info = latest_checkpoint(root)
    if info is None:
        return None
    return Base(info.step, _save_id(info.path))


_SAVE_IDS: dict[str, tuple[tuple[int, int, int], Optional[str]]] = {}  # checkpoint -> (its .metadata's stat, id)


def _save_id(checkpoint: str) -> Optional[str]:
    """The save id a checkpoint's `.metadata` records (None: unreadable, it matches no copy's base).
    A local one is parsed once per version of the file (it is published by a rename: a new inode),
    not at the constructor and again at each restart: parsing it is a large file's work at scale."""
    key = None
    if not is_remote(checkpoint):
        try:
            stat = os.stat(os.path.join(checkpoint, METADATA_FILE))
            key = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except OSError:
            return None
        if checkpoint in _SAVE_IDS and _SAVE_IDS[checkpoint][0] == key:
            return _SAVE_IDS[checkpoint][1]
    try:
        meta = read_metadata(checkpoint).storage_meta
        save_id = meta.save_id if meta is not None else None
    except Exception:
        return None
    if key is not None:
        if len(_SAVE_IDS) > 256:
            _SAVE_IDS.clear()
        _SAVE_IDS[checkpoint] = (key, save_id)
    return save_id


@dataclass(frozen=True)
class Verdict:
    """May a copy be used, must it be persisted, and if not, why."""

    use: bool
    persist: bool = False
    why: str = ""


def judge(root: str, history: RootHistory, newest: Optional[Base], copy_root_id: Optional[str],
          base: Optional[Base], step: int, token: str) -> Verdict:
    """The history rule for the copy every rank holds (same save, same history); `newest`: the
    root's newest committed checkpoint now. A wiped or recreated root has a new id: no copy of
    its old history matches it."""
    if copy_root_id != history.root_id:
        return Verdict(False, why=f"the copy of step {step} belongs to another history (root id "
                                  f"{str(copy_root_id)[:8]}, the root's {history.root_id[:8]}: another job, "
                                  "or the root was wiped or recreated on this path)")
    if newest is not None and newest.step == step and newest.save_id == token:
        return Verdict(True)  # the copy is the committed save itself
    if newest == base:
        return Verdict(True, persist=True)  # staged on top of the disk's newest: newer than the disk
    def name(b: Optional[Base]) -> str:
        return "no committed checkpoint" if b is None else f"step {b.step}"
    return Verdict(False, why=f"the copy of step {step} was staged on top of {name(base)}, and the root's newest "
                              f"committed checkpoint is now {name(newest)} (its history moved on or was rolled back)")
