"""Restoring from the memory tier: `load_latest` (loading/restart.py) loads the memory copy
instead of the disk when every rank holds the same complete copy of the same history and the
history rule (loading/history.py) says it is the one: staged on top of the root's newest committed
checkpoint, or that very save. Anything else, the disk: another root's or another history's copy
(INFO, and it is removed once the disk load succeeded), an incomplete one, one any rank lacks (its
file is not on this node), or one whose checksums do not match (found while reading: then a
WARNING, and the disk of the same history overwrites every entry).

Every rank reads the headers of every rank's file (on one node they are all here), the ranks
gather what they saw, the coordinator decides (it alone reads the disk's newest `.metadata`) and
every rank follows. The copy is read like a checkpoint: DCP Metadata rebuilt from the headers,
through SafeReader (objects with weights_only unless trusted; every range and CRC32C checked).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointError, PartialLoadError
from ..formats import CHECKSUM_ALGORITHM, Sidecar
from ..memory_file import MemoryCopy, NotACopy, memory_file_name, owner_alive, read_copy, root_key
from .history import Base, RootHistory, judge, newest_committed
from .load import load
from .memory_plan import rebuild_metadata
from .resume import ResumeReport
from .opened import OpenCheckpoint, opened_with
from .peer_copies import PeerCopies, Peers, find_on_peers
from .peer_source import PeerFiles
from .safe_reader import SafeReader

log = logging.getLogger("asyncckpt")

NO_COPY = "no memory copy"


class Ranks(Protocol):
    pg: Any
    rank: int
    size: int
    is_coordinator: bool

    def broadcast(self, obj: Any) -> Any: ...

    def all_gather(self, obj: Any) -> list[Any]: ...


@dataclass(frozen=True)
class Seen:
    """What one rank found of the memory tier: the save every rank's file holds, or the problem."""

    step: Optional[int] = None
    token: Optional[str] = None
    memory_only: bool = False
    problem: Optional[str] = None
    root_id: Optional[str] = None  # the history of this rank's own copy
    base: Optional[Base] = None


@dataclass(frozen=True)
class Decision:
    use: bool
    persist: bool = False  # newer than the disk: write and commit it (in the background)
    why: str = ""  # why not
    warn: bool = False
    drop: bool = False  # another history's copy: removed once the disk load succeeded
    newest: Optional[Base] = None  # the root's newest committed checkpoint (with a history)


@dataclass(frozen=True)
class MemoryRestore:
    report: ResumeReport
    persist: bool
    token: str = ""  # the save the copy holds (its persist maps the file: save/mapped_copy.py)


@dataclass(frozen=True)
class MemoryAttempt:
    """What trying the memory tier came to: the copy loaded (`restored`), or not; then whether
    the copy is to go once the disk loaded (`drop`), and whether the failed load had already
    changed the state (`touched`: the disk of the same history must overwrite it, or the
    restart fails with PartialLoadError)."""

    restored: Optional[MemoryRestore] = None
    drop: bool = False
    touched: bool = False
    newest: Optional[Base] = None  # the root's newest committed checkpoint, as the coordinator found it


def restore(
    state_dict: dict[str, Any], root: str, memory_dir: str, group: Ranks, *, trusted: bool, wait_s: float,
    key: Optional[str] = None, history: Optional[RootHistory] = None, peers: Optional[Peers] = None,
) -> MemoryAttempt:
    """Load the memory copy into `state_dict` when it is the one to resume from (every rank
    decides the same). `key`: what keys the tier's files, when not the root
    (save/memory_tier._tier_key); `history`: the root's, as the checkpointer found it; `peers`:
    the other nodes, which serve the copies this node lacks (loading/peer_copies.py)."""
    started = time.perf_counter()
    found = find_on_peers(memory_dir, key or root, group, peers, wait_s, _read_waiting) if peers else None
    if found is None:
        copies, seen = _look(memory_dir, key or root, group, wait_s)
        return _decide_and_load(state_dict, root, memory_dir, group, trusted, history, copies, seen, started)
    try:  # the copies of the newest save whole across the nodes, as their headers say
        return _decide_and_load(state_dict, root, memory_dir, group, trusted, history, found.copies,
                                [_seen(copy) for copy in found.copies], started, found, peers)
    finally:  # (every rank's reads are over: the load's last collective, or no load)
        found.stop()


def _decide_and_load(state_dict: dict[str, Any], root: str, memory_dir: str, group: Ranks, trusted: bool,
                     history: Optional[RootHistory], copies: list[MemoryCopy], seen: list[Seen], started: float,
                     found: Optional[PeerCopies] = None, peers: Optional[Peers] = None) -> MemoryAttempt:
    decision = group.broadcast(decide(seen, root, history) if group.is_coordinator else None)
    if not decision.use:
        if decision.warn:
            log.warning("memory tier: not restoring from memory (%s); loading from disk", decision.why)
        elif decision.why:
            log.info("memory tier: not restoring from memory: %s; loading from disk", decision.why)
        return MemoryAttempt(drop=decision.drop, newest=decision.newest)
    step = seen[0].step
    what = f"the copy of step {step}"
    if found is None:
        loaded, pulled = _load_copy(state_dict, copies, memory_dir, group, trusted, what), ()
    else:
        loaded, pulled = _load_from_peers(state_dict, copies, memory_dir, group, trusted, what, found, peers)
    if loaded is not True:  # (the same on every rank)
        return MemoryAttempt(touched=loaded == "touched", newest=decision.newest)
    what = ("memory only" if seen[0].memory_only else "not committed") if decision.persist else "committed too"
    log.info("resumed from memory: step %d (save %s, %s%s) in %.2fs", step, seen[0].token[:8], what,
             f", {sum(c.nbytes for c in pulled) / 2**20:.1f} MiB read from other nodes" if pulled else "",
             time.perf_counter() - started)
    report = ResumeReport(step, copies[group.rank].path, source="peer" if pulled else "memory", pulled=pulled)
    return MemoryAttempt(MemoryRestore(report, decision.persist, seen[0].token), newest=decision.newest)


def _load_from_peers(state_dict: dict[str, Any], copies: list[MemoryCopy], memory_dir: str, group: Ranks,
                     trusted: bool, what: str, found: PeerCopies, peers: Peers) -> tuple[bool | str, tuple]:
    """_load_copy, the copies this node lacks read from their holders (peer_source.py); a load
    that failed on a holder's account is tried again without it while every copy has another."""
    skip: frozenset[tuple[str, Any]] = frozenset()  # (file name, node)
    touched = False
    while True:
        source = PeerFiles(found.remote, peers.secret, peers.timeout_s, skip)
        mine = _load_here(state_dict, copies, memory_dir, group, trusted, what, source)
        everyone = group.all_gather((mine, source.pulled(group.rank), source.failed))
        loaded = _agreed([outcome for outcome, _, _ in everyone])
        pulled = tuple(copy for _, done, _ in everyone for copy in done)
        if loaded is True:
            return True, pulled
        touched = touched or loaded == "touched"
        blamed = {pair for _, _, theirs in everyone for pair in theirs} - skip
        avoid = skip | blamed
        left = all(group.all_gather(all(any((os.path.basename(path), h.node) not in avoid for h in copy.holders)
                                        for path, copy in found.remote.items())))
        if not blamed or not left:
            return ("touched" if touched else False), pulled
        skip = frozenset(avoid)
        log.warning("memory tier: %s failed on %s; reading from other holders", what,
                    ", ".join(sorted(f"node {node!r}'s {name}" for name, node in blamed)))


def restore_saved(
    state_dict: dict[str, Any], checkpoint: OpenCheckpoint, key: str, memory_dir: str, group: Ranks, *,
    trusted: bool,
) -> bool:
    """The doors' resumes (they load a directory they name): load the committed `checkpoint` from
    the memory copy when every rank holds that very save (the save id its `.metadata` records);
    False: nothing was loaded, read its files. Every rank decides the same from what all saw.
    It never waits for a copy being staged: a committed save was sealed before its writes began,
    so a copy still incomplete holds another save (or a failed one) and the files are read."""
    started = time.perf_counter()
    meta = checkpoint.metadata.storage_meta
    save_id = meta.save_id if meta is not None else None
    copies, seen = _look(memory_dir, key, group, wait_s=0.0)
    if save_id is None or any(s.problem is not None or s.token != save_id for s in seen):
        problems = sorted({s.problem for s in seen if s.problem not in (None, NO_COPY)})
        log.info("memory tier: %s is not the save held in memory%s; loading its files", checkpoint.path,
                 f" ({'; '.join(problems[:4])})" if problems else "")
        return False
    loaded = _load_copy(state_dict, copies, memory_dir, group, trusted, f"the copy of {checkpoint.path}")
    if loaded is not True:
        return False  # the caller reads the files: every entry overwritten
    log.info("loaded %s from memory (save %s) in %.2fs", checkpoint.path, save_id[:8], time.perf_counter() - started)
    return True


def _look(memory_dir: str, root: str, group: Ranks, wait_s: float) -> tuple[list[MemoryCopy], list[Seen]]:
    """This rank's view of every rank's copy, and what every rank saw (one all_gather)."""
    copies: list[MemoryCopy] = []
    try:
        copies = read_copies(memory_dir, root, group.size, time.monotonic() + wait_s)
        mine = _seen(copies[group.rank])
    except NotACopy as exc:
        mine = Seen(problem=str(exc))
    return copies, group.all_gather(mine)


def _seen(copy: MemoryCopy) -> Seen:
    base = None if copy.base_step is None else Base(copy.base_step, copy.base_token)
    return Seen(copy.step, copy.token, copy.memory_only, root_id=copy.root_id, base=base)


def _load_copy(state_dict: dict[str, Any], copies: list[MemoryCopy], memory_dir: str, group: Ranks, trusted: bool,
               what: str) -> bool | str:
    """Load the copies into `state_dict`: True; else, the same answer on every rank (with a WARNING
    where it failed: a checksum mismatch, say), False, or "touched" when the state was changed
    already on some rank (then the disk must overwrite every entry)."""
    return _agreed(group.all_gather(_load_here(state_dict, copies, memory_dir, group, trusted, what)))


def _load_here(state_dict: dict[str, Any], copies: list[MemoryCopy], memory_dir: str, group: Ranks, trusted: bool,
               what: str, source: Optional[PeerFiles] = None) -> bool | str:
    """_load_copy's load, the copies this node lacks read from `source` (their holders): this
    rank's outcome, which may differ from another's (a rank can fail alone after the load's
    collectives). A rank that cannot even begin stops every rank before those collectives."""
    try:
        metadata, checksums = rebuild_metadata(copies)
        reader: Optional[MemoryReader] = MemoryReader(memory_dir, metadata, checksums, trusted, source)
        problem = None
    except (CheckpointError, ValueError, KeyError, TypeError) as exc:
        reader, problem = None, exc
    if any(group.all_gather(problem is not None)):
        if problem is not None:
            log.warning("memory tier: %s did not load (%s); loading from disk", what, problem)
        return False
    try:
        load(state_dict, memory_dir, trusted=trusted, process_group=group.pg, no_dist=group.size == 1,
             storage_reader=reader)
    except (CheckpointError, ValueError, KeyError, TypeError) as exc:
        log.warning("memory tier: %s did not load (%s)", what, exc)
        return "touched" if isinstance(exc, PartialLoadError) else False
    return True


def _agreed(outcomes: list[bool | str]) -> bool | str:
    """Every rank's outcome as one: True where all loaded; "touched" where any state changed."""
    if all(o is True for o in outcomes):
        return True
    return "touched" if any(o is True or o == "touched" for o in outcomes) else False


def read_copies(memory_dir: str, root: str, world_size: int, deadline: float) -> list[MemoryCopy]:
    """Every rank's copy, as this rank sees them: complete, of `root`, of the same save.
    NotACopy (naming the file) otherwise."""
    copies = []
    for rank in range(world_size):
        path = os.path.join(memory_dir, memory_file_name(root, rank))
        try:
            copy = _read_waiting(path, deadline)
        except NotACopy as exc:
            if str(exc) == NO_COPY and rank == 0:
                raise
            raise NotACopy(f"{path}: {exc}") from None
        if copy.root != root_key(root) or copy.rank != rank or copy.world_size != world_size:
            raise NotACopy(f"{path}: it holds rank {copy.rank} of {copy.world_size} of {copy.root!r}, not rank "
                           f"{rank} of {world_size} of {root_key(root)!r}")
        if copies and (copy.token, copy.step) != (copies[0].token, copies[0].step):
            raise NotACopy(f"{path} holds step {copy.step} (save {copy.token[:8]}), rank 0's step "
                           f"{copies[0].step} (save {copies[0].token[:8]})")
        copies.append(copy)
    return copies


def _read_waiting(path: str, deadline: float) -> MemoryCopy:
    """read_copy, waiting (until `deadline`) while the worker that was staging into it lives:
    the worker of a trainer that just died seals the save it was staging before it exits."""
    writer = 0
    while True:
        try:
            return read_copy(path)
        except NotACopy as exc:
            writer = exc.busy_pid or writer
            if not (writer and writer != os.getpid() and owner_alive(writer) and time.monotonic() < deadline):
                raise
        time.sleep(0.05)


def decide(seen: list[Seen], root: str, history: Optional[RootHistory]) -> Decision:
    """The coordinator's choice between the memory copy every rank saw and the disk: the same
    save and the same history on every rank, and the history rule (loading/history.py)."""
    newest = newest_committed(root) if history is not None else None
    problems = [f"rank {r}: {s.problem}" for r, s in enumerate(seen) if s.problem is not None]
    if problems:
        quiet = all(s.problem == NO_COPY for s in seen)
        return Decision(False, why="" if quiet else "; ".join(problems[:4]), warn=not quiet, newest=newest)
    saves = {(s.step, s.token) for s in seen}
    if len(saves) > 1:
        return Decision(False, why=f"the ranks hold different saves: {sorted(saves)[:4]}", warn=True, newest=newest)
    step, token = seen[0].step, seen[0].token
    strangers = [r for r, s in enumerate(seen) if (s.root_id, s.base) != (seen[0].root_id, seen[0].base)]
    if strangers:
        return Decision(False, drop=True, newest=newest,
                        why=f"the copy of rank {strangers[0]} belongs to another history than rank 0's")
    if history is None:
        return Decision(False, why="this tier keeps no history (it restores only a save it is named)")
    verdict = judge(root, history, newest, seen[0].root_id, seen[0].base, step, token)
    return Decision(verdict.use, persist=verdict.persist, why=verdict.why, drop=not verdict.use, newest=newest)


class MemoryReader(SafeReader):
    """SafeReader over the memory tier's files: the Metadata rebuilt from the headers, the
    headers' checksums; tensors are raw bytes in the slabs, read as local files are, or from
    the holders of the copies this node lacks (`peers`: peer_source.PeerFiles)."""

    def __init__(self, memory_dir: str, metadata: Metadata, checksums: dict[tuple[str, int, int], int],
                 trusted: bool, peers: Optional[PeerFiles] = None) -> None:
        super().__init__(opened_with(memory_dir, metadata, trusted), trusted=trusted)
        self._rebuilt = metadata
        self._header_checksums = checksums
        self._peers = peers

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._rebuilt

    def _load_checksums(self) -> dict[tuple[str, int, int], int]:
        self.sidecar = Sidecar(CHECKSUM_ALGORITHM, None, [])
        return self._header_checksums

    def raw_file(self, relative_path: str) -> bool:
        return True

    def _source(self):
        return self._peers if self._peers is not None else super()._source()

    def read_data(self, plan: Any, planner: Any) -> Any:
        """SafeReader's; a failure of this rank's reads is told to the holders' source first (it
        names a damaged item's file), before DCP merges every rank's failures into one message."""
        try:
            return super().read_data(plan, planner)
        except CheckpointError as exc:
            if self._peers is not None:
                self._peers.blame(str(exc))
            raise

    def _file_size(self, relative_path: str, reqs: list) -> int:
        """A copy on another node: as large as its items say (its holder checks each range it serves)."""
        if self._peers is not None and self.opened.files[relative_path] in self._peers.remote:
            return max(info.offset + info.length for info in self.metadata.storage_data.values()
                       if info.relative_path == relative_path)
        return super()._file_size(relative_path, reqs)
