"""Resolve a final plan into what the worker needs: tensors it can reach, and pickled objects.

CPU tensors reach the worker through shared memory: their storage is moved into shared memory in
place once (like `model.share_memory()`), so later saves hand over nothing but a key. A storage
that cannot be moved (not allocated by torch, e.g. `torch.from_numpy`) is copied into shared
memory on every save instead. A fingerprint per tensor (storage pointer, offset, shape, stride)
tells when the user reallocated a tensor, so the worker never reads an old handle.
"""

from __future__ import annotations

import logging
import os
import resource
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch
import torch.multiprocessing

from ..errors import CheckpointError
from .planning import PlannedSave, is_tensor_item
from ..protocol import BYTES, TENSOR, ItemIndex, ItemSpec
from .subclasses import local_tensor, plain_tensor

log = logging.getLogger(__name__)

Fingerprint = tuple

SHM_DIR = "/dev/shm"  # where torch puts shared CPU storages (shm_open), a tmpfs on Linux
SHM_HEADROOM_BYTES = 1 << 20  # left free for tmpfs bookkeeping and other users
_PAGE = 4096
FD_HEADROOM = 64  # descriptors kept spare beyond those the shared storages will hold


@dataclass
class Snapshot:
    structure_key: str
    items: tuple[ItemSpec, ...]
    tensors: list[Optional[torch.Tensor]]
    fingerprints: list[Optional[Fingerprint]]
    always_fresh: frozenset[int]
    objects: dict[int, bytes]
    cuda_devices: tuple[int, ...]  # the CUDA devices its tensors are on (each one's work must finish first)


def take_snapshot(planned: PlannedSave) -> Snapshot:
    items, tensors, fingerprints, objects = [], [], [], {}
    always_fresh, cuda_devices = set(), set()
    resolved: dict[int, tuple[torch.Tensor, bool]] = {}
    for pos, item in enumerate(planned.plan.items):  # resolve and check everything before moving anything
        if is_tensor_item(item):
            fqn = item.index.fqn
            tensor, fresh = _reachable_tensor(planned.planner.resolve_data(item), fqn, item.tensor_data.properties.dtype)
            expected = tuple(item.tensor_data.chunk.sizes)
            if tuple(tensor.shape) != expected:
                raise CheckpointError(f"state entry {fqn!r}: resolved shape {tuple(tensor.shape)} != planned {expected}")
            resolved[pos] = (tensor, fresh)
    sharing = shared_memory_needed(resolved.values())
    check_shm_space(sharing.nbytes)  # a full /dev/shm is a SIGBUS, not an error
    ensure_fd_room(sharing.segments)  # each shared storage holds a descriptor
    move_into_shared_memory(resolved.values())
    for pos, item in enumerate(planned.plan.items):
        if not is_tensor_item(item):
            objects[pos] = _pickled_object(planned, item)
            items.append(ItemSpec(ItemIndex.of(item.index), BYTES))
            tensors.append(None)
            fingerprints.append(None)
            continue
        tensor, fresh = _shareable_tensor(*resolved.pop(pos), item.index.fqn)
        if fresh:
            always_fresh.add(pos)
        if tensor.is_cuda:
            cuda_devices.add(tensor.device.index)
        items.append(ItemSpec(ItemIndex.of(item.index), TENSOR, tensor.dtype, tuple(tensor.shape)))
        tensors.append(tensor)
        fingerprints.append(_fingerprint(tensor))
    return Snapshot(
        planned.structure_key,
        tuple(items),
        tensors,
        fingerprints,
        frozenset(always_fresh),
        objects,
        tuple(sorted(cuda_devices)),
    )


def _pickled_object(planned: PlannedSave, item) -> bytes:
    try:
        return planned.planner.resolve_data(item).getvalue()
    except Exception as exc:
        raise CheckpointError(
            f"state entry {item.index.fqn!r} cannot be serialized ({type(exc).__name__}: {exc})"
        ) from exc


def _reachable_tensor(tensor, fqn: str, planned_dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """Check a resolved tensor; return (plain detached tensor, whether it is a fresh copy)."""
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"state entry {fqn!r}: planner resolved {type(tensor).__name__}, not a tensor")
    plain = plain_tensor(tensor, fqn, planned_dtype)
    tensor, fresh = plain.tensor, plain.fresh
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise CheckpointError(f"state entry {fqn!r}: layout {tensor.layout} is not supported")
    if tensor.is_cuda:
        return tensor, fresh
    if tensor.device.type != "cpu":
        raise CheckpointError(f"state entry {fqn!r}: device {tensor.device} is not supported (cpu or cuda)")
    return tensor, fresh


@dataclass
class SharingNeeds:
    """What moving a save's tensors into shared memory creates: page-rounded bytes of /dev/shm
    and new segments (each holds a file descriptor)."""

    nbytes: int = 0
    segments: int = 0


def shared_memory_needed(resolved) -> SharingNeeds:
    """Count the segments sharing these (tensor, fresh) pairs creates: a whole storage for each
    one moved in place (once however many views it has), else a copy of the tensor's bytes."""
    needs, seen = SharingNeeds(), set()
    for tensor, fresh in resolved:
        tensor = local_tensor(tensor)  # a held copy's DTensor: its shard is what moves
        if tensor.is_cuda:
            continue
        storage = tensor.untyped_storage()
        if storage.is_shared():
            continue
        if not fresh and storage.resizable():  # moved in place
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            nbytes = storage.nbytes()
        else:
            nbytes = tensor.numel() * tensor.element_size()
        needs.nbytes += shm_bytes(nbytes)
        needs.segments += 1
    return needs


def shm_bytes(nbytes: int) -> int:
    """What `nbytes` take in /dev/shm: whole pages."""
    return -(-nbytes // _PAGE) * _PAGE


def ensure_fd_room(new_segments: int, open_fds: Optional[int] = None, limits: Optional[tuple] = None) -> None:
    """Make room for `new_segments` more open descriptors, or raise CheckpointError.

    With torch's default "file_descriptor" sharing strategy every shared CPU storage keeps a file
    descriptor open for as long as it lives, in the trainer and again in the worker; a state of
    more tensors than `ulimit -n` (often 1024) would otherwise fail deep inside torch. The soft
    limit is raised toward the hard one when needed (the worker raises its own at start)."""
    if new_segments <= 0 or torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    if open_fds is None:
        try:
            open_fds = len(os.listdir("/proc/self/fd"))
        except OSError:
            return
    soft, hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = open_fds + new_segments + FD_HEADROOM
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard == resource.RLIM_INFINITY or needed <= hard:
        target = needed * 2 if hard == resource.RLIM_INFINITY else min(hard, needed * 2)
        try:
            if limits is None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("raised the open-file limit from %d to %d for %d shared tensors", soft, target, new_segments)
            return
        except (ValueError, OSError) as exc:
            reason = f"raising the soft limit to {target} failed: {exc}"
    else:
        reason = f"the hard limit is {hard}"
    raise CheckpointError(
        f"too many tensors to share with the checkpoint worker: {new_segments} shared-memory segments "
        f"need one open file each (here and in the worker), {open_fds} files are open and the "
        f"open-file limit is {soft} ({reason}). Raise it (`ulimit -n {needed * 2}`, or LimitNOFILE= / "
        f"--ulimit nofile= for services and containers), or keep fewer, larger tensors in the state."
    )


def shm_free_bytes(path: str = SHM_DIR) -> Optional[int]:
    """Free bytes in the shared-memory filesystem, or None where there is none to ask."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_shm_space(needed: int, free: Optional[int] = None, path: str = SHM_DIR) -> None:
    """Raise CheckpointError when `needed` bytes will not fit in `path` (free bytes from statvfs
    unless given). Writing past a full tmpfs kills the process with SIGBUS, so fail first."""
    if needed <= 0:
        return
    if free is None:
        free = shm_free_bytes(path)
    if free is None or needed + SHM_HEADROOM_BYTES <= free:
        return
    raise CheckpointError(
        f"not enough shared memory to hand the state to the checkpoint worker: {needed} bytes "
        f"({needed / 2**20:.1f} MiB) must move into {path}, which has {free} bytes ({free / 2**20:.1f} MiB) free "
        f"(and {SHM_HEADROOM_BYTES >> 20} MiB is kept spare). Going on would risk SIGBUS. Enlarge {path} "
        f"(docker/podman: --shm-size; Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm; "
        f"or remount the tmpfs with a larger size=), or save fewer bytes per process (shard the state "
        f"over more ranks). Nothing was written."
    )


SHARE_THREADS = 4


def move_into_shared_memory(resolved) -> None:
    """Move the storages of these (tensor, fresh) pairs that can move in place into shared
    memory, each storage once, largest first, on a few threads (most of the time is the kernel
    allocating and zeroing tmpfs pages, which runs in parallel). One that fails is left as it
    was: `_shareable_tensor` then copies it or names the entry in its error."""
    storages = {}
    for tensor, fresh in resolved:
        if tensor.is_cuda or fresh:
            continue
        storage = tensor.untyped_storage()
        if not storage.is_shared() and storage.resizable():
            storages.setdefault(storage.data_ptr(), storage)
    if not storages:
        return

    def move(storage) -> None:
        try:
            storage.share_memory_()
        except RuntimeError:
            pass

    largest_first = sorted(storages.values(), key=lambda storage: -storage.nbytes())
    with ThreadPoolExecutor(min(SHARE_THREADS, len(largest_first)), thread_name_prefix="asyncckpt-share") as pool:
        list(pool.map(move, largest_first))


def _shareable_tensor(tensor: torch.Tensor, fresh: bool, fqn: str) -> tuple[torch.Tensor, bool]:
    """Return (tensor the worker can reach, whether it is a fresh copy made for this save)."""
    if tensor.is_cuda or tensor.untyped_storage().is_shared():
        return tensor, fresh
    if not fresh and tensor.untyped_storage().resizable():
        try:
            tensor.share_memory_()
            return tensor, False
        except RuntimeError:
            pass
    try:
        copy = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
    except RuntimeError as exc:  # e.g. "Too many open files", "No space left on device"
        raise CheckpointError(f"state entry {fqn!r} cannot be moved into shared memory ({SHM_DIR}): {exc}") from exc
    copy.copy_(tensor)
    return copy, True


def _fingerprint(tensor: torch.Tensor) -> Fingerprint:
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.device,
    )


@dataclass
class WorkerHolds:
    """What the worker has cached: a structure, and each tensor with its fingerprint.

    The tensors are kept referenced here on purpose: while they live, their storage cannot be
    freed, so a new tensor can never reuse the address and pass the pointer comparison (a freed
    shared-memory mapping is otherwise handed straight back to the next allocation)."""

    structure_key: str
    fingerprints: list
    tensors: list


@dataclass
class TensorsToSend:
    """What a request hands over: whether the worker knows the structure, the tensors it must be
    sent (by position), and for a new structure the positions whose tensor the worker already
    holds under the previous one (new position -> held position)."""

    known_structure: bool
    fresh: dict[int, torch.Tensor]
    kept: dict[int, int]


def tensors_to_send(snapshot: Snapshot, held: Optional[WorkerHolds]) -> TensorsToSend:
    """Send a tensor only if the worker does not hold it: always for one copied fresh on every
    save, else when no held tensor has its fingerprint (the same structure: at its own position;
    a new structure: at any position of the held one)."""
    known = held is not None and held.structure_key == snapshot.structure_key
    held_at = {} if held is None else {fp: pos for pos, fp in enumerate(held.fingerprints) if fp is not None}
    fresh, kept = {}, {}
    for pos, tensor in enumerate(snapshot.tensors):
        if tensor is None:
            continue
        fingerprint = snapshot.fingerprints[pos]
        if pos in snapshot.always_fresh:
            fresh[pos] = tensor
        elif known:
            if fingerprint != held.fingerprints[pos]:
                fresh[pos] = tensor
        elif fingerprint in held_at:
            kept[pos] = held_at[fingerprint]
        else:
            fresh[pos] = tensor
    return TensorsToSend(known, fresh, kept)


def copies_warning(snapshot: Snapshot) -> Optional[str]:
    """What to tell the user when some tensors are copied into shared memory on every save."""
    if not snapshot.always_fresh:
        return None
    names = [snapshot.items[p].index.fqn for p in sorted(snapshot.always_fresh)]
    nbytes = sum(snapshot.items[p].nbytes for p in snapshot.always_fresh)
    return (
        f"{len(names)} tensors ({nbytes / 1e6:.1f} MB, e.g. {', '.join(repr(n) for n in names[:3])}) are copied "
        "into shared memory on every save: their storage was not allocated by torch or was exported to "
        "NumPy (.numpy() makes it non-resizable), so it cannot be moved into shared memory in place"
    )
