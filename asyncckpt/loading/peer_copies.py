"""A restart's copies from other nodes (CheckpointConfig(memory_replicas=R)): before the memory
tier decides (loading/memory_tier.py), every rank lists the complete copies its node's
`memory_dir` holds, the ranks gather the lists (one all_gather, no per-tensor traffic) and choose
the newest save for which every rank's copy is on some node. The headers of that save's copies
(one per rank, from a node that holds it) are gathered next: from them and its own state's keys
each rank knows which copies its load reads (its own; another rank's where that one saved an
entry this rank holds and did not save itself, as a replicated tensor saved once). Each node pulls
those it lacks, split among its ranks, from the ranks of nodes that hold them (each rank serves
its node's files meanwhile; replica_wire.py has the wire, and checks every item's CRC32C on
receipt, so the load does not check those files again). The tier then decides from the gathered
headers as on one node: the same history rule; the disk when anything is missing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Hashable, Optional

from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ..memory_file import MemoryCopy, NotACopy, StoredItem, memory_file_name, root_key
from ..replica_server import CopyServer
from ..replica_wire import Address, Expected, ReplicaError, listener, pull, pull_items
from .completeness import expand_statefuls
from .memory_plan import rebuild_metadata

log = logging.getLogger("asyncckpt")

PULLS_AT_ONCE = 4  # copies one rank pulls at a time (each from its own holder, when it can)


@dataclass(frozen=True)
class Peers:
    """What a restart needs to reach the other nodes' copies."""

    secret: bytes
    nodes: tuple[Hashable, ...]  # every rank's node
    host: str  # this rank's address for them
    timeout_s: float


@dataclass(frozen=True)
class PulledCopy:
    """One copy a restart fetched from another node."""

    rank: int  # whose copy
    into: int  # the rank that pulled it (its node keeps it)
    node: Any  # the node that served it
    nbytes: int
    path: str  # where it is on the node that pulled it
    whole: bool = True  # False: only the items that node's ranks read (a file removed after the restart)


SaveKey = tuple  # (step, token, root_id, base): what makes two ranks' copies one save


@dataclass(frozen=True)
class PeerCopies:
    """The save every rank's copy of exists of somewhere, its copies (rank order, as this node's
    files: those its load reads are here), and what was pulled (by every rank)."""

    copies: list[MemoryCopy]
    pulled: tuple[PulledCopy, ...]
    verified: frozenset[str]  # the files this node pulled: every item received was CRC-checked on receipt
    partial: tuple[str, ...]  # the files of items this rank pulled: removed once every rank has loaded

    def remove_partial(self, group: Any) -> None:
        """After the restore: remove the files of items this rank pulled (once every rank is done)."""
        group.all_gather(None)
        for path in self.partial:
            try:
                os.unlink(path)
            except OSError:
                pass


def fill_from_peers(memory_dir: str, key: str, group: Any, peers: Peers, wait_s: float, read: Any,
                    state_dict: dict[str, Any]) -> Optional[PeerCopies]:
    """Pull into this node's `memory_dir` the copies its ranks read of the newest save that every
    rank's copy exists of somewhere (see the module's docstring); None when there is no such save.
    `read(path, deadline)`: a copy read as the tier reads it (waiting while its worker seals it)."""
    root = root_key(key)
    expected = Expected(memory_dir, root, group.size, lambda rank: memory_file_name(key, rank))
    held = _inventory(expected, group.size, time.monotonic() + wait_s, read)
    try:  # (a rank that cannot serve still takes part: the others pull from other holders)
        server: Optional[CopyServer] = CopyServer(listener(peers.host), peers.secret, expected, put=False, get=True,
                                                  timeout_s=peers.timeout_s).start()
    except OSError as exc:
        log.warning("memory tier: rank %d cannot serve its node's copies to a restart: %s", group.rank, exc)
        server = None
    try:
        seen = group.all_gather(({rank: _save(copy) for rank, copy in held.items()},
                                 server.address if server is not None else None))
        wanted = _newest_whole(seen, group.size)
        if wanted is None:
            return None
        headers = group.all_gather({rank: copy for rank, copy in held.items()  # each once, from its first holder
                                    if _designated(seen, rank, wanted) == group.rank})
        copies = [dataclasses.replace(next(h[rank] for h in headers if rank in h), path=expected.path_of(rank))
                  for rank in range(group.size)]
        needs = group.all_gather(_reads(copies, group.rank, state_dict))
        pulled: list[PulledCopy] = []
        problems: list[str] = []
        share = _my_share(seen, peers.nodes, group.rank, wanted, needs)

        def pull_one(part: tuple[int, Optional[list[int]]]) -> PulledCopy | str:
            rank, items = part
            return _pull_one(rank, None if items is None else [copies[rank].items[i] for i in items], wanted, seen,
                             peers, expected, group.rank)

        with ThreadPoolExecutor(max_workers=max(1, min(len(share), PULLS_AT_ONCE))) as pool:  # the sources differ
            for done in pool.map(pull_one, share):
                (pulled if isinstance(done, PulledCopy) else problems).append(done)
        everyone = group.all_gather((pulled, problems))  # also: every server stays up until all are done
    finally:
        if server is not None:
            server.stop()
    for problem in (p for _, problems in everyone for p in problems):
        log.warning("memory tier: %s", problem)
    result = tuple(copy for pulled, _ in everyone for copy in pulled)
    if result and group.is_coordinator:
        log.info("memory tier: pulled %d copies of step %s from other nodes, %d whole (%.1f MiB)", len(result),
                 wanted[0], sum(c.whole for c in result), sum(c.nbytes for c in result) / 2**20)
    here = [c for c in result if peers.nodes[c.into] == peers.nodes[group.rank]]
    for c in here:  # this node's file of that rank's copy: the items pulled, where only those were
        if not c.whole:
            copies[c.rank] = dataclasses.replace(copies[c.rank], path=c.path)
    return PeerCopies(copies, result, frozenset(os.path.basename(c.path) for c in here),
                      tuple(c.path for c in here if not c.whole and c.into == group.rank))


def _inventory(expected: Expected, world_size: int, deadline: float, read: Any) -> dict[int, MemoryCopy]:
    """rank -> its complete copy in this node's directory (this tier's, this world size)."""
    held = {}
    for rank in range(world_size):
        path = expected.path_of(rank)
        if not os.path.exists(path):
            continue
        try:
            copy = read(path, deadline)
        except NotACopy:
            continue
        if copy.root == expected.root and copy.rank == rank and copy.world_size == world_size:
            held[rank] = copy
    return held


def _save(copy: MemoryCopy) -> SaveKey:
    return (copy.step, copy.token, copy.root_id, copy.base_step, copy.base_token)


def _newest_whole(seen: list[tuple[dict[int, SaveKey], Any]], world_size: int) -> Optional[SaveKey]:
    """The newest save whose every rank's copy some node holds; None if there is none."""
    covered: dict[SaveKey, set[int]] = {}
    for held, _ in seen:
        for rank, save in held.items():
            covered.setdefault(save, set()).add(rank)
    whole = [save for save, ranks in covered.items() if len(ranks) == world_size]
    return max(whole, key=lambda save: save[0]) if whole else None


def _designated(seen: list, rank: int, wanted: SaveKey) -> int:
    """The rank that sends the header of `rank`'s copy of `wanted`: the first that holds one."""
    return next(q for q, (held, _) in enumerate(seen) if held.get(rank) == wanted)


def _reads(copies: list[MemoryCopy], me: int, state_dict: dict[str, Any]) -> dict[int, Optional[list[int]]]:
    """What this rank's load reads of each copy: its own whole (None), and of another rank's the
    items of entries this rank's state holds and its own copy lacks (a replicated tensor or object
    saved once), by their index in that copy; whole where that is most of it. The same world size
    and layout as the save (else the disk): a sharded entry this rank saved a piece of is read from
    its own copy. Every copy whole when the state cannot be listed."""
    try:
        keys = set(flatten_state_dict(expand_statefuls(state_dict))[0])
        metadata, _ = rebuild_metadata(copies)
    except Exception:
        return {rank: None for rank in range(len(copies))}
    names = {os.path.basename(copy.path): rank for rank, copy in enumerate(copies)}
    own_name = os.path.basename(copies[me].path)
    own = {index.fqn for index, info in metadata.storage_data.items() if info.relative_path == own_name}
    places = [{item.at: n for n, item in enumerate(copy.items)} for copy in copies]
    wanted: dict[int, set[int]] = {}
    for index, info in metadata.storage_data.items():
        rank = names[info.relative_path]
        if rank != me and index.fqn in keys and index.fqn not in own:
            wanted.setdefault(rank, set()).add(places[rank][info.offset])
    reads: dict[int, Optional[list[int]]] = {me: None}
    for rank, items in wanted.items():
        total = sum(item.length for item in copies[rank].items)
        part = sum(copies[rank].items[n].length for n in items)
        reads[rank] = None if part * 2 >= total else sorted(items)
    return reads


def _my_share(seen: list, nodes: tuple, me: int, wanted: SaveKey,
              needs: list[dict[int, Optional[list[int]]]]) -> list[tuple[int, Optional[list[int]]]]:
    """What the ranks of this node read of the copies of `wanted` it lacks (whole, None, or item
    indices: the union of theirs), split among them: this rank's part."""
    mine = [rank for rank, node in enumerate(nodes) if node == nodes[me]]
    here = {rank for q in mine for rank, save in seen[q][0].items() if save == wanted}
    merged: dict[int, Optional[set[int]]] = {}
    for q in mine:
        for rank, items in needs[q].items():
            if rank in here:
                continue
            if items is None or (rank in merged and merged[rank] is None):
                merged[rank] = None
            else:
                merged[rank] = (merged.get(rank) or set()) | set(items)
    parts = [(rank, None if items is None else sorted(items)) for rank, items in sorted(merged.items())]
    return parts[mine.index(me)::len(mine)]


def _pull_one(rank: int, items: Optional[list[StoredItem]], wanted: SaveKey, seen: list, peers: Peers,
              expected: Expected, me: int) -> PulledCopy | str:
    """Pull rank `rank`'s copy of `wanted` (whole, or only `items`) from a rank of another node
    that holds it, trying the next holder when one fails; the PulledCopy, or why not."""
    holders = [q for q, (held, address) in enumerate(seen)
               if held.get(rank) == wanted and address is not None and peers.nodes[q] != peers.nodes[me]]
    holders = holders[rank % len(holders):] + holders[:rank % len(holders)] if holders else []  # spread the load
    reasons = []
    for q in holders:
        address = Address(*seen[q][1])
        try:
            if items is None:
                nbytes = pull(address, peers.secret, expected, rank, wanted[1], peers.timeout_s)
                return PulledCopy(rank, me, peers.nodes[q], nbytes, expected.path_of(rank))
            path = os.path.join(expected.directory, f".{expected.name_of(rank)}.items-{wanted[1][:12]}-{me}")
            nbytes = pull_items(address, peers.secret, rank, wanted[1], items, path, peers.timeout_s)
            return PulledCopy(rank, me, peers.nodes[q], nbytes, path, whole=False)
        except (ReplicaError, OSError) as exc:  # (OSError: this node's side, e.g. a full memory_dir)
            reasons.append(f"from rank {q}: {exc}")
    return f"rank {me} could not pull rank {rank}'s copy of step {wanted[0]}: {'; '.join(reasons) or 'no holder'}"
