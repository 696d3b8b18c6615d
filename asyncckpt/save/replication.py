"""Where the memory tier's copies go besides their own node (CheckpointConfig(memory_replicas=R)),
set up once when the checkpointer is built: the job's secret (rank 0 makes it, the process group
hands it out), every rank's node and the address its worker receives copies on (one all_gather),
and the ranks whose workers keep this rank's copies. The worker sends them (worker/replicas.py);
a restart reads what its node lacks from them (loading/peer_copies.py).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from ..config import CheckpointConfig
from ..errors import CheckpointError
from ..loading.peer_copies import Peers
from ..protocol import Replication
from ..replica_wire import listener, new_secret
from .ranks import RankGroup

log = logging.getLogger("asyncckpt")


@dataclass(frozen=True)
class ReplicaSetup:
    replication: Replication  # for the worker
    peers: Peers  # for a restart


def replica_targets(nodes: Sequence[Hashable], rank: int, replicas: int) -> list[int]:
    """The ranks whose workers keep `rank`'s copies: the rank in the same place on each of the
    next `replicas` nodes (nodes in the order of their first rank, in a ring). A node's copies
    then live on R+1 consecutive nodes, so losing any R nodes leaves every copy somewhere, while
    the job has more than R nodes; never a rank of the same node."""
    order = list(dict.fromkeys(nodes))
    mine = order.index(nodes[rank])
    place = [r for r, node in enumerate(nodes) if node == nodes[rank]].index(rank)
    targets = []
    for k in range(1, min(replicas, len(order) - 1) + 1):
        ranks = [r for r, node in enumerate(nodes) if node == order[(mine + k) % len(order)]]
        targets.append(ranks[place % len(ranks)])
    return targets


def set_up(config: CheckpointConfig, group: RankGroup) -> ReplicaSetup:
    """The collective part (every rank calls it from the constructor)."""
    try:
        node: Any = config.node_of(group.rank) if config.node_of is not None else socket.gethostname()
        hash(node)
        host = config.replica_host or _own_address()
        sock = listener(host)
        address = (node, host, sock.getsockname()[1], None)
    except Exception as exc:  # every rank must reach the all_gather
        sock, address = None, (None, None, None, f"rank {group.rank}: {type(exc).__name__}: {exc}")
    secret = group.broadcast(new_secret() if group.is_coordinator else None)
    seen = group.all_gather(address)
    problems = [problem for *_, problem in seen if problem is not None]
    if problems:
        if sock is not None:
            sock.close()
        raise CheckpointError(f"memory_replicas: cannot set up the copies between nodes: {'; '.join(problems[:4])}")
    nodes = tuple(node for node, *_ in seen)
    targets = replica_targets(nodes, group.rank, config.memory_replicas)
    if group.is_coordinator and len(set(nodes)) < 2:
        log.warning("memory_replicas=%d: every rank is on one node (%r); no copy leaves it (CheckpointConfig.node_of "
                    "says which node a rank is on)", config.memory_replicas, nodes[0])
    sources = tuple(r for r in range(group.size) if group.rank in replica_targets(nodes, r, config.memory_replicas))
    log.debug("memory tier: rank %d on node %r keeps the copies of ranks %s and sends its own to ranks %s",
              group.rank, nodes[group.rank], list(sources), targets)
    replication = Replication(secret, sock, tuple((r, seen[r][1], seen[r][2]) for r in targets), sources,
                              config.timeout_s)
    return ReplicaSetup(replication, Peers(secret, nodes, host, config.timeout_s))


def _own_address() -> str:
    """The address other nodes reach this one by: the one this host would send from to the job's
    MASTER_ADDR, else the one its name resolves to."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                return probe.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())
