"""The parallel loader (reader.py): bitwise-equal loads for both formats, every dtype we save,
targets it cannot read into directly, stock dcp.save checkpoints, and what a damaged checkpoint
does to the caller's state (named in the error; never a silent partial load)."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt.reader as reader
from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, PartialLoadError, load
from asyncckpt.formats import SAFETENSORS_DTYPES
from asyncckpt.loading import read_metadata

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


@pytest.mark.parametrize("piece_bytes", [reader.PIECE_BYTES, SMALL_PIECES], ids=["default-pieces", "4KiB-pieces"])
@pytest.mark.parametrize("fmt", ["torch_save", "safetensors"])
def test_every_dtype_loads_bitwise_equal(saved, fmt, piece_bytes, monkeypatch):
    monkeypatch.setattr(reader, "PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(reader, "BUFFER_BYTES", piece_bytes)
    target = fresh_target(source_state(fmt))
    load(target, saved[fmt])
    assert_bitwise_equal(target, source_state(fmt))


@pytest.mark.parametrize("fmt", ["torch_save", "safetensors"])
def test_non_contiguous_shared_storage_and_other_dtype_targets(saved, fmt, monkeypatch):
    """Targets the bytes cannot land in directly: transposed, strided, another dtype; and views
    of one storage, side by side (as a flat parameter buffer holds them)."""
    monkeypatch.setattr(reader, "PIECE_BYTES", SMALL_PIECES)
    monkeypatch.setattr(reader, "BUFFER_BYTES", SMALL_PIECES)  # many slabs of rows through the buffer
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
    monkeypatch.setattr(reader, "PIECE_BYTES", SMALL_PIECES)
    monkeypatch.setattr(reader, "BUFFER_BYTES", SMALL_PIECES)
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


@pytest.mark.parametrize(
    "how", ["missing file", "truncated file", "range past the end", "flipped data byte", "flipped header byte"]
)
def test_damaged_checkpoint_raises_naming_file_and_item_and_the_state_left(saved, tmp_path, how):
    path = str(tmp_path / "copy")
    shutil.copytree(saved["torch_save"], path)
    file, items = _damage(path, how)
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
        assert not same_bits(target["t_float32"], fresh_target(source, fill=SENTINEL)["t_float32"])
    else:
        # found before any read: nothing changed, and the error says so
        assert not isinstance(raised.value, PartialLoadError), message
        assert "nothing in state_dict was changed" in message, message
        assert_bitwise_equal(target, fresh_target(source, fill=SENTINEL))


@pytest.mark.parametrize("algorithm", ["crc32c", "crc32"])
def test_checksums_of_pieces_combine_into_the_items(algorithm):
    """Pieces of one item are checksummed on different threads and combined."""
    from asyncckpt.formats import CHECKSUM_FUNCTIONS, crc_combine

    crc = CHECKSUM_FUNCTIONS[algorithm]
    data = bytes(random_tensor(torch.uint8, (10_000,), 5))
    for cut in (0, 1, 4096, 9_999, 10_000):
        a, b = data[:cut], data[cut:]
        assert crc_combine(algorithm, crc(a), crc(b), len(b)) == crc(data)
