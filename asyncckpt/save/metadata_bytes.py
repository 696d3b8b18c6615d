"""`.metadata` assembled from pieces, so the coordinator of a steady save does not rebuild it.

Stock `dcp.load` reads one pickled `Metadata`, whose `storage_data` has one entry per item of every
rank: 35 million at 16,384 ranks for a 70B model sharded over all of them. Building those objects
on the coordinator, and pickling them, costs minutes per save (docs/benchmark.md, "Scale"). Yet
between two saves of the same plan almost nothing changes: the global plan (`state_dict_metadata`)
not at all, and each rank's entries (file, offset, length) only when an item's size changes.

So the file is written as one valid pickle stream made of pieces:

    PROTO 4 | prologue | POP | head | GET storage_data | rank 0's entries | ... | POP | storage_meta BUILD | STOP

- *prologue*: a list of what the pieces refer to, so each has a known memo index: first the
  classes and field names every entry uses (the same small indices in every process,
  `_shared_indices`), then the empty `storage_data`, `NAME_SLOTS` placeholder strings whose
  indices the ranks reuse for their file names, and every fqn of the plan;
- *head*: the global plan's `Metadata` with an empty `storage_data` and no `storage_meta`,
  pickled once per plan by the coordinator at planning; every rank gets the memo indices of its
  fqns and of the name slots with its final plan (`HeadRefs`, with the head's CRC);
- *entries*: each rank's `storage_data` items, encoded by that rank (`encode_entries`) without
  memo writes of their own (pickle's fast mode) except its file names, which it puts (BINPUT)
  into the name slots first; each fqn is a GET of the head's (so written once per file, not once
  per rank: ~40 % smaller than DCP's file); the pieces never depend on one another's memo;
- *tail*: this save's `storage_meta` (checkpoint id, save id), set on the `Metadata` (BUILD), so
  everything before it is the same bytes for every save of one layout.

The coordinator refuses entries encoded for another head (their CRC of it differs): a GET would
name another tensor. A rank's entries are reused only while its file names stay the same: an
incremental save or a re-save of a committed step names its files with a fresh tag, so its ranks
send their entries.

A rank whose entries equal those of its last committed save sends nothing new, and the coordinator
reuses what it kept: the image of the last committed `.metadata` but its tail (`MetadataImage`,
in page-aligned memory), so a steady save puts a new tail after it and writes it, with O_DIRECT on
a local file system (storage/page_buffer.py), so the CPU does not copy its bytes again. The
result is an ordinary protocol-4 pickle (checked with the C and the pure-Python unpicklers,
`pickletools` and stock `dcp.load` in the tests).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
import pickletools
import struct
import zlib
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan

from ..protocol import ItemWritten
from ..storage.page_buffer import PageBuffer

_PROTO = b"\x80\x04"
_FRAME = 0x95
_STOP, _POP, _BUILD = b".", b"0", b"b"
# what every entry refers to: pickled first, so each has the same memo index in every process
_SHARED = (MetadataIndex, _StorageInfo, torch.Size, "fqn", "offset", "index", "relative_path", "length",
           "transform_descriptors")
# large payloads the C pickler writes outside frames: opcode -> size of its length field
_UNFRAMED_PAYLOADS = {ord("B"): 4, ord("X"): 4, 0x8D: 8, 0x8E: 8, 0x96: 8}


DCP_VERSION = "1.0.0"
NAME_SLOTS = 64  # file names a rank's piece refers to by memo (beyond: written out in every entry)


@dataclass(frozen=True)
class MetadataHead:
    """The parts of `.metadata` that a plan fixes, pickled once per plan."""

    plan: Metadata  # the global metadata these bytes encode (kept: its identity is the cache key)
    data: bytes  # PROTO, prologue, POP, head (no STOP)
    storage_data_index: int  # memo index of the (empty) storage_data dict
    fqn_indices: dict[str, int]  # memo index of every fqn of the plan
    name_slots: tuple[int, ...]  # memo indices each rank's piece puts its file names at
    crc: int  # of `data`: which head a rank's entries refer to


@dataclass(frozen=True)
class HeadRefs:
    """What a rank encodes its entries with, sent with its final plan: the head's memo index of
    each fqn it writes (in `plan_fqns` order; -1: not in the head, written out) and of the slots
    for its file names, and the head's CRC, which its share carries back to the commit."""

    head_crc: int
    name_slots: tuple[int, ...]
    indices: tuple[int, ...]

    def bind(self, plan: SavePlan) -> "EntryRefs":
        """These references for the plan they were made for."""
        fqns = plan_fqns(plan)
        if len(fqns) != len(self.indices):
            raise ValueError(f"{len(self.indices)} fqn references sent for a plan of {len(fqns)} fqns")
        return EntryRefs(self.head_crc, self.name_slots,
                         {fqn: index for fqn, index in zip(fqns, self.indices) if index >= 0})


@dataclass(frozen=True)
class EntryRefs:
    """`HeadRefs` bound to a rank's plan: the memo index of each of its fqns."""

    head_crc: int
    name_slots: tuple[int, ...]
    fqn_indices: dict[str, int]


@dataclass(frozen=True)
class EntriesPlan:
    """How a save's `.metadata` is put together, as the plan fixed it: every rank encodes its
    entries with `refs`; the coordinator joins them to `head`."""

    refs: EntryRefs
    head: Optional[MetadataHead] = None  # the coordinator's


def plan_fqns(plan: SavePlan) -> list[str]:
    return sorted({item.index.fqn for item in plan.items})


def head_refs(head: MetadataHead, plan: SavePlan) -> HeadRefs:
    """The references for the rank that writes `plan` (see `HeadRefs`)."""
    return HeadRefs(head.crc, head.name_slots, tuple(head.fqn_indices.get(fqn, -1) for fqn in plan_fqns(plan)))


def encode_head(plan: Metadata) -> MetadataHead:
    """The head of every `.metadata` of saves planned with `plan` (see the module docstring)."""
    storage_data = {}
    head = dataclasses.replace(plan, storage_data=storage_data, storage_meta=None, version=DCP_VERSION)
    fqns = list(plan.state_dict_metadata)
    slots = [f"\0{n}" for n in range(NAME_SLOTS)]  # placeholders (distinct objects: one memo index each)
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=4)
    pickler.dump([*_SHARED, storage_data, *slots, *fqns])  # slots first: below 256, a GET of one is 2 bytes
    memo = pickler.memo.copy()  # the prologue's: the head's own memo (millions of objects at scale) is never copied
    prologue = buffer.getvalue()
    buffer.seek(0)
    buffer.truncate()
    pickler.dump(head)
    data = _PROTO + _unframed(prologue)[:-1] + _POP + _unframed(buffer.getvalue())[:-1]
    return MetadataHead(plan, data, memo[id(storage_data)][0], {fqn: memo[id(fqn)][0] for fqn in fqns},
                        tuple(memo[id(slot)][0] for slot in slots), zlib.crc32(data))


def encode_entries(items: Iterable[ItemWritten], refs: EntryRefs) -> bytes:
    """One rank's `storage_data` entries as a piece of the `.metadata` stream (see the docstring):
    its file names put in the head's name slots, then MARK key value ... SETITEMS, every fqn a
    reference to the head's."""
    memo = {id(obj): (index, obj) for obj, index in _shared_indices()}
    fqns = {}
    for fqn, index in refs.fqn_indices.items():
        memo[id(fqn)] = (index, fqn)
        fqns[fqn] = fqn  # the object the memo knows, found by its value
    names: dict[str, str] = {}
    entries = {}
    for item in items:
        name = names.setdefault(item.relative_path, item.relative_path)  # one object per file
        index = MetadataIndex(fqns.get(item.index.fqn, item.index.fqn), item.index.offset, item.index.index)
        entries[index] = _StorageInfo(name, item.offset, item.length)
    puts = []
    for slot, name in zip(refs.name_slots, names.values()):
        puts.append(_string(name) + _put(slot) + _POP)
        memo[id(name)] = (slot, name)
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=4)
    pickler.fast = True  # no memo writes: the piece must not depend on what came before it
    pickler.memo = memo
    pickler.dump(entries)
    body = _unframed(buffer.getvalue())
    if body[:1] != b"}" or body[-1:] != _STOP:  # EMPTY_DICT ... STOP
        raise ValueError("unexpected pickle of storage entries")
    return b"".join(puts) + body[1:-1]


@dataclass(frozen=True)
class KeptEntries:
    """Where one rank's entries lie in a `MetadataImage`, and their CRC (what a steady rank sends)."""

    crc: int
    start: int
    end: int


@dataclass
class MetadataImage:
    """A save's `.metadata` but its tail, in page-aligned memory (storage/page_buffer.py): the
    head, every rank's entries in rank order, the POP after them. The coordinator keeps it from
    one commit to the next; a steady save only puts a new tail after it and writes it whole."""

    head: MetadataHead
    buffer: PageBuffer
    ranks: dict[int, KeptEntries]
    prefix_length: int

    def entries(self, rank: int) -> memoryview:
        kept = self.ranks[rank]
        return self.buffer.view(kept.start, kept.end)

    def with_tail(self, checkpoint_id: str, save_id: str) -> PageBuffer:
        """The whole `.metadata` of one save: this image, then its storage_meta (written without
        its memo: the entries reused indices). The buffer is the image's own, changed in place."""
        pickler_out = io.BytesIO()
        pickler = pickle.Pickler(pickler_out, protocol=4)
        pickler.fast = True
        pickler.dump({"storage_meta": StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)})
        self.buffer.truncate(self.prefix_length)
        self.buffer.append(_unframed(pickler_out.getvalue())[:-1] + _BUILD + _STOP)
        return self.buffer


_TAIL_ROOM = 64 << 10  # a tail (storage_meta: the step directory's path, a save id) fits without growing


def build_image(head: MetadataHead, entries: dict[int, tuple[int, bytes | memoryview]]) -> MetadataImage:
    """An image of `head` and every rank's (crc, encoded entries), in rank order."""
    opening = _get(head.storage_data_index)
    size = len(head.data) + len(opening) + sum(len(e) for _, e in entries.values()) + len(_POP)
    buffer = PageBuffer(size + _TAIL_ROOM)
    buffer.append(head.data)
    buffer.append(opening)
    ranks = {}
    for rank in sorted(entries):
        crc, data = entries[rank]
        start = buffer.append(data)
        ranks[rank] = KeptEntries(crc, start, buffer.length)
    buffer.append(_POP)
    return MetadataImage(head, buffer, ranks, buffer.length)


@functools.lru_cache(maxsize=1)
def _shared_indices() -> tuple[tuple[object, int], ...]:
    """Each shared object with its memo index (the head's prologue starts with them)."""
    pickler = pickle.Pickler(io.BytesIO(), protocol=4)
    pickler.dump(list(_SHARED))
    memo = pickler.memo.copy()
    return tuple((obj, memo[id(obj)][0]) for obj in _SHARED)


def _put(index: int) -> bytes:
    return b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)


def _string(text: str) -> bytes:
    """A str's opcode, without the memo write pickle.dumps adds."""
    data = text.encode("utf-8", "surrogatepass")
    return (b"\x8c" + bytes([len(data)]) if len(data) < 256 else b"X" + struct.pack("<I", len(data))) + data


def _get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def _unframed(data: bytes) -> bytes:
    """A protocol-4 pickle's opcodes without PROTO and FRAME headers (frames are optional, and a
    frame must not be cut, so pieces are joined unframed). Frames and the large payloads the C
    pickler writes between them are walked by their headers; anything else takes pickletools."""
    if data[:2] != _PROTO:
        raise ValueError("not a protocol-4 pickle")
    pieces, pos, end = [], 2, len(data)
    view = memoryview(data)
    while pos < end:
        opcode = data[pos]
        if opcode == _FRAME:
            length = int.from_bytes(data[pos + 1:pos + 9], "little")
            pieces.append(view[pos + 9:pos + 9 + length])
            pos += 9 + length
        elif opcode in _UNFRAMED_PAYLOADS and pos + 1 + _UNFRAMED_PAYLOADS[opcode] < end:
            size = _UNFRAMED_PAYLOADS[opcode]
            length = int.from_bytes(data[pos + 1:pos + 1 + size], "little")
            pieces.append(view[pos:pos + 1 + size + length])
            pos += 1 + size + length
        else:
            return _unframed_slowly(data)
    return b"".join(pieces)


def _unframed_slowly(data: bytes) -> bytes:
    """`_unframed` for any stream: rebuilt opcode by opcode (a rare layout; slow on big pickles)."""
    out = bytearray()
    ops = list(pickletools.genops(data))
    for n, (op, _arg, pos) in enumerate(ops):
        if op.name in ("PROTO", "FRAME"):
            continue
        following = ops[n + 1][2] if n + 1 < len(ops) else len(data)
        out += data[pos:following]
    return bytes(out)
