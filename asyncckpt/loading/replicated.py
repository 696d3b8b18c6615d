"""Resume at scale: bytes that several ranks load read from storage once per job.

With DDP every rank loads the same full tensors; with HSDP every rank of a replicate group the
same shards: the same (file, offset, length) read by k ranks is k times the storage traffic.
The coordinator sees every rank's load plan (DCP's global plan step, `SafeReader.
prepare_global_plan`): an item read by several ranks is *shared* by them; one of them, chosen so
each reads about 1/k of the bytes, reads it (checking its checksum) and broadcasts it to the
others, which check each item's length and CRC32C (and the sidecar's checksum when they have
it): to the ranks of its own node through a file in shared memory (node_share.py), to those of
other nodes point to point over gloo. No user flag: the plans say which ranks read what.

Then every rank loads as before through `SharedSource`, which serves the shared items' bytes
from memory and passes any other read to the storage. The shared bytes are held in host memory
until the load ends: `SHARED_BYTES_MAX` bounds them per load (items past it are read by every
rank that needs them, as before). On GPU the payloads go through gloo too (not yet NCCL into
the device targets).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import os
import sys
import uuid
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan

from ..errors import CheckpointError, PartialLoadError
from ..formats import crc32c
from .broadcast import LoadGroup
from .byte_sources import ByteSource, SharedSource
from .node_share import MemoryPayload, open_payload, payload_name

SHARED_BYTES_MAX = 4 << 30  # host memory a load may hold shared bytes in, per rank


Ranks = range | tuple[int, ...]  # (a range where the ranks are evenly spaced: DDP's all, HSDP's replicas)


@dataclass(frozen=True)
class SharedItem:
    """One stored item several ranks read: its bytes in its file, who reads it from storage."""

    relative_path: str
    offset: int
    length: int
    reader: int  # the rank of the load's group that reads it
    members: Ranks  # every rank of the group that needs it (the reader among them); one object per set


@dataclass(frozen=True)
class ReadShares:
    """The coordinator's verdict, sent to every rank with its plan (`LoadPlan.storage_data`):
    the shared items, every rank's node and the load's id (it names the readers' files in shared
    memory). Its size does not grow with ranks x items: each set of members is one object (a
    range where it can be), which every item refers to, and the nodes are runs of consecutive
    ranks (`node_runs`: (first rank, node number); -1: a rank that shares no memory)."""

    items: tuple[SharedItem, ...]
    node_runs: tuple[tuple[int, int], ...] = ()
    nonce: str = ""

    def node(self, rank: int) -> int:
        at = bisect.bisect_right(self.node_runs, (rank, sys.maxsize)) - 1
        return self.node_runs[at][1] if at >= 0 else -1

    def same_node(self, a: int, b: int) -> bool:
        node = self.node(a)
        return node >= 0 and node == self.node(b)

    def layout(self, reader: int) -> tuple[list[SharedItem], dict[SharedItem, int]]:
        """The items `reader` reads, in order, and where each lies in its payload."""
        items = [item for item in self.items if item.reader == reader]
        at, where = 0, {}
        for item in items:
            where[item] = at
            at += item.length
        return items, where

    def local_receivers(self, reader: int) -> bool:
        sets = {id(item.members): item.members for item in self.items if item.reader == reader}
        return any(m != reader and self.same_node(m, reader) for members in sets.values() for m in members)

    def rounds(self) -> list[tuple[Ranks, int, list[SharedItem]]]:
        """(members, reader, its items) in the order every rank runs them (the items' order)."""
        grouped: dict[tuple[Ranks, int], list[SharedItem]] = {}
        for item in self.items:
            grouped.setdefault((item.members, item.reader), []).append(item)
        return [(members, reader, items) for (members, reader), items in grouped.items()]


@dataclass(frozen=True)
class PlanNote:
    """What each rank's local plan tells the coordinator (`LoadPlan.storage_data`): its node
    (node_share.node_key) and a digest of the stored items it reads, so that ranks reading the
    same items (DDP: all of them) are one group, whose items the coordinator goes through once."""

    node: str
    items_digest: str


def plan_note(plan: LoadPlan, node: str) -> PlanNote:
    """This rank's note (computed by every rank, in parallel: O(its items))."""
    keys = sorted((req.storage_index.fqn, tuple(req.storage_index.offset or ())) for req in plan.items)
    return PlanNote(node, hashlib.blake2b(repr(keys).encode(), digest_size=16).hexdigest())


def assign_shared_reads(plans: list[LoadPlan], metadata: Metadata, budget: int = SHARED_BYTES_MAX) -> list[LoadPlan]:
    """Every rank's plan with the shared reads attached (unchanged when no item is read twice).
    Ranks whose notes say they read the same items are one group, whose items are gone through
    once; then O(log ranks) per item: at 16,384 DDP ranks the coordinator does no ranks x items
    work (DCP's gather of the plans does it once already)."""
    infos = metadata.storage_data
    groups: dict[object, list[int]] = {}
    for rank, plan in enumerate(plans):
        note = plan.storage_data
        groups.setdefault(note.items_digest if isinstance(note, PlanNote) else ("rank", rank), []).append(rank)
    readers_of: dict[tuple[str, int, int], list[list[int]]] = {}
    for ranks in groups.values():
        seen = set()
        for req in plans[ranks[0]].items:
            info = infos[req.storage_index]
            key = (info.relative_path, info.offset, info.length)
            if key not in seen:  # (a rank may read one stored item into two places)
                seen.add(key)
                readers_of.setdefault(key, []).append(ranks)
    load: dict[int, int] = {}  # bytes each rank reads for others so far
    sets: dict[tuple[int, ...], Ranks] = {}
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # per set of members: (its load when pushed, rank)
    shared: list[SharedItem] = []
    held = 0
    for (path, offset, length), readers in sorted(readers_of.items(), key=lambda kv: -kv[0][2]):
        members = tuple(readers[0]) if len(readers) == 1 else tuple(sorted(r for ranks in readers for r in ranks))
        if len(members) < 2 or held + length > budget:
            continue
        if members not in sets:
            sets[members] = _compact(members)
            heaps[members] = [(load.get(r, 0), r) for r in members]
            heapq.heapify(heaps[members])
        reader = _least_loaded(heaps[members], load)  # spread: ~1/k of the bytes each
        load[reader] = load.get(reader, 0) + length
        heapq.heappush(heaps[members], (load[reader], reader))
        held += length
        shared.append(SharedItem(path, offset, length, reader, sets[members]))
    if not shared:
        return plans
    shares = ReadShares(tuple(sorted(shared, key=lambda s: (s.relative_path, s.offset))), _node_runs(plans),
                        uuid.uuid4().hex[:12])
    return [replace(plan, storage_data=shares) for plan in plans]


def _least_loaded(heap: list[tuple[int, int]], load: dict[int, int]) -> int:
    """The rank of the set with the fewest bytes read for others (the lowest rank among equals);
    an entry whose load changed since (the rank read for another set) is pushed again, current."""
    while True:
        seen, rank = heapq.heappop(heap)
        if seen == load.get(rank, 0):
            return rank
        heapq.heappush(heap, (load.get(rank, 0), rank))


def _compact(members: tuple[int, ...]) -> Ranks:
    """A range when the ranks are evenly spaced (a few bytes pickled, not one per rank)."""
    step = members[1] - members[0]
    if step > 0 and all(b - a == step for a, b in zip(members, members[1:])):
        return range(members[0], members[-1] + 1, step)
    return members


def _node_runs(plans: list[LoadPlan]) -> tuple[tuple[int, int], ...]:
    """Every rank's node (what its local plan said: node_share.node_key) as runs of consecutive
    ranks on one node, the nodes numbered; "" (no shared memory) is -1."""
    numbers: dict[str, int] = {}
    runs: list[tuple[int, int]] = []
    for rank, plan in enumerate(plans):
        key = plan.storage_data.node if isinstance(plan.storage_data, PlanNote) else ""
        node = numbers.setdefault(key, len(numbers)) if key else -1
        if not runs or runs[-1][1] != node:
            runs.append((rank, node))
    return tuple(runs)


@dataclass(frozen=True)
class ReadOutcome:
    """What a rank tells the others once it has read its share."""

    error: Optional[str] = None
    in_memory: bool = False  # its items are in its payload file (node_share.py) for the ranks of its node
    pid: int = 0  # (the payload file's name holds it: a file whose process is gone is removed later)
    crcs: tuple[int, ...] = ()  # CRC32C of each item it read, in `ReadShares.layout` order


def share_reads(
    shares: ReadShares, group: LoadGroup, files: dict[str, str], source: ByteSource,
    expected_crc: Callable[[SharedItem], Optional[int]], checksum: Optional[Callable[[bytes], int]],
) -> "SharedSource":
    """Read this rank's share of the shared items, hand every share to its ranks (through shared
    memory inside a node, gloo between nodes), and return a source serving the items this rank
    needs from memory. A collective over `group`: every rank calls it with the same `shares`.
    Nothing of the caller's state is written here."""
    me = group.rank
    mine, where = shares.layout(me)
    payload = None
    if mine and shares.local_receivers(me):
        payload = MemoryPayload.create(payload_name(shares.nonce, me, os.getpid()), sum(item.length for item in mine))
    try:
        outcome, got = ReadOutcome(in_memory=payload is not None, pid=os.getpid()), {}
        try:
            got = _read_own(mine, files, source, expected_crc, checksum, payload, where)
            outcome = replace(outcome, crcs=tuple(crc32c(got[item]) for item in mine))
        except CheckpointError as exc:
            outcome = replace(outcome, error=str(exc))
        told = _exchange(group, outcome)
        _raise_failures(group, [t.error for t in told])
        checked_later = lambda item: checksum is not None and expected_crc(item) is not None  # noqa: E731 (the load checks the sidecar's)
        problems = []
        by_memory: dict[int, list[SharedItem]] = {}  # inside this node first (no rank waits on another for
        for members, reader, items in shares.rounds():  # them), each reader's payload mapped once
            if told[reader].in_memory and me != reader and me in members and shares.same_node(me, reader):
                by_memory.setdefault(reader, []).extend(items)
        for reader, items in by_memory.items():
            _receive(got, problems, lambda: _from_memory(shares, reader, told[reader], items, checked_later))
        for members, reader, items in shares.rounds():  # then other nodes (and readers without a payload)
            by_gloo = lambda m: not (told[reader].in_memory and shares.same_node(m, reader))  # noqa: E731
            if me == reader:
                to = tuple(m for m in members if m != reader and by_gloo(m))
                if to:
                    _send_round(items, reader, got, group, to)
            elif me in members and by_gloo(me):
                _receive(got, problems, lambda: _receive_round(items, reader, group, checked_later))
        # a damaged item stops every rank (none waits on this one in a later round); the payload files may go now
        _raise_failures(group, [t.error for t in _exchange(group, ReadOutcome("; ".join(problems) or None))])
    finally:
        if payload is not None:
            payload.remove()
    return SharedSource(source, {(files[item.relative_path], item.offset): data for item, data in got.items()})


def _read_own(items, files, source, expected_crc, checksum, payload: Optional[MemoryPayload],
              where: dict[SharedItem, int]) -> dict[SharedItem, bytes]:
    """The items this rank reads for its group (into its payload when it has one), each checked
    against its checksum."""
    def read(item: SharedItem):
        data = payload.view(where[item], item.length) if payload is not None else bytearray(item.length)
        what = f"{files[item.relative_path]}: bytes {item.offset}..{item.offset + item.length}"
        try:
            source.read_into(files[item.relative_path], item.offset, [memoryview(data)], what)
        except PartialLoadError as exc:  # nothing of the state was written yet
            raise CheckpointError(str(exc)) from None
        expected = expected_crc(item)
        if checksum is not None and expected is not None and checksum(data) != expected:
            raise CheckpointError(f"{what}: checksum mismatch (expected {expected:08x})")
        return data
    if not items:
        return {}
    with ThreadPoolExecutor(max_workers=source.threads, thread_name_prefix="asyncckpt-shared") as pool:
        return dict(zip(items, pool.map(read, items)))


def _from_memory(shares: ReadShares, reader: int, told: ReadOutcome, items: list[SharedItem],
                 checked_later: Callable[[SharedItem], bool]) -> dict:
    """`items` from the payload of `reader` (a rank of this node), each checked: its
    length, and its CRC32C unless the load checks the sidecar's checksum of it anyway."""
    order, where = shares.layout(reader)
    path, crcs = payload_name(shares.nonce, reader, told.pid), told.crcs
    try:
        view = open_payload(path, sum(item.length for item in order))
    except OSError as exc:
        raise Damaged(f"the items rank {reader} read could not be opened in shared memory ({exc})") from None
    crc_of = dict(zip(order, crcs))
    out = {}
    for item in items:
        data = view[where[item]:where[item] + item.length]
        _check(item, data, crc_of[item], checked_later, f"read by rank {reader} (in {path})")
        out[item] = data
    return out


class Damaged(CheckpointError):
    """An item another rank read arrived with another length or CRC32C."""


def _receive(got: dict, problems: list[str], receive: Callable[[], dict]) -> None:
    """`receive()`'s items into `got`; a damaged one into `problems` (this rank goes on taking
    part in the other rounds, and the last exchange stops every rank)."""
    try:
        got.update(receive())
    except Damaged as exc:
        problems.append(str(exc))


def _check(item: SharedItem, data, crc: Optional[int], checked_later: Callable[[SharedItem], bool], whence: str) -> None:
    if len(data) != item.length or (not checked_later(item) and crc32c(data) != crc):
        raise Damaged(f"{item.relative_path}: bytes {item.offset}..{item.offset + item.length} {whence} arrived damaged")


def _send_round(items, reader, got, group: LoadGroup, to: tuple[int, ...]) -> None:
    """The reader's side of a round to ranks `to` (of other nodes): point to point over the load's
    gloo group (no group is made for them), the items' CRC32Cs, then their bytes."""
    total = sum(item.length for item in items)
    crcs = torch.tensor([crc32c(got[item]) for item in items], dtype=torch.int64)
    payload = torch.empty(max(total, 1), dtype=torch.uint8)
    view, at = memoryview(payload.numpy()), 0
    for item in items:
        view[at:at + item.length] = got[item]
        at += item.length

    def send() -> None:
        sent = [dist.isend(tensor, dst=dist.get_global_rank(group.pg, r), group=group.pg)
                for r in to for tensor in ((crcs, payload) if total else (crcs,))]
        for work in sent:
            work.wait()
    _collective(send, group)


def _receive_round(items, reader, group: LoadGroup, checked_later: Callable[[SharedItem], bool]) -> dict:
    """A receiver's side of `_send_round`: each item checked, its length and its CRC32C (unless
    the load checks the sidecar's checksum of it anyway)."""
    total = sum(item.length for item in items)
    src = dist.get_global_rank(group.pg, reader)
    crcs = torch.zeros(len(items), dtype=torch.int64)
    payload = torch.empty(max(total, 1), dtype=torch.uint8)
    _collective(lambda: dist.recv(crcs, src=src, group=group.pg), group, src)
    if total:
        _collective(lambda: dist.recv(payload, src=src, group=group.pg), group, src)
    view, at, out = memoryview(payload.numpy()), 0, {}
    for item, crc in zip(items, crcs.tolist()):
        data = view[at:at + item.length]  # (the payload lives as long as its views)
        at += item.length
        _check(item, data, crc, checked_later, f"sent by rank {src}")
        out[item] = data
    return out


def _collective(run: Callable[[], object], group: LoadGroup, src: Optional[int] = None) -> None:
    try:
        run()
    except Exception as exc:  # gloo: a peer gone, or the group's timeout
        who = f" from rank {src}" if src is not None else ""
        raise CheckpointError(f"sharing replicated reads{who} failed ({type(exc).__name__}: {exc})") from None


@contextmanager
def failures_told(shares: Optional[ReadShares], group: Optional[LoadGroup]) -> Iterator[None]:
    """Around what a rank does before `share_reads`: an error there is told to the other ranks
    (they wait for it in `share_reads`), then raised here."""
    try:
        yield
    except Exception as exc:
        if shares is not None and group is not None:
            try:
                _exchange_errors(group, str(exc))
            except CheckpointError:
                pass  # this rank's own error is the one to raise
        raise


def _exchange(group: LoadGroup, mine):
    """Every rank's `mine`, on every rank (one all_gather of small objects)."""
    every: list = [None] * group.size
    _collective(lambda: dist.all_gather_object(every, mine, group=group.pg), group)
    return every


def _raise_failures(group: LoadGroup, errors: list[Optional[str]]) -> None:
    """CheckpointError naming each rank that failed, on every rank."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError("; ".join(f"rank {dist.get_global_rank(group.pg, r)}: {e}" for r, e in failed))


def _exchange_errors(group: LoadGroup, error: Optional[str]) -> None:
    """Every rank's error (None: fine) on every rank; CheckpointError naming each rank that failed."""
    _raise_failures(group, [t.error for t in _exchange(group, ReadOutcome(error))])
