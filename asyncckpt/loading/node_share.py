"""Resume at scale inside one node: a reading rank hands the items it read for the ranks of its
own node over in shared memory, not through gloo (and a relay, the items it received from
another node for them).

Loopback TCP costs several copies and system calls per byte: 64 MiB broadcast to three ranks of
one node took 0.28-0.35 s here, six times what reading it took. Instead the reader reads its items
straight into one file under /dev/shm (`MemoryPayload`), the ranks of its node map that file
(`open_payload`) and check each item's length (and its CRC32C where the reader did not check
it against the sidecar in that file), and the reader removes the file once they hold it. A node is one boot of one machine seen through one /dev/shm (`node_key`): the
containers of one host, each with a /dev/shm of its own, are nodes of their own. A reader that
cannot place its items there (a small /dev/shm: Docker's default is 64 MiB) keeps them in its
own memory, and they go by gloo as to ranks of other nodes.
"""

from __future__ import annotations

import mmap
import os
import socket
from typing import Optional

from ..memory_file import owner_alive

SHM_DIR = "/dev/shm"


def node_key() -> str:
    """What ranks that can share a /dev/shm file have in common ("" where there is none)."""
    try:
        info = os.stat(SHM_DIR)
    except OSError:
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    return f"{boot}:{info.st_dev}:{info.st_ino}"


PAYLOAD_PREFIX = "asyncckpt-load-"


def payload_name(nonce: str, rank: int, pid: int, kind: str = "r") -> str:
    """The payload file of rank `rank` (process `pid`) of the load `nonce`: "r", the items it
    read; "relay", those it received for the ranks of its node."""
    return os.path.join(SHM_DIR, f"{PAYLOAD_PREFIX}{nonce}-{kind}{rank}-p{pid}")


def remove_stale_payloads() -> None:
    """Payload files of this user whose process is gone (killed between creating and removing
    its file): they would hold their bytes of /dev/shm until the machine restarts."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PAYLOAD_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name.rpartition("-p")[2]
        path = os.path.join(SHM_DIR, name)
        try:
            if pid.isdigit() and not owner_alive(int(pid)) and os.stat(path).st_uid == os.geteuid():
                os.unlink(path)
        except OSError:
            pass  # (removed meanwhile)


class MemoryPayload:
    """The writer's side (a reader, a relay): one file of `size` bytes under /dev/shm, mapped, its
    room reserved."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(size, 1))  # ENOSPC here, never a SIGBUS while reading into it
            self._map = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # (the mapping keeps it)
        self._view = memoryview(self._map)

    @classmethod
    def create(cls, path: str, size: int) -> Optional["MemoryPayload"]:
        """None when /dev/shm cannot hold it (the items then go by gloo)."""
        remove_stale_payloads()
        try:
            return cls(path, size)
        except OSError:
            return None

    def view(self, at: int, length: int) -> memoryview:
        return self._view[at:at + length]

    def remove(self) -> None:
        """The file's name goes (the mappings, the reader's and its receivers', stay valid)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def open_payload(path: str, size: int) -> memoryview:
    """A receiver's read-only view of a reader's payload file; OSError when it is not there or
    shorter than `size`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < max(size, 1):
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, not {size}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # its page tables at once, not a fault per page
        return memoryview(mmap.mmap(fd, max(size, 1), flags=flags, prot=mmap.PROT_READ))
    finally:
        os.close(fd)
