"""Where a restart comes from: the one place `load_latest` decides it.

The sources, in order: the memory tier (when the history rule lets its copy be used:
loading/history.py), later the peers' copies, then the disk (the newest committed checkpoint that
loads: loading/resume.py). The byte sources below each (files, slab files, object stores) know
nothing of this order. The save side calls `restart` and persists what it returns as newer than
the disk; nothing here calls up into save/.

Never a mixed state: a memory copy that failed to load after changing the state falls back to the
disk of the same history (the rule only ever uses a copy whose base is the disk's newest), which
overwrites every entry; where the disk has nothing, PartialLoadError, never a fresh start.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from ..errors import CheckpointError, PartialLoadError
from .load import PARTLY_LOADED
from .memory_tier import MemoryAttempt
from .resume import ResumeReport, resume


class MemorySource(Protocol):
    """The memory tier as a restart sees it (save/memory_tier.MemoryTier)."""

    def attempt(self, state_dict: dict[str, Any], trusted: bool) -> MemoryAttempt: ...

    def drop(self) -> None: ...


@dataclass(frozen=True)
class Restart:
    report: Optional[ResumeReport]  # None: nothing to resume (a fresh start)
    persist: bool = False  # restored from memory and newer than the disk: the caller persists it


def restart(state_dict: dict[str, Any], root: str, group: Any, memory: Optional[MemorySource], *, trusted: bool,
            strict: bool, checksums: bool, allow_partial: bool = False) -> Restart:
    """Load what the job resumes from into `state_dict` (see the module's docstring)."""
    # allow_partial (a target that leaves saved entries out on purpose): the disk's copy, whose load checks it
    attempt = memory.attempt(state_dict, trusted) if memory is not None and not allow_partial else MemoryAttempt()
    if attempt.restored is not None:
        report, persist = attempt.restored.report, attempt.restored.persist
        return Restart(dataclasses.replace(report, persisted=False) if persist else report, persist)
    try:
        report = resume(state_dict, root, group, trusted=trusted, strict=strict, checksums=checksums,
                        allow_partial=allow_partial)
    except PartialLoadError:
        raise
    except CheckpointError as exc:
        if attempt.touched:
            raise PartialLoadError(f"the memory copy failed half-way, then the disk: {exc}; {PARTLY_LOADED}") from exc
        raise
    if report is None and attempt.touched:
        raise PartialLoadError(f"the memory tier's copy of {root!r} failed to load half-way and the root holds no "
                               f"committed checkpoint to load instead; {PARTLY_LOADED}")
    if attempt.drop and memory is not None:
        memory.drop()
    return Restart(report)
