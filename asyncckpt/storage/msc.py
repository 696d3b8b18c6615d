"""Object-store roots (`msc://profile/...`, `s3://bucket/...`) through multi-storage-client.

Object stores have no rename and msc publishes a partial object when a `with msc.open(...)`
block raises, so data files are spooled to a local temp file and uploaded only on commit;
`.metadata`, the sidecar and `latest` are each one PUT (whole or nothing); deletion lists and
deletes every key, dot-files included (msc's recursive delete skips them).
"""

from __future__ import annotations

import errno
import importlib
import math
import os
import tempfile
import time
from typing import Any, Optional, Sequence

from ..errors import CheckpointError
from .base import OpenUpload, Storage, Versioned, WriteHandle, unique_suffix
from .page_buffer import PageBuffer
from .requests import count_requests_of
from .retries import with_retries
from .upload_memory import SINGLE_PUT_MEMORY_BYTES, MemoryBudget


class _SpooledUpload(WriteHandle):
    """An object-store data file: bytes go to a local temp file, uploaded whole by `commit()`.

    Nothing is visible in the bucket before the upload completes, and a failed or aborted file
    never publishes anything (an `msc.open` object would be uploaded by `close()` even after an
    exception, and would hold the whole object in memory). The temp file is written through an
    unbuffered OS file, so a forked writer's writes land in it too. `upload_file` streams a large
    file in multipart chunks; a file small enough for one PUT is read whole, within the storage's
    shared `upload_memory` budget, so memory stays bounded whatever the objects' sizes."""

    def __init__(self, storage: "MscStorage", path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s  # bounds the wait for upload memory; the worker bounds the rest
        self._deadline = time.monotonic() + timeout_s  # no retry of the upload starts after it
        self._storage = storage
        fd, self._tmp = tempfile.mkstemp(prefix="asyncckpt-upload-", suffix=".part")
        self._file = os.fdopen(fd, "wb", buffering=0)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += self._file.write(view[written:])
        return written

    def fileno(self) -> int:
        return self._file.fileno()

    def commit(self) -> None:
        try:
            self._file.close()
            size = os.path.getsize(self._tmp)

            def upload(client, key) -> None:
                in_memory = size if size <= _single_put_limit(client) else 0
                with self._storage.upload_memory.hold(in_memory, self.timeout_s, f"upload {self.path}"):
                    client.upload_file(key, self._tmp)

            self._storage._call("upload", self.path, upload, self._deadline)
        finally:
            self._discard_tmp()

    def abort(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        self._discard_tmp()

    def _discard_tmp(self) -> None:
        try:
            os.unlink(self._tmp)
        except OSError:
            pass


class MscStorage(Storage):
    """Object stores through multi-storage-client: `msc://profile/prefix` (a profile of the
    MSC_CONFIG file) and `s3://bucket/prefix` (msc's implicit profile: boto3's credentials and
    AWS_ENDPOINT_URL).

    There are no directories and no rename: a "directory" is a key prefix; data files are spooled
    to a local temp file (`$TMPDIR`) and uploaded once complete; small files (`.metadata`, the
    sidecar, `latest`) are one PUT each, which readers see whole or not at all. Deleting a tree
    lists and deletes every key under the prefix, dot-files included (msc's recursive delete
    skips them on object stores). Every msc failure comes out as an OSError naming the URL."""

    PROBE_TTL_S = 60.0

    def __init__(self, single_put_memory_bytes: int = SINGLE_PUT_MEMORY_BYTES) -> None:
        importlib.import_module("multistorageclient")  # fail here, with the hint from storage_for

        self.upload_memory = MemoryBudget(single_put_memory_bytes)
        self._proven: dict[str, float] = {}  # prefix -> when a probe write there last succeeded

    def join(self, *parts: str) -> str:
        head, *rest = parts
        pieces = [str(head).rstrip("/")] + [str(p).strip("/") for p in rest if str(p).strip("/")]
        return "/".join(pieces)

    def prepare_dir(self, path: str, fsync: bool = True) -> None:
        """Nothing to create; prove the store takes writes there by writing and deleting a probe
        key. A prefix under one proven in the last PROBE_TTL_S is not probed again (a save
        prepares its root and its step prefix; a later failure still surfaces from the writes)."""
        path = path.rstrip("/")
        now = time.monotonic()
        if any(now - self._proven.get(p, -math.inf) < self.PROBE_TTL_S for p in _self_and_parents(path)):
            return
        probe = self.join(path, f".asyncckpt-probe-{unique_suffix()}")
        try:
            self._call("write", probe, lambda client, key: client.write(key, b""))
            self._call("delete", probe, lambda client, key: client.delete(key))
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {path!r} is not writable: {exc}") from exc
        self._proven[path] = now

    def create(self, path: str, fsync: bool = True, timeout_s: float = 600.0) -> WriteHandle:
        return _SpooledUpload(self, path, timeout_s)  # an upload is durable once it returns: fsync has no work

    def writes_to_upload(self, path: str, nbytes: int) -> int:
        """One PUT up to the profile's multipart threshold; above it create + parts + complete,
        parts of the profile's `multipart_chunksize` (msc's 32 MiB by default)."""
        client, _ = _resolve(path)
        if nbytes <= _single_put_limit(client) or _is_posix(client):
            return 1
        return 2 + -(-nbytes // _part_size(client))

    def write_atomic(self, path: str, data: bytes | Sequence[bytes] | PageBuffer, fsync: bool = True) -> None:
        if isinstance(data, PageBuffer):
            data = data.view()
        whole = bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) else b"".join(data)
        self._call("write", path, lambda client, key: client.write(key, whole))

    def read_bytes(self, path: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        from multistorageclient.types import Range

        if offset == 0 and length is None:
            return self._call("read", path, lambda client, key: client.read(key))
        if length is None:
            length = self.size(path) - offset
        if length <= 0:
            return b""
        return self._call("read", path, lambda client, key: client.read(key, byte_range=Range(offset, length)))

    def exists(self, path: str) -> bool:
        def is_object(client, key) -> bool:
            try:  # strict=False: one HEAD, without msc's "is it a directory then?" listing
                return client.info(key, strict=False).type == "file"
            except FileNotFoundError:
                return False

        return self._call("stat", path, is_object)

    def is_dir(self, path: str) -> bool:
        def has_keys(client, key) -> bool:
            return next(iter(client.list(path=_as_prefix(key), include_directories=True)), None) is not None

        return self._call("list", path, has_keys)

    def is_symlink(self, path: str) -> bool:
        return False

    def real_path(self, path: str) -> str:
        return path

    def modified_time(self, path: str) -> Optional[float]:
        def last_modified(client, key) -> Optional[float]:
            try:
                info = client.info(key, strict=False)
            except FileNotFoundError:  # a prefix, not an object
                return None
            return info.last_modified.timestamp() if info.type == "file" and info.last_modified else None

        return self._call("stat", path, last_modified)

    def list_dir(self, path: str) -> list[str]:
        def names(client, key) -> list[str]:
            prefix = _as_prefix(key)
            found = set()
            for entry in client.list(path=prefix, include_directories=True):
                name = entry.key[len(prefix) :] if entry.key.startswith(prefix) else entry.key.rsplit("/", 1)[-1]
                if name and "/" not in name.rstrip("/"):
                    found.add(name.rstrip("/"))
            return sorted(found)

        return self._call("list", path, names)

    def size(self, path: str) -> int:
        return self._call("stat", path, lambda client, key: client.info(key, strict=False).content_length)

    def remove_file(self, path: str) -> None:
        def delete(client, key) -> None:
            try:
                client.delete(key)
            except FileNotFoundError:
                pass

        self._call("delete", path, delete)

    supports_links = True  # as server-side copies: an object store has no second names

    def link(self, source: str, path: str) -> None:
        """A server-side copy of `source` (S3 CopyObject through msc): an incremental save's
        unchanged files are never uploaded from here again."""
        def copy(client, key) -> None:
            source_client, source_key = _resolve(source)
            if source_client is not client:
                raise OSError(errno.EXDEV, f"{source} and {path} are not in the same storage profile")
            client.copy(source_key, key)

        self._call("copy", path, copy)

    def remove_tree(self, path: str) -> None:
        def delete_all(client, key) -> None:
            keys = [entry.key for entry in client.list_recursive(path=_as_prefix(key))]
            # a checkpoint's commit object goes first: a crash mid-delete leaves it uncommitted
            first = [k for k in keys if k.rsplit("/", 1)[-1] == ".metadata"]
            for batch in (first, [k for k in keys if k not in first]):
                if batch:
                    client.delete_many(batch)
            if _is_posix(client):  # a POSIX profile has real directories: remove the empty ones
                try:
                    client.delete(key, recursive=True)
                except FileNotFoundError:
                    pass

        self._call("delete", path, delete_all)

    def read_versioned(self, path: str) -> Optional[Versioned]:
        def read(client, key) -> Optional[Versioned]:
            try:  # the ETag first: if the object changes before the read, a write at this ETag fails
                info = client.info(key, strict=False)
                return Versioned(client.read(key), info.etag or "") if info.type == "file" else None
            except FileNotFoundError:
                return None

        return self._call("read", path, read)

    def write_if_version(self, path: str, data: bytes, version: Optional[str]) -> bool:
        """A conditional PUT (If-None-Match: * / If-Match: ETag) through msc's provider (its public
        `write` has no conditions). A `type: file` profile ignores the conditions: there the
        check and the write are two steps."""
        from multistorageclient.types import PreconditionFailedError

        def put(client, key) -> bool:
            condition = {"if_none_match": "*"} if version is None else {"if_match": version}
            try:
                client._storage_provider.put_object(key, bytes(data), **condition)
            except (PreconditionFailedError, FileNotFoundError):  # changed, or removed, meanwhile:
                return _holds(client, key, data)  # unless by our own try whose answer was lost
            return True

        return self._call("write", path, put)

    def open_uploads(self, path: str) -> list[OpenUpload]:
        def listed(client, key) -> list[OpenUpload]:
            s3 = _s3_api(client, _as_prefix(key))
            if s3 is None:
                return []
            api, bucket, prefix = s3
            found = []
            for page in api.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
                for upload in page.get("Uploads", []):
                    initiated = upload.get("Initiated")
                    found.append(OpenUpload(
                        self.join(path, upload["Key"][len(prefix) :]), upload["UploadId"],
                        initiated.timestamp() if initiated is not None else None,
                    ))
            return found

        return self._call("list uploads", path, listed)

    def abort_upload(self, upload: OpenUpload) -> None:
        def abort(client, key) -> None:
            s3 = _s3_api(client, key)
            if s3 is None:
                return
            api, bucket, s3_key = s3
            try:
                api.abort_multipart_upload(Bucket=bucket, Key=s3_key, UploadId=upload.upload_id)
            except api.exceptions.NoSuchUpload:
                pass  # completed or aborted meanwhile

        self._call("abort upload", upload.path, abort)

    def sync_dir(self, path: str) -> None:
        pass  # no directories: an object is durable once its upload returned

    def remove_empty_dir(self, path: str) -> None:
        pass  # a prefix with no keys does not exist

    def _call(self, operation: str, url: str, action, deadline: Optional[float] = None) -> Any:
        """Run `action(client, key)` for `url`, again on transient failures (retries.py; not past
        the monotonic `deadline`); any msc failure (RuntimeError, ValueError for an unknown
        profile, botocore errors...) becomes an OSError naming the operation and URL."""
        try:
            client, key = _resolve(url)
            _count_requests(client)
            return with_retries(lambda: action(client, key), deadline)
        except OSError as exc:
            raise _with_context(exc, f"{operation} {url}: {exc}") from exc
        except Exception as exc:
            raise OSError(f"{operation} {url}: {type(exc).__name__}: {exc}") from exc


def _holds(client, key: str, data: bytes) -> bool:
    """The object holds exactly `data` (bytes that name their writer: a lease)."""
    try:
        return client.read(key) == bytes(data)
    except FileNotFoundError:
        return False


def _with_context(exc: OSError, message: str) -> OSError:
    """The same kind of OSError (FileNotFoundError stays one), its message naming the URL."""
    try:
        return type(exc)(message)
    except Exception:
        return OSError(message)


def _single_put_limit(client) -> int:
    """Largest file msc uploads as one in-memory PUT for this client's profile (0: none, as for
    POSIX profiles, which copy files). Reads msc's provider setting; msc's default otherwise."""
    if _is_posix(client):
        return 0
    limit = getattr(getattr(client, "_storage_provider", None), "_multipart_threshold", None)
    return limit if isinstance(limit, int) else 64 << 20


def _part_size(client) -> int:
    """A multipart upload's part size for this client's profile (msc's S3 default otherwise)."""
    provider = getattr(client, "_storage_provider", None)
    size = getattr(getattr(provider, "_transfer_config", None), "multipart_chunksize", None)
    size = getattr(provider, "_multipart_chunksize", size)
    return size if isinstance(size, int) and size > 0 else 32 << 20


def _s3_api(client, key: str):
    """(boto3 S3 client, bucket, S3 key) behind a msc client and key, for what msc has no API for:
    listing and aborting unfinished multipart uploads. Reads msc's private
    `_storage_provider._s3_client` and `_prepend_base_path` (msc 1.3, S3-compatible providers);
    None where they are missing (another provider or msc version): open uploads are then left to
    the bucket's lifecycle rule (AbortIncompleteMultipartUpload)."""
    provider = getattr(client, "_storage_provider", None)
    api = getattr(provider, "_s3_client", None)
    full_path = getattr(provider, "_prepend_base_path", None)
    if api is None or not callable(full_path) or not hasattr(api, "list_multipart_uploads"):
        return None
    bucket, _, s3_key = full_path(key).partition("/")
    return api, bucket, s3_key


def _count_requests(client) -> None:
    """Count the requests of the boto3 client behind a msc client (requests.py), where there is one."""
    api = getattr(getattr(client, "_storage_provider", None), "_s3_client", None)
    if api is not None and hasattr(api, "meta"):
        count_requests_of(api)


def _is_posix(client) -> bool:
    """A `type: file` profile (a directory tree behind msc), not an object store."""
    return type(getattr(client, "_storage_provider", None)).__name__.startswith("Posix")


def _resolve(url: str):
    import multistorageclient as msc

    return msc.resolve_storage_client(url)


def _self_and_parents(url: str) -> list[str]:
    """`msc://p/a/b` -> [`msc://p/a/b`, `msc://p/a`, `msc://p`]."""
    scheme, rest = url.split("://", 1)
    parts = rest.split("/")
    return [f"{scheme}://" + "/".join(parts[:n]) for n in range(len(parts), 0, -1)]


def _as_prefix(key: str) -> str:
    key = key.strip("/")
    return f"{key}/" if key else ""
