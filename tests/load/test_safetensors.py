"""format="safetensors": every bucket file is a valid safetensors file; `.metadata` points at each
tensor's raw bytes; objects live in a torch_save file after them (`__{rank}_{n}.distcp`); asyncckpt and DCP's
HuggingFaceStorageReader both read the checkpoint back."""

from __future__ import annotations

import glob
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

from asyncckpt import AsyncCheckpointer, CheckpointConfig, load
from asyncckpt.loading.safe_reader import SafeLoadPlanner, SafeReader
from asyncckpt.loading.load import verify_checkpoint
from conftest import assert_state_equal, clone_state, step_path, zeros_like_state

MiB = 1 << 20



def mixed_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {
            "w": torch.randn(128, 64, generator=g),
            "b": torch.randn(64, generator=g).to(torch.bfloat16),
            "mask": torch.rand(33, generator=g) > 0.5,
            "ids": torch.arange(100, dtype=torch.int64),
            "half": torch.randn(7, 3, generator=g).half(),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
        },
        "big": torch.randn(3 * MiB // 4, generator=g),  # 3 MiB
        "meta": {"step": 9, "names": ["x", "y"]},
    }


def tensors_of(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, dict):
            out.update(tensors_of(value, name + "."))
    return out


def save(root: str, state: dict, **config) -> str:
    with AsyncCheckpointer(root, CheckpointConfig(format="safetensors", **config)) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
    return step_path(root, 1)


def test_every_bucket_file_is_a_valid_safetensors_file(ckpt_root):
    state = mixed_state()
    expected = tensors_of(clone_state(state))
    path = save(ckpt_root, state, io_workers=2)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    assert [os.path.basename(f) for f in files] == ["__0_0.safetensors", "__0_1.safetensors"]
    assert os.path.exists(os.path.join(path, "__0_2.distcp"))  # the objects, in torch_save format
    seen = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            assert f.metadata()["format"] == "pt" and "DCP_SHARDING_INFO" in f.metadata()
            for key in f.keys():
                seen[key] = f.get_tensor(key)
    assert seen.keys() == expected.keys()
    for key, tensor in expected.items():
        assert_state_equal(seen[key], tensor, key)


def test_metadata_points_at_each_tensors_raw_bytes(ckpt_root):
    state = mixed_state()
    expected = tensors_of(clone_state(state))
    path = save(ckpt_root, state, io_workers=1)
    metadata = pickle.load(open(os.path.join(path, ".metadata"), "rb"))
    for index, info in metadata.storage_data.items():
        if index.fqn not in expected:
            assert info.relative_path == "__0_1.distcp"  # objects file after the one safetensors file
            continue
        tensor = expected[index.fqn]
        assert info.relative_path.endswith(".safetensors") and info.length == tensor.nbytes
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        assert raw == tensor.reshape(-1).view(torch.uint8).numpy().tobytes(), index.fqn


@pytest.mark.parametrize("io", ["thread", "process"])
def test_round_trip_through_stock_dcp_load_with_safe_reader_is_bitwise_equal(ckpt_root, io):
    state = mixed_state()
    expected = clone_state(state)
    path = save(ckpt_root, state, io=io, io_workers=3)
    target = zeros_like_state(expected)  # stock dcp.load with asyncckpt's (safe) StorageReader
    dcp.load(target, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=True)
    assert_state_equal(target, expected)
    assert verify_checkpoint(path) == []


def test_asyncckpt_load_reads_it_back_bitwise_equal(ckpt_root):
    state = mixed_state()
    expected = clone_state(state)
    path = save(ckpt_root, state, io_workers=2)
    target = zeros_like_state(expected)
    load(target, path, verify=True)
    assert_state_equal(target, expected)


def test_huggingface_storage_reader_loads_the_tensors(ckpt_root):
    state = mixed_state()
    expected = clone_state(state)
    path = save(ckpt_root, state, io_workers=2)
    # HF's reader knows tensors only (it builds its metadata from the safetensors headers)
    target = {"model": zeros_like_state(expected["model"]), "big": torch.zeros_like(expected["big"])}
    dcp.load(target, storage_reader=HuggingFaceStorageReader(path), no_dist=True)
    assert_state_equal(target["model"], expected["model"])
    assert_state_equal(target["big"], expected["big"])


def test_budget_and_io_modes_write_the_same_safetensors_files(tmp_path):
    state = mixed_state()
    contents = {}
    for name, config in {
        "thread": dict(io="thread"),
        "process": dict(io="process"),
        "budget": dict(io="thread", staging_budget_bytes=MiB),  # "big" streams through the slab
    }.items():
        path = save(str(tmp_path / name), state, io_workers=2, **config)
        contents[name] = {os.path.basename(p): open(p, "rb").read() for p in glob.glob(os.path.join(path, "__0_*"))}
    assert len(contents["thread"]) == 3
    assert contents["thread"] == contents["process"] == contents["budget"]


def test_flipped_byte_in_a_safetensors_file_is_named(ckpt_root):
    state = mixed_state()
    path = save(ckpt_root, state, io_workers=1)
    metadata = pickle.load(open(os.path.join(path, ".metadata"), "rb"))
    [(index, info)] = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == "model.w"]
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset + 17)
        byte = f.read(1)
        f.seek(info.offset + 17)
        f.write(bytes([byte[0] ^ 1]))
    [problem] = verify_checkpoint(path)
    assert "model.w" in problem and info.relative_path in problem
