"""Resume at scale: bytes that several ranks load read from storage once per job.

With DDP every rank loads the same full tensors; with HSDP every rank of a replicate group the
same shards: the same (file, offset, length) read by k ranks is k times the storage traffic.
The coordinator sees every rank's load plan (DCP's global plan step, read_shares.py): an item
read by several ranks is *shared* by them; one of them, chosen so each reads about 1/k of the
bytes, reads it (checking its checksum) and hands it to the others. To other nodes: point to
point over gloo, once per node (to one of its ranks, the relay, which checks it and hands it to
the others of its node through a file in shared memory). To the ranks of its own node: through
a file in shared memory (node_share.py) on an object store, while on a file system they read it
themselves, through the page cache their node shares (`ReadShares.reads_itself`: the storage is
read once per node, and copying from the cache is cheaper than any hand-over; they do not check
again what the reader verified, and of an item only one node's ranks read, one checks it for the
others: `ReadShares.checked`). An item is
checked against the sidecar's checksum by its reader (when the load checks checksums); a rank that copies it from the memory it
was checked in (or from a relay's file, the relay having checked it against the reader's CRC32C)
checks its length, one that received it over gloo its CRC32C too (or its load checks the
sidecar's). No user flag: the plans say which ranks read what.

Then every rank loads as before through `SharedSource`, which serves the shared items' bytes
from memory and passes any other read to the storage. The shared bytes are held in host memory
until the load ends: `SHARED_BYTES_MAX` bounds them per load (items past it are read by every
rank that needs them, as before). On GPU the payloads go through gloo too (not yet NCCL into
the device targets).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..errors import CheckpointError, PartialLoadError
from ..formats import Sidecar, crc32c
from .broadcast import LoadGroup
from .byte_sources import ByteSource, SharedSource
from .node_share import MemoryPayload, open_payload, payload_name
from .read_shares import ReadShares, SharedItem


def _verified(shares: ReadShares, told: list) -> dict[SharedItem, bool]:
    """Whether each shared item's reader checked it against the sidecar (what it told), in one
    pass over the items (each reader's in `ReadShares.layout` order): O(items), not readers x items."""
    place: dict[int, int] = {}
    verified = {}
    for item in shares.items:
        at = place.get(item.reader, 0)
        place[item.reader] = at + 1
        said = told[item.reader].verified
        verified[item] = said[at] if at < len(said) else False
    return verified


@dataclass(frozen=True)
class ReadOutcome:
    """What a rank tells the others once it has read its share."""

    error: Optional[str] = None
    in_memory: bool = False  # its items are in its payload file (node_share.py) for the ranks of its node
    pid: int = 0  # (the payload files' names hold it: a file whose process is gone is removed later)
    crcs: tuple[int, ...] = ()  # CRC32C of each item it read, in `ReadShares.layout` order
    verified: tuple[bool, ...] = ()  # each matched the sidecar's checksum, where it lies (its payload, its memory)
    relaying: bool = False  # it has a relay file for the items it receives for its node (ReadShares.relay)


def share_reads(
    shares: ReadShares, group: LoadGroup, files: dict[str, str], source: ByteSource,
    expected_crc: Callable[[SharedItem], Optional[int]], sidecar: Optional[Sidecar],
) -> "SharedSource":
    """Read this rank's share of the shared items, hand every share to its ranks (inside a node
    through shared memory or the page cache, between nodes over gloo: to one rank of each node,
    which hands them to its node through shared memory), and return a source serving the items
    this rank needs from memory. A collective over `group`: every rank calls it with the same
    `shares`. Nothing of the caller's state is written here."""
    me, pid = group.rank, os.getpid()
    mine, where = shares.layout(me)
    relayed, relayed_at = shares.relay_layout(me)
    payload = relay_file = None
    got: dict[SharedItem, bytes] = {}
    try:
        if mine and shares.local_receivers(me):
            payload = MemoryPayload.create(payload_name(shares.nonce, me, pid), sum(item.length for item in mine))
        if relayed:
            relay_file = MemoryPayload.create(payload_name(shares.nonce, me, pid, "relay"), sum(i.length for i in relayed))
        outcome = ReadOutcome(in_memory=payload is not None, pid=pid, relaying=relay_file is not None)
        try:
            got, outcome = _read_own(mine, files, source, expected_crc, sidecar, payload, where, outcome)
        except Exception as exc:  # told to the others, who wait for it
            outcome = replace(outcome, error=str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}")
        told = _exchange(group, outcome)
        _raise_failures(group, [t.error for t in told])
        crcs = dict(zip(mine, outcome.crcs))
        # what its reader checked against the sidecar's checksum, told by the reader: where this rank copies
        # it from the very memory it was checked in (or a relay checked it against the reader's CRC32C of
        # it), the load need not check it again
        verified = _verified(shares, told)
        checked = {item for item in mine if verified[item]}
        for members, reader, items in shares.rounds():  # read through the page cache the reader checked them in
            if me in members and shares.reads_itself(me, reader):
                checked.update(item for item in items if verified[item])
        problems: list[str] = []
        by_memory: dict[int, list[SharedItem]] = {}  # inside this node first (no rank waits on another for
        for members, reader, items in shares.rounds():  # them), each reader's payload mapped once
            if told[reader].in_memory and me != reader and me in members and shares.same_node(me, reader):
                by_memory.setdefault(reader, []).extend(items)
        for reader, items in by_memory.items():
            order, at = shares.layout(reader)
            if _receive(got, problems, lambda: _mapped(shares, reader, told[reader], order, at, items, verified.get,
                                                       f"read by rank {reader}")):
                checked.update(item for item in items if verified[item])
        later = lambda item: sidecar is not None and expected_crc(item) is not None  # noqa: E731 (its load checks it)
        relays = _gloo_rounds(shares, group, told, got, crcs, (relay_file, relayed_at), later, problems)
        checked.update(item for item in relayed if relay_file is not None and item in got and verified[item])
        if any(t.relaying for t in told):  # every relay holds its node's items: the ranks of its node map them
            _raise_failures(group, [t.error for t in _exchange(group, ReadOutcome("; ".join(problems) or None))])
            for relay, items in relays.items():
                order, at = shares.relay_layout(relay)
                if _receive(got, problems, lambda: _mapped(shares, relay, told[relay], order, at, items, lambda i: True,
                                                           f"relayed by rank {relay}", "relay")):
                    checked.update(item for item in items if verified[item])
        # a damaged item stops every rank (none waits on this one in a later round); the payload files may go now
        _raise_failures(group, [t.error for t in _exchange(group, ReadOutcome("; ".join(problems) or None))])
    finally:
        for made in (payload, relay_file):
            if made is not None:
                made.remove()
    return SharedSource(source, {(files[item.relative_path], item.offset): data for item, data in got.items()},
                        frozenset((files[item.relative_path], item.offset, item.length) for item in checked))


def _gloo_rounds(shares: ReadShares, group: LoadGroup, told: list, got: dict, crcs: dict,
                 relay: tuple[Optional[MemoryPayload], dict[SharedItem, int]], later: Callable[[SharedItem], bool],
                 problems: list[str]) -> dict[int, list[SharedItem]]:
    """Every round's items to the ranks that do not get them inside the reader's node: to each
    other node's relay (which receives them into its relay file and checks each against the
    reader's CRC32C of it, for its node) where it has one, else to each rank (which checks each
    item's CRC32C unless its load checks the sidecar's checksum of it: `later`). Returns the
    items this rank is to map from its node's relays, by relay. `relay`: this rank's relay file
    and where each item it relays lies in it (`ReadShares.relay_layout`)."""
    me = group.rank
    relay_file, relay_at = relay
    from_relays: dict[int, list[SharedItem]] = {}
    for members, reader, items in shares.rounds():
        def on_its_node(m: int) -> bool:  # through its payload, or the page cache
            return shares.reads_itself(m, reader) or (told[reader].in_memory and shares.same_node(m, reader))

        known: dict[int, Optional[int]] = {}  # node -> its relay in this round

        def relay_of(m: int) -> Optional[int]:
            node = shares.node(m)
            if node < 0:
                return None
            if node not in known:
                chosen = shares.relay(members, reader, m)
                known[node] = chosen if chosen is not None and told[chosen].relaying else None
            return known[node]

        if me == reader:
            to = tuple(m for m in members if m != reader and not on_its_node(m) and relay_of(m) in (None, m))
            if to:
                _send_round(items, got, crcs, group, to)
        elif me in members and not on_its_node(me):
            its_relay = relay_of(me)
            if its_relay is None:
                _receive(got, problems, lambda: _receive_round(items, reader, group, later))
            elif its_relay == me:  # into the relay file, each item checked whole: its node's ranks take it as is
                into = relay_file.view(relay_at[items[0]], sum(item.length for item in items))
                _receive(got, problems, lambda: _receive_round(items, reader, group, lambda _: False, into))
            else:
                from_relays.setdefault(its_relay, []).extend(items)
    return from_relays


def _read_own(items, files, source, expected_crc, sidecar: Optional[Sidecar], payload: Optional[MemoryPayload],
              where: dict[SharedItem, int], outcome: ReadOutcome) -> tuple[dict[SharedItem, bytes], ReadOutcome]:
    """The items this rank reads for its group (into its payload when it has one), each checked
    against the sidecar's checksum, with its CRC32C for the receivers (the sidecar's own where
    that is a CRC32C: no second pass over the bytes)."""
    def read(item: SharedItem):
        data = payload.view(where[item], item.length) if payload is not None else bytearray(item.length)
        what = f"{files[item.relative_path]}: bytes {item.offset}..{item.offset + item.length}"
        try:
            source.read_into(files[item.relative_path], item.offset, [memoryview(data)], what)
        except PartialLoadError as exc:  # nothing of the state was written yet
            raise CheckpointError(str(exc)) from None
        expected = expected_crc(item) if sidecar is not None else None
        if expected is not None and sidecar.checksum(data) != expected:
            raise CheckpointError(f"{what}: checksum mismatch (expected {expected:08x})")
        crc = expected if expected is not None and sidecar.algorithm == "crc32c" else crc32c(data)  # (the receivers' CRC)
        return data, crc, expected is not None
    if not items:
        return {}, outcome
    with ThreadPoolExecutor(max_workers=source.threads, thread_name_prefix="asyncckpt-shared") as pool:
        done = list(pool.map(read, items))
    return ({item: data for item, (data, _, _) in zip(items, done)},
            replace(outcome, crcs=tuple(crc for _, crc, _ in done), verified=tuple(ok for _, _, ok in done)))


def _mapped(shares: ReadShares, rank: int, told: ReadOutcome, order: list[SharedItem], at: dict[SharedItem, int],
            items: list[SharedItem], skip_crc: Callable[[SharedItem], bool], whence: str, kind: str = "r") -> dict:
    """`items` from a file in /dev/shm of `rank` (a rank of this node) that holds `order` laid end
    to end (`at`: where each begins), each checked: its length, and its CRC32C unless `skip_crc`
    (its reader checked the sidecar's checksum of these very bytes; a relay checked it whole)."""
    path = payload_name(shares.nonce, rank, told.pid, kind)
    try:
        view = open_payload(path, sum(item.length for item in order))
    except OSError as exc:
        raise Damaged(f"the items {whence} could not be opened in shared memory ({exc})") from None
    crc_of = dict(zip(order, told.crcs)) if kind == "r" else {}
    out = {}
    for item in items:
        data = view[at[item]:at[item] + item.length]
        _check(item, data, crc_of.get(item), skip_crc, f"{whence} (in {path})")
        out[item] = data
    return out


def _bytes_of(item: SharedItem) -> str:
    return f"{item.relative_path}: bytes {item.offset}..{item.offset + item.length}"


class Damaged(CheckpointError):
    """An item another rank read arrived with another length or CRC32C."""


def _receive(got: dict, problems: list[str], receive: Callable[[], dict]) -> bool:
    """`receive()`'s items into `got` (True); a damaged one into `problems` (False: this rank goes
    on taking part in the other rounds, and the last exchange stops every rank)."""
    try:
        got.update(receive())
        return True
    except Damaged as exc:
        problems.append(str(exc))
        return False


def _check(item: SharedItem, data, crc: Optional[int], skip_crc: Callable[[SharedItem], bool],
           whence: str) -> None:
    if len(data) != item.length or (not skip_crc(item) and crc32c(data) != crc):
        raise Damaged(f"{_bytes_of(item)} {whence} arrived damaged")


def _send_round(items, got, crcs: dict, group: LoadGroup, to: tuple[int, ...]) -> None:
    """The reader's side of a round to ranks `to` (of other nodes): point to point over the load's
    gloo group (no group is made for them), the items' CRC32Cs, then their bytes."""
    total = sum(item.length for item in items)
    crc_values = torch.tensor([crcs[item] for item in items], dtype=torch.int64)
    payload = torch.empty(max(total, 1), dtype=torch.uint8)
    view, at = memoryview(payload.numpy()), 0
    for item in items:
        view[at:at + item.length] = got[item]
        at += item.length

    def send() -> None:
        sent = [dist.isend(tensor, dst=dist.get_global_rank(group.pg, r), group=group.pg)
                for r in to for tensor in ((crc_values, payload) if total else (crc_values,))]
        for work in sent:
            work.wait()
    _collective(send, group)


def _receive_round(items, reader, group: LoadGroup, skip_crc: Callable[[SharedItem], bool],
                   into: Optional[memoryview] = None) -> dict:
    """A receiver's side of `_send_round` (into `into`, a relay file's part, or fresh memory):
    each item checked, its length and its CRC32C unless `skip_crc`."""
    total = sum(item.length for item in items)
    src = dist.get_global_rank(group.pg, reader)
    crcs = torch.zeros(len(items), dtype=torch.int64)
    payload = torch.frombuffer(into, dtype=torch.uint8) if into is not None and total else torch.empty(max(total, 1),
                                                                                                      dtype=torch.uint8)
    _collective(lambda: dist.recv(crcs, src=src, group=group.pg), group, src)
    if total:
        _collective(lambda: dist.recv(payload, src=src, group=group.pg), group, src)
    view, at, out = into if into is not None else memoryview(payload.numpy()), 0, {}
    for item, crc in zip(items, crcs.tolist()):
        data = view[at:at + item.length]  # (the payload lives as long as its views)
        at += item.length
        _check(item, data, crc, skip_crc, f"sent by rank {src}")
        out[item] = data
    return out


def _collective(run: Callable[[], object], group: LoadGroup, src: Optional[int] = None) -> None:
    try:
        run()
    except Exception as exc:  # gloo: a peer gone, or the group's timeout
        who = f" from rank {src}" if src is not None else ""
        raise CheckpointError(f"sharing replicated reads{who} failed ({type(exc).__name__}: {exc})") from None


@contextmanager
def failures_told(shares: Optional[ReadShares], group: Optional[LoadGroup]) -> Iterator[None]:
    """Around what a rank does before `share_reads`: an error there is told to the other ranks
    (they wait for it in `share_reads`), then raised here."""
    try:
        yield
    except Exception as exc:
        if shares is not None and group is not None:
            try:
                _exchange_errors(group, str(exc))
            except CheckpointError:
                pass  # this rank's own error is the one to raise
        raise


def _exchange(group: LoadGroup, mine):
    """Every rank's `mine`, on every rank (one all_gather of small objects)."""
    every: list = [None] * group.size
    _collective(lambda: dist.all_gather_object(every, mine, group=group.pg), group)
    return every


def _raise_failures(group: LoadGroup, errors: list[Optional[str]]) -> None:
    """CheckpointError naming each rank that failed, on every rank."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError("; ".join(f"rank {dist.get_global_rank(group.pg, r)}: {e}" for r, e in failed))


def _exchange_errors(group: LoadGroup, error: Optional[str]) -> None:
    """Every rank's error (None: fine) on every rank; CheckpointError naming each rank that failed."""
    _raise_failures(group, [t.error for t in _exchange(group, ReadOutcome(error))])
