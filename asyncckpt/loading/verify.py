"""Checking a checkpoint's bytes against its checksums: which sidecar belongs to a `.metadata`,
reading it as untrusted input, and the one item verifier that `verify_checkpoint`,
`load(verify=True)` and `python -m asyncckpt verify` share.

A save into a fresh step directory writes `.checksums.json`; a save replacing a committed
checkpoint of its step writes `.checksums.<save_id>.json`, so the committed checkpoint keeps its
own sidecar until the new `.metadata` replaces it. `.metadata` records the save id, which names
the sidecar to use; sidecars of other saves are ignored here and removed after the commit.
With several ranks the sidecar holds the coordinator's items and names every other rank's part
(`p07/.checksums.r7.json`, beside its data files) with its length and CRC32C, so a part left by
another save under the same name is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointError
from ..formats import ChecksumsPart, ItemChecksum, Sidecar, crc32c, decode_checksums
from ..layout import CHECKSUMS_FILE, SIDECAR_NAME, is_checksums_part, sidecar_file
from .safety import check_relative_path
from ..storage import Storage

_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")
READ_CHUNK = 64 << 20
UNCHECKED_HINT = (
    "the data may still be intact: to load it without checking checksums, pass checksums=False "
    "(asyncckpt.load, load_latest)"
)


def committed_save_id(metadata: Metadata) -> Optional[str]:
    """The save id a `.metadata` records (None for checkpoints written before it was recorded,
    or one that is not a save id of ours: it is never used to build a path then)."""
    meta = getattr(metadata, "storage_meta", None)
    save_id = getattr(meta, "save_id", None)
    return save_id if isinstance(save_id, str) and _SAVE_ID.match(save_id) else None


def sidecar_belongs_to(sidecar: Sidecar, metadata: Metadata) -> bool:
    """Whether a checksums sidecar was written with this `.metadata` (older sidecars name no save)."""
    theirs = committed_save_id(metadata)
    return sidecar.save_id is None or theirs is None or sidecar.save_id == theirs


def find_sidecar(storage: Storage, path: str, metadata: Metadata) -> Optional[str]:
    """The sidecar file of the save `metadata` records, or None when the checkpoint has none."""
    save_id = committed_save_id(metadata)
    for name in ([sidecar_file(save_id)] if save_id else []) + [CHECKSUMS_FILE]:
        if storage.exists(storage.join(path, name)):
            return storage.join(path, name)
    return None


def stale_sidecars(storage: Storage, path: str, names: list[str], metadata: Metadata) -> list[str]:
    """Sidecars and checksums parts among `names` (the listing of checkpoint `path`) that belong
    to other saves than the one `metadata` records (while its own sidecar cannot be read, no part
    is judged stale)."""
    own = find_sidecar(storage, path, metadata)
    stale = [n for n in names if SIDECAR_NAME.match(n) and not is_checksums_part(n) and storage.join(path, n) != own]
    parts = [n for n in names if is_checksums_part(n)]
    if own is None:
        return stale + parts
    try:
        sidecar = decode_checksums(storage.read_bytes(own))
    except (OSError, ValueError):
        return stale
    if own.endswith(CHECKSUMS_FILE) and not sidecar_belongs_to(sidecar, metadata):
        return stale + [CHECKSUMS_FILE] + parts
    used = {p.file for p in sidecar.parts}
    return stale + [n for n in parts if n not in used]


def read_sidecar(
    storage: Storage, path: str, file: str, data_files: Optional[Iterable[str]] = None, data: Optional[bytes] = None
) -> Sidecar:
    """The sidecar `file` of checkpoint `path`, parsed, with the items of its parts that hold
    `data_files` (None: of every part); CheckpointError naming the file if it or a part is
    damaged, unreadable or another save's, or names a file outside the checkpoint. `data`: its
    bytes, already read (by another rank)."""
    try:
        sidecar = decode_checksums(storage.read_bytes(file) if data is None else data)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: damaged or unreadable checksums sidecar: {exc}") from None
    _check_paths(storage, path, file, {e.relative_path for e in sidecar.items})
    items = list(sidecar.items)
    for part in parts_holding(sidecar, data_files):
        items += read_part(storage, path, file, sidecar, part)
    return Sidecar(sidecar.algorithm, sidecar.save_id, items, sidecar.parts)


def parts_holding(sidecar: Sidecar, data_files: Optional[Iterable[str]]) -> list[ChecksumsPart]:
    """The parts of `sidecar` that hold items of `data_files` (None: every part)."""
    if data_files is None:
        return list(sidecar.parts)
    wanted = set(data_files)
    return [p for p in sidecar.parts if not wanted.isdisjoint(p.data_files)]


def read_part(storage: Storage, path: str, file: str, sidecar: Sidecar, part: ChecksumsPart) -> list[ItemChecksum]:
    """The items of one part of the sidecar `file`: its bytes must be those the sidecar names."""
    _check_paths(storage, path, file, {part.file})
    name = storage.join(path, part.file)
    try:
        data = storage.read_bytes(name)
    except OSError as exc:
        raise CheckpointError(f"{name}: checksums part named by {file} is unreadable: {exc}") from None
    if len(data) != part.length or crc32c(data) != part.crc32c:
        raise CheckpointError(f"{name}: checksums part is not the one {file} names (damaged, or another save's)")
    try:
        decoded = decode_checksums(data)
    except ValueError as exc:
        raise CheckpointError(f"{name}: damaged checksums part: {exc}") from None
    if decoded.algorithm != sidecar.algorithm or decoded.parts:
        raise CheckpointError(f"{name}: checksums part does not match {file}")
    _check_paths(storage, path, name, {e.relative_path for e in decoded.items})
    return decoded.items


def _check_paths(storage: Storage, path: str, file: str, relative_paths: set[str]) -> None:
    for relative_path in relative_paths:
        try:
            check_relative_path(storage, path, relative_path)
        except CheckpointError as exc:
            raise CheckpointError(f"{file}: {exc}") from None


@dataclass(frozen=True)
class ItemCheck:
    """One item re-read: where it is, whether a checksum covered it, and what is wrong (None: intact)."""

    relative_path: str
    name: str  # the fqn, with the chunk's offsets for a shard
    checked: bool
    problem: Optional[str]


def check_items(
    storage: Storage, path: str, metadata: Metadata, sidecar: Sidecar,
    progress: Optional[Callable[[int, str], None]] = None,
) -> Iterator[ItemCheck]:
    """Re-read every item `metadata` names, in file order and in chunks, and compare its checksum
    from `sidecar` (items without one are only read back). `progress(nbytes, name)` is told of
    every chunk. `metadata`'s paths must have been checked (loading.read_metadata does)."""
    sums = {(e.fqn, e.offset): e for e in sidecar.items}
    items = sorted((metadata.storage_data or {}).items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))
    for index, info in items:
        offset = tuple(index.offset) if index.offset is not None else None
        name = index.fqn if offset is None else f"{index.fqn}{list(offset)}"
        expected = sums.get((index.fqn, offset))
        problem = _check_item(storage, path, info, expected, sidecar, lambda n: progress and progress(n, name))
        yield ItemCheck(info.relative_path, name, expected is not None, problem)


def _check_item(storage: Storage, path: str, info, expected, sidecar: Sidecar, advance) -> Optional[str]:
    if expected is not None and (expected.relative_path, expected.start, expected.length) != (
        info.relative_path, info.offset, info.length
    ):
        advance(info.length)
        return f"{CHECKSUMS_FILE} and .metadata disagree on its location"
    file, crc, read = storage.join(path, info.relative_path), 0, 0
    try:
        while read < info.length:
            data = storage.read_bytes(file, info.offset + read, min(READ_CHUNK, info.length - read))
            if not data:
                break
            crc, read = sidecar.checksum(data, crc), read + len(data)
            advance(len(data))
    except OSError as exc:
        advance(info.length - read)
        return f"cannot read ({exc.strerror or exc})"
    if read < info.length:
        advance(info.length - read)
        return f"truncated: {read} of {info.length} bytes at offset {info.offset}"
    if expected is not None and crc != expected.crc32:
        return (f"checksum mismatch in bytes {info.offset}..{info.offset + info.length} "
                f"({sidecar.algorithm} {crc:08x}, expected {expected.crc32:08x})")
    return None
