"""How items become bytes in a bucket file, what the files are called, and their checksums.

Format "torch_save": each tensor chunk is a standalone `torch.save` archive of exactly that chunk
and each object its `torch.save` bytes, so DCP's stock FileSystemReader reads every byte range.
Format "safetensors": each bucket file is a safetensors file (header, then every tensor's raw
bytes); `.metadata` points at each tensor's raw byte range, and `loading.SafeReader` reads them.
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import google_crc32c
import numpy as np
import torch
import xxhash

from .layout import SAFETENSORS, TORCH_SAVE
from .storage import WriteHandle

CHECKSUM_ALGORITHM = "crc32c"  # hardware CRC32C: about 9 GiB/s a core here, zlib's CRC32 2.6
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"  # the key DCP's HuggingFaceStorageReader reads chunk offsets from


class ItemSink:
    """File-like view of a WriteHandle that tracks the offset and the CRC32C of the current item.

    `offset` starts where the file already ends (a file is appended to across staging rounds).
    `stream_record` lets one large record of a torch.save archive come from elsewhere: when
    torch.save writes the placeholder storage's bytes, the real bytes are written instead."""

    def __init__(self, handle: WriteHandle, checksums: bool, offset: int = 0) -> None:
        self._handle = handle
        self._checksums = checksums
        self.offset = offset
        self._crc = 0
        self._substitute: Optional[tuple[int, int, Iterable]] = None

    def write(self, data) -> int:
        sub = self._substitute
        if sub is not None and len(data) == sub[1] and _address(data) == sub[0]:
            self._substitute = None
            for piece in sub[2]:
                self._write(piece)
            return len(data)
        return self._write(data)

    def _write(self, data) -> int:
        n = self._handle.write(data)
        if self._checksums:
            self._crc = crc32c(data, self._crc)
        self.offset += n
        return n

    def flush(self) -> None:
        pass

    def begin_item(self) -> int:
        self._crc = 0
        return self.offset

    def item_crc(self) -> Optional[int]:
        return self._crc if self._checksums else None

    def stream_record(self, placeholder: torch.Tensor, pieces: Iterable) -> None:
        self._substitute = (placeholder.data_ptr(), placeholder.untyped_storage().nbytes(), pieces)

    def check_streamed(self) -> None:
        if self._substitute is not None:
            self._substitute = None
            raise RuntimeError("torch.save did not write the streamed tensor's bytes in one record")


def _address(data) -> int:
    import numpy

    return numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data


def write_tensor(sink: ItemSink, tensor: torch.Tensor, fmt: str = TORCH_SAVE) -> None:
    """One tensor item. torch_save: a standalone torch.save archive of `tensor`, which must own a
    compact storage. safetensors: its raw bytes."""
    if fmt == SAFETENSORS:
        if tensor.nbytes:
            sink.write(raw_bytes(tensor))
    else:
        torch.save(tensor, sink)


def write_tensor_streamed(
    sink: ItemSink, dtype: torch.dtype, shape: Sequence[int], pieces: Iterable, fmt: str = TORCH_SAVE
) -> None:
    """A tensor too large to stage whole, from `pieces` (buffers, in C order, that together hold
    its bytes). The torch_save bytes are the same as `write_tensor` would write: torch.save runs
    on a placeholder whose pages are never touched, and its one data record is replaced."""
    if fmt == SAFETENSORS:
        for piece in pieces:
            sink.write(piece)
        return
    placeholder = torch.empty(tuple(shape), dtype=dtype)  # untouched: costs address space, not memory
    sink.stream_record(placeholder, pieces)
    torch.save(placeholder, sink)
    sink.check_streamed()


def raw_bytes(tensor: torch.Tensor):
    return tensor.reshape(-1).view(torch.uint8).numpy()


DIGEST_ALGORITHM = "xxh3_128"  # about 11 GB/s a core here (BLAKE2b: 0.5): far faster than any disk


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """A 128-bit digest of a (staged, compact) tensor's dtype, shape and bytes: equal digests
    mean an incremental save may reuse the stored item. The GIL is released while hashing."""
    hasher = xxhash.xxh3_128(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    if tensor.nbytes:
        hasher.update(raw_bytes(tensor))
    return hasher.digest()


def write_object_bytes(sink: ItemSink, data: bytes) -> None:
    """An object already pickled by the planner (torch.save bytes)."""
    sink.write(data)


def use_fast_serialization() -> None:
    """Turn off torch.save's own CRC32 in this process (the worker only): measured at 0.28 GiB/s,
    it would cap writes far below the disk; our CRC32C (about 9 GiB/s a core) replaces it."""
    torch.serialization.set_crc32_options(False)


@dataclass(frozen=True)
class ItemChecksum:
    fqn: str
    offset: Optional[tuple[int, ...]]
    relative_path: str
    start: int
    length: int
    crc32: int
    digest: Optional[bytes] = None  # tensors of an incremental save (DIGEST_ALGORITHM)


def _extend_without_gil() -> Optional[Callable[[int, int, int], int]]:
    """google_crc32c's C function `crc32c_extend(crc, address, length)` called through ctypes,
    which releases the GIL for the call. The module's own `extend` holds the GIL for anything but
    `bytes` of 1 MiB or more (its _crc32c.c), so checksums on several threads ran one at a time.
    dlsym finds the function in the extension or the library it links. None where it cannot."""
    try:
        from google_crc32c import _crc32c

        function = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    except (ImportError, OSError, AttributeError):
        return None
    function.restype = ctypes.c_uint32
    function.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
    return function


_EXTEND_WITHOUT_GIL = _extend_without_gil()
GIL_FREE_BYTES = 64 << 10  # below this the GIL is kept: the ctypes call costs ~2 us more than the work saved


def crc32c(data, value: int = 0) -> int:
    """CRC32C of any bytes-like object, continuing from `value`; from GIL_FREE_BYTES on, other
    threads run meanwhile (the loader's reading threads checksum in parallel)."""
    array = np.frombuffer(data, dtype=np.uint8)
    if _EXTEND_WITHOUT_GIL is not None and array.size >= GIL_FREE_BYTES:
        return _EXTEND_WITHOUT_GIL(value, array.ctypes.data, array.size)
    return google_crc32c.extend(value, array)


CHECKSUM_FUNCTIONS: dict[str, Callable[..., int]] = {"crc32c": crc32c, "crc32": zlib.crc32}  # crc32: older sidecars
_POLYNOMIALS = {"crc32c": 0x82F63B78, "crc32": 0xEDB88320}  # reflected


def _multiply_mod(a: int, b: int, poly: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order), as zlib's multmodp."""
    m, p = 1 << 31, 0
    while m and a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ poly if b & 1 else b >> 1
    return p


@functools.lru_cache(maxsize=256)  # pieces mostly share a few lengths
def _shift_power(poly: int, length: int) -> int:
    """x^(8 * length) modulo the polynomial: what appending `length` bytes multiplies a CRC by."""
    power, square, n = 1 << 31, 1 << 30, 8 * length  # x^0, x^1: reflected
    while n:
        if n & 1:
            power = _multiply_mod(square, power, poly)
        square = _multiply_mod(square, square, poly)
        n >>= 1
    return power


def crc_combine(algorithm: str, crc1: int, crc2: int, length2: int) -> int:
    """The checksum of A + B from those of A and B (B `length2` bytes long), so that pieces of
    one item read on different threads are checked without a second pass (zlib's crc32_combine)."""
    poly = _POLYNOMIALS[algorithm]
    return _multiply_mod(_shift_power(poly, length2), crc1, poly) ^ crc2


@dataclass(frozen=True)
class ChecksumsPart:
    """A rank's own checksums file, named by the sidecar (a save of several ranks: each rank writes
    its items' checksums beside its data files, so the coordinator never gathers them). `length`
    and `crc32c` bind the part to this save: a part another save left under the name fails them."""

    file: str  # relative to the checkpoint directory
    length: int
    crc32c: int
    data_files: tuple[str, ...]  # the files whose items it holds (a load reads only the parts it needs)


@dataclass(frozen=True)
class Sidecar:
    """The checksums of one save: `save_id` is the one in its `.metadata` (StorageMeta), so a
    sidecar left by a save that never committed is recognised as not belonging to the checkpoint
    (None in sidecars written before it was recorded). `items` are the sidecar's own and, once
    read (loading.verify.read_sidecar), those of its `parts`."""

    algorithm: str
    save_id: Optional[str]
    items: list[ItemChecksum]
    parts: tuple[ChecksumsPart, ...] = ()

    def checksum(self, data, value: int = 0) -> int:
        return CHECKSUM_FUNCTIONS[self.algorithm](data, value)

    def combine(self, crc1: int, crc2: int, length2: int) -> int:
        return crc_combine(self.algorithm, crc1, crc2, length2)


def encode_checksums(entries: list[ItemChecksum], save_id: Optional[str], parts: Sequence[ChecksumsPart] = ()) -> bytes:
    """A sidecar (or, with no save_id, a rank's part: it is bound to its save by the sidecar)."""
    records = [
        {
            "fqn": e.fqn,
            "offset": list(e.offset) if e.offset is not None else None,
            "file": e.relative_path,
            "start": e.start,
            "length": e.length,
            "crc32": e.crc32,
            **({DIGEST_ALGORITHM: e.digest.hex()} if e.digest is not None else {}),
        }
        for e in entries
    ]
    # compact: json's C encoder (indent= takes the pure-Python one, 3.5x slower at 100k items)
    doc = {"algorithm": CHECKSUM_ALGORITHM, "save_id": save_id, "items": records}
    if parts:
        doc["parts"] = [{"file": p.file, "length": p.length, "crc32c": p.crc32c, "data_files": list(p.data_files)}
                        for p in parts]
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_checksums(data: bytes) -> Sidecar:
    """Parse a sidecar; ValueError, saying what is wrong, for anything that is not one."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise ValueError("not a checksums document (no list of items)")
    if doc.get("algorithm") not in CHECKSUM_FUNCTIONS:
        raise ValueError(f"unknown checksum algorithm {doc.get('algorithm')!r}")
    save_id = doc.get("save_id")
    if save_id is not None and not isinstance(save_id, str):
        raise ValueError(f"save_id is {type(save_id).__name__}, not a string")
    parts = doc.get("parts", [])
    if not isinstance(parts, list):
        raise ValueError("parts is not a list")
    return Sidecar(doc["algorithm"], save_id, [_decode_item(n, r) for n, r in enumerate(doc["items"])],
                   tuple(_decode_part(n, p) for n, p in enumerate(parts)))


def _decode_part(n: int, record) -> ChecksumsPart:
    try:
        file, length, crc, data_files = record["file"], record["length"], record["crc32c"], record["data_files"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"part {n}: missing field {exc}") from None
    ok = isinstance(file, str) and _is_int(length) and _is_int(crc) and isinstance(data_files, list)
    if not ok or not all(isinstance(f, str) for f in data_files):
        raise ValueError(f"part {n}: a field has the wrong type ({record!r:.200})")
    return ChecksumsPart(file, length, crc, tuple(data_files))


def _decode_item(n: int, record) -> ItemChecksum:
    try:
        fqn, offset, file = record["fqn"], record["offset"], record["file"]
        numbers = [record[key] for key in ("start", "length", "crc32")]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"item {n}: missing field {exc}") from None
    ok = isinstance(fqn, str) and isinstance(file, str) and all(_is_int(x) for x in numbers)
    if not ok or not (offset is None or (isinstance(offset, list) and all(_is_int(x) for x in offset))):
        raise ValueError(f"item {n}: a field has the wrong type ({record!r:.200})")
    digest = record.get(DIGEST_ALGORITHM)
    if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{32}", digest)):
        raise ValueError(f"item {n}: {DIGEST_ALGORITHM} is not 32 hex digits ({digest!r:.60})")
    return ItemChecksum(fqn, tuple(offset) if offset is not None else None, file, *numbers,
                        bytes.fromhex(digest) if digest is not None else None)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# safetensors ------------------------------------------------------------------------------------
def _safetensors_dtypes() -> dict[torch.dtype, str]:
    names = {
        "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
        "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16",
        "uint32": "U32", "uint64": "U64", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
        "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    }
    return {getattr(torch, n): code for n, code in names.items() if hasattr(torch, n)}


SAFETENSORS_DTYPES = _safetensors_dtypes()


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors bucket file, in file order."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    saved_offsets: Optional[tuple[int, ...]]  # the chunk's offsets in the whole tensor (DCP)


def safetensors_header(entries: Sequence[SafetensorsEntry]) -> bytes:
    """The 8-byte length plus JSON header of a safetensors file holding `entries` back to back.
    The chunk offsets go into `__metadata__` under DCP_SHARDING_INFO, as DCP's
    HuggingFaceStorageReader expects. A name seen twice in one file gets its offsets appended."""
    header: dict = {}
    sharding: dict = {}
    begin = 0
    for entry in entries:
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{entry.name}: dtype {entry.dtype} cannot be stored in safetensors format")
        offsets = list(entry.saved_offsets) if entry.saved_offsets is not None else [0] * len(entry.shape)
        name = entry.name if entry.name not in header else f"{entry.name}@{offsets}"
        numel = 1
        for dim in entry.shape:
            numel *= dim
        end = begin + numel * torch.empty((), dtype=entry.dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape), "data_offsets": [begin, end]}
        sharding[name] = {"saved_offsets": offsets}
        begin = end
    header["__metadata__"] = {"format": "pt", DCP_SHARDING_INFO: json.dumps(sharding)}
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body
