"""Where a tensor's bytes lie inside a `torch.save` archive, without loading it.

A DCP `torch_save` item is a standalone zip archive (stored, not compressed) of one tensor. The
loader reads its head and tail windows (a few KiB), finds the data record from the zip's central
directory and the record's local header, and learns the tensor's layout (storage offset, size,
stride) from its tiny `data.pkl`, unpickled by an unpickler that builds nothing but a description
of the tensor (any other global refuses the item: the loader falls back to `torch.load`). The
tensor's bytes can then be read straight into the target's memory.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

WINDOW = 4096  # bytes read at each end of an item: the records before and after the tensor data


# torch.FloatStorage and friends, as `_rebuild_tensor_v2` archives name their element type
_TYPED_STORAGES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64,
}


class ArchiveError(ValueError):
    """The item is not a torch.save archive of one plain tensor this parser understands."""


@dataclass(frozen=True)
class TensorRecord:
    """One tensor in an archive: its storage's bytes at [data_start, data_start + nbytes) of the
    item, and the tensor's view of that storage (in elements)."""

    data_start: int
    nbytes: int
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _Rebuilt:
    key: str
    dtype: Any
    storage_nbytes: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Windows(io.RawIOBase):
    """A read-only file of `length` bytes of which only the head and tail windows are known."""

    def __init__(self, length: int, head: bytes, tail: bytes) -> None:
        self._length, self._head, self._tail, self._pos = length, head, tail, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self._length}[whence] + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._length if n is None or n < 0 else min(self._length, self._pos + n)
        data = self.slice(self._pos, end)
        self._pos = end
        return data

    def slice(self, start: int, end: int) -> bytes:
        if end <= len(self._head):
            return self._head[start:end]
        tail_start = self._length - len(self._tail)
        if start >= tail_start:
            return self._tail[start - tail_start:end - tail_start]
        raise ArchiveError(f"bytes {start}..{end} lie outside the head and tail windows")


class _DescribingUnpickler(pickle.Unpickler):
    """Unpickles `data.pkl` of a one-tensor archive into a `_Rebuilt`, running no code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):  # typed storage (older dtypes)
            return _describe_v2
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):  # untyped storage and a dtype
            return _describe_v3
        if (module, name) in (("collections", "OrderedDict"), ("torch.storage", "UntypedStorage")):
            return OrderedDict if name == "OrderedDict" else torch.uint8
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, torch.dtype):
            return value
        if module == "torch" and name in _TYPED_STORAGES:
            return _TYPED_STORAGES[name]
        raise ArchiveError(f"data.pkl names {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ArchiveError(f"unexpected persistent id {pid!r:.100}")
        return pid


def _describe_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None) -> _Rebuilt:
    _, dtype, key, _, numel = storage
    return _Rebuilt(str(key), dtype, int(numel) * dtype.itemsize, int(storage_offset), _ints(size), _ints(stride))


def _describe_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None) -> _Rebuilt:
    _, _, key, _, nbytes = storage
    return _Rebuilt(str(key), dtype, int(nbytes), int(storage_offset), _ints(size), _ints(stride))


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def locate_tensor(read: Callable[[int, int], bytes], length: int, dtype: torch.dtype) -> TensorRecord:
    """The tensor record of a one-tensor torch.save archive of `length` bytes; `read(offset, n)`
    returns its bytes. ArchiveError if it is anything else (compressed, several storages, a
    subclass, a record outside the archive)."""
    if length <= 2 * WINDOW:
        head = tail = read(0, length)
    else:
        head, tail = read(0, WINDOW), read(length - WINDOW, WINDOW)
    windows = _Windows(length, head, tail)
    try:
        members = {info.filename: info for info in zipfile.ZipFile(windows).infolist()}
    except (zipfile.BadZipFile, ValueError, struct.error, EOFError) as exc:
        raise ArchiveError(f"not a readable zip archive: {exc}") from None
    pickled = [name for name in members if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickled) != 1:
        raise ArchiveError("no single data.pkl record")
    prefix = pickled[0][: -len("data.pkl")]
    try:
        rebuilt = _DescribingUnpickler(io.BytesIO(_member_bytes(windows, members[pickled[0]]))).load()
    except ArchiveError:
        raise
    except Exception as exc:
        raise ArchiveError(f"data.pkl: {type(exc).__name__}: {exc}") from None
    if not isinstance(rebuilt, _Rebuilt):
        raise ArchiveError(f"data.pkl holds a {type(rebuilt).__name__}, not one tensor")
    if rebuilt.dtype != dtype:
        raise ArchiveError(f"the archive holds {rebuilt.dtype}, the metadata says {dtype}")
    record = members.get(f"{prefix}data/{rebuilt.key}")
    if record is None:
        raise ArchiveError(f"no data record for storage {rebuilt.key!r}")
    start = _data_start(windows, record)
    if (
        record.file_size != rebuilt.storage_nbytes or record.file_size % dtype.itemsize
        or start < 0 or start + record.file_size > length
    ):
        raise ArchiveError(f"data record of {record.file_size} bytes does not fit the tensor or the item")
    numel = record.file_size // dtype.itemsize
    return TensorRecord(start, record.file_size, numel, rebuilt.storage_offset, rebuilt.size, rebuilt.stride)


def _data_start(windows: _Windows, info: zipfile.ZipInfo) -> int:
    """Where a stored member's bytes begin: after its local header (whose extra field pads the
    data to torch's alignment and may differ from the central directory's)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ArchiveError(f"{info.filename} is compressed")
    header = windows.slice(info.header_offset, info.header_offset + 30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ArchiveError(f"{info.filename}: no local header at {info.header_offset}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _member_bytes(windows: _Windows, info: zipfile.ZipInfo) -> bytes:
    start = _data_start(windows, info)
    return windows.slice(start, start + info.file_size)
