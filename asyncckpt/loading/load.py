"""Finding and loading checkpoints: layout names, `latest`, listing, `load`, `verify`, `cleanup`.

Loading reads through `SafeReader` (safe_reader.py), a DCP StorageReader that treats the
checkpoint as untrusted data (see safety.py) and reads local files in parallel (reader.py).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ..errors import CheckpointError, PartialLoadError
from ..formats import CHECKSUM_ALGORITHM, Sidecar
from .broadcast import load_group, open_shared
from .completeness import expand_statefuls, receive_everything
from .opened import OpenCheckpoint, as_open, read_metadata
from .ring import check_ring_bytes
from .safe_reader import SafeLoadPlanner, SafeReader
from ..layout import (
    METADATA_FILE, SIDECAR_NAME, CheckpointInfo, is_data_file, is_data_folder, is_temp_file, latest_checkpoint, list_checkpoints,
    list_files, parse_step, remove_empty_data_folders,
)
from ..storage import OpenUpload, is_remote, storage_for
from .verify import UNCHECKED_HINT, check_items, sidecar_belongs_to, stale_sidecars


log = logging.getLogger(__name__)

PARTLY_LOADED = (
    "state_dict is now PARTLY LOADED (some values are the checkpoint's, others what they were before): "
    "do not train from it; load again (a good checkpoint) or rebuild it from fresh values"
)
NOT_CHANGED = "nothing in state_dict was changed"
@contextlib.contextmanager
def interrupted_before_changes(path, changed_before: bool = False) -> Iterator[None]:
    """Ctrl-C in a step of a load that changes nothing (reading `.metadata`, say) is
    KeyboardInterrupt saying whether the state was changed (`changed_before`: by an earlier
    attempt), as one during the load itself says."""
    try:
        yield
    except KeyboardInterrupt as exc:
        if exc.args:  # (it says already)
            raise
        says = PARTLY_LOADED if changed_before else NOT_CHANGED
        raise KeyboardInterrupt(f"loading {getattr(path, 'path', path)!r}: {says}") from exc


def load(
    state_dict: dict[str, Any], path: str | OpenCheckpoint, *, verify: bool = False, trusted: bool = False,
    process_group=None, no_dist: bool = False, checksums: bool = True, ring_bytes: Optional[int] = None,
    storage_reader: Optional[SafeReader] = None, strict: bool = True,
) -> None:
    """Load a committed checkpoint into `state_dict` in place (tensors are read into the
    existing tensors; resharding follows DCP). `path`: its directory, or the checkpoint already
    opened (`loading.opened.open_checkpoint`: its `.metadata` was read as that said). With `verify=True`, checksums are checked first
    (they are checked as items are read either way). `checksums=False` checks none (for an
    intact checkpoint whose checksums sidecar is damaged).
    Safe for checkpoints from anywhere unless `trusted=True`, which allows full unpickling of
    `.metadata` and of objects (paths and byte ranges are checked either way). `no_dist=True`:
    this process loads alone, with no collective, even inside a distributed job. `ring_bytes`:
    the host memory (pinned, for CUDA targets) that bytes not read straight into their target go
    through (default 256 MiB; a piece larger than a slot of 16 MiB takes one more buffer).
    `storage_reader`: a SafeReader of another source (the memory tier's), instead of the committed
    checkpoint at `path`. `strict` (default): every saved entry under a key `state_dict` names
    reaches it (a fresh optimizer's empty `state` receives its saved moments) or the load is
    refused, naming the entries (completeness.py); `strict=False` loads only what it holds."""
    if verify and not checksums:
        raise ValueError("verify=True checks the checksums; it cannot go with checksums=False")
    check_ring_bytes(ring_bytes)
    if storage_reader is None:
        try:  # a store that cannot be read (after its retries) fails here too, before anything was read
            # a refused .metadata fails here, with its own message, on every rank; resume at scale:
            # read by one rank, sent to the others (broadcast.py)
            with interrupted_before_changes(path):
                shared_by = load_group(process_group, no_dist)  # (for NCCL: makes a gloo group, a rendezvous)
                opened = open_shared(path, trusted=trusted, group=shared_by)
        except OSError as exc:
            raise CheckpointError(f"loading {path!r} failed: {exc}; {NOT_CHANGED}") from exc
        path = opened.path
        reader = SafeReader(opened, trusted=trusted, checksums=checksums, ring_bytes=ring_bytes)
        reader.shared_by = shared_by  # resume at scale: items several ranks read, read once (replicated.py)
    else:
        opened, reader = None, storage_reader
    use_dist = not no_dist and dist.is_available() and dist.is_initialized()
    with interrupted_before_changes(path):  # Ctrl-C from here to the load's own handling says so too
        target = expand_statefuls(state_dict)
        group = reader.shared_by.pg if reader.shared_by is not None else process_group  # (gloo, the same ranks)
        ranks = _Ranks(group) if use_dist and dist.get_world_size(process_group) > 1 else None
        filled = receive_everything(target, reader.read_metadata(), path, strict, ranks)
        try:
            problems = verify_checkpoint(opened) if verify and opened is not None else []
        except BaseException:
            filled.undo()
            raise
        if problems:
            filled.undo()
            raise CheckpointError(f"{path!r} failed verification: " + "; ".join(problems[:5]))
    try:
        with warnings.catch_warnings():  # one process is what we mean: DCP's warning says nothing
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(
                target,
                storage_reader=reader,
                planner=SafeLoadPlanner(trusted, allow_partial_load=not strict),
                process_group=process_group,
                no_dist=not use_dist,
            )
        for key, value in state_dict.items():  # as dcp.load does with the Statefuls it is given
            if isinstance(value, Stateful):
                value.load_state_dict(target[key])
            else:
                state_dict[key] = target[key]
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, SystemExit) or (isinstance(exc, KeyboardInterrupt) and exc.args):
            raise
        filled.undo()
        failures = exc.failures if isinstance(exc, CheckpointException) else {}
        wrapped = any(isinstance(e, KeyboardInterrupt) for e, _ in failures.values())  # DCP wraps a Ctrl-C
        if isinstance(exc, KeyboardInterrupt) or wrapped:
            raise KeyboardInterrupt(f"loading {path!r}: {PARTLY_LOADED if reader.touched else NOT_CHANGED}") from exc
        causes = "; ".join(f"rank {rank}: {_describe(e)}" for rank, (e, _) in sorted(failures.items())) or _describe(exc)
        if reader.touched:  # this rank's tensors were being written (or were, and another rank failed)
            raise PartialLoadError(f"loading {path!r} failed: {causes}; {PARTLY_LOADED}") from exc
        raise CheckpointError(f"loading {path!r} failed: {causes}; {NOT_CHANGED}") from exc


class _Ranks:
    """completeness.LoadingRanks over `group`; a rank gone (or the group's timeout) is
    CheckpointError (before the load writes anything)."""

    def __init__(self, group) -> None:
        self.group = group

    def any(self, flag: bool) -> bool:
        if dist.get_backend(self.group) != "gloo":  # (NCCL, mixed: the device all_gather_object picks)
            return any(self.gather(flag))
        vote = torch.tensor([int(flag)], dtype=torch.int64)
        self._run(lambda: dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group))  # 1.3 ms here; objects 9.5
        return bool(vote.item())

    def gather(self, obj) -> list:
        out = [None] * dist.get_world_size(self.group)
        self._run(lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    @staticmethod
    def _run(collective) -> None:
        try:
            collective()
        except Exception as exc:  # gloo: a peer gone, or the timeout
            raise CheckpointError(f"the loading ranks could not agree on what the target lacks "
                                  f"({type(exc).__name__}: {exc}); {NOT_CHANGED}") from None


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def verify_checkpoint(path: str | OpenCheckpoint, trusted: bool = False) -> list[str]:
    """Re-read every item and check its checksum; return one line per damaged item (empty: intact),
    or one line saying why it cannot be verified. A damaged `.metadata` or sidecar raises
    CheckpointError naming the file. `trusted` as for `load` (how `.metadata` is unpickled)."""
    opened = as_open(path, trusted=trusted)
    if opened.sidecar_file is None:
        return [f"{opened.path}: it has no checksums sidecar (written by stock dcp.save, or with checksums=False): "
                "nothing to verify"]
    sidecar = opened.sidecar()
    if not sidecar_belongs_to(sidecar, opened.metadata):
        return [f"{opened.sidecar_file} belongs to another save of this step (an interrupted re-save); cannot verify"]
    checks = check_items(opened.storage, opened.path, opened.metadata, sidecar)
    return [f"{c.relative_path}: {c.name}: {c.problem}" for c in checks if c.problem]


def damage_of(path: str | OpenCheckpoint, trusted: bool = False) -> Optional[str]:
    """Why the committed checkpoint at `path` is damaged, or None when it reads back intact: its
    `.metadata` and sidecar read safely, and every item reads back whole and matches its checksum
    (items without one: whole). Stops at the first damaged item; never raises."""
    try:
        opened = as_open(path, trusted=trusted)
        try:
            sidecar = opened.own_sidecar()
        except CheckpointError as exc:
            return f"{exc}; {UNCHECKED_HINT}"
        if sidecar is None:  # nothing to compare with: read back only
            sidecar = Sidecar(CHECKSUM_ALGORITHM, None, [])
        for check in check_items(opened.storage, opened.path, opened.metadata, sidecar):
            if check.problem:
                return f"{check.relative_path}: {check.name}: {check.problem}"
    except CheckpointError as exc:
        return str(exc)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def resume_order(root: str) -> list[CheckpointInfo]:
    """The committed checkpoints of `root` in the order `load_latest` tries them: the one
    `latest_checkpoint` picks, then the others, newest first."""
    first = latest_checkpoint(root)
    others = [c for c in reversed(list_checkpoints(root)) if c.committed and c != first]
    return [first] + others if first is not None else []


def unreferenced_files(path: str, names: list[str]) -> list[str]:
    """Data files and sidecars of other saves of this step beside a committed checkpoint: what
    its `.metadata` does not use (nothing, if that cannot be read safely)."""
    try:
        metadata = read_metadata(path)
    except Exception as exc:  # refused or damaged: not ours to judge
        log.warning("leaving %s alone: its %s cannot be read safely (%s)", path, METADATA_FILE, exc)
        return []
    used = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return [n for n in names if is_data_file(n) and n not in used] + stale_sidecars(storage_for(path), path, names, metadata)


def uploads_left_open(
    uploads: list[OpenUpload], step_dir: Optional[str] = None, root: Optional[str] = None
) -> dict[str, list[OpenUpload]]:
    """The uploads of data files (our names) in `step_dir` or in any ROOT/step_N of `root`
    (directly or in a data folder), grouped by step directory; nothing else (another job's root
    nested under ours, files of other names) is ours to abort."""
    found: dict[str, list[OpenUpload]] = {}
    for upload in uploads:
        directory, _, name = upload.path.rpartition("/")
        if is_data_folder(directory.rpartition("/")[2]):  # step_N/p07/__7_0.distcp
            directory, _, folder = directory.rpartition("/")
            name = f"{folder}/{name}"
        parent, _, dir_name = directory.rpartition("/")
        ours = (step_dir is not None and directory == step_dir.rstrip("/")) or (
            root is not None and parent == root.rstrip("/") and parse_step(dir_name) is not None
        )
        if ours and is_data_file(name):
            found.setdefault(directory, []).append(upload)
    return found


def cleanup(root: str, dry_run: bool = False) -> list[str]:
    """Remove what interrupted saves left in `root`: step directories without `.metadata`, stray
    temp files of atomic writes, and data files and checksum sidecars a committed checkpoint's
    `.metadata` does not name (an interrupted re-save of that step). Returns the paths removed (with `dry_run`, that would be).

    Only what is recognisably ours goes: a torn directory holding anything but data files and
    temp files (a subdirectory, a file of another name) is kept and logged; symlinks are never
    followed or removed; nothing a committed checkpoint uses is touched (one whose `.metadata`
    cannot be read safely is left alone). On an object store, the multipart uploads of data
    files left open in the step directories are aborted too (their paths are returned).
    Do not run it while a save into `root` is in flight. A local `root` that is not there, or
    is a file, raises CheckpointError."""
    storage = storage_for(root)
    if not is_remote(root) and not storage.is_dir(root):  # a prefix holding no object may still hold open uploads
        what = "is a file, not a checkpoint root" if storage.exists(root) else "no such checkpoint root"
        raise CheckpointError(f"cleanup: {root!r}: {what}")
    uploads = [u for found in uploads_left_open(storage.open_uploads(root), root=root).values() for u in found]
    leftovers = [storage.join(root, name) for name in storage.list_dir(root) if is_temp_file(name)]
    spread = []  # committed checkpoints whose data folders may be left empty
    for info in list_checkpoints(root, storage):
        names = list_files(storage, info.path)
        if info.committed:
            leftovers += [storage.join(info.path, n) for n in names if is_temp_file(n)]
            leftovers += [storage.join(info.path, n) for n in unreferenced_files(info.path, names)]
            spread.append(info.path)
            continue
        foreign = [n for n in names if not (is_data_file(n) or is_temp_file(n) or SIDECAR_NAME.match(n))
                   or storage.is_dir(storage.join(info.path, n))]
        if foreign:
            log.warning("cleanup: keeping %s: it holds %s, which a save does not write", info.path, ", ".join(foreign[:3]))
        else:
            leftovers.append(info.path)
    leftovers = [p for p in leftovers if not storage.is_symlink(p)]
    if not dry_run:
        for path in leftovers:
            if storage.is_dir(path):
                storage.remove_tree(path)
            else:
                storage.remove_file(path)
        for upload in uploads:
            storage.abort_upload(upload)
        for step_dir in spread:  # data folders emptied above (prefix spreading)
            remove_empty_data_folders(storage, step_dir)
    leftovers += [u.path for u in uploads]
    if leftovers and not dry_run:
        log.info("cleanup removed %s", ", ".join(leftovers))
    return leftovers
