"""`load_latest`: resume from the newest committed checkpoint that loads, past damaged ones.

A job whose newest checkpoint is damaged would otherwise fail at every restart. A checkpoint
that fails to load is checked (`loading.damage_of`, on the coordinator, its verdict shared): a
damaged one is skipped with a WARNING and the next older committed one is tried. One that reads
back intact is not skipped, its error is raised: an older checkpoint would not fix a state that
does not match, or an object that needs `trusted=True`.

A load that failed half-way (PartialLoadError) changed the state; the next one that succeeds
overwrites every entry of it, so the state is then wholly that checkpoint's. If none loads, the
error says whether the state was changed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from ..errors import CheckpointError, PartialLoadError
from .load import NOT_CHANGED, PARTLY_LOADED, damage_of, interrupted_before_changes, load, resume_order
from .broadcast import load_group, open_shared
from ..layout import CheckpointInfo

log = logging.getLogger("asyncckpt")


class Ranks(Protocol):
    """What resuming needs of the ranks (the checkpointer's RankGroup): the process group loads
    go through, and the coordinator's verdict on a checkpoint told to every rank."""

    pg: Any
    is_coordinator: bool

    def broadcast(self, obj: Any) -> Any: ...


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A committed checkpoint `load_latest` did not resume from because it is damaged."""

    step: int
    path: str
    reason: str


@dataclass(frozen=True)
class ResumeReport:
    """What `load_latest` resumed from, and the newer checkpoints it skipped as damaged (newest
    first). `source`: "disk" (a committed checkpoint, `path`), "memory" (the memory tier's copy;
    `path` is this rank's memory file) or "peer" (the memory tier's copy, some of it read from other
    nodes: `pulled`, every rank's reads, loading/peer_source.PulledCopy; `path` is the file's name
    here, absent where this rank's own copy was read from another node). `persisted` (from memory only):
    None when the copy was committed already, False while it is newer than the disk, True once a
    save committed it (`persisted_at`: that commit's time, time.time())."""

    step: int
    path: str
    skipped: tuple[SkippedCheckpoint, ...] = ()
    source: str = "disk"
    persisted: Optional[bool] = None
    persisted_at: Optional[float] = None
    pulled: tuple = ()


def resume(
    state_dict: dict[str, Any], root: str, group: Ranks, *, trusted: bool, strict: bool, checksums: bool,
    allow_partial: bool = False,
) -> Optional[ResumeReport]:
    """Load the newest committed checkpoint of `root` that loads into `state_dict` (None: there
    is none). `strict`: only the one `latest` names, its failure raised as it is. `allow_partial`:
    saved entries the state has no place for are left out instead of refused (`load`'s strict=False)."""
    candidates = resume_order(root)
    skipped: list[SkippedCheckpoint] = []
    touched = False
    for n, info in enumerate(candidates):
        opened = None  # the checkpoint, opened once for its load and its damage check
        try:
            # resume at scale: .metadata read by one rank of the job, sent to the others (broadcast.py)
            with interrupted_before_changes(info.path, changed_before=touched):
                shared_by = load_group(group.pg, no_dist=getattr(group, "size", 2) == 1)
                opened = open_shared(info.path, trusted=trusted, group=shared_by)
            try:
                load(state_dict, opened, trusted=trusted, process_group=group.pg, checksums=checksums,
                     strict=not allow_partial)
            except KeyboardInterrupt as exc:  # (an earlier candidate's failed load left the state partly loaded)
                if touched and NOT_CHANGED in str(exc):
                    raise KeyboardInterrupt(str(exc).replace(NOT_CHANGED, PARTLY_LOADED)) from exc
                raise
        except CheckpointError as exc:
            touched = touched or isinstance(exc, PartialLoadError)
            last = strict or n == len(candidates) - 1
            checked = opened or info.path
            reason = None if last else group.broadcast(damage_of(checked, trusted) if group.is_coordinator else None)
            if reason is None:
                if not skipped:
                    raise
                raise _none_loaded(root, skipped, info, exc, touched) from exc
            log.warning("%s is damaged, trying the next older committed checkpoint: %s", info.path, reason)
            skipped.append(SkippedCheckpoint(info.step, info.path, reason))
            continue
        return ResumeReport(info.step, info.path, tuple(skipped))
    return None


def _none_loaded(
    root: str, skipped: list[SkippedCheckpoint], info: CheckpointInfo, exc: CheckpointError, touched: bool
) -> CheckpointError:
    cause = str(exc).removesuffix(f"; {NOT_CHANGED}").removesuffix(f"; {PARTLY_LOADED}")
    damaged = "; ".join(f"{s.path} is damaged: {s.reason}" for s in skipped)
    message = f"no checkpoint of {root!r} could be loaded: {damaged}; then {info.path}: {cause}"
    if touched:
        return PartialLoadError(f"{message}; {PARTLY_LOADED}")
    return CheckpointError(f"{message}; {NOT_CHANGED}")
