"""The memory tier's file (CheckpointConfig(memory_tier=True)): one per rank under `memory_dir`,
written by the worker (its staging slab *is* the file's first bytes) and read by the trainer on
restart. Its name, and the record after the slab that says what the slab holds.

    [slab: staged tensors at their offsets][objects' pickled bytes][header: JSON][footer: 48 bytes]

The footer (fixed size, at the end) says whether the copy is complete and where the header is;
the header (CRC32C in the footer) names the root, rank, world size, step and save, every item's
place and CRC32C, and the trainer's plan (opaque here: `plan`). Staging a save first clears the
footer's complete flag; the header and footer are rewritten once every CRC is computed. A file
whose footer does not check out is not a copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Any, Optional

from .formats import crc32c

PREFIX = "asyncckpt-"
SUFFIX = ".slab"
MAGIC = b"ACKPTMEM"
VERSION = 1
_FOOTER = struct.Struct("<8sIIIIQQII")  # magic, version, complete, worker pid, spare, header at, length, crc, spare
FOOTER_BYTES = _FOOTER.size
COMPLETE_AT = 12  # the complete flag's offset inside the footer


def memory_file_name(root: str, rank: int) -> str:
    """`asyncckpt-<root, sanitized>-<hash of the root>-rank<r>.slab`: readable in `ls`, unique per
    root (the hash is of the absolute path or URL) and rank."""
    key = root if "://" in root else os.path.abspath(root)
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", key.rstrip("/")).strip("_")[-40:] or "root"
    return f"{PREFIX}{tail}-{hashlib.sha256(key.encode()).hexdigest()[:10]}-rank{rank}{SUFFIX}"


def root_key(root: str) -> str:
    """How a header names its root: as the file name's hash is taken."""
    return root if "://" in root else os.path.abspath(root)


@dataclass(frozen=True)
class Footer:
    complete: bool
    worker_pid: int
    header_at: int
    header_length: int
    header_crc: int

    def encode(self) -> bytes:
        return _FOOTER.pack(MAGIC, VERSION, int(self.complete), self.worker_pid, 0, self.header_at,
                            self.header_length, self.header_crc, 0)


def incomplete_flag() -> bytes:
    """The bytes written at COMPLETE_AT to mark a copy incomplete (the next save is staging)."""
    return struct.pack("<I", 0)


@dataclass(frozen=True)
class StoredItem:
    """Where one item of the plan lies in the file (absolute offset), and its CRC32C."""

    at: int
    length: int
    crc32: int


@dataclass(frozen=True)
class MemoryCopy:
    """A complete copy's header, as read back (`plan` is the trainer's, undecoded)."""

    path: str
    root: str
    rank: int
    world_size: int
    step: int
    token: str  # the save's id: equal on every rank, and the `.metadata` save_id once it is committed
    memory_only: bool
    trainer_pid: int
    worker_pid: int
    host: str
    items: tuple[StoredItem, ...]
    plan: Any
    root_id: Optional[str] = None  # its history (loading/history.py); None: written before histories
    base_step: Optional[int] = None
    base_token: Optional[str] = None


class NotACopy(Exception):
    """A file that holds no usable copy; the message says why. `busy_pid`: the worker still
    writing it (incomplete, that worker alive)."""

    def __init__(self, message: str, busy_pid: int = 0) -> None:
        super().__init__(message)
        self.busy_pid = busy_pid


def encode_header(fields: dict[str, Any], items: list[StoredItem]) -> bytes:
    return json.dumps({**fields, "items": [[i.at, i.length, i.crc32] for i in items]}, separators=(",", ":")).encode()


def read_copy(path: str) -> MemoryCopy:
    """The complete copy in `path`, or NotACopy saying why not. The file must be a regular file
    of this user, readable by nobody else (a planted file is refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotACopy("no memory copy") from None
    except OSError as exc:
        raise NotACopy(f"cannot open it ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise NotACopy("not a private regular file of this user")
        if info.st_size < FOOTER_BYTES:
            raise NotACopy("too short to hold a copy")
        footer = os.pread(fd, FOOTER_BYTES, info.st_size - FOOTER_BYTES)
        magic, version, complete, worker_pid, _, at, length, crc, _ = _FOOTER.unpack(footer)
        if magic != MAGIC or version != VERSION:
            raise NotACopy("incomplete (no footer: its save was staging or it is not a memory copy)")
        if not complete:
            raise NotACopy("incomplete (a save was staging into it)", busy_pid=worker_pid)
        if at + length > info.st_size - FOOTER_BYTES:
            raise NotACopy("damaged (its header lies past the end)")
        raw = os.pread(fd, length, at)
        if len(raw) != length or crc32c(raw) != crc:
            raise NotACopy("damaged (header checksum mismatch)")
    finally:
        os.close(fd)
    try:
        header = json.loads(raw)
        items = tuple(StoredItem(int(a), int(n), int(c)) for a, n, c in header["items"])
        base = header.get("base")
        return MemoryCopy(path, str(header["root"]), int(header["rank"]), int(header["world_size"]),
                          int(header["step"]), str(header["token"]), bool(header["memory_only"]),
                          int(header["trainer_pid"]), int(header["worker_pid"]), str(header["host"]), items,
                          header["plan"], header.get("root_id"), None if base is None else int(base[0]),
                          None if base is None else base[1])
    except (ValueError, KeyError, TypeError) as exc:
        raise NotACopy(f"damaged (header unreadable: {exc})") from None


def owner_alive(pid: int) -> bool:
    """Whether a process of this pid exists here (one of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
