"""Resume at scale, the coordinator's part: which ranks read which stored items for the others.

DCP's global plan step (`SafeReader.prepare_global_plan`) gives the coordinator every rank's load
plan; an item (file, offset, length) several ranks read is *shared*: one of them reads it for the
others (replicated.py moves the bytes). The verdict rides on every rank's plan, so it must stay
small at any rank count.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import sys
import uuid
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Optional

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan


SHARED_BYTES_MAX = 4 << 30  # host memory a load may hold shared bytes in, per rank


Ranks = range | tuple[int, ...]  # (a range where the ranks are evenly spaced: DDP's all, HSDP's replicas)


@dataclass(frozen=True)
class SharedItem:
    """One stored item several ranks read: its bytes in its file, who reads it from storage (of
    `ReadShares.checked`: who checks it, every member reading it)."""

    relative_path: str
    offset: int
    length: int
    reader: int  # the rank of the load's group that reads it (checks it)
    # every rank of the group that needs it (the reader among them); one object per set (and not
    # hashed with the item: a stored item is shared once, and a tuple of 16,384 ranks is slow to hash)
    members: Ranks = field(compare=False)


@dataclass(frozen=True)
class ReadShares:
    """The coordinator's verdict, sent to every rank with its plan (`LoadPlan.storage_data`):
    the shared items, the items one rank of a node checks for the others (`checked`), every
    rank's node and the load's id (it names the readers' files in shared memory). Its size does not grow with ranks x items: each set of members is one object (a
    range where it can be), which every item refers to, and the nodes are runs of consecutive
    ranks (`node_runs`: (first rank, node number); -1: a rank that shares no memory)."""

    items: tuple[SharedItem, ...]
    node_runs: tuple[tuple[int, int], ...] = ()
    nonce: str = ""
    page_cache: bool = False  # a file system: the ranks of a node read their reader's items themselves
    # on a file system, items only ranks of one node read: each of them reads the item itself through
    # the node's page cache, and the item's `reader` alone checks its checksum (`checked_elsewhere`)
    checked: tuple[SharedItem, ...] = ()

    @property
    def any_shared(self) -> bool:
        """Whether some item's bytes go from its reader to other ranks (share_reads has work)."""
        return bool(self.items)

    def checked_elsewhere(self, rank: int) -> set[tuple[str, int, int]]:
        """(file, offset, length) of the items `rank` reads through its node's page cache whose
        checksum another rank of the node checks: the same cached bytes need one check a node,
        not one a rank (a damaged item fails that rank's load, and so every rank's)."""
        return {(i.relative_path, i.offset, i.length) for i in self.checked if i.reader != rank}

    def node(self, rank: int) -> int:
        at = bisect.bisect_right(self.node_runs, (rank, sys.maxsize)) - 1
        return self.node_runs[at][1] if at >= 0 else -1

    def same_node(self, a: int, b: int) -> bool:
        node = self.node(a)
        return node >= 0 and node == self.node(b)

    def layout(self, reader: int) -> tuple[list[SharedItem], dict[SharedItem, int]]:
        """The items `reader` reads, in order, and where each lies in its payload."""
        return _end_to_end([item for item in self.items if item.reader == reader])

    def relay_layout(self, rank: int) -> tuple[list[SharedItem], dict[SharedItem, int]]:
        """The items `rank` relays to its node, in order, and where each lies in its relay file."""
        return _end_to_end(self.relayed(rank))

    def reads_itself(self, rank: int, reader: int) -> bool:
        """Whether `rank` reads the items of `reader` from storage itself: the ranks of one node
        read a file system through the node's page cache, which reads the storage once for them
        all (each rank copying from the cache is cheaper than any hand-over; it does not check
        again what the reader says it verified)."""
        return self.page_cache and rank != reader and self.same_node(rank, reader)

    def local_receivers(self, reader: int) -> bool:
        if self.page_cache:
            return False
        sets = {id(item.members): item.members for item in self.items if item.reader == reader}
        return any(m != reader and self.same_node(m, reader) for members in sets.values() for m in members)

    def rounds(self) -> list[tuple[Ranks, int, list[SharedItem]]]:
        """(members, reader, its items) in the order every rank runs them (the items' order)."""
        grouped: dict[tuple[int, int], list[SharedItem]] = {}  # by (the set's object, reader): one object per set
        for item in self.items:
            grouped.setdefault((id(item.members), item.reader), []).append(item)
        return [(items[0].members, items[0].reader, items) for items in grouped.values()]

    def relay(self, members: Ranks, reader: int, rank: int) -> Optional[int]:
        """The rank of `rank`'s node that receives the round's items (`members`, `reader`) from
        the reader's node for the ranks of its own node, which then map them from its /dev/shm
        file: a node receives them once, not once per rank. None: `rank` receives its own (the
        reader's node, a rank without shared memory, or the node's only member). The node's
        members take turns by the reader's place among `members` (readers are spread over them)."""
        node = self.node(rank)
        if node < 0 or node == self.node(reader):
            return None
        on_node = self.node_members(members, node)
        return on_node[_place(members, reader) % len(on_node)] if len(on_node) >= 2 else None

    def relayed(self, rank: int) -> list[SharedItem]:
        """The items `rank` relays to its node, in the order they lie in its relay file (the
        order of the rounds, in which it receives them)."""
        return [item for members, reader, items in self.rounds()
                if rank in members and self.relay(members, reader, rank) == rank for item in items]

    def node_members(self, members: Ranks, node: int) -> list[int]:
        """The ranks of `members` on `node`: O(the node's runs of ranks), not O(members)."""
        out: list[int] = []
        for lo, hi in self._spans_of_nodes.get(node, ()):
            if isinstance(members, range):  # (a step > 0: `_compact`)
                first = max(0, -(-(lo - members.start) // members.step))
                last = min(len(members), max(0, -(-(hi - members.start) // members.step)))
                out.extend(members[first:last])
            else:  # (sorted)
                out.extend(members[bisect.bisect_left(members, lo):bisect.bisect_left(members, hi)])
        return out

    @cached_property
    def _spans_of_nodes(self) -> dict[int, list[tuple[int, int]]]:
        """node -> its runs of ranks as [first, end) (the last run ends past any rank)."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for at, (first, node) in enumerate(self.node_runs):
            end = self.node_runs[at + 1][0] if at + 1 < len(self.node_runs) else sys.maxsize
            spans.setdefault(node, []).append((first, end))
        return spans


@dataclass(frozen=True)
class PlanNote:
    """What each rank's local plan tells the coordinator (`LoadPlan.storage_data`): its node
    (node_share.node_key), a digest of the stored items it reads, so that ranks reading the
    same items (DDP: all of them) are one group, whose items the coordinator goes through once,
    and whether it checks checksums (a sidecar, `checksums=True`): only then may it check an item
    for its node's ranks."""

    node: str
    items_digest: str
    checks: bool = True


def plan_note(plan: LoadPlan, node: str, checks: bool = True) -> PlanNote:
    """This rank's note (computed by every rank, in parallel: O(its items))."""
    keys = sorted((req.storage_index.fqn, tuple(req.storage_index.offset or ())) for req in plan.items)
    return PlanNote(node, hashlib.blake2b(repr(keys).encode(), digest_size=16).hexdigest(), checks)


def assign_shared_reads(plans: list[LoadPlan], metadata: Metadata, budget: int = SHARED_BYTES_MAX,
                        page_cache: bool = False) -> list[LoadPlan]:
    """Every rank's plan with the shared reads attached (unchanged when no item is read twice).
    Ranks whose notes say they read the same items are one group, whose items are gone through
    once; then O(log ranks) per item: at 16,384 DDP ranks the coordinator does no ranks x items
    work (DCP's gather of the plans does it once already). `page_cache`: the checkpoint is on a
    file system, whose page cache the ranks of a node share (`ReadShares.reads_itself`): an item
    only ranks of one node read is not shared: each reads it, one of them checks it (`checked`;
    where every rank checks checksums, else each checks its own)."""
    infos = metadata.storage_data
    shares = ReadShares((), _node_runs(plans), uuid.uuid4().hex[:12], page_cache)
    one_check = all(not isinstance(p.storage_data, PlanNote) or p.storage_data.checks for p in plans)
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
    through_cache: dict[tuple[int, ...], bool] = {}  # per set: its ranks read through one page cache
    shared: list[SharedItem] = []
    checked: list[SharedItem] = []
    held = 0
    for (path, offset, length), readers in sorted(readers_of.items(), key=lambda kv: -kv[0][2]):
        members = tuple(readers[0]) if len(readers) == 1 else tuple(sorted(r for ranks in readers for r in ranks))
        if len(members) < 2:
            continue
        if members not in sets:
            through_cache[members] = page_cache and _one_node(members, shares)
            sets[members] = _compact(members)
            heaps[members] = [(load.get(r, 0), r) for r in members]
            heapq.heapify(heaps[members])
        if (not through_cache[members] and held + length > budget) or (through_cache[members] and not one_check):
            continue  # (read, and checked, by every rank that needs it)
        reader = _least_loaded(heaps[members], load)  # spread: ~1/k of the bytes each
        load[reader] = load.get(reader, 0) + length
        heapq.heappush(heaps[members], (load[reader], reader))
        item = SharedItem(path, offset, length, reader, sets[members])
        if through_cache[members]:
            checked.append(item)  # they read it through their page cache; `reader` checks it
        else:
            held += length
            shared.append(item)
    if not shared and not checked:
        return plans
    in_order = lambda items: tuple(sorted(items, key=lambda s: (s.relative_path, s.offset)))  # noqa: E731
    shares = replace(shares, items=in_order(shared), checked=in_order(checked))
    return [replace(plan, storage_data=shares) for plan in plans]


def _end_to_end(items: list[SharedItem]) -> tuple[list[SharedItem], dict[SharedItem, int]]:
    """`items` and where each begins when they are laid end to end in one file."""
    at, where = 0, {}
    for item in items:
        where[item] = at
        at += item.length
    return items, where


def _place(members: Ranks, rank: int) -> int:
    """Where `rank` is among `members` (sorted)."""
    if isinstance(members, range):
        return (rank - members.start) // members.step
    return bisect.bisect_left(members, rank)


def _one_node(members: tuple[int, ...], shares: ReadShares) -> bool:
    return all(shares.same_node(members[0], m) for m in members[1:])


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
