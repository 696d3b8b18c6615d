"""A restart's reads of the memory tier's copies that this node lacks (CheckpointConfig(
memory_replicas=R)): `PeerFiles` reads them from a rank of another node that holds them, straight
into the targets, as the reader (reader.py) reads local files: the same pieces, each asked for in
one request (replica_wire.Ranges), each step checksummed as it lands. Nothing is written here and
nothing is read twice. The copies this node holds are read as local files.

Each copy is read from one holder per load, so a load that fails names the holder to skip next
(`failed`, by node: its node's file of that copy): a holder that could not be reached, stopped
sending, or sent an item whose checksum did not match (this rank's reader named the file).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Hashable, Iterator, Optional

from ..errors import CheckpointError, PartialLoadError
from ..replica_wire import Address, Ranges, ReplicaError
from .byte_sources import ByteSource, LocalFiles


@dataclass(frozen=True)
class Holder:
    """A rank of another node that holds a copy, and where its restart serves it."""

    rank: int
    node: Hashable
    address: Address


@dataclass(frozen=True)
class RemoteCopy:
    """A copy of the save being restored that this node lacks: whose, and who holds it."""

    rank: int  # whose copy
    token: str  # the save
    holders: tuple[Holder, ...]  # in the order this rank tries them


@dataclass(frozen=True)
class PulledCopy:
    """What one rank's restart read of one copy held on another node."""

    rank: int  # whose copy
    into: int  # the rank that read it
    node: Any  # the node that served it
    nbytes: int


@dataclass
class _Stream:
    """The request of the piece a thread is reading, and where it is in it."""

    path: str
    at: int
    ranges: Ranges


class PeerFiles(ByteSource):
    """Local files as LocalFiles reads them; the paths in `remote` from their holders (see the
    module's docstring). `skip`: (file name, node) pairs a failed load blamed (that node's file
    is not read again)."""

    def __init__(self, remote: dict[str, RemoteCopy], secret: bytes, timeout_s: float,
                 skip: frozenset[tuple[str, Hashable]] = frozenset()) -> None:
        self.base = LocalFiles()
        self.threads, self.piece_bytes = self.base.threads, self.base.piece_bytes
        self.step_bytes, self.whole_item_bytes = self.base.step_bytes, self.base.whole_item_bytes
        self.remote, self.secret, self.timeout_s = remote, secret, timeout_s
        self.holder = {path: next((h for h in copy.holders if (os.path.basename(path), h.node) not in skip), None)
                       for path, copy in remote.items()}
        self._local = threading.local()
        self._lock = threading.Lock()
        self.received: dict[str, int] = {}  # path -> bytes read from its holder
        self.failed: set[tuple[str, Hashable]] = set()  # (file name, node): not to be read again

    def open(self, paths: set[str]) -> None:
        self.base.open({path for path in paths if path not in self.remote})
        lost = sorted(path for path in paths if path in self.remote and self.holder[path] is None)
        if lost:
            raise CheckpointError(f"{lost[0]}: no rank of another node is left to read it from; nothing in "
                                  "state_dict was changed")

    def piece(self, path: str, offset: int, nbytes: int) -> Any:
        return self._streaming(path, offset, nbytes) if path in self.remote else contextlib.nullcontext()

    @contextlib.contextmanager
    def _streaming(self, path: str, offset: int, nbytes: int) -> Iterator[None]:
        self._local.stream = _Stream(path, offset, self._ask(path, offset, nbytes, path))
        try:
            yield
        finally:
            self._local.stream.ranges.close()
            self._local.stream = None

    def read(self, path: str, offset: int, n: int) -> bytes:
        if path not in self.remote:
            return self.base.read(path, offset, n)
        data = bytearray(n)
        try:
            self.read_into(path, offset, [memoryview(data)], path)
        except PartialLoadError as exc:
            raise OSError(str(exc)) from None
        return bytes(data)

    def read_into(self, path: str, offset: int, buffers: list[memoryview], what: str) -> None:
        if path not in self.remote:
            self.base.read_into(path, offset, buffers, what)
            return
        total = sum(len(b) for b in buffers)
        stream: Optional[_Stream] = getattr(self._local, "stream", None)
        if stream is not None and (stream.path, stream.at) == (path, offset) and stream.ranges.left >= total:
            self._receive(stream.ranges, path, buffers, what)
            stream.at += total
            return
        ranges = self._ask(path, offset, total, what)  # a read outside the piece being streamed
        try:
            self._receive(ranges, path, buffers, what)
        finally:
            ranges.close()

    def _ask(self, path: str, offset: int, nbytes: int, what: str) -> Ranges:
        copy, holder = self.remote[path], self.holder[path]
        try:
            return Ranges(holder.address, self.secret, copy.rank, copy.token, [(offset, nbytes)], self.timeout_s)
        except ReplicaError as exc:
            raise self._failure(path, what, exc) from None

    def _receive(self, ranges: Ranges, path: str, buffers: list[memoryview], what: str) -> None:
        try:
            for buffer in buffers:
                ranges.receive(buffer)
        except ReplicaError as exc:
            raise self._failure(path, what, exc) from None
        with self._lock:
            self.received[path] = self.received.get(path, 0) + sum(len(b) for b in buffers)

    def _failure(self, path: str, what: str, exc: Exception) -> PartialLoadError:
        holder = self.holder[path]
        with self._lock:
            self.failed.add((os.path.basename(path), holder.node))
        return PartialLoadError(f"{what}: reading it from rank {holder.rank} (node {holder.node!r}) failed: {exc}")

    def blame(self, error: str) -> None:
        """This rank's load failed (`error`: its own message): the holders of the files it names
        (a damaged item) are not read again."""
        with self._lock:
            self.failed |= {(os.path.basename(path), holder.node) for path, holder in self.holder.items()
                            if holder is not None and path in error}

    def pulled(self, me: int) -> list[PulledCopy]:
        return [PulledCopy(self.remote[path].rank, me, self.holder[path].node, n) for path, n in self.received.items()]

    def close(self) -> None:
        self.base.close()
