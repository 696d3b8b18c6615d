"""The memory tier across nodes, in the worker (CheckpointConfig(memory_replicas=R)): it keeps the
copies peers send (a CopyServer on the socket the trainer made) and sends each copy it sealed to
its targets' workers, on a thread of its own: the trainer never waits for it. A push still going
when the next save begins staging is cancelled (the slab is about to change under it); a peer that
fails is logged and skipped (asyncckpt/replica_wire.py has the wire).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

from asyncckpt.memory_file import memory_file_name
from asyncckpt.protocol import MemoryTier
from asyncckpt.replica_server import CopyServer
from asyncckpt.replica_wire import Address, Cancelled, Expected, Push, ReplicaError

log = logging.getLogger("asyncckpt.worker")

ABANDON_WAIT_S = 0.2


class Replicator:
    def __init__(self, settings: MemoryTier, rank: int) -> None:
        replication = settings.replication
        assert replication is not None
        self.settings = settings
        self.rank = rank
        self.replication = replication
        root = settings.root
        expected = Expected(os.path.dirname(settings.path), root, settings.world_size,
                            lambda rank: memory_file_name(root, rank))
        self.server = CopyServer(replication.listener, replication.secret, expected, put=True, get=False,
                                 timeout_s=replication.timeout_s, keeps=frozenset(replication.sources)).start()
        self._pushes: list[Push] = []
        self._thread: Optional[threading.Thread] = None

    def push(self, step: int, token: str) -> None:
        """Send the copy just sealed (at the tier's path) to every target, in the background."""
        self.abandon()
        targets = self.replication.targets
        if not targets:
            return
        self._pushes = [Push(Address(host, port), self.replication.secret, self.settings.path, self.rank,
                             token, self.replication.timeout_s) for _, host, port in targets]
        self._thread = threading.Thread(target=self._send, args=(self._pushes, targets, step), daemon=True,
                                        name="asyncckpt-replica-push")
        self._thread.start()

    def _send(self, pushes: list[Push], targets: tuple[tuple[int, str, int], ...], step: int) -> None:
        for push, (rank, _, _) in zip(pushes, targets):
            started = time.perf_counter()
            try:
                sent = push.run()
            except Cancelled as exc:
                log.debug("memory tier: the copy of step %d for rank %d was not sent: %s", step, rank, exc)
                return
            except (ReplicaError, OSError) as exc:
                log.warning("memory tier: the copy of step %d did not reach rank %d's worker: %s", step, rank, exc)
                continue
            log.debug("memory tier: sent the copy of step %d (%d bytes) to rank %d in %.3fs", step, sent, rank,
                      time.perf_counter() - started)

    def abandon(self) -> None:
        """A newer save begins: stop sending the older copy (its bytes are about to change). Not
        awaited beyond a moment: a cancelled push sends no further piece, its socket is shut (a
        send under way breaks off), and a receiver never keeps a copy whose CRCs do not match."""
        for push in self._pushes:
            push.cancel()
        self.finish(ABANDON_WAIT_S)

    def close(self, timeout_s: float) -> bool:
        """The trainer closes: let the pushes and receptions under way end (at most `timeout_s`
        in all: peers close at about the same time, and a copy half-received is never kept)."""
        deadline = time.monotonic() + timeout_s
        sent = self.finish(timeout_s)
        return self.server.drain(max(0.0, deadline - time.monotonic())) and sent

    def finish(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for the pushes under way; True when none is left."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                return False
            self._thread = None
        return True

