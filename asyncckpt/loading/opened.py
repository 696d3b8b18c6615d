"""A committed checkpoint opened once: its storage, `.metadata` (unpickled safely, every file it
names checked to lie inside), its data files and the checksums sidecar of its save.

`load`, `verify_checkpoint`, `load_latest`'s damage check, the CLI's `inspect` / `verify`, the
export and the doors' resumes are handed this one object, so a path's storage is resolved once,
`.metadata` is read and unpickled once and the sidecar found and parsed once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointError
from ..formats import Sidecar
from ..layout import METADATA_FILE
from ..storage import Storage, storage_for
from .safety import check_relative_path, load_metadata
from .verify import find_sidecar, parts_holding, read_part, read_sidecar, sidecar_belongs_to

_NOT_LOOKED = object()  # the sidecar's file has not been looked for yet


def read_metadata(
    path: str, *, trusted: bool = False, name: str = METADATA_FILE, storage: Optional[Storage] = None
) -> Metadata:
    """A checkpoint's DCP metadata, unpickled safely (see safety.py), every file it names
    checked to lie inside `path`."""
    storage = storage or storage_for(path)
    source = storage.join(path, name)
    metadata = load_metadata(storage.read_bytes(source), source, trusted)
    _checked_files(storage, path, metadata)
    return metadata


def _checked_files(storage: Storage, path: str, metadata: Metadata) -> dict[str, str]:
    """relative path -> full path of every file `metadata` names, each refused unless inside `path`."""
    relative_paths = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return {relative_path: check_relative_path(storage, path, relative_path) for relative_path in sorted(relative_paths)}


def require_committed(path: str, storage: Optional[Storage] = None) -> None:
    """CheckpointError unless `path` holds a committed checkpoint, saying what is there instead."""
    storage = storage or storage_for(path)
    if storage.exists(storage.join(path, METADATA_FILE)):
        return
    if storage.exists(path):
        raise CheckpointError(f"{path!r} is a file, not a checkpoint directory")
    if not storage.is_dir(path):
        raise CheckpointError(f"{path!r}: no such checkpoint directory")
    raise CheckpointError(f"{path!r} is not a committed checkpoint (no {METADATA_FILE})")


@dataclass
class OpenCheckpoint:
    """A committed checkpoint, read once. `files` maps each relative path `.metadata` names to
    its full path (checked to stay inside `path`); the sidecar and file sizes are read on first
    use and kept."""

    path: str
    storage: Storage
    metadata: Metadata
    trusted: bool
    files: dict[str, str]
    _sidecar_file: object = field(default=_NOT_LOOKED, repr=False)
    _sidecar: Optional[Sidecar] = field(default=None, repr=False)  # with the items of the parts read so far
    _parts_read: set[str] = field(default_factory=set, repr=False)
    _sizes: dict[str, int] = field(default_factory=dict, repr=False)
    _sidecar_bytes: Optional[bytes] = field(default=None, repr=False)  # resume at scale: sent by the rank that read it (broadcast.py)

    @property
    def sidecar_file(self) -> Optional[str]:
        """The sidecar of the save `.metadata` records; None: saved without checksums."""
        if self._sidecar_file is _NOT_LOOKED:
            self._sidecar_file = find_sidecar(self.storage, self.path, self.metadata)
        return self._sidecar_file  # type: ignore[return-value]

    def sidecar(self, data_files: Optional[Iterable[str]] = None) -> Optional[Sidecar]:
        """The parsed sidecar (None: there is none) with the items of its parts that hold
        `data_files` (None: every part; a load reads only those of the files it reads);
        CheckpointError naming it or a part if one is damaged."""
        if self.sidecar_file is None:
            return None
        if self._sidecar is None:
            self._sidecar = read_sidecar(self.storage, self.path, self.sidecar_file, data_files=(), data=self._sidecar_bytes)
        missing = [p for p in parts_holding(self._sidecar, data_files) if p.file not in self._parts_read]
        if missing:
            items = list(self._sidecar.items)
            for part in missing:
                items += read_part(self.storage, self.path, self.sidecar_file, self._sidecar, part)
                self._parts_read.add(part.file)
            self._sidecar = replace(self._sidecar, items=items)
        return self._sidecar

    def own_sidecar(self) -> Optional[Sidecar]:
        """The sidecar, unless it belongs to another save of this step (an interrupted re-save)."""
        sidecar = self.sidecar()
        return sidecar if sidecar is not None and sidecar_belongs_to(sidecar, self.metadata) else None

    def file_size(self, relative_path: str) -> int:
        """Size of a data file (OSError if it cannot be read), asked of the storage once."""
        if relative_path not in self._sizes:
            self._sizes[relative_path] = self.storage.size(self.files[relative_path])
        return self._sizes[relative_path]


def open_checkpoint(path: str, *, trusted: bool = False) -> OpenCheckpoint:
    """Open the committed checkpoint at `path`: CheckpointError saying what is there instead if
    it is none, or naming `.metadata` if that is refused or damaged. `trusted`: unpickle
    `.metadata` fully (paths are checked either way)."""
    storage = storage_for(path)
    require_committed(path, storage)
    return opened_from_bytes(path, storage, storage.read_bytes(storage.join(path, METADATA_FILE)), trusted)


def opened_from_bytes(path: str, storage: Storage, data: bytes, trusted: bool = False) -> OpenCheckpoint:
    """The checkpoint at `path` whose `.metadata` holds `data` (read here, or by another rank:
    loading/broadcast.py), unpickled safely and its paths checked."""
    source = storage.join(path, METADATA_FILE)
    metadata = load_metadata(data, source, trusted)
    return OpenCheckpoint(path, storage, metadata, trusted, _checked_files(storage, path, metadata))


def opened_with(path: str, metadata: Metadata, trusted: bool = False) -> OpenCheckpoint:
    """The checkpoint at `path` described by `metadata` a caller read itself (its paths checked here)."""
    storage = storage_for(path)
    return OpenCheckpoint(path, storage, metadata, trusted, _checked_files(storage, path, metadata))


def as_open(checkpoint: str | OpenCheckpoint, *, trusted: bool = False) -> OpenCheckpoint:
    """`checkpoint` itself when already open (read as its opener said), else opened now."""
    return checkpoint if isinstance(checkpoint, OpenCheckpoint) else open_checkpoint(checkpoint, trusted=trusted)
