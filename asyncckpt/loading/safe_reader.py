"""`SafeReader`: a DCP StorageReader for checkpoints nobody here wrote, and the planner it needs.

Every path and byte range is checked before anything is read; `.metadata` is unpickled by a
restricted unpickler and objects with `weights_only=True` (see safety.py). The parallel reader
(reader.py) reads the data: local files with positional reads, object stores with ranged GETs.
"""

from __future__ import annotations

import dataclasses

import io
import logging
from typing import Any, Optional

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import DefaultLoadPlanner, StorageReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..errors import CheckpointError
from ..formats import Sidecar
from ..layout import METADATA_FILE, is_safetensors_file
from .byte_sources import LocalFiles, ObjectRanges
from .opened import OpenCheckpoint, open_checkpoint, opened_with, read_metadata
from .reader import ItemRead, fetch_items, place_items
from .broadcast import LoadGroup
from .node_share import node_key
from .read_shares import ReadShares, SharedItem, assign_shared_reads, plan_note
from .replicated import failures_told, share_reads
from .ring import check_ring_bytes
from .safety import (
    TRUST_HINT, check_ranges, load_object, load_tensor, raw_tensor, refused_globals, refused_objects_text,
)
from ..storage import LocalStorage
from ..storage.mounts import mount_of_path
from .verify import UNCHECKED_HINT, sidecar_belongs_to

log = logging.getLogger(__name__)



class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but objects are unpickled with `weights_only=True` unless
    trusted (the stock planner unpickles them fully). `allow_partial_load`: entries of the target
    the checkpoint lacks are left as they are instead of refused."""

    def __init__(self, trusted: bool = False, allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.trusted = trusted

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_object(value.getvalue(), self.trusted, f"object {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


LOCAL_FUSE = ("fuse.fuse-overlayfs", "fuseblk")  # FUSE file systems over this host's own disks


class SafeReader(StorageReader):
    """A DCP StorageReader for checkpoints nobody here wrote, on any asyncckpt storage (local,
    msc://, s3://). It reads what stock FileSystemReader reads (torch.save items, stream
    transforms) and asyncckpt's raw safetensors items; every path and byte range is checked
    before it is read. Objects need `SafeLoadPlanner` unless `trusted=True`; they are read
    first, so one that weights_only refuses stops the load before any tensor is written.
    `checksums=False` reads without checking checksums (the sidecar is not read). `ring_bytes`:
    host memory (pinned for CUDA targets) for bytes not read straight into their target (ring.py)."""

    def __init__(
        self, checkpoint: str | OpenCheckpoint, *, trusted: bool = False, checksums: bool = True,
        ring_bytes: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.trusted = trusted
        self.ring_bytes = check_ring_bytes(ring_bytes)
        self.use_checksums = checksums
        self._transforms = _StorageReaderTransforms()
        self.shared_by: Optional[LoadGroup] = None  # resume at scale: the ranks replicated reads are shared with (load sets it)
        self.reset(checkpoint)

    def reset(self, checkpoint_id=None) -> None:
        if isinstance(checkpoint_id, OpenCheckpoint):
            self.path, self.opened = checkpoint_id.path, checkpoint_id
        elif checkpoint_id is not None:
            self.path, self.opened = str(checkpoint_id), None  # opened by read_metadata
        self.metadata: Optional[Metadata] = None
        self.touched = False  # whether read_data began writing into the caller's state
        self.checksums: dict[tuple[str, int, int], int] = {}
        self.sidecar: Optional[Sidecar] = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, OpenCheckpoint))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP asks for __{rank}.metadata when .metadata is missing
        if rank is not None:
            return read_metadata(self.path, trusted=self.trusted, name=f"__{rank}{METADATA_FILE}")
        if self.opened is None:  # unpickled once: 0.3 s for 2,000 tensors here
            self.opened = open_checkpoint(self.path, trusted=self.trusted)
        return self.opened.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointError(f"{self.path}: {METADATA_FILE} has no storage_data")
        if self.opened is None or self.opened.metadata is not metadata:  # a caller's own metadata
            self.opened = opened_with(self.path, metadata, self.trusted)
        self.metadata = metadata
        self.checksums = self._load_checksums() if self.use_checksums else {}

    def _load_checksums(self) -> dict[tuple[str, int, int], int]:
        """(file, offset, length) -> checksum from the sidecar, so every item is checked as it is
        read (no second pass over the data). Checkpoints without a sidecar load unchecked."""
        try:
            sidecar = self.opened.sidecar(data_files=())  # parts: those of the files read (_load_parts_for)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}; {UNCHECKED_HINT}") from None
        if sidecar is None:
            return {}
        if not sidecar_belongs_to(sidecar, self.metadata):
            log.warning("%s belongs to another save of this step (an interrupted re-save); loading unchecked",
                        self.opened.sidecar_file)
            return {}
        self.sidecar = sidecar
        return {(e.relative_path, e.start, e.length): e.crc32 for e in sidecar.items}

    def _load_parts_for(self, relative_paths) -> None:
        """The checksums of the files this rank reads, from the parts that hold them (a save of
        several ranks: each rank's own), read now rather than every part at set-up."""
        try:
            self.sidecar = self.opened.sidecar(data_files=relative_paths)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}; {UNCHECKED_HINT}") from None
        self.checksums = {(e.relative_path, e.start, e.length): e.crc32 for e in self.sidecar.items}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """DCP's plan phase, where an error on any rank is raised on every rank before anything is
        read: the checksums parts of the files this rank will read are read here. Resume at scale:
        the plan carries this rank's node to the coordinator (replicated.py shares through shared
        memory inside a node)."""
        if self.sidecar is not None and self.sidecar.parts:
            self._load_parts_for({self.metadata.storage_data[req.storage_index].relative_path for req in plan.items})
        if self.shared_by is None:
            return plan
        return dataclasses.replace(plan, storage_data=plan_note(plan, node_key(), self.use_checksums and self.sidecar is not None))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if self.shared_by is not None:  # resume at scale: items several ranks read, read once (replicated.py)
            return assign_shared_reads(plans, self.metadata, page_cache=self.page_cache_shared())
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not self.trusted and not isinstance(planner, SafeLoadPlanner):
            if any(req.type == LoadItemType.BYTE_IO for req in plan.items):
                raise CheckpointError(f"{self.path}: objects are unpickled by the planner: use SafeLoadPlanner, or {TRUST_HINT}")
        shares = plan.storage_data if isinstance(plan.storage_data, ReadShares) else None  # resume at scale
        sharing = shares is not None and shares.any_shared and self.shared_by is not None
        per_file: dict[str, list[ReadItem]] = {}
        files = self.opened.files
        with failures_told(shares if sharing else None, self.shared_by):  # a rank failing here fails the ranks it shares reads with
            for req in plan.items:
                per_file.setdefault(self.metadata.storage_data[req.storage_index].relative_path, []).append(req)
            for relative_path, reqs in per_file.items():  # every range checked before anything is read
                size = self._file_size(relative_path, reqs)
                ranges = [(_item_name(r), self.metadata.storage_data[r.storage_index].offset,
                           self.metadata.storage_data[r.storage_index].length) for r in reqs]
                check_ranges(files[relative_path], sorted(ranges, key=lambda r: r[1]), size)
            if self.sidecar is not None and self.sidecar.parts:  # (read in prepare_local_plan under DCP)
                self._load_parts_for(per_file)
            items = [self._item_read(files[info_path], req, planner) for info_path, reqs in per_file.items() for req in reqs]
        sidecar = self.sidecar if self.checksums else None
        source = self._source()
        if sharing:  # resume at scale: read once, broadcast (replicated.py)
            source = share_reads(shares, self.shared_by, files, source, self._expected_crc, sidecar)
        if shares is not None and self.shared_by is not None:
            # not checked again: what the rank that read it checked in the memory (or page cache) this rank
            # copies it from; a tensor only ranks of this node read, checked by one of them
            copied = source.checked if sharing else frozenset()
            elsewhere = {(files[path], offset, length) for path, offset, length in shares.checked_elsewhere(self.shared_by.rank)}
            for item in items:
                key = (item.path, item.start, item.length)
                if key in copied or (key in elsewhere and item.req.type != LoadItemType.BYTE_IO):
                    item.expected_crc = None
            log.debug("%s: %d items shared between ranks, %d checked once per node; this rank checks %d of its %d",
                      self.path, len(shares.items), len(shares.checked),
                      sum(item.expected_crc is not None for item in items), len(items))
        objects = [item for item in items if item.req.type == LoadItemType.BYTE_IO]
        unread = items
        if objects and not self.trusted:  # read apart, first: nothing of the state is written yet
            fetch_items(objects, sidecar, source)
            self._refuse_unsafe_objects(objects)
            unread = [item for item in items if item.req.type != LoadItemType.BYTE_IO]
        self.touched = True
        fetch_items(unread, sidecar, source, self.ring_bytes)
        place_items(items, planner, lambda item: self._place(item.path, item.req, bytes(item.data), planner))
        done: Future = Future()
        done.set_result(None)
        return done

    def page_cache_shared(self) -> bool:
        """Whether the ranks of one node read this checkpoint through one page cache (a local or
        network file system, not an object store): they read a shared item themselves, the
        node's storage reads done once by the cache (read_shares.ReadShares.reads_itself). Not
        on a FUSE mount (an object store mounted as files, e.g. mountpoint-s3 or gcsfuse, may
        cache nothing): its node's ranks get a shared item through shared memory instead; FUSE
        over local disks (`LOCAL_FUSE`: fuse-overlayfs, the root of rootless containers; fuseblk)
        is read through the page cache as any file system."""
        if not isinstance(self.opened.storage, LocalStorage):
            return False
        mount = mount_of_path(self.path)
        return mount is None or not mount.fstype.startswith("fuse") or mount.fstype in LOCAL_FUSE

    def _expected_crc(self, item: SharedItem) -> Optional[int]:
        return self.checksums.get((item.relative_path, item.offset, item.length))

    def _source(self):
        storage = self.opened.storage
        return LocalFiles() if isinstance(storage, LocalStorage) else ObjectRanges(storage)

    def _refuse_unsafe_objects(self, objects: list[ItemRead]) -> None:
        """Refuse, before anything is written, the objects that weights_only unpickling would refuse
        (the same rule: safety.refused_globals), naming every one."""
        refused = {item.req.storage_index.fqn: found for item in objects if (found := refused_globals(item.data))}
        if refused:
            raise CheckpointError(
                f"{self.path}: {len(refused)} saved objects need full unpickling, which weights_only=True refuses: "
                f"{refused_objects_text(refused)}; {TRUST_HINT}"
            )

    def _file_size(self, relative_path: str, reqs: list[ReadItem]) -> int:
        try:
            return self.opened.file_size(relative_path)
        except OSError as exc:
            file = self.opened.files[relative_path]
            names = ", ".join(_item_name(req) for req in reqs[:10]) + (" ..." if len(reqs) > 10 else "")
            raise CheckpointError(f"{file}: cannot read it ({exc.strerror or exc}); it holds {len(reqs)} items: {names}") from None

    def _item_read(self, file: str, req: ReadItem, planner: LoadPlanner) -> ItemRead:
        """What the parallel reader needs of one item (its target resolved here, on this thread)."""
        info = self.metadata.storage_data[req.storage_index]
        expected_crc = self.checksums.get((info.relative_path, info.offset, info.length))
        item = ItemRead(req, file, f"{file}: {_item_name(req)}", info.offset, info.length, expected_crc)
        if req.type != LoadItemType.BYTE_IO and not info.transform_descriptors:
            item.dtype, item.chunk = self._chunk_layout(req)
            item.torch_save = not self.raw_file(info.relative_path)
            item.target = planner.resolve_tensor(req).detach()
            if tuple(item.target.size()) != tuple(req.lengths):
                raise CheckpointError(f"{item.name}: target size {tuple(item.target.size())} != {tuple(req.lengths)} read")
        return item

    def _place(self, file: str, req: ReadItem, data: bytes, planner: LoadPlanner) -> None:
        """Decode one item's checked bytes and put the result in the state dict."""
        info = self.metadata.storage_data[req.storage_index]
        what = f"{file}: {_item_name(req)}"
        if info.transform_descriptors:
            data = self._transforms.transform_load_stream(req, info.transform_descriptors, io.BytesIO(data)).read()
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(data))
            return
        if self.raw_file(info.relative_path):
            tensor = raw_tensor(data, *self._chunk_layout(req), what)
        else:
            tensor = load_tensor(data, what)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"{what}: stored size {tuple(tensor.size())} != target {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def raw_file(self, relative_path: str) -> bool:
        """Whether a data file holds its tensors as raw bytes (else torch.save archives)."""
        return is_safetensors_file(relative_path)

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
