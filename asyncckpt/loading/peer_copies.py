"""A restart's copies on other nodes (CheckpointConfig(memory_replicas=R)): before the memory
tier decides (loading/memory_tier.py), every rank lists the complete copies its node's
`memory_dir` holds, the ranks gather the lists (one all_gather, no per-tensor traffic) and choose
the newest save for which every rank's copy is on some node. The headers of that save's copies
(one per rank, from a node that holds it) are gathered next, and each rank serves its node's
files meanwhile (replica_server.py). The tier then decides from the gathered headers as on one
node: the same history rule; the disk when anything is missing. Its load reads the copies this
node lacks from their holders, straight into the targets (peer_source.PeerFiles): only the bytes
this rank's state needs, checked as they land, nothing written here.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Hashable, Optional

from ..memory_file import MemoryCopy, NotACopy, memory_file_name, root_key
from ..replica_server import CopyServer
from ..replica_wire import Address, Expected, listener
from .peer_source import Holder, RemoteCopy

log = logging.getLogger("asyncckpt")


@dataclass(frozen=True)
class Peers:
    """What a restart needs to reach the other nodes' copies."""

    secret: bytes
    nodes: tuple[Hashable, ...]  # every rank's node
    host: str  # this rank's address for them
    timeout_s: float


SaveKey = tuple  # (step, token, root_id, base): what makes two ranks' copies one save


@dataclass(frozen=True)
class PeerCopies:
    """The save every rank's copy of exists of somewhere: its copies (rank order, named as this
    node's files), those this node lacks (by that name) and who holds them, and this rank's
    server of its node's copies (stop() once every rank's load is over)."""

    copies: list[MemoryCopy]
    remote: dict[str, RemoteCopy]
    server: Optional[CopyServer]

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def find_on_peers(memory_dir: str, key: str, group: Any, peers: Peers, wait_s: float,
                  read: Any) -> Optional[PeerCopies]:
    """The newest save that every rank's copy exists of somewhere (see the module's docstring);
    None when there is none. `read(path, deadline)`: a copy read as the tier reads it (waiting
    while its worker seals it)."""
    root = root_key(key)
    expected = Expected(memory_dir, root, group.size, lambda rank: memory_file_name(key, rank))
    held = _inventory(expected, group.size, time.monotonic() + wait_s, read)
    try:  # (a rank that cannot serve still takes part: the others read from other holders)
        server: Optional[CopyServer] = CopyServer(listener(peers.host), peers.secret, expected, put=False, get=True,
                                                  timeout_s=peers.timeout_s).start()
    except OSError as exc:
        log.warning("memory tier: rank %d cannot serve its node's copies to a restart: %s", group.rank, exc)
        server = None
    try:
        seen = group.all_gather(({rank: _save(copy) for rank, copy in held.items()},
                                 server.address if server is not None else None))
        wanted = _newest_whole(seen, group.size)  # (the same on every rank: from what all saw)
        headers = None if wanted is None else group.all_gather(
            {rank: copy for rank, copy in held.items() if _designated(seen, rank, wanted) == group.rank})
    except BaseException:
        if server is not None:
            server.stop()
        raise
    if headers is None:
        if server is not None:
            server.stop()
        return None
    copies = [dataclasses.replace(next(h[rank] for h in headers if rank in h), path=expected.path_of(rank))  # each once
              for rank in range(group.size)]
    here = {rank for rank, copy in held.items() if _save(copy) == wanted}
    remote = {expected.path_of(rank): RemoteCopy(rank, wanted[1], _holders(seen, peers, rank, wanted, group.rank))
              for rank in range(group.size) if rank not in here}
    return PeerCopies(copies, remote, server)


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


def _holders(seen: list, peers: Peers, rank: int, wanted: SaveKey, me: int) -> tuple[Holder, ...]:
    """The ranks of other nodes that hold `rank`'s copy of `wanted` and serve it, in the order `me`
    tries them: the nodes taken in turn (one rank of each, then the next of each), rotated by
    `me`, so that the ranks of a node spread their reads over the holding nodes and their ranks."""
    by_node: dict[Hashable, list[Holder]] = {}
    for q, (held, address) in enumerate(seen):
        if held.get(rank) == wanted and address is not None and peers.nodes[q] != peers.nodes[me]:
            by_node.setdefault(peers.nodes[q], []).append(Holder(q, peers.nodes[q], Address(*address)))
    holders = [h for turn in itertools.zip_longest(*by_node.values()) for h in turn if h is not None]
    turn = me % len(holders) if holders else 0
    return tuple(holders[turn:] + holders[:turn])
