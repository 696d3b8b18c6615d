"""Finding and loading checkpoints: layout names, `latest`, listing, `load`, `verify`."""

from __future__ import annotations

import logging
import pickle
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from .errors import CheckpointError
from .formats import CHECKSUMS_FILE, crc32_of, decode_checksums
from .storage import Storage, storage_for

log = logging.getLogger(__name__)

METADATA_FILE = ".metadata"
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> Optional[int]:
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    name: str
    path: str
    committed: bool


def list_checkpoints(root: str, storage: Optional[Storage] = None) -> list[CheckpointInfo]:
    """Every step directory in `root`, oldest first; `committed` means `.metadata` exists.
    Symlinks and anything not named step_NNNNNNNN are not checkpoints of this root."""
    storage = storage or storage_for(root)
    found = []
    for name in storage.list_dir(root):
        step = parse_step(name)
        path = storage.join(root, name)
        if step is None or not storage.is_dir(path):
            continue
        committed = storage.exists(storage.join(path, METADATA_FILE))
        found.append(CheckpointInfo(step, name, path, committed))
    return sorted(found, key=lambda c: c.step)


def read_latest_marker(root: str, storage: Optional[Storage] = None) -> Optional[str]:
    storage = storage or storage_for(root)
    marker = storage.join(root, LATEST_FILE)
    if not storage.exists(marker):
        return None
    return storage.read_bytes(marker).decode().strip() or None


def latest_checkpoint(root: str) -> Optional[CheckpointInfo]:
    """The checkpoint `latest` names if it is committed, else the newest committed one."""
    storage = storage_for(root)
    committed = [c for c in list_checkpoints(root, storage) if c.committed]
    named = read_latest_marker(root, storage)
    for info in committed:
        if info.name == named:
            return info
    if named is not None:
        log.warning("%s: 'latest' names %r, which is not a committed checkpoint; using the newest committed", root, named)
    return committed[-1] if committed else None


def load(state_dict: dict[str, Any], path: str, *, verify: bool = False, process_group=None) -> None:
    """Load a committed checkpoint into `state_dict` in place (tensors are copied into the
    existing tensors; resharding follows DCP). With `verify=True`, checksums are checked first."""
    storage = storage_for(path)
    if not storage.exists(storage.join(path, METADATA_FILE)):
        raise CheckpointError(f"{path!r} is not a committed checkpoint (no {METADATA_FILE})")
    if verify:
        problems = verify_checkpoint(path)
        if problems:
            raise CheckpointError(f"{path!r} failed verification: " + "; ".join(problems[:5]))
    use_dist = dist.is_available() and dist.is_initialized()
    try:
        dcp.load(state_dict, storage_reader=FileSystemReader(path), process_group=process_group, no_dist=not use_dist)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"loading {path!r} failed: {exc}") from exc


def verify_checkpoint(path: str) -> list[str]:
    """Re-read every item with a checksum; return one line per damaged item (empty: intact)."""
    storage = storage_for(path)
    sidecar = storage.join(path, CHECKSUMS_FILE)
    if not storage.exists(sidecar):
        return [f"{path}: no {CHECKSUMS_FILE} (saved with checksums=False?)"]
    problems = []
    for entry in decode_checksums(storage.read_bytes(sidecar)):
        data = storage.read_bytes(storage.join(path, entry.relative_path), entry.start, entry.length)
        name = entry.fqn if entry.offset is None else f"{entry.fqn}{list(entry.offset)}"
        if len(data) != entry.length:
            problems.append(f"{entry.relative_path}: {name} is truncated")
        elif crc32_of(data) != entry.crc32:
            problems.append(f"{entry.relative_path}: {name} checksum mismatch")
    return problems


def read_metadata(path: str):
    storage = storage_for(path)
    return pickle.loads(storage.read_bytes(storage.join(path, METADATA_FILE)))
