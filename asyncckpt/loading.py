"""Finding and loading checkpoints: layout names, `latest`, listing, `load`, `verify`, `cleanup`.

Loading reads through `SafeReader`, a DCP StorageReader that treats the checkpoint as untrusted
data (see safety.py): restricted unpickling of `.metadata`, paths and byte ranges checked before
any read, tensors and objects loaded with `weights_only=True` unless the caller says `trusted=True`.
"""

from __future__ import annotations

import io
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import DefaultLoadPlanner, StorageReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .errors import CheckpointError
from .formats import SIDECAR_NAME, Sidecar, is_data_file, is_safetensors_file
from .safety import TRUST_HINT, check_range, check_relative_path, load_metadata, load_object, load_tensor, raw_tensor
from .reader import ItemRead, read_items
from .storage import LocalStorage, OpenUpload, Storage, storage_for
from .verify import check_items, find_sidecar, read_sidecar, sidecar_belongs_to, stale_sidecars

log = logging.getLogger(__name__)

METADATA_FILE = ".metadata"
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
# write_atomic's temp files (stock DCP: .metadata.tmp) and prepare_dir's probes
_TEMP_FILE = re.compile(
    r"^\.(\.metadata|\.checksums(\.[0-9a-f]{32})?\.json|latest)\.tmp-[A-Za-z0-9-]+$|^\.metadata\.tmp$|^\.asyncckpt-probe-[\w-]+$"
)


def is_checkpoint_file(name: str) -> bool:
    """Whether a file of this name is one a save writes into a checkpoint directory."""
    return name == METADATA_FILE or bool(SIDECAR_NAME.match(name)) or is_data_file(name) or bool(_TEMP_FILE.match(name))


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


def load(
    state_dict: dict[str, Any], path: str, *, verify: bool = False, trusted: bool = False, process_group=None,
    no_dist: bool = False,
) -> None:
    """Load a committed checkpoint into `state_dict` in place (tensors are copied into the
    existing tensors; resharding follows DCP). With `verify=True`, checksums are checked first.
    Safe for checkpoints from anywhere unless `trusted=True`, which allows full unpickling of
    `.metadata` and of objects (paths and byte ranges are checked either way). `no_dist=True`:
    this process loads alone, with no collective, even inside a distributed job."""
    storage = storage_for(path)
    if not storage.exists(storage.join(path, METADATA_FILE)):
        raise CheckpointError(f"{path!r} is not a committed checkpoint (no {METADATA_FILE})")
    reader = SafeReader(path, trusted=trusted)
    metadata = reader.read_metadata()  # a refused .metadata fails here, with its own message, on every rank
    check_no_stateless_optimizer(state_dict, metadata, path)
    if verify:
        problems = verify_checkpoint(path, trusted)
        if problems:
            raise CheckpointError(f"{path!r} failed verification: " + "; ".join(problems[:5]))
    use_dist = not no_dist and dist.is_available() and dist.is_initialized()
    try:
        with warnings.catch_warnings():  # one process is what we mean: DCP's warning says nothing
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(
                state_dict,
                storage_reader=reader,
                planner=SafeLoadPlanner(trusted),
                process_group=process_group,
                no_dist=not use_dist,
            )
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"loading {path!r} failed: {exc}") from exc


def check_no_stateless_optimizer(state_dict: dict[str, Any], metadata: Metadata, path: str, prefix: str = "") -> None:
    """DCP loads only the keys the target already has. A fresh optimizer has no state yet, so its
    saved moments would be dropped without a word: refuse instead, saying what to do."""
    for key, value in state_dict.items():
        fqn = f"{prefix}{key}"
        if isinstance(value, dict):
            check_no_stateless_optimizer(value, metadata, path, f"{fqn}.")
        elif isinstance(value, torch.optim.Optimizer) and not value.state:
            saved = [k for k in metadata.state_dict_metadata if k.startswith(f"{fqn}.state.")]
            if saved:
                raise CheckpointError(
                    f"{path!r}: the optimizer at {fqn!r} has no state yet, so its {len(saved)} saved state "
                    "entries would be silently dropped; save and load model and optimizer through "
                    "torch.distributed.checkpoint.state_dict.get_state_dict / set_state_dict (see docs/usage.md), "
                    "or load after the optimizer's first step"
                )


def read_metadata(path: str, *, trusted: bool = False, name: str = METADATA_FILE) -> Metadata:
    """A checkpoint's DCP metadata, unpickled safely (see safety.py), every file it names
    checked to lie inside `path`."""
    storage = storage_for(path)
    source = storage.join(path, name)
    metadata = load_metadata(storage.read_bytes(source), source, trusted)
    for relative_path in {info.relative_path for info in (metadata.storage_data or {}).values()}:
        check_relative_path(storage, path, relative_path)
    return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but objects are unpickled with `weights_only=True` unless
    trusted (the stock planner unpickles them fully)."""

    def __init__(self, trusted: bool = False) -> None:
        super().__init__()
        self.trusted = trusted

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_object(value.getvalue(), self.trusted, f"object {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeReader(StorageReader):
    """A DCP StorageReader for checkpoints nobody here wrote, on any asyncckpt storage (local,
    msc://, s3://). It reads what stock FileSystemReader reads (torch.save items, stream
    transforms) and asyncckpt's raw safetensors items; every path and byte range is checked
    before it is read. Objects need `SafeLoadPlanner` unless `trusted=True`."""

    def __init__(self, path: str, *, trusted: bool = False) -> None:
        super().__init__()
        self.trusted = trusted
        self._transforms = _StorageReaderTransforms()
        self.reset(path)

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.path = str(checkpoint_id)
            self.storage = storage_for(self.path)
        self.metadata: Optional[Metadata] = None
        self.checksums: dict[tuple[str, int, int], int] = {}
        self.sidecar: Optional[Sidecar] = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, str)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP asks for __{rank}.metadata when .metadata is missing
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        return read_metadata(self.path, trusted=self.trusted, name=name)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointError(f"{self.path}: {METADATA_FILE} has no storage_data")
        self.metadata = metadata
        self.checksums = self._load_checksums()

    def _load_checksums(self) -> dict[tuple[str, int, int], int]:
        """(file, offset, length) -> checksum from the sidecar, so every item is checked as it is
        read (no second pass over the data). Checkpoints without a sidecar load unchecked."""
        path = find_sidecar(self.storage, self.path, self.metadata)
        if path is None:
            return {}
        sidecar = read_sidecar(self.storage, self.path, path)
        if not sidecar_belongs_to(sidecar, self.metadata):
            log.warning("%s belongs to another save of this step (an interrupted re-save); loading unchecked", path)
            return {}
        self.sidecar = sidecar
        return {(e.relative_path, e.start, e.length): e.crc32 for e in sidecar.items}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not self.trusted and not isinstance(planner, SafeLoadPlanner):
            if any(req.type == LoadItemType.BYTE_IO for req in plan.items):
                raise CheckpointError(f"{self.path}: objects are unpickled by the planner: use SafeLoadPlanner, or {TRUST_HINT}")
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.metadata.storage_data[req.storage_index].relative_path, []).append(req)
        files = {relative_path: check_relative_path(self.storage, self.path, relative_path) for relative_path in per_file}
        for relative_path, reqs in per_file.items():  # every range checked before anything is read
            size = self._file_size(files[relative_path], reqs)
            for req in reqs:
                info = self.metadata.storage_data[req.storage_index]
                check_range(files[relative_path], _item_name(req), info.offset, info.length, size)
        if isinstance(self.storage, LocalStorage):
            items = [self._item_read(files[info_path], req, planner) for info_path, reqs in per_file.items() for req in reqs]
            decode = lambda item: self._place(item.path, item.req, bytes(item.data), planner)  # noqa: E731
            read_items(items, planner, self.sidecar if self.checksums else None, decode)
        else:
            for relative_path, reqs in per_file.items():
                for req in reqs:
                    self._read_item(files[relative_path], req, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _file_size(self, file: str, reqs: list[ReadItem]) -> int:
        try:
            return self.storage.size(file)
        except OSError as exc:
            names = ", ".join(_item_name(req) for req in reqs[:3]) + (" ..." if len(reqs) > 3 else "")
            raise CheckpointError(f"{file}: cannot read it ({exc.strerror or exc}); it holds {names}") from None

    def _item_read(self, file: str, req: ReadItem, planner: LoadPlanner) -> ItemRead:
        """What the parallel reader needs of one item (its target resolved here, on this thread)."""
        info = self.metadata.storage_data[req.storage_index]
        expected_crc = self.checksums.get((info.relative_path, info.offset, info.length))
        item = ItemRead(req, file, f"{file}: {_item_name(req)}", info.offset, info.length, expected_crc)
        if req.type != LoadItemType.BYTE_IO and not info.transform_descriptors:
            item.dtype, item.chunk = self._chunk_layout(req)
            item.torch_save = not is_safetensors_file(info.relative_path)
            item.target = planner.resolve_tensor(req).detach()
            if tuple(item.target.size()) != tuple(req.lengths):
                raise CheckpointError(f"{item.name}: target size {tuple(item.target.size())} != {tuple(req.lengths)} read")
        return item

    def _read_item(self, file: str, req: ReadItem, planner: LoadPlanner) -> None:
        info = self.metadata.storage_data[req.storage_index]
        data = self.storage.read_bytes(file, info.offset, info.length)
        what = f"{file}: {_item_name(req)}"
        if len(data) != info.length:
            raise CheckpointError(f"{what} is truncated ({len(data)} of {info.length} bytes)")
        expected_crc = self.checksums.get((info.relative_path, info.offset, info.length))
        if expected_crc is not None and self.sidecar.checksum(data) != expected_crc:
            raise CheckpointError(f"{what}: checksum mismatch (the data file is damaged)")
        self._place(file, req, data, planner)

    def _place(self, file: str, req: ReadItem, data: bytes, planner: LoadPlanner) -> None:
        """Decode one item's checked bytes and put the result in the state dict."""
        info = self.metadata.storage_data[req.storage_index]
        what = f"{file}: {_item_name(req)}"
        if info.transform_descriptors:
            data = self._transforms.transform_load_stream(req, info.transform_descriptors, io.BytesIO(data)).read()
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(data))
            return
        if is_safetensors_file(info.relative_path):
            tensor = raw_tensor(data, *self._chunk_layout(req), what)
        else:
            tensor = load_tensor(data, what)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"{what}: stored size {tuple(tensor.size())} != target {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def _chunk_layout(self, req: ReadItem):
        """dtype and shape of a raw item, which only the metadata records."""
        meta = self.metadata.state_dict_metadata.get(req.storage_index.fqn)
        if isinstance(meta, TensorStorageMetadata):
            for chunk in meta.chunks:
                if tuple(chunk.offsets) == tuple(req.storage_index.offset or ()):
                    return meta.properties.dtype, tuple(chunk.sizes)
        raise CheckpointError(f"{self.path}: no chunk in {METADATA_FILE} for {req.storage_index}")


def _item_name(req: ReadItem) -> str:
    """An item as errors name it: its fqn, with the chunk's offsets for a tensor."""
    offset = req.storage_index.offset
    return req.storage_index.fqn if offset is None else f"{req.storage_index.fqn}{list(offset)}"


def verify_checkpoint(path: str, trusted: bool = False) -> list[str]:
    """Re-read every item and check its checksum; return one line per damaged item (empty: intact),
    or one line saying why it cannot be verified. A damaged `.metadata` or sidecar raises
    CheckpointError naming the file. `trusted` as for `load` (how `.metadata` is unpickled)."""
    storage = storage_for(path)
    if not storage.exists(storage.join(path, METADATA_FILE)):
        raise CheckpointError(f"{path!r} is not a committed checkpoint (no {METADATA_FILE})")
    metadata = read_metadata(path, trusted=trusted)
    file = find_sidecar(storage, path, metadata)
    if file is None:
        return [f"{path}: no checksums sidecar (saved with checksums=False?)"]
    sidecar = read_sidecar(storage, path, file)
    if not sidecar_belongs_to(sidecar, metadata):
        return [f"{file} belongs to another save of this step (an interrupted re-save); cannot verify"]
    return [f"{c.relative_path}: {c.name}: {c.problem}" for c in check_items(storage, path, metadata, sidecar) if c.problem]


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
    """The uploads of data files (our names) directly in `step_dir` or in any ROOT/step_N of
    `root`, grouped by directory; nothing else (another job's root nested under ours, files of
    other names) is ours to abort."""
    found: dict[str, list[OpenUpload]] = {}
    for upload in uploads:
        directory, _, name = upload.path.rpartition("/")
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
    Do not run it while a save into `root` is in flight."""
    storage = storage_for(root)
    uploads = [u for found in uploads_left_open(storage.open_uploads(root), root=root).values() for u in found]
    leftovers = [storage.join(root, name) for name in storage.list_dir(root) if _TEMP_FILE.match(name)]
    for info in list_checkpoints(root, storage):
        names = storage.list_dir(info.path)
        if info.committed:
            leftovers += [storage.join(info.path, n) for n in names if _TEMP_FILE.match(n)]
            leftovers += [storage.join(info.path, n) for n in unreferenced_files(info.path, names)]
            continue
        foreign = [n for n in names if not (is_data_file(n) or _TEMP_FILE.match(n) or SIDECAR_NAME.match(n))
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
    leftovers += [u.path for u in uploads]
    if leftovers and not dry_run:
        log.info("cleanup removed %s", ", ".join(leftovers))
    return leftovers
