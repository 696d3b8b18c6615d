"""A restart's copies from other nodes (CheckpointConfig(memory_replicas=R)): before the memory
tier decides (loading/memory_tier.py), every rank lists the complete copies its node's
`memory_dir` holds, the ranks gather the lists (one all_gather, no per-tensor traffic) and choose
the newest save for which every rank's copy is on some node; each node then pulls the copies of
that save it lacks, split among its ranks, from the ranks of nodes that hold them (each rank
serves its node's files meanwhile; replica_wire.py has the wire). Then the tier decides from the
files as on one node: the same history rule, the same checks, the disk when anything is missing.

A node that lacks a copy pulls it whole, so a restored node's `memory_dir` holds every rank's
copy of the save, as one node's does (pulling only the items its ranks read is a later step).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Hashable, Optional

from ..memory_file import NotACopy, memory_file_name, root_key
from ..replica_wire import Address, CopyServer, Expected, ReplicaError, listener, pull

log = logging.getLogger("asyncckpt")


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


SaveKey = tuple  # (step, token, root_id, base): what makes two ranks' copies one save


def fill_from_peers(memory_dir: str, key: str, group: Any, peers: Peers, wait_s: float,
                    read: Any) -> tuple[PulledCopy, ...]:
    """Pull into this node's `memory_dir` the copies of the newest save that every rank's copy
    exists of somewhere and this node lacks (see the module's docstring); what every rank pulled.
    `read(path, deadline)`: a copy read as the tier reads it (waiting while its worker seals it)."""
    root = root_key(key)
    expected = Expected(memory_dir, root, group.size, lambda rank: memory_file_name(key, rank))
    held = _inventory(expected, group.size, time.monotonic() + wait_s, read)
    server = CopyServer(listener(peers.host), peers.secret, expected, put=False, get=True,
                        timeout_s=peers.timeout_s).start()
    try:
        seen = group.all_gather((held, server.address))
        wanted = _newest_whole(seen, group.size)
        pulled: list[PulledCopy] = []
        problems: list[str] = []
        if wanted is not None:
            for rank in _my_share(seen, peers.nodes, group.rank, wanted):
                done = _pull_one(rank, wanted, seen, peers, expected, group.rank)
                (pulled if isinstance(done, PulledCopy) else problems).append(done)
        everyone = group.all_gather((pulled, problems))  # also: every server stays up until all are done
    finally:
        server.stop()
    for problem in (p for _, problems in everyone for p in problems):
        log.warning("memory tier: %s", problem)
    result = tuple(copy for pulled, _ in everyone for copy in pulled)
    if result and group.is_coordinator:
        log.info("memory tier: pulled %d copies of step %s from other nodes (%.1f MiB)", len(result), wanted[0],
                 sum(c.nbytes for c in result) / 2**20)
    return result


def _inventory(expected: Expected, world_size: int, deadline: float, read: Any) -> dict[int, SaveKey]:
    """rank -> the save its complete copy in this node's directory holds (this tier's, this world size)."""
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
            held[rank] = (copy.step, copy.token, copy.root_id, copy.base_step, copy.base_token)
    return held


def _newest_whole(seen: list[tuple[dict[int, SaveKey], Any]], world_size: int) -> Optional[SaveKey]:
    """The newest save whose every rank's copy some node holds; None if there is none."""
    covered: dict[SaveKey, set[int]] = {}
    for held, _ in seen:
        for rank, save in held.items():
            covered.setdefault(save, set()).add(rank)
    whole = [save for save, ranks in covered.items() if len(ranks) == world_size]
    return max(whole, key=lambda save: save[0]) if whole else None


def _my_share(seen: list[tuple[dict[int, SaveKey], Any]], nodes: tuple, me: int, wanted: SaveKey) -> list[int]:
    """The copies of `wanted` this node lacks, split among its ranks: this rank's part."""
    mine = [rank for rank, node in enumerate(nodes) if node == nodes[me]]
    here = {rank for q in mine for rank, save in seen[q][0].items() if save == wanted}
    lacking = [rank for rank in range(len(nodes)) if rank not in here]
    return lacking[mine.index(me)::len(mine)]


def _pull_one(rank: int, wanted: SaveKey, seen: list, peers: Peers, expected: Expected, me: int) -> PulledCopy | str:
    holders = [q for q, (held, _) in enumerate(seen) if held.get(rank) == wanted and peers.nodes[q] != peers.nodes[me]]
    holders = holders[rank % len(holders):] + holders[:rank % len(holders)] if holders else []  # spread the load
    reasons = []
    for q in holders:
        host, port = seen[q][1]
        try:
            nbytes = pull(Address(host, port), peers.secret, expected, rank, wanted[1], peers.timeout_s)
        except ReplicaError as exc:
            reasons.append(f"from rank {q}: {exc}")
            continue
        return PulledCopy(rank, me, peers.nodes[q], nbytes)
    return f"rank {me} could not pull rank {rank}'s copy of step {wanted[0]}: {'; '.join(reasons) or 'no holder'}"
