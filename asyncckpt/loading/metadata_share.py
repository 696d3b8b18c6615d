"""Resume at scale: the `.metadata` and sidecar bytes one rank read reach the others a node at a
time, not a rank at a time.

A plain gloo broadcast hands every rank its own copy over TCP: with 8 ranks a node, a node
receives the bytes 8 times (a 3.5 GiB `.metadata` of 70B FSDP at 16,384 ranks: 57 TB through
the network), and inside a node loopback TCP costs several copies a byte. Here the reading rank
sends them to one rank of each other node (the node's first rank, its "leader"), leader to
leader along a binomial tree (point to point over the load's group: no subgroup to make, each
leader sends at most log2(nodes) times); each leader puts them in one file under /dev/shm
(node_share.MemoryPayload) and the ranks of its node map that file. An all-gather of a few
numbers per rank tells every rank where its leader's file is, then an all-reduce of one that
every rank holds its bytes (the leaders then remove their files). Where a leader's /dev/shm has no room (Docker's 64 MiB) or a rank cannot
map its leader's file, every rank gets the bytes through the plain broadcast instead.

Nodes are node_share.node_key's (one boot of a machine seen through one /dev/shm). Where every
rank is a node of its own there is nothing to share in memory: the plain broadcast.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from . import node_share
from .node_share import MemoryPayload, open_payload, payload_name

log = logging.getLogger(__name__)

Blobs = list[Optional[bytes]]


@dataclass(frozen=True)
class Nodes:
    """The ranks of a load's group by node: each node's first rank (its leader), in rank order."""

    leaders: tuple[int, ...]  # group ranks; leaders[0] is rank 0, the reader
    leader_of: tuple[int, ...]  # group rank -> the group rank of its node's leader

    @property
    def shared(self) -> bool:
        """Whether some node holds more than one rank (else nothing is shared in memory)."""
        return len(self.leaders) < len(self.leader_of)


def nodes_of(keys: Sequence[str]) -> Nodes:
    """`keys`: each group rank's node key ("" = a node of its own: no /dev/shm to share)."""
    first: dict[str, int] = {}
    leader_of = []
    for rank, key in enumerate(keys):
        leader_of.append(first.setdefault(key, rank) if key else rank)
    return Nodes(tuple(sorted(set(leader_of))), tuple(leader_of))


def tree_children(index: int, count: int) -> list[int]:
    """The leaders (indices into `leaders`) that leader `index` sends to, in order: a binomial
    tree rooted at 0, so that every leader receives once and the bytes cross log2(count) hops."""
    children = []
    step = 1
    while step <= index:
        step <<= 1
    while index + step < count:
        children.append(index + step)
        step <<= 1
    return children


def tree_parent(index: int) -> int:
    """The leader that sends to leader `index` (> 0): `index` without its highest set bit."""
    return index - (1 << (index.bit_length() - 1))


@dataclass(frozen=True)
class Placed:
    """Where a leader put the bytes for its node (a leader with no room there tells None instead):
    the file `_place` made (its name from the leader's rank, process and a random token)."""

    rank: int
    pid: int
    token: int
    lengths: tuple[int, ...]

    @property
    def path(self) -> str:
        return payload_name(f"meta{self.token:08x}", self.rank, self.pid)


def spread_blobs(blobs: Optional[Blobs], count: int, group, what: str, keys: Sequence[str],
                 broadcast: Callable[[Optional[Blobs], int, object, str], Blobs]) -> Blobs:
    """The reading rank's `count` blobs on every rank of `group` (a collective: every rank calls
    it), a node at a time (above). `keys`: every rank's node key. `broadcast`: the plain one."""
    nodes = nodes_of(keys)
    if not nodes.shared:
        return broadcast(blobs, count, group, what)
    leader = nodes.leader_of[group.rank]
    ranks_of = Counter(nodes.leader_of)
    sharing = [r for r in nodes.leaders if ranks_of[r] > 1]  # leaders of nodes of several ranks
    payload: Optional[MemoryPayload] = None
    here: Optional[Placed] = None
    try:
        if leader == group.rank:
            blobs = _along_the_tree(blobs, count, group, nodes, what)
            if group.rank in sharing:
                here = Placed(group.rank, os.getpid(), secrets.randbits(32), blob_lengths(blobs))
                payload = _place(blobs, here)
        placed = _all_gather_placed(group, here if payload is not None else None, count, what)
        if any(placed[r] is None for r in sharing):
            mine = None  # (a node has no room: every rank takes the plain broadcast below)
        elif leader == group.rank:
            mine = blobs
        else:
            mine = _mapped(placed[leader])
        held = _every_rank(group, mine is not None, what)
    finally:
        if payload is not None:
            payload.remove()  # (every rank holds its bytes, or goes by the broadcast; mappings stay valid)
    if held:
        log.debug("%s: shared through /dev/shm by %d node(s)", what, len(nodes.leaders))
        return mine
    log.debug("%s: a node could not share through /dev/shm; every rank gets the broadcast", what)
    return broadcast(blobs if group.is_reader else None, count, group, what)


def _along_the_tree(blobs: Optional[Blobs], count: int, group, nodes: Nodes, what: str) -> Blobs:
    """A leader's blobs: the reader's own, or received from its parent leader; then sent on to
    its children."""
    index = nodes.leaders.index(group.rank)
    global_rank = lambda rank: dist.get_global_rank(group.pg, rank)  # noqa: E731
    if index > 0:
        parent = global_rank(nodes.leaders[tree_parent(index)])
        lengths = torch.empty(count, dtype=torch.int64)
        _p2p(lambda: dist.recv(lengths, src=parent, group=group.pg), what, parent)
        payload = torch.empty(max(int(lengths.clamp(min=0).sum()), 1), dtype=torch.uint8)
        if int(lengths.clamp(min=0).sum()):
            _p2p(lambda: dist.recv(payload, src=parent, group=group.pg), what, parent)
        blobs = cut_blobs(memoryview(payload.numpy()), lengths.tolist())
    children = [global_rank(nodes.leaders[c]) for c in tree_children(index, len(nodes.leaders))]
    if children:
        lengths = torch.tensor(blob_lengths(blobs), dtype=torch.int64)
        payload = joined_blobs(blobs)
        for child in children:
            _p2p(lambda: dist.send(lengths, dst=child, group=group.pg), what, child)
            if int(lengths.clamp(min=0).sum()):
                _p2p(lambda: dist.send(payload, dst=child, group=group.pg), what, child)
    return blobs


def _p2p(run: Callable[[], object], what: str, peer: int) -> None:
    try:
        run()
    except Exception as exc:  # gloo: a peer gone, or the group's timeout
        raise CheckpointError(f"{what}: passing it on with rank {peer} failed ({type(exc).__name__}: {exc})") from None


def _all_gather_placed(group, mine: Optional[Placed], count: int, what: str) -> list[Optional[Placed]]:
    """Every rank's `Placed` (None: it placed nothing), in one all-gather of a few numbers each
    (4 gloo ranks here: 4.5 ms, against 9.5 ms for an all-gather of small objects)."""
    row = [1, mine.pid, mine.token, *mine.lengths] if mine is not None else [0] * (3 + count)
    rows = [torch.empty(3 + count, dtype=torch.int64) for _ in range(group.size)]
    try:
        dist.all_gather(rows, torch.tensor(row, dtype=torch.int64), group=group.pg)
    except Exception as exc:
        raise CheckpointError(f"{what}: sharing it inside the nodes failed ({type(exc).__name__}: {exc})") from None
    return [Placed(rank, int(r[1]), int(r[2]), tuple(r[3:].tolist())) if int(r[0]) else None for rank, r in enumerate(rows)]


def _every_rank(group, flag: bool, what: str) -> bool:
    """Whether `flag` is true on every rank (an all-reduce of one number)."""
    vote = torch.tensor([int(flag)], dtype=torch.int64)
    try:
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group.pg)
    except Exception as exc:
        raise CheckpointError(f"{what}: sharing it inside the nodes failed ({type(exc).__name__}: {exc})") from None
    return bool(vote.item())


def _all_gather(group, mine, what: str) -> list:
    every: list = [None] * group.size
    try:
        dist.all_gather_object(every, mine, group=group.pg)
    except Exception as exc:
        raise CheckpointError(f"{what}: sharing it inside the nodes failed ({type(exc).__name__}: {exc})") from None
    return every


def blob_lengths(blobs: Blobs) -> tuple[int, ...]:
    """Each blob's length, -1 for None (how the blobs travel: their lengths, then their bytes)."""
    return tuple(-1 if b is None else len(b) for b in blobs)


def joined_blobs(blobs: Blobs) -> torch.Tensor:
    """The blobs' bytes one after another, as a uint8 tensor to send (one byte if there are none)."""
    return torch.frombuffer(bytearray(b"".join(b for b in blobs if b is not None)) or bytearray(1), dtype=torch.uint8)


def cut_blobs(data: memoryview, lengths: Sequence[int]) -> Blobs:
    """The blobs of `joined_blobs`' bytes, given their `blob_lengths`."""
    out: Blobs = []
    at = 0
    for n in lengths:
        out.append(None if n < 0 else bytes(data[at:at + n]))
        at += max(n, 0)
    return out


def _place(blobs: Blobs, placed: Placed) -> Optional[MemoryPayload]:
    """The blobs one after another in the file under /dev/shm `placed` names (None: no room there)."""
    size = sum(max(n, 0) for n in blob_lengths(blobs))
    payload = MemoryPayload.create(placed.path, size)
    if payload is None:
        return None
    try:
        at = 0
        for blob in blobs:
            if blob:
                payload.view(at, len(blob))[:] = blob
                at += len(blob)
    except BaseException:  # (a Ctrl-C while copying: no file left holding the node's memory)
        payload.remove()
        raise
    return payload


def _mapped(placed: Placed) -> Optional[Blobs]:
    """The blobs of a leader's file (None: it cannot be mapped)."""
    try:
        view = open_payload(placed.path, sum(max(n, 0) for n in placed.lengths))
        try:
            return cut_blobs(view, placed.lengths)
        finally:
            view.release()
    except Exception as exc:  # (not there, short, no memory for the copy: the broadcast instead, no rank waits)
        log.debug("cannot take the bytes of %s: %s", placed.path, exc)
        return None


def node_keys(group) -> list[str]:
    """Every rank's node key (one all-gather), cached per group: nodes do not change."""
    if group.pg not in _keys:
        _keys[group.pg] = _all_gather(group, node_share.node_key(), "finding the ranks' nodes")
    return _keys[group.pg]


_keys: dict = {}
