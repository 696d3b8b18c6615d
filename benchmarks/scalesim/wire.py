"""The collectives of N ranks replaced by their inputs and outputs, for the coordinator's code.

`SimulatedGroup` stands in for `asyncckpt.save.ranks.RankGroup` (and for DCP's `_DistWrapper`)
on rank 0: a gather returns the coordinator's own object and what the other ranks sent (given as
the bytes they pickled, outside the timing); the coordinator's own work on them (unpickling every
message, pickling its replies) is real. It counts the bytes that torch.distributed's object
collectives move, as they move them (distributed_c10d.py, torch 2.13):
- gather_object: an all-gather of every rank's message size (8 bytes each, to every rank), then
  every message padded to the largest one: the coordinator receives ranks x largest;
- scatter_object_list: the largest reply's size broadcast, every reply padded to it;
- broadcast_object_list: a size, then the pickled object, to every rank;
- all_reduce of an int64 tensor (RankGroup.agree): its bytes to and from every rank.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Optional, Sequence

SIZE_BYTES = 8  # one int64 per message size


@dataclass
class Traffic:
    """Bytes per save: what a typical other rank (rank 1) sends and receives, what the
    coordinator receives."""

    rank_sent: int = 0
    rank_received: int = 0
    coordinator_received: int = 0

    def add(self, other: "Traffic") -> None:
        self.rank_sent += other.rank_sent
        self.rank_received += other.rank_received
        self.coordinator_received += other.coordinator_received


class SimulatedGroup:
    """RankGroup's interface for rank `rank` of `size`. Before each gather, `inbox` holds what
    ranks 1..size-1 pickled; after a scatter, `replies` holds every rank's reply."""

    def __init__(self, size: int, rank: int = 0, reply: Any = None) -> None:
        self.size, self.rank = size, rank
        self.collectives = 0
        self.traffic = Traffic()
        self.inbox: Sequence[bytes] = ()
        self.replies: Optional[list[Any]] = None
        self._reply = reply  # what a non-coordinator's scatter returns

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def agree(self, flags: Sequence[int], what: str, step: int) -> list[int]:
        """Every rank brings the same flags (an unchanged plan, no failure)."""
        self.collectives += 1
        nbytes = (6 + len(flags)) * 8  # RankGroup.agree: call, kind and step as (x, -x), then the flags
        self.traffic.add(Traffic(nbytes, nbytes, nbytes))
        return list(flags)

    def agree_finished(self, pending: bool, blocking: bool, step: int, bound_s: float) -> tuple[bool, bool]:
        self.agree([int(pending), 0], "finalize", step)
        return False, False

    def gather(self, obj: Any) -> Optional[list[Any]]:
        self.collectives += 1
        if not self.is_coordinator:  # (its bytes are counted on the coordinator's group)
            return None
        mine = pickle.dumps(obj)
        sizes = [len(mine)] + [len(blob) for blob in self.inbox]
        if len(sizes) != self.size:
            raise ValueError(f"gather: {len(sizes)} messages for {self.size} ranks")
        largest = max(sizes)
        self.traffic.add(Traffic(rank_sent=largest + SIZE_BYTES, rank_received=SIZE_BYTES * self.size,
                            coordinator_received=(largest + SIZE_BYTES) * (self.size - 1)))
        return [pickle.loads(mine)] + [pickle.loads(blob) for blob in self.inbox]

    def scatter(self, objs: Optional[list[Any]]) -> Any:
        self.collectives += 1
        if not self.is_coordinator:
            return self._reply
        blobs = [pickle.dumps(o) for o in objs]
        self.traffic.add(Traffic(rank_received=max(map(len, blobs)) + SIZE_BYTES))
        self.replies = objs
        return pickle.loads(blobs[0])

    def broadcast(self, obj: Any) -> Any:
        self.collectives += 1
        if self.is_coordinator:
            self.traffic.add(Traffic(rank_received=len(pickle.dumps(obj)) + SIZE_BYTES))
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        raise NotImplementedError("no asyncckpt save or commit path all-gathers objects")

    def take_traffic(self) -> Traffic:
        """The bytes counted since the last call."""
        traffic, self.traffic = self.traffic, Traffic()
        return traffic
