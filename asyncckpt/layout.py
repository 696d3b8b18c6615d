"""Names on disk, in one place: step directories, `latest`, `.metadata`, data files, checksum
sidecars; and the listing of a root's checkpoints by those names. The worker writes data files
by these names too, so this module imports nothing of the trainer side."""

from __future__ import annotations

import logging
import os
import operator
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from .storage import Storage, storage_for

log = logging.getLogger(__name__)

METADATA_FILE = ".metadata"  # DCP's: written last, its presence is the commit
CHECKSUMS_FILE = ".checksums.json"  # the sidecar of a save into a fresh step directory
# either kind of sidecar, or a rank's checksums part (`p07/.checksums.r7.json`, tagged as its data files)
SIDECAR_NAME = re.compile(r"^(p\d{2,}/)?\.checksums(\.[0-9a-f]{32}|\.r\d+(?P<tag>\.[0-9a-f]{8})?)?\.json$")
TORCH_SAVE = "torch_save"
SAFETENSORS = "safetensors"
TORCH_SAVE_SUFFIX = ".distcp"
SAFETENSORS_SUFFIX = ".safetensors"
ROOT_ID_FILE = ".asyncckpt_root_id"  # in a root: the id of its history (loading/history.py)
LOCK_FILE = ".asyncckpt.lock"  # in a root (or a folder the doors save into): which job holds it


# data file names -------------------------------------------------------------------------------
# A save's data files are `__{rank}_{n}{tag}.distcp` (torch_save) or `.safetensors`. The tag is
# empty, or "." and 8 hex digits when the save replaces a committed checkpoint of the same step:
# its files then get other names, and the old checkpoint stays whole until the new one commits.
# With prefix spreading a rank's data files lie in a data folder of the step directory (below):
# their names, relative to the step directory, are then `p07/__7_0.distcp`.
_DATA_FILE = re.compile(
    rf"^(p\d{{2,}}/)?__\d+_\d+(?P<tag>\.[0-9a-f]{{8}})?({re.escape(TORCH_SAVE_SUFFIX)}|{re.escape(SAFETENSORS_SUFFIX)})$"
)


def data_file_name(rank: int, n: int, fmt: str = TORCH_SAVE, tag: str = "") -> str:
    """The name of data file `n` of `rank` in format `fmt`."""
    return f"__{rank}_{n}{tag}" + (SAFETENSORS_SUFFIX if fmt == SAFETENSORS else TORCH_SAVE_SUFFIX)


def new_file_tag() -> str:
    """A fresh tag for the data files of a save that replaces a committed checkpoint."""
    return f".{uuid.uuid4().hex[:8]}"


def is_data_file(name: str, tag: Optional[str] = None) -> bool:
    """Whether `name` (relative to its step directory) is a data file a save writes (and, when
    `tag` is given, one with that tag)."""
    match = _DATA_FILE.match(name)
    return match is not None and (tag is None or (match.group("tag") or "") == tag)


# prefix spreading ----------------------------------------------------------------------------------
# S3 takes about 3,500 writes/s per key prefix (more makes it answer 503 SlowDown). A save of many
# ranks can spread its data files over `prefixes` data folders right after the step directory:
# rank r's files go to `p{r % prefixes}` (`step_00000100/p07/__7_0.distcp`), so each folder is a
# prefix of its own. `.metadata`, the sidecar and `latest` stay where they are; `.metadata` names
# each file by its path relative to the step directory, which stock DCP readers join as given.
WRITES_PER_PREFIX = 3500  # no data folder gets more writes than this in one save
_DATA_FOLDER = re.compile(r"^p\d{2,}$")


def prefix_count(ranks: int, writes_per_rank: int) -> int:
    """Data folders for a save of `ranks` ranks issuing at most `writes_per_rank` write requests
    each: few enough that a rank's files stay together, enough that no folder gets more than
    WRITES_PER_PREFIX writes, so even a save that ends within a second is not throttled. 1: none."""
    per_folder = max(1, WRITES_PER_PREFIX // max(writes_per_rank, 1))  # whole ranks per folder
    return max(1, min(ranks, -(-ranks // per_folder)))


def data_folder(rank: int, prefixes: int) -> str:
    """The data folder of `rank`'s files when a save is spread over `prefixes` ("": none)."""
    if prefixes <= 1:
        return ""
    return f"p{rank % prefixes:0{max(2, len(str(prefixes - 1)))}d}"


def in_folder(folder: str, name: str) -> str:
    """A data file's name relative to its step directory."""
    return f"{folder}/{name}" if folder else name


def is_data_folder(name: str) -> bool:
    return bool(_DATA_FOLDER.match(name))


def list_files(storage: Storage, path: str) -> list[str]:
    """The names in a checkpoint directory, each data folder's files as `pNN/name` instead of the
    folder (an empty data folder lists as nothing)."""
    names = []
    for name in storage.list_dir(path):
        if is_data_folder(name) and storage.is_dir(storage.join(path, name)):
            names += [in_folder(name, inner) for inner in storage.list_dir(storage.join(path, name))]
        else:
            names.append(name)
    return names


def remove_empty_data_folders(storage: Storage, step_dir: str) -> None:
    """Remove the data folders (prefix spreading) whose files all went: a filesystem would keep
    them empty (an object store has no empty folders)."""
    for name in storage.list_dir(step_dir):
        if is_data_folder(name):
            storage.remove_empty_dir(storage.join(step_dir, name))


def as_step(step: Any) -> int:
    """A step as an int. Integral scalars count (NumPy ints, a one-element integer tensor: what
    training loops often count with); bools, floats and negatives are refused."""
    try:
        value = operator.index(step) if not isinstance(step, bool) else None
    except TypeError:
        value = None
    if value is None or value < 0:
        raise ValueError(f"step must be a non-negative integer, not {step!r}")
    return value


def save_directory(
    root: Optional[str], step: Any, checkpoint_dir: Optional[str]
) -> tuple[Optional[int], Optional[str], str]:
    """Where a save goes, after checking its arguments: (the step as an int (`as_step`), or None;
    the step directory's name, or None for a `checkpoint_dir` the caller named; the directory written)."""
    step = None if step is None else as_step(step)
    if checkpoint_dir is not None:
        return step, None, os.fspath(checkpoint_dir)
    if step is None:
        raise ValueError("schedule_save needs a step (saved as ROOT/step_N) or a checkpoint_dir")
    if root is None:
        raise ValueError("schedule_save(step=...) needs a checkpoint root: AsyncCheckpointer(root, ...)")
    return step, step_dir_name(step), storage_for(root).join(root, step_dir_name(step))


def is_safetensors_file(name: str) -> bool:
    """Whether a data file holds raw tensor bytes (safetensors) rather than torch.save archives."""
    return name.endswith(SAFETENSORS_SUFFIX)


def checksums_part_file(rank: int, tag: str = "", folder: str = "") -> str:
    """The name of `rank`'s checksums part (a save of several ranks), beside its data files."""
    return in_folder(folder, f".checksums.r{rank}{tag}.json")


def is_checksums_part(name: str, tag: Optional[str] = None) -> bool:
    """Whether `name` is a rank's checksums part (and, when `tag` is given, one with that tag)."""
    match = SIDECAR_NAME.match(name)
    return match is not None and ".r" in name.rpartition("/")[2] and (tag is None or (match.group("tag") or "") == tag)


def sidecar_file(save_id: Optional[str]) -> str:
    """The sidecar name of a save that replaces a committed checkpoint of its step: tied to the
    save, so the committed checkpoint's own sidecar stays in place until the new `.metadata` is."""
    return CHECKSUMS_FILE if save_id is None else f".checksums.{save_id}.json"


# step directories and `latest` --------------------------------------------------------------------
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
# write_atomic's temp files (stock DCP: .metadata.tmp) and prepare_dir's probes
_TEMP_FILE = re.compile(
    r"^\.(\.metadata|\.checksums(\.[0-9a-f]{32})?\.json|latest)\.tmp-[A-Za-z0-9-]+$|^\.metadata\.tmp$|^\.asyncckpt-probe-[\w-]+$"
    r"|^(p\d{2,}/)?\.\.checksums\.r\d+(\.[0-9a-f]{8})?\.json\.tmp-[A-Za-z0-9-]+$"  # of a rank's checksums part
)


def is_temp_file(name: str) -> bool:
    """A temp file of an atomic write (stock DCP's `.metadata.tmp` too) or a writability probe."""
    return bool(_TEMP_FILE.match(name))


def is_checkpoint_file(name: str) -> bool:
    """Whether a file of this name is one a save writes into a checkpoint directory."""
    return name == METADATA_FILE or bool(SIDECAR_NAME.match(name)) or is_data_file(name) or is_temp_file(name)


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
