"""Sharing CPU tensors with the worker: how much /dev/shm and how many descriptors a save's
tensors need (checked before anything moves: a full tmpfs is a SIGBUS, not an error), and moving
them into shared memory, in place where torch allocated them, else as a copy each save."""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import re
import resource
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch
import torch.multiprocessing

from ..errors import CheckpointError
from ..memory_file import owner_alive
from .subclasses import local_tensor

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # where torch puts shared CPU storages (shm_open), a tmpfs on Linux
SHM_HEADROOM_BYTES = 1 << 20  # left free for tmpfs bookkeeping and other users
_PAGE = 4096
FD_HEADROOM = 64  # descriptors kept spare beyond those the shared storages will hold
_SEGMENTS = itertools.count()  # names this process's segment files apart (each unlinked at once)
_SEGMENT_NAME = re.compile(r"asyncckpt-(\d+)-\d+-\d+")  # (pid, thread, count)
_SWEPT: set[str] = set()  # the folders whose orphaned segment names this process removed


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


def available_memory_bytes() -> Optional[int]:
    """The memory the kernel says can be allocated without swapping (MemAvailable), or None where
    /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


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


def shared_segment(nbytes: int, path: str = SHM_DIR,
                   holding: Optional[torch.UntypedStorage] = None) -> torch.UntypedStorage:
    """A new shared-memory segment of `nbytes` in `path`, as torch's `_new_shared` makes one (a
    file there, unlinked at once, mapped by its descriptor), but with its pages reserved by
    `posix_fallocate`, which releases the GIL: torch reserves them holding it, which stops every
    other thread of the trainer meanwhile (measured: 0.1 s per 512 MiB), so a hand-off thread
    would stall the training loop and the threads moving a first save's storages could not
    allocate in parallel. A full `path` is OSError (ENOSPC) here, never a SIGBUS later. Where
    the sharing strategy is not by descriptor, torch's own.

    `holding`: a CPU storage of `nbytes` whose bytes the segment gets. They are written into its
    file (`pwrite`, the GIL released) instead of copied into a reserved mapping: the kernel then
    neither zeroes each new page first nor takes a fault per page (a fresh GiB here: 0.22-0.27 s
    instead of 0.34-0.43 s). The pages are mapped into the process on first touch, as ever."""
    if (nbytes == 0 or torch.multiprocessing.get_sharing_strategy() != "file_descriptor"
            or not hasattr(torch.UntypedStorage, "_new_shared_fd_cpu")):
        segment = torch.UntypedStorage._new_shared(nbytes)
        if holding is not None:
            _bytes_of(segment).copy_(_bytes_of(holding))
        return segment
    _remove_orphaned_names(path)
    name = os.path.join(path, f"asyncckpt-{os.getpid()}-{threading.get_ident()}-{next(_SEGMENTS)}")
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.unlink(name)
        if holding is None:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
        else:
            _write_all(fd, memoryview(_bytes_of(holding).numpy()))
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # (it keeps a descriptor of its own)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], done)


def _remove_orphaned_names(path: str) -> None:
    """A segment's name lives for a moment (created, then unlinked at once); a process killed in
    that moment leaves it behind, empty, for good. Once per process and folder, the names of
    processes that are gone are removed (only this user's)."""
    if path in _SWEPT:
        return
    _SWEPT.add(path)
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        match = _SEGMENT_NAME.fullmatch(name)
        if match is None or owner_alive(int(match.group(1))):
            continue
        try:
            if os.stat(os.path.join(path, name), follow_symlinks=False).st_uid == os.geteuid():
                os.unlink(os.path.join(path, name))
        except OSError:
            pass  # (removed meanwhile)


def new_reserved_shared(nbytes: int, path: str = SHM_DIR) -> torch.UntypedStorage:
    """A new shared-memory segment of `nbytes` whose pages are reserved before anything is written
    (posix_fallocate on its descriptor): torch grows a segment with ftruncate only, so on a full
    tmpfs the first write would fault with SIGBUS and kill the process; here that is a
    CheckpointError naming the mount, the bytes needed and free. Where torch's sharing strategy
    gives no descriptor ("file_system"), the segment is opened by its name under `path`."""
    try:
        storage = shared_segment(nbytes, path)  # (reserved already where sharing is by descriptor)
        if nbytes == 0:
            return storage
        if torch.multiprocessing.get_sharing_strategy() == "file_descriptor":
            os.posix_fallocate(storage._share_fd_cpu_()[0], 0, nbytes)  # (torch owns the descriptor; a no-op if reserved)
        else:
            name = storage._share_filename_cpu_()[1]
            fd = os.open(os.path.join(path, os.fsdecode(name).lstrip("/")), os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
    except (OSError, RuntimeError) as exc:  # torch's own: RuntimeError "unable to allocate shared memory"
        free = shm_free_bytes(path)
        raise CheckpointError(
            f"cannot reserve {nbytes} bytes ({nbytes / 2**20:.1f} MiB) of shared memory in {path} "
            f"({free if free is not None else 'unknown'} bytes free): {exc}. Nothing was written; "
            f"enlarge {path} (docker: --shm-size) or save fewer bytes per process"
        ) from exc
    return storage


SHARE_THREADS = 4


def move_into_shared_memory(resolved, keep_old_pages: bool = False) -> dict[int, torch.UntypedStorage]:
    """Move the storages of these (tensor, fresh) pairs that can move in place into shared
    memory, each storage once, largest first, on a few threads (most of the time is the kernel
    allocating and zeroing tmpfs pages, which runs in parallel). One that fails is left as it
    was: `shareable_tensor` then copies it or names the entry in its error. `keep_old_pages`:
    each moved storage's old pages, which hold its values as of now, are kept instead of freed and
    returned by its new data pointer (a first save's private copy without copying; nothing is kept
    where torch has no storage swap, or with less than twice their size in available memory)."""
    kept: dict[int, torch.UntypedStorage] = {}
    storages = {}
    for tensor, fresh in resolved:
        if tensor.is_cuda or fresh:
            continue
        storage = tensor.untyped_storage()
        if not storage.is_shared() and storage.resizable():
            storages.setdefault(storage.data_ptr(), storage)
    if not storages:
        return kept
    available = available_memory_bytes() if keep_old_pages else None
    swap = keep_old_pages and hasattr(torch.UntypedStorage, "_swap_data_ptr_") and (
        available is None or 2 * sum(storage.nbytes() for storage in storages.values()) <= available)

    def move(storage) -> None:
        if not swap:
            try:
                storage.share_memory_()
            except RuntimeError:
                pass
            return
        old = swap_into_shared_memory(storage)
        if old is not None:
            kept[storage.data_ptr()] = old

    largest_first = sorted(storages.values(), key=lambda storage: -storage.nbytes())
    with ThreadPoolExecutor(min(SHARE_THREADS, len(largest_first)), thread_name_prefix="asyncckpt-share") as pool:
        list(pool.map(move, largest_first))
    return kept


def swap_into_shared_memory(storage: torch.UntypedStorage) -> Optional[torch.UntypedStorage]:
    """Give `storage` shared pages holding its bytes, in place, and return a storage of its old
    pages (the values as of now); None, with `storage` as it was, when that cannot be done.

    `_swap_data_ptr_` is a private torch API: its result is checked (the storage now owns the
    new shared segment, the old one its former pages, a sample of bytes the same) and any failure
    or surprise, whatever its exception type, leaves the storage with its own pages, to be shared
    or copied the ordinary way."""
    try:
        shared = shared_segment(storage.nbytes(), holding=storage)  # (the GIL released meanwhile)
    except Exception as exc:
        log.debug("no shared copy of a %d-byte storage (%s: %s): shared the ordinary way", storage.nbytes(),
                  type(exc).__name__, exc)
        return None
    old_ptr, new_ptr = storage.data_ptr(), shared.data_ptr()
    try:
        storage._swap_data_ptr_(shared)  # the storage has the shared pages now, `shared` the old ones
        problem = _swap_problem(storage, shared, old_ptr, new_ptr)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem is None:
        return shared
    log.debug("storage swap into shared memory not kept (%s): shared the ordinary way", problem)
    if storage.data_ptr() == new_ptr:  # swapped, but not as expected: give the storage its own pages back
        try:
            storage._swap_data_ptr_(shared)
        except Exception as exc:
            raise CheckpointError(f"a storage swapped into shared memory could not be restored ({exc})") from exc
    return None


def _swap_problem(storage, old_pages, old_ptr: int, new_ptr: int) -> Optional[str]:
    """What is wrong after a swap, or None: the storage must own the shared segment, the other
    storage its former pages, and the bytes must match (first, middle and last page)."""
    if storage.data_ptr() != new_ptr or old_pages.data_ptr() != old_ptr:
        return "the data pointers did not trade places"
    if not storage.is_shared():
        return "the storage is not in shared memory after it"
    nbytes = storage.nbytes()
    mine, theirs = _bytes_of(storage), _bytes_of(old_pages)
    for start in {0, max(0, nbytes // 2 - _PAGE // 2), max(0, nbytes - _PAGE)}:
        if not torch.equal(mine[start:start + _PAGE], theirs[start:start + _PAGE]):
            return f"bytes differ at offset {start}"
    return None


MADV_POPULATE_WRITE = 23  # Linux 5.14; the worker faults its slab in the same way (worker/staging.py)
_libc = ctypes.CDLL(None, use_errno=True)


def populate_for_writing(address: int, nbytes: int) -> bool:
    """Fault in the pages of fresh memory at `address` in one call (several times faster than a
    copy faulting them one by one); False where the kernel cannot (the copy then faults them)."""
    return nbytes > 0 and _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), MADV_POPULATE_WRITE) == 0


MADV_REMOVE = 9  # shared memory: free the pages and their backing, as a hole punched in the file


def free_shared_pages(address: int, nbytes: int) -> bool:
    """Free the pages of a shared-memory mapping at `address` (its bytes read as zeros after).
    ctypes lets go of the GIL meanwhile: dropping the last reference to a large storage unmaps
    it holding the GIL (~0.2 s per GiB), which stops every Python thread of the trainer."""
    return nbytes > 0 and _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), MADV_REMOVE) == 0


def free_shared_storages(tensors) -> None:
    """Free the pages under the shared storages of `tensors` (each storage once, None skipped)
    without the GIL, so that dropping them afterwards unmaps nothing left. Only for memory no
    process reads any more: every mapping of it reads zeros after."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors if t is not None}
    for address, storage in storages.items():
        if storage.is_shared():
            free_shared_pages(address, storage.nbytes())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def shareable_tensor(tensor: torch.Tensor, fresh: bool, fqn: str) -> tuple[torch.Tensor, bool]:
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
