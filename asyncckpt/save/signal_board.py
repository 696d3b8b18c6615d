"""Several ranks' preemption between saves: a key in the job's store (the default group's) that the
first signalled rank sets, naming the finalize() call after which every rank turns `preempted`
true; each rank's thread checks it (preemption.py). No collective, nothing on the loop's thread."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

log = logging.getLogger("asyncckpt")

BOARD_POLL_S = 0.5  # how often each rank checks the board,
BOARD_CHECKS_PER_S = 2000  # and less often past 1,000 ranks: the store serves at most this many checks a second


def board_poll_s(ranks: int) -> float:
    return max(BOARD_POLL_S, ranks / BOARD_CHECKS_PER_S)


@dataclass(frozen=True)
class Posted:
    """A signalled rank's post: who, its signal, when (its wall clock), and the finalize() call every
    rank stops after."""

    rank: int
    signum: int
    at: float
    stop_after: int

    def text(self) -> str:
        return f"{self.rank} {self.signum} {self.at!r} {self.stop_after}"

    @classmethod
    def parse(cls, data: bytes) -> Posted:
        rank, signum, at, stop_after = data.decode().split()
        return cls(int(rank), int(signum), float(at), int(stop_after))


class SignalBoard:
    """A key in the job's store (the default group's) that a signalled rank sets: the other
    ranks' watchdogs learn of the signal without a collective (two store checks a second each)."""

    def __init__(self, store) -> None:
        self._store = store

    @classmethod
    def of(cls, group) -> Optional[SignalBoard]:
        """Collective (the key's name is the coordinator's): None, where there is no store to use."""
        name = group.broadcast(uuid.uuid4().hex)
        try:
            return cls(dist.PrefixStore(f"asyncckpt/preempted/{name}/", dist.distributed_c10d._get_default_store()))
        except Exception as exc:  # a private torch API: without it, ranks learn of a signal at agreements only
            log.debug("no store for preemption signals: %r", exc)
            return None

    def post(self, posted: Posted) -> Optional[Posted]:
        """Post `posted` unless a rank posted first (signals to several ranks: the first post is
        the one every rank follows). Returns the post on the board, or None: the store failed."""
        try:
            return Posted.parse(self._store.compare_set("signal", "", posted.text()))
        except Exception as exc:  # (the others learn of it at the next agreement, or not at all)
            log.warning("rank %d could not tell the other ranks of its preemption signal: %r", posted.rank, exc)
            return None

    def posted(self) -> Optional[Posted]:
        """What a signalled rank posted, or None: none has."""
        try:
            if not self._store.check(["signal"]):
                return None
            return Posted.parse(self._store.get("signal"))
        except Exception:  # the store is gone (the job is ending): nothing to learn
            return None
