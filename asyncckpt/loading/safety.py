"""Reading checkpoints nobody here wrote: `.metadata` without running code, paths kept inside.

A DCP `.metadata` is a pickle, and unpickling runs whatever callable the file names. Here it is
rebuilt by an unpickler that only builds the classes DCP's metadata is made of (found by pickling
the metadata of asyncckpt and stock `dcp.save` checkpoints: nested state, optimizer state,
objects, DTensors). Byte ranges named by the metadata are data too: a path must stay inside the
checkpoint directory, and a range inside its file. Objects load with `weights_only=True`.
`trusted=True` opts into full unpickling, for checkpoints whose author you trust.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import pickle
import re
from typing import Any, Iterator, Optional

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..errors import CheckpointError
from ..storage import Storage

_DCP = "torch.distributed.checkpoint.metadata"
_OLD_DCP = "torch.distributed._shard.sharded_tensor.metadata"  # where older torch releases pickled TensorProperties from
ALLOWED_GLOBALS = frozenset(
    [(_DCP, name) for name in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )]
    + [(_OLD_DCP, "TensorProperties"), (_OLD_DCP, "MEM_FORMAT_ENCODING")]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how TensorProperties pickles its layout
        ("pathlib", "PosixPath"),  # stock dcp.save stores checkpoint_id as a Path
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    ]
    + [("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)]
)

TRUST_HINT = "pass trusted=True to opt into full unpickling (only for checkpoints whose author you trust)"


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: any other global is refused before it is imported."""

    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise CheckpointError(
                f"{self._source}: refusing to unpickle {module}.{name}: DCP metadata is not made of it, "
                f"and unpickling it could run code; {TRUST_HINT}"
            )
        return super().find_class(module, name)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while millions of small acyclic objects are built
    (a `.metadata` unpickled, plans gathered): each collection would traverse all of them, which
    makes the work grow faster than linearly (4.5x less CPU for a 70B x 16-rank `.metadata`)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load_metadata(data: bytes, source: str, trusted: bool = False) -> Metadata:
    """Unpickle `.metadata` bytes (restricted unless `trusted`) and check its storage entries."""
    try:
        with collector_paused():
            metadata = pickle.loads(data) if trusted else _MetadataUnpickler(data, source).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{source}: cannot read DCP metadata: {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{source}: not DCP metadata (a pickled {type(metadata).__name__})")
    for index, info in (metadata.storage_data or {}).items():
        _check_entry(index, info, source)
    return metadata


def _check_entry(index: Any, info: Any, source: str) -> None:
    """Every storage entry must be plain data of the right types before any path or range is used."""
    if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
        raise CheckpointError(f"{source}: malformed storage entry {index!r}: {info!r}")
    valid = (
        isinstance(info.relative_path, str)
        and all(type(n) is int and n >= 0 for n in (info.offset, info.length))
        and (info.transform_descriptors is None or all(isinstance(d, str) for d in info.transform_descriptors))
    )
    if not valid:
        raise CheckpointError(f"{source}: malformed storage entry for {index.fqn!r}: {info!r}")


def check_relative_path(storage: Storage, directory: str, relative_path: str) -> str:
    """The full path of a file named by checkpoint metadata, refused unless it stays inside
    `directory`: no absolute path, no `..`, and (locally) no symlink resolving outside it."""
    if not relative_path or "\0" in relative_path or relative_path.startswith(("/", "\\")) \
            or os.path.isabs(relative_path) or ".." in relative_path.replace("\\", "/").split("/"):
        raise CheckpointError(f"{directory}: refusing file {relative_path!r} named by the metadata: it is not inside the checkpoint")
    full = storage.join(directory, relative_path)
    real_dir, real_full = storage.real_path(directory), storage.real_path(full)
    if real_full != real_dir and not real_full.startswith(real_dir.rstrip("/") + "/"):
        raise CheckpointError(f"{directory}: refusing file {relative_path!r}: it resolves outside the checkpoint (a symlink)")
    return full


def check_ranges(path: str, ranges: list[tuple[str, int, int]], size: int) -> None:
    """Byte ranges (what, offset, length) named by the metadata must lie inside their file of
    `size` bytes; the error names every item that does not (a truncated file loses several)."""
    past = [(what, offset, length) for what, offset, length in ranges if offset + length > size]
    if past:
        what, offset, length = past[0]
        more = f" (and {len(past) - 1} more: {', '.join(p[0] for p in past[1:6])}{' ...' if len(past) > 6 else ''})"
        raise CheckpointError(
            f"{path}: {what} claims bytes {offset}..{offset + length}, past the end of the file ({size} bytes)"
            + (more if len(past) > 1 else "")
        )


def load_object(data: bytes, trusted: bool, what: str) -> Any:
    """A BYTE_IO object (torch.save bytes): `weights_only=True` unless trusted."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        if trusted:
            raise CheckpointError(f"{what}: cannot unpickle: {exc}") from exc
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        refused = found.group(1) if found else "a class outside torch's weights_only allow-list"
        raise CheckpointError(f"{what}: refusing to unpickle {refused} (weights_only=True refused it); {TRUST_HINT}") from exc


def refused_globals(data: bytes | bytearray) -> Optional[list[str]]:
    """The classes and functions that `load_object` (weights_only=True) refuses in a torch.save
    archive `data`: its pickle's GLOBAL opcodes read without unpickling, against torch's own
    allow-list and what `torch.serialization.add_safe_globals` added. None when that cannot be
    told (not a zip archive, an opcode the scan does not know): unpickling then decides."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    except Exception:
        return None


def refused_objects_text(refused: dict[str, list[str]]) -> str:
    """`refused` (entry -> its refused globals) as errors and warnings name it."""
    shown = [f"{name!r} ({', '.join(found[:3])}{' ...' if len(found) > 3 else ''})" for name, found in refused.items()]
    return ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")


def load_tensor(data: bytes, what: str) -> torch.Tensor:
    """A tensor item (a torch.save archive of one chunk), always with `weights_only=True`."""
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{what}: cannot load tensor: {type(exc).__name__}: {exc}") from exc
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{what}: expected a tensor, found a {type(tensor).__name__}")
    return tensor


def raw_tensor(data: bytes, dtype: torch.dtype, sizes: tuple[int, ...], what: str) -> torch.Tensor:
    """A tensor item stored as raw bytes (safetensors bucket files): no unpickling at all."""
    expected = torch.Size(sizes).numel() * dtype.itemsize
    if len(data) != expected:
        raise CheckpointError(f"{what}: {len(data)} bytes stored, {expected} expected for {dtype} {list(sizes)}")
    if not data:
        return torch.empty(sizes, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(sizes)
