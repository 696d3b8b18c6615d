"""How items become bytes in a bucket file, and their checksums.

Format "torch_save": each tensor chunk is a standalone `torch.save` archive of exactly that chunk
and each object its `torch.save` bytes, so DCP's stock FileSystemReader reads every byte range.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Optional

import torch

from .storage import WriteHandle

CHECKSUMS_FILE = ".checksums.json"
CHECKSUM_ALGORITHM = "crc32"


class ItemSink:
    """File-like view of a WriteHandle that tracks the offset and the CRC32 of the current item."""

    def __init__(self, handle: WriteHandle, checksums: bool) -> None:
        self._handle = handle
        self._checksums = checksums
        self.offset = 0
        self._crc = 0

    def write(self, data) -> int:
        n = self._handle.write(data)
        if self._checksums:
            self._crc = zlib.crc32(data, self._crc)
        self.offset += n
        return n

    def flush(self) -> None:
        pass

    def begin_item(self) -> int:
        self._crc = 0
        return self.offset

    def item_crc(self) -> Optional[int]:
        return self._crc if self._checksums else None


def write_tensor(sink: ItemSink, tensor: torch.Tensor) -> None:
    """A standalone torch.save archive of `tensor`, which must own a compact storage."""
    torch.save(tensor, sink)


def write_object_bytes(sink: ItemSink, data: bytes) -> None:
    """An object already pickled by the planner (torch.save bytes)."""
    sink.write(data)


def use_fast_serialization() -> None:
    """Turn off torch.save's own CRC32 in this process (the worker only): measured at 0.28 GiB/s,
    it would cap writes far below the disk; our zlib CRC32 (about 3.7 GiB/s) replaces it."""
    torch.serialization.set_crc32_options(False)


@dataclass(frozen=True)
class ItemChecksum:
    fqn: str
    offset: Optional[tuple[int, ...]]
    relative_path: str
    start: int
    length: int
    crc32: int


def encode_checksums(entries: list[ItemChecksum]) -> bytes:
    records = [
        {
            "fqn": e.fqn,
            "offset": list(e.offset) if e.offset is not None else None,
            "file": e.relative_path,
            "start": e.start,
            "length": e.length,
            "crc32": e.crc32,
        }
        for e in entries
    ]
    return json.dumps({"algorithm": CHECKSUM_ALGORITHM, "items": records}, indent=0).encode()


def decode_checksums(data: bytes) -> list[ItemChecksum]:
    doc = json.loads(data)
    if doc.get("algorithm") != CHECKSUM_ALGORITHM:
        raise ValueError(f"unknown checksum algorithm {doc.get('algorithm')!r}")
    return [
        ItemChecksum(
            fqn=r["fqn"],
            offset=tuple(r["offset"]) if r["offset"] is not None else None,
            relative_path=r["file"],
            start=int(r["start"]),
            length=int(r["length"]),
            crc32=int(r["crc32"]),
        )
        for r in doc["items"]
    ]


def crc32_of(data) -> int:
    return zlib.crc32(data)
