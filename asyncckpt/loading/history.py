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

import uuid
from dataclasses import dataclass
from typing import Optional

from ..layout import ROOT_ID_FILE, latest_checkpoint
from ..storage import storage_for
from .safe_reader import read_metadata


@dataclass(frozen=True)
class Base:
    """A committed checkpoint of the root: its step and the save id its `.metadata` records."""

    step: int
    save_id: Optional[str]


@dataclass(frozen=True)
class RootHistory:
    """The root's id, and whether the root had none until now (empty, new or wiped: nothing in
    memory can belong to it), and its newest committed checkpoint then."""

    root_id: str
    fresh: bool
    newest: Optional[Base]


def root_history(root: str, fsync: bool = True) -> RootHistory:
    """Read the root's id, writing a new one (atomically) where it has none. The coordinator
    calls this once, before the root is used, and shares the answer."""
    storage = storage_for(root)
    path = storage.join(root, ROOT_ID_FILE)
    root_id = storage.read_bytes(path).decode().strip() if storage.exists(path) else ""
    fresh = not root_id
    if fresh:
        root_id = uuid.uuid4().hex
        storage.write_atomic(path, root_id.encode() + b"\n", fsync)
    return RootHistory(root_id, fresh, None if fresh else newest_committed(root))


def newest_committed(root: str) -> Optional[Base]:
    """The root's newest committed checkpoint (the one `latest` names), or None."""
    info = latest_checkpoint(root)
    if info is None:
        return None
    try:
        meta = read_metadata(info.path).storage_meta
    except Exception:  # unreadable: it matches no copy's base
        return Base(info.step, None)
    return Base(info.step, meta.save_id if meta is not None else None)


@dataclass(frozen=True)
class Verdict:
    """May a copy be used, must it be persisted, and if not, why."""

    use: bool
    persist: bool = False
    why: str = ""


def judge(root: str, history: RootHistory, copy_root_id: Optional[str], base: Optional[Base], step: int,
          token: str) -> Verdict:
    """The history rule for the copy every rank holds (same save, same history)."""
    if history.fresh:
        return Verdict(False, why=f"the root {root!r} had no history id (empty, new or wiped): the copy of "
                                  f"step {step} belongs to another history")
    if copy_root_id != history.root_id:
        return Verdict(False, why=f"the copy of step {step} belongs to another history (root id "
                                  f"{str(copy_root_id)[:8]}, the root's {history.root_id[:8]}: another job or a "
                                  "recreated root on this path)")
    newest = newest_committed(root)
    if newest is not None and newest.step == step and newest.save_id == token:
        return Verdict(True)  # the copy is the committed save itself
    if newest == base:
        return Verdict(True, persist=True)  # staged on top of the disk's newest: newer than the disk
    def name(b: Optional[Base]) -> str:
        return "no committed checkpoint" if b is None else f"step {b.step}"
    return Verdict(False, why=f"the copy of step {step} was staged on top of {name(base)}, and the root's newest "
                              f"committed checkpoint is now {name(newest)} (its history moved on or was rolled back)")
