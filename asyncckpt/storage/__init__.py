"""Where checkpoint bytes live, behind one small interface (base.py).

`LocalStorage` (local.py) uses plain `os` calls with the full fsync discipline. `MscStorage`
(msc.py) serves object stores (`msc://profile/...`, `s3://bucket/...`) through multi-storage-client,
imported only when a path needs it. `storage_for(path)` picks the backend from the path.
"""

from __future__ import annotations

import errno
import os
import threading

from ..errors import CheckpointError
from .base import OpenUpload, Storage, Versioned, WriteHandle, is_remote, unique_suffix
from .local import LocalStorage

__all__ = [
    "LocalStorage", "OpenUpload", "Storage", "Versioned", "WriteHandle", "check_writable_without_writing", "is_remote",
    "storage_for", "unique_suffix",
]

_backends: dict[str, Storage] = {}
_backends_lock = threading.Lock()


def storage_for(path: str) -> Storage:
    """The backend for a checkpoint root or directory: one instance per kind and process (msc
    caches its clients per profile, so they are reused across saves)."""
    kind = "local"
    if is_remote(path):
        kind = str(path).split("://", 1)[0].lower()
        if kind not in ("msc", "s3"):
            raise CheckpointError(
                f"{path!r}: unsupported URL scheme {kind!r}; use a local path, msc://profile/... or s3://bucket/..."
            )
        kind = "msc"
    backend = _backends.get(kind)
    if backend is None:
        with _backends_lock:
            backend = _backends.get(kind)
            if backend is None:
                backend = _backends[kind] = _make_backend(path, kind)
    return backend


def check_writable_without_writing(path: str) -> None:
    """What `prepare_dir` refuses first, checked without writing anything: a local path under a
    file, or in a directory we may not write. For a save whose rest runs later on another thread,
    so a bad path still raises from the call (object stores: nothing checked here)."""
    if is_remote(path):
        return
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CheckpointError(f"checkpoint directory {path!r} is not writable: a path component is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"checkpoint directory {path!r} is not writable: {os.strerror(errno.EACCES)}")


def _make_backend(path: str, kind: str) -> Storage:
    if kind == "local":
        return LocalStorage()
    try:
        from .msc import MscStorage

        return MscStorage()
    except ImportError as exc:
        raise CheckpointError(
            f"{path!r}: object-store roots need multi-storage-client: pip install 'asyncckpt[msc]' ({exc})"
        ) from exc
