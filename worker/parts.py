"""One writer's work: a round's part of one data file (`write_part`), the same in a writer thread
and a forked writer child, so both modes produce byte-identical files; what a failure says."""

from __future__ import annotations

import logging
import errno
import os
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from asyncckpt.formats import ItemSink, use_fast_serialization, write_object_bytes, write_tensor, write_tensor_streamed
from asyncckpt.protocol import TENSOR, ItemSpec, ItemWritten, WriteOptions
from asyncckpt.storage import WriteHandle

from .buckets import Bucket
from .staging import SlabShare

log = logging.getLogger("asyncckpt.worker")


class WriteError(Exception):
    """Writing a data file failed; `path` names it."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message

    def __reduce__(self):  # crosses the pipe from a forked writer
        return (WriteError, (self.path, self.message))


@dataclass
class SaveData:
    """What writers read for one save: the items, their staged tensors, the pickled objects."""

    items: Sequence[ItemSpec]
    staged: Sequence[Optional[torch.Tensor]]
    objects: dict[int, bytes]
    options: WriteOptions
    slab: Optional[SlabShare] = None  # where forked writers find the staged tensors


@dataclass
class OpenFile:
    """A data file being written, round after round: the next item goes at `offset`."""

    bucket: Bucket
    path: str
    handle: WriteHandle
    offset: int = 0
    committed: bool = False


def write_part(data: SaveData, file: OpenFile, positions: Sequence[int], commit: bool):
    """Append the items at `positions` to `file`; commit (fsync, close) it when asked.
    Returns (where each item landed, the file's new end)."""
    sink = ItemSink(file.handle, data.options.checksums, file.offset)
    written: list[ItemWritten] = []
    try:
        for pos in positions:
            spec = data.items[pos]
            start = sink.begin_item()
            if spec.kind == TENSOR:
                write_tensor(sink, data.staged[pos], file.bucket.format)
            else:
                write_object_bytes(sink, data.objects[pos])
            written.append(_landed(spec, file, start, sink))
        if commit:
            file.handle.commit()
    except BaseException as exc:
        raise WriteError(file.path, describe(exc)) from exc
    return written, sink.offset


def write_streamed(data: SaveData, file: OpenFile, pos: int, pieces: Iterable) -> list[ItemWritten]:
    """Append one tensor that passes through the staging slab in `pieces` (runs in the worker,
    which may touch CUDA; forked writers never do)."""
    spec = data.items[pos]
    sink = ItemSink(file.handle, data.options.checksums, file.offset)
    try:
        start = sink.begin_item()
        write_tensor_streamed(sink, spec.dtype, spec.shape, pieces, file.bucket.format)
    except BaseException as exc:
        raise WriteError(file.path, describe(exc)) from exc
    file.offset = sink.offset
    return [_landed(spec, file, start, sink)]


def _landed(spec: ItemSpec, file: OpenFile, start: int, sink: ItemSink) -> ItemWritten:
    return ItemWritten(spec.index, file.bucket.file_name, start, sink.offset - start, sink.item_crc())


def describe(exc: BaseException) -> str:
    # torch.save's C++ writer turns an OSError from write() (ENOSPC, EFBIG, EIO) into a bare
    # "unexpected pos" RuntimeError; the OSError survives only as its __context__
    seen = exc
    for _ in range(8):  # a short walk down the chain (chains can loop)
        if seen is None or (isinstance(seen, OSError) and seen.errno):
            break
        seen = seen.__cause__ or seen.__context__
    if isinstance(seen, OSError):
        exc = seen
    if isinstance(exc, OSError) and exc.errno:
        return f"[{errno.errorcode.get(exc.errno, exc.errno)}] {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


def commit(file: OpenFile):
    try:
        file.handle.commit()
    except BaseException as exc:
        raise WriteError(file.path, describe(exc)) from exc
    return None


def prepare_writer(nice: Optional[int]) -> None:
    """Run in every writer thread or child: torch.save's own CRC off (its setting is per
    thread), and the configured lower CPU priority (per thread on Linux, so staging keeps the
    trainer's)."""
    use_fast_serialization()
    if nice:
        try:
            os.nice(nice)
        except OSError as exc:
            log.warning("could not lower writer CPU priority by %d: %s", nice, exc)
