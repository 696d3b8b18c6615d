"""The parallel loader (reader.py): bitwise-equal loads for both formats, every dtype we save,
targets it cannot read into directly, stock dcp.save checkpoints, and what a damaged checkpoint
does to the caller's state (named in the error; never a silent partial load); on an object store
(the session's S3 server), ranged GETs of only the items needed, in parallel, adjacent ones in one."""

from __future__ import annotations

import os
import pickle
import shutil
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt.loading.archive as archive
import asyncckpt.loading.ring as ring
from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, PartialLoadError, load
from asyncckpt.loading.byte_sources import LocalFiles, ObjectRanges
from asyncckpt.formats import SAFETENSORS_DTYPES
from asyncckpt.layout import is_data_file
from asyncckpt.loading.safe_reader import read_metadata
from asyncckpt.storage.msc import MscStorage
from asyncckpt.testing.s3_server import BUCKET
from conftest import damaged_copy

SHAPE = (37, 29)
SMALL_PIECES = 4096  # every tensor above 4 KiB spans several reads (checksums combined across threads)
SENTINEL = -7


def random_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Arbitrary bytes viewed as `dtype` (NaNs and all): only a bitwise compare can pass."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    high = 2 if dtype == torch.bool else 256  # a bool is 0 or 1
    return torch.randint(0, high, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def saved_dtypes(fmt: str) -> list[torch.dtype]:
    extra = [torch.complex128] if fmt == "torch_save" else []  # safetensors has no complex128
    return list(SAFETENSORS_DTYPES) + extra


def source_state(fmt: str) -> dict:
    state = {f"t_{str(d).split('.')[-1]}": random_tensor(d, SHAPE, n) for n, d in enumerate(saved_dtypes(fmt))}
    state["scalar"] = torch.tensor(2.5)
    state["big"] = random_tensor(torch.float32, (512, 300), 99)  # 600 KiB: many small pieces
    state["step"] = 7
    state["meta"] = {"name": "run-3", "lrs": [0.1, 0.2]}
    return state


def fresh_target(state: dict, fill=0) -> dict:
    target = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):  # every byte `fill`, whatever the dtype
            nbytes = value.numel() * value.element_size()
            target[key] = torch.full((nbytes,), fill % 256, dtype=torch.uint8).view(value.dtype).view(value.shape)
        elif isinstance(value, dict):
            target[key] = {k: None for k in value}
        else:
            target[key] = None
    return target


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaNs included)."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*flat)


def assert_bitwise_equal(loaded: dict, expected: dict) -> None:
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(loaded[key], value), key
        else:
            assert loaded[key] == value, key


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    """One asyncckpt checkpoint per format, saved once for the module (tests damage copies)."""
    root = str(tmp_path_factory.mktemp("saved"))
    paths = {}
    for fmt in ("torch_save", "safetensors"):
        with AsyncCheckpointer(os.path.join(root, fmt), CheckpointConfig(format=fmt, io_workers=2)) as ckpt:
            ckpt.schedule_save(source_state(fmt), step=1)
        paths[fmt] = os.path.join(root, fmt, "step_00000001")
    return paths


@pytest.mark.parametrize("piece_bytes", [LocalFiles.piece_bytes, SMALL_PIECES], ids=["default-pieces", "4KiB-pieces"])
@pytest.mark.parametrize("fmt", ["torch_save", "safetensors"])
def test_every_dtype_loads_bitwise_equal(saved, fmt, piece_bytes, monkeypatch):
    monkeypatch.setattr(LocalFiles, "piece_bytes", piece_bytes)
    monkeypatch.setattr(ring, "SLOT_BYTES", piece_bytes)
    target = fresh_target(source_state(fmt))
    load(target, saved[fmt])
    assert_bitwise_equal(target, source_state(fmt))


@pytest.mark.parametrize("fmt", ["torch_save", "safetensors"])
def test_non_contiguous_shared_storage_and_other_dtype_targets(saved, fmt, monkeypatch):
    """Targets the bytes cannot land in directly: transposed, strided, another dtype; and views
    of one storage, side by side (as a flat parameter buffer holds them)."""
    monkeypatch.setattr(LocalFiles, "piece_bytes", SMALL_PIECES)
    monkeypatch.setattr(ring, "SLOT_BYTES", SMALL_PIECES)  # many slabs of rows through the buffer
    source = source_state(fmt)
    flat = torch.zeros(2 * 37 * 29 + 512 * 300)
    target = fresh_target(source)
    target["t_float32"] = flat[: 37 * 29].view(SHAPE)  # shared storage, contiguous
    target["big"] = flat[37 * 29: 37 * 29 + 512 * 300].view(300, 512).t()  # shared storage, transposed
    target["t_int32"] = torch.zeros(2 * 37, 29, dtype=torch.int32)[::2]  # strided rows
    target["t_float64"] = torch.zeros(SHAPE, dtype=torch.float32)  # float64 saved, converted on load
    load(target, saved[fmt])
    for key in ("t_float32", "big", "t_int32"):
        assert same_bits(target[key], source[key]), key
    assert torch.equal(flat[-(37 * 29):], torch.zeros(37 * 29))  # nothing written past the views
    assert same_bits(target["t_float64"], source["t_float64"].float())


def test_stock_dcp_save_checkpoints_load(tmp_path, monkeypatch):
    """dcp.save keeps a transposed tensor's strides in its archive; views that do not cover
    their storage are cloned; objects are torch.save bytes."""
    monkeypatch.setattr(LocalFiles, "piece_bytes", SMALL_PIECES)
    monkeypatch.setattr(ring, "SLOT_BYTES", SMALL_PIECES)
    base = random_tensor(torch.float32, (64, 48), 1)
    source = {
        "transposed": base.t(),
        "row_view": base[3:9],
        "bf16": random_tensor(torch.bfloat16, (100, 33), 2),
        "f8": random_tensor(torch.float8_e5m2, (40,), 3),
        "scalar": torch.tensor(4, dtype=torch.int64),
        "step": 11,
        "meta": {"tag": "x"},
    }
    path = str(tmp_path / "dcp")
    dcp.save(source, checkpoint_id=path, no_dist=True)
    target = fresh_target(source)
    load(target, path)
    assert_bitwise_equal(target, source)


def _item_of(path: str, fqn: str):
    metadata = read_metadata(path)
    [(index, info)] = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn]
    return metadata, index, info


def _damage(path: str, how: str) -> tuple[str, set[str]]:
    """Damage the item `t_float32` of the checkpoint at `path`; return its file and the items
    of which the error must name one (those the damage reaches)."""
    metadata, index, info = _item_of(path, "t_float32")
    after = {i.fqn for i, s in metadata.storage_data.items() if s.relative_path == info.relative_path
             and (how == "missing file" or s.offset >= info.offset)}
    file = os.path.join(path, info.relative_path)
    if how == "missing file":
        os.remove(file)
    elif how in ("flipped data byte", "flipped header byte"):
        at = info.offset + (info.length - 200 if how == "flipped data byte" else 40)
        with open(file, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x5A]))
    elif how == "truncated file":
        # the damaged item becomes the file's last: everything after it goes, and half of it
        with open(file, "r+b") as f:
            f.truncate(info.offset + info.length // 2)
    elif how == "range past the end":
        end = os.path.getsize(file)
        metadata.storage_data[index] = type(info)(info.relative_path, end - 10, info.length)
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
    return info.relative_path, after if how in ("missing file", "truncated file") else {"t_float32"}


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.parametrize(
    "how", ["missing file", "truncated file", "range past the end", "flipped data byte", "flipped header byte"]
)
def test_damaged_checkpoint_raises_naming_file_and_item_and_the_state_left(saved, tmp_path, how, backend, request):
    path = str(tmp_path / "copy")
    shutil.copytree(saved["torch_save"], path)
    file, items = _damage(path, how)
    if backend != "local":  # the damaged checkpoint's objects: the error names the object's URL
        path = upload(request.getfixturevalue("s3_server"), path, backend)
        file = f"{path}/{file}"
    source = source_state("torch_save")
    target = fresh_target(source, fill=SENTINEL)
    with pytest.raises(CheckpointError) as raised:
        load(target, path)
    message = str(raised.value)
    assert file in message and any(item in message for item in items), message
    if how.startswith("flipped"):
        # found once the bytes landed: the error says the state is partly loaded, and it is
        assert isinstance(raised.value, PartialLoadError), message
        assert "checksum mismatch" in message and "PARTLY LOADED" in message, message
        if backend == "local":  # read in place (an object store reads an item this small whole, then checks it)
            assert not same_bits(target["t_float32"], fresh_target(source, fill=SENTINEL)["t_float32"])
    else:
        # found before any read: nothing changed, and the error says so
        assert not isinstance(raised.value, PartialLoadError), message
        assert "nothing in state_dict was changed" in message, message
        assert_bitwise_equal(target, fresh_target(source, fill=SENTINEL))


def test_a_path_that_is_no_checkpoint_is_named_for_what_it_is(tmp_path):
    """A mistyped path says there is no such directory, not that a checkpoint there is uncommitted."""
    from asyncckpt import verify_checkpoint

    missing, torn, file = str(tmp_path / "missing"), str(tmp_path / "torn"), str(tmp_path / "file")
    os.mkdir(torn)
    open(file, "wb").close()
    for path, expected in [(missing, "no such checkpoint directory"), (file, "is a file, not a checkpoint directory"),
                           (torn, r"not a committed checkpoint \(no \.metadata\)")]:
        with pytest.raises(CheckpointError, match=expected):
            load({"w": torch.zeros(2)}, path)
        with pytest.raises(CheckpointError, match=expected):
            verify_checkpoint(path)


@pytest.mark.parametrize("algorithm", ["crc32c", "crc32"])
def test_checksums_of_pieces_combine_into_the_items(algorithm):
    """Pieces of one item are checksummed on different threads and combined."""
    from asyncckpt.formats import CHECKSUM_FUNCTIONS, crc_combine

    crc = CHECKSUM_FUNCTIONS[algorithm]
    data = bytes(random_tensor(torch.uint8, (10_000,), 5))
    for cut in (0, 1, 4096, 9_999, 10_000):
        a, b = data[:cut], data[cut:]
        assert crc_combine(algorithm, crc(a), crc(b), len(b)) == crc(data)


def test_a_large_checksum_lets_other_threads_run():
    """The reading threads checksum what they read as they read it: a CRC32C of a large buffer
    must release the GIL, or the threads' checksums run one at a time and a warm load takes
    much longer (google_crc32c's own `extend` holds the GIL for anything but `bytes`). While one
    thread checksums 128 MiB, another thread keeps running: no pause of half the call in its
    ticks (holding the GIL, the pause is the whole call: 0.7-0.97 of it here, 0.1-0.2 without)."""
    import sys
    import time

    from asyncckpt.formats import crc32c

    data = memoryview(torch.ones(128 << 20, dtype=torch.uint8).numpy())
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # a thread waiting for the GIL gets it within 0.5 ms of asking
    pauses = []
    try:
        for _ in range(3):  # the ticking thread may be descheduled on a busy box: a few tries
            ticks, stop = [], threading.Event()

            def tick() -> None:
                while not stop.is_set():
                    ticks.append(time.perf_counter())

            ticker = threading.Thread(target=tick)
            ticker.start()
            while not ticks:
                time.sleep(0.001)
            start = time.perf_counter()
            crc32c(data)
            end = time.perf_counter()
            stop.set()
            ticker.join(timeout=10)
            marks = [start] + [t for t in ticks if start < t < end] + [end]
            pauses.append(max(b - a for a, b in zip(marks, marks[1:])) / (end - start))
            if pauses[-1] < 0.5:
                return
        pytest.fail(f"another thread paused for {max(pauses):.0%} of crc32c of 128 MiB: it holds the GIL")
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.parametrize("fmt", ["torch_save", "safetensors"])
def test_a_flipped_byte_mid_item_is_found_when_the_item_is_read_on_several_threads(saved, tmp_path, fmt, monkeypatch):
    """A 600 KiB tensor read straight into its target in 128 KiB pieces on several threads,
    each checksummed as it is read (64 KiB at a time, the GIL released) and the parts combined:
    one byte flipped in its middle fails the load with PartialLoadError naming file and item."""
    monkeypatch.setattr(LocalFiles, "piece_bytes", 128 << 10)
    monkeypatch.setattr(LocalFiles, "step_bytes", 64 << 10)
    readers: dict[int, int] = {}  # thread -> reads of "big"
    two_readers = threading.Event()
    real_read_into = LocalFiles.read_into

    def read_into(self, path, offset, buffers, what):
        if ": big[" in what:  # the first thread to read it waits for a second one to read another piece
            readers[threading.get_ident()] = readers.get(threading.get_ident(), 0) + 1
            if len(readers) > 1:
                two_readers.set()
            two_readers.wait(timeout=30)
        real_read_into(self, path, offset, buffers, what)

    monkeypatch.setattr(LocalFiles, "read_into", read_into)
    damaged = damaged_copy(saved[fmt], str(tmp_path / "damaged"), "big")
    file = next(s.relative_path for i, s in read_metadata(damaged).storage_data.items() if i.fqn == "big")
    with pytest.raises(PartialLoadError, match=rf"{file}: big\[0, 0\]: checksum mismatch.*PARTLY LOADED"):
        load(fresh_target(source_state(fmt)), damaged)
    assert len(readers) > 1 and sum(readers.values()) >= 10, readers  # 600 KiB in 64 KiB reads, on several threads


# object stores ----------------------------------------------------------------------------------
def upload(s3, directory: str, scheme: str) -> str:
    """The files of a local checkpoint directory put as objects under a fresh prefix; its URL."""
    prefix = s3.unique_prefix(os.path.basename(directory))
    client = s3.server.s3_client()
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=f.read())
    return s3.url(scheme, prefix)


class RangeLog(MscStorage):
    """The real msc backend, recording every read of a data file: (object, offset, length).
    With `meet=True`, the first two such reads wait for each other at a barrier, so the load
    fails unless two reads are in flight at once."""

    def __init__(self, meet: bool = False) -> None:
        super().__init__()
        self.reads: list[tuple[str, int, int]] = []
        self._barrier = threading.Barrier(2, timeout=30) if meet else None

    def read_bytes(self, path: str, offset: int = 0, length=None) -> bytes:
        if is_data_file(path.rsplit("/", 1)[-1]):
            self.reads.append((path, offset, length))
            if self._barrier is not None and len(self.reads) <= 2:
                self._barrier.wait()
        return super().read_bytes(path, offset, length)


@pytest.fixture
def range_log(monkeypatch):
    """Installs a RangeLog as the object-store backend `load` uses; returns a function that
    installs a fresh one (`meet` as RangeLog's) and returns it."""
    from asyncckpt import storage

    def install(meet: bool = False) -> RangeLog:
        log = RangeLog(meet)
        monkeypatch.setitem(storage._backends, "msc", log)
        return log

    return install


@pytest.mark.parametrize("scheme", ["s3", "msc"])
@pytest.mark.parametrize("fmt", ["torch_save", "safetensors"])
def test_object_store_checkpoints_load_bitwise_equal_one_ranged_get_per_file(saved, s3_server, range_log, fmt, scheme):
    """Every item of a file is needed and they lie end to end: one GET per file reads its tensors,
    and one its objects (read first, so that one weights_only refuses stops the load before any
    tensor is written; a save puts them after the tensors)."""
    url = upload(s3_server, saved[fmt], scheme)
    log = range_log()
    target = fresh_target(source_state(fmt))
    load(target, url)
    assert_bitwise_equal(target, source_state(fmt))
    spans = {}  # (object, holds objects) -> (first byte, end) of those items
    for index, info in read_metadata(saved[fmt]).storage_data.items():
        key = (f"{url}/{info.relative_path}", index.offset is None)  # objects have no chunk offset
        first, end = spans.get(key, (info.offset, info.offset + info.length))
        spans[key] = (min(first, info.offset), max(end, info.offset + info.length))
    assert sorted(log.reads) == sorted((path, first, end - first) for (path, _), (first, end) in spans.items())


@pytest.mark.parametrize("fmt", ["torch_save", "safetensors"])
def test_object_store_load_reads_only_the_needed_items_in_parallel(saved, s3_server, range_log, fmt, monkeypatch):
    """A target needing a part of the files: only the needed items' bytes are requested (no
    whole-object GET), in ranges of at most a piece, two or more in flight at once."""
    monkeypatch.setattr(ObjectRanges, "piece_bytes", SMALL_PIECES)
    monkeypatch.setattr(ObjectRanges, "step_bytes", SMALL_PIECES)
    monkeypatch.setattr(ObjectRanges, "whole_item_bytes", 0)  # archives found by reading their head and tail
    monkeypatch.setattr(ring, "SLOT_BYTES", SMALL_PIECES)
    url = upload(s3_server, saved[fmt], "s3")
    log = range_log(meet=True)
    wanted = ("big", "t_float32", "t_int8")
    source = source_state(fmt)
    target = fresh_target({key: source[key] for key in wanted})
    target["t_int8"] = target["t_int8"].t().contiguous().t()  # not in place: slabs through a buffer
    load(target, url)
    assert_bitwise_equal(target, {key: source[key] for key in wanted})
    needed = {}  # file -> [(start, end)] of the wanted items
    for index, info in read_metadata(saved[fmt]).storage_data.items():
        if index.fqn in wanted:
            needed.setdefault(f"{url}/{info.relative_path}", []).append((info.offset, info.offset + info.length))
    for path, offset, length in log.reads:  # a piece, or an archive's head and tail (one read if small)
        assert length is not None and 0 < length <= max(SMALL_PIECES, 2 * archive.WINDOW), (path, offset, length)
        assert any(start <= offset and offset + length <= end for start, end in needed[path]), (path, offset, length)
    wanted_bytes = sum(end - start for ranges in needed.values() for start, end in ranges)
    assert wanted_bytes <= sum(length for _, _, length in log.reads) <= wanted_bytes + 2 * archive.WINDOW * len(wanted)


class Shrinking(RangeLog):
    """The real backend; just before the first GET of tensor data (at offset 0: a save writes a
    file's tensors first, its objects after them, and the load reads objects first), another
    writer replaces that object with its first half (after the load checked every object's size)."""

    def __init__(self, s3) -> None:
        super().__init__()
        self.s3 = s3
        self.shrunk = None  # the object replaced
        self._lock = threading.Lock()

    def read_bytes(self, path: str, offset: int = 0, length=None) -> bytes:
        with self._lock:
            if is_data_file(path.rsplit("/", 1)[-1]) and offset == 0 and self.shrunk is None:
                self.shrunk = path
                key = path.split(f"{BUCKET}/", 1)[1]
                client = self.s3.server.s3_client()
                whole = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
                client.put_object(Bucket=BUCKET, Key=key, Body=whole[: len(whole) // 2])
        return super().read_bytes(path, offset, length)


def test_object_store_object_shrinking_during_load_raises_naming_it(saved, s3_server, monkeypatch):
    """A GET that returns less than the range asked (the object changed after its size was
    checked) fails the load naming the object and item; the state is said to be partly loaded."""
    url = upload(s3_server, saved["torch_save"], "s3")
    shrinking = Shrinking(s3_server)
    from asyncckpt import storage

    monkeypatch.setitem(storage._backends, "msc", shrinking)
    target = fresh_target(source_state("torch_save"), fill=SENTINEL)
    with pytest.raises(PartialLoadError) as raised:
        load(target, url)
    message = str(raised.value)
    assert f"{shrinking.shrunk}: " in message and "PARTLY LOADED" in message, message


MANY_FILES_SCRIPT = """
import os, resource, sys, torch, torch.distributed.checkpoint as dcp
from asyncckpt import load
path, n = sys.argv[1], int(sys.argv[2])
state = {f"t{i}": torch.arange(64, dtype=torch.float32) + i for i in range(n)}
dcp.save(state, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=False), no_dist=True)
files = [f for f in os.listdir(path) if f.endswith(".distcp")]
assert len(files) == n, len(files)  # one file per tensor
in_use = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + n // 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
target = {k: torch.zeros_like(v) for k, v in state.items()}
load(target, path)
assert all(torch.equal(target[k], state[k]) for k in state)
print("loaded", n, "files with", in_use + n // 4, "descriptors allowed")
"""


def test_a_checkpoint_of_more_files_than_free_descriptors_loads(tmp_path):
    """Stock DCP with one file per item (or many ranks' files) loaded by one process: the loader
    holds one file open per reading thread, not every file at once times every thread."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", MANY_FILES_SCRIPT, str(tmp_path / "ckpt"), "400"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0 and "loaded 400 files" in done.stdout, done.stdout + done.stderr


def _archive_claiming(nbytes: int) -> bytes:
    """A one-tensor torch.save archive whose record says float32 (4,) over a storage of `nbytes`
    bytes (the data record as long): what a crafted checkpoint can claim."""
    import collections
    import io
    import zipfile

    storage = object()

    class Tensor:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v3, (storage, 0, (4,), (1,), False, collections.OrderedDict(), torch.float32))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.UntypedStorage, "0", "cpu", nbytes) if obj is storage else None

    pickled = io.BytesIO()
    Pickler(pickled, protocol=2).dump(Tensor())
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickled.getvalue())
        z.writestr("archive/data/0", bytes(nbytes))
        z.writestr("archive/version", b"3\n")
    return out.getvalue()


def test_an_archive_claiming_a_storage_longer_than_its_tensor_is_not_read_in_place():
    """19 bytes claimed for a float32 (4,) tensor: read in place, 3 bytes would land past the
    target's end (heap memory). The layout is refused (the item is then read whole and decoded
    by torch's own weights_only loader)."""
    honest, crafted = _archive_claiming(16), _archive_claiming(19)
    assert archive.locate_tensor(lambda o, n: honest[o:o + n], len(honest), torch.float32).nbytes == 16
    with pytest.raises(archive.ArchiveError, match="does not fit"):
        archive.locate_tensor(lambda o, n: crafted[o:o + n], len(crafted), torch.float32)


def test_ctrl_c_while_reading_metadata_says_nothing_was_changed(tmp_path, monkeypatch):
    """Ctrl-C before a load has touched the state (reading `.metadata`) is KeyboardInterrupt that
    says so, through `load` and `load_latest` alike, as one during the reads says what it changed."""
    import asyncckpt.loading.opened as opened

    state = {"w": torch.arange(6.0)}
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        ckpt.schedule_save(state, step=1)
    target = {"w": torch.zeros(6)}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(opened, "load_metadata", interrupted)
    with pytest.raises(KeyboardInterrupt, match="loading .*step_00000001.*: nothing in state_dict was changed"):
        load(target, str(tmp_path / "step_00000001"))
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        with pytest.raises(KeyboardInterrupt, match="nothing in state_dict was changed"):
            ckpt.load_latest(target)
    assert torch.equal(target["w"], torch.zeros(6))


class _InterruptedStateful:
    """A Stateful that a Ctrl-C reaches in `state_dict()` (before a load reads anything) or in
    `load_state_dict()` (after the load wrote its tensors)."""

    def __init__(self, when: str):
        self.when, self.w = when, torch.zeros(6)

    def state_dict(self):
        if self.when == "state_dict":
            raise KeyboardInterrupt
        return {"w": self.w}

    def load_state_dict(self, state):
        raise KeyboardInterrupt


@pytest.mark.parametrize("when, says", [("state_dict", "nothing in state_dict was changed"),
                                        ("load_state_dict", "PARTLY LOADED")])
def test_ctrl_c_in_a_statefuls_own_calls_says_what_the_load_changed(tmp_path, when, says):
    """Ctrl-C anywhere in a load is KeyboardInterrupt saying whether the state was changed, also in
    the load's own steps around DCP's (a Stateful's state_dict() before, its load_state_dict() after)."""
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        ckpt.schedule_save({"m": {"w": torch.arange(6.0)}}, step=1)
    with pytest.raises(KeyboardInterrupt, match=f"loading .*step_00000001.*: .*{says}"):
        load({"m": _InterruptedStateful(when)}, str(tmp_path / "step_00000001"))
