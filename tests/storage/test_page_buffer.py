"""A `PageBuffer` is published exactly like bytes: with O_DIRECT where the file system takes it
(whole pages, then the file cut to its length), through the page cache where it does not or
where nothing needs to be durable."""

from __future__ import annotations

import errno
import os

import pytest

from asyncckpt.storage import LocalStorage
from asyncckpt.storage import local
from asyncckpt.storage.page_buffer import PAGE, PageBuffer

SIZES = (0, 1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5)


def _buffer(size: int, capacity: int = 0) -> tuple[PageBuffer, bytes]:
    data = os.urandom(size)
    buffer = PageBuffer(capacity)
    buffer.append(data[:size // 2])
    buffer.append(data[size // 2:])  # grows past its capacity when it must
    return buffer, data


def _published(tmp_path, buffer: PageBuffer) -> bytes:
    path = str(tmp_path / ".metadata")
    LocalStorage().write_atomic(path, buffer)
    assert os.listdir(tmp_path) == [".metadata"]  # no temp file left
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("size", SIZES)
def test_a_page_buffer_is_written_directly_and_cut_to_its_length(tmp_path, size):
    buffer, data = _buffer(size)
    if not local._write_direct(str(tmp_path / "probe"), buffer):
        pytest.skip(f"{tmp_path} refuses O_DIRECT (the fallback is tested below)")
    with open(tmp_path / "probe", "rb") as f:
        assert f.read() == data
    os.unlink(tmp_path / "probe")
    assert _published(tmp_path, buffer) == data


def test_a_new_tail_replaces_the_old_one_and_leaves_no_stale_bytes(tmp_path):
    buffer, data = _buffer(2 * PAGE + 100)
    buffer.append(b"a long tail " * 50)
    buffer.truncate(len(data))
    buffer.append(b"short")
    assert _published(tmp_path, buffer) == data + b"short"
    assert bytes(buffer.padded_view()[buffer.length:]) == bytes(len(buffer.padded_view()) - buffer.length)


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_a_file_system_refusing_direct_io_gets_the_bytes_through_the_page_cache(tmp_path, monkeypatch, refused_at):
    """Where O_DIRECT is refused (EINVAL: some FUSE mounts, tmpfs before Linux 6.6), the same
    bytes are written the plain way."""
    real_open, real_write = os.open, os.write
    direct_fds = set()

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT and refused_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument", path)
        fd = real_open(path, flags, *args, **kwargs)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def write(fd, data):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(local.os, "open", open_)
    monkeypatch.setattr(local.os, "write", write)
    buffer, data = _buffer(3 * PAGE + 5)
    assert _published(tmp_path, buffer) == data
