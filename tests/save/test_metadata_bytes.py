"""`.metadata` assembled from a plan's head and each rank's encoded entries (save/metadata_bytes.py)
is the same `Metadata` a plain pickle gives, readable by every unpickler stock DCP or a tool may use."""

from __future__ import annotations

import io
import pickle
import pickletools

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties, TensorStorageMetadata,
)

from asyncckpt.loading.safety import load_metadata
from asyncckpt.protocol import ItemIndex, ItemWritten
from asyncckpt.save.metadata_bytes import assemble, encode_entries, encode_head

RANKS, TENSORS = 3, 40


def _plan(planner_data=None) -> Metadata:
    state = {
        f"layers.{t}.weight": TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([4 * RANKS, 16]),
            [ChunkStorageMetadata(torch.Size([4 * r, 0]), torch.Size([4, 16])) for r in range(RANKS)],
        )
        for t in range(TENSORS)
    }
    state["lr_scheduler"] = BytesStorageMetadata()
    return Metadata(state, planner_data)


def _rank_items(rank: int) -> list[ItemWritten]:
    """Rank 2 writes nothing (a DDP rank that is not the lowest); the others spread their items
    over two files in their data folder, and rank 0 also writes an object."""
    if rank == 2:
        return []
    items = []
    for t in range(TENSORS):
        name = f"p0{rank}/__{rank}_{t % 2}.distcp"
        items.append(ItemWritten(ItemIndex(f"layers.{t}.weight", (4 * rank, 0), t), name, 1000 * t, 256 + t, 7))
    if rank == 0:
        items.append(ItemWritten(ItemIndex("lr_scheduler"), "p00/__0_0.distcp", 99_000, 123))
    return items


def _classic(plan: Metadata, step_dir: str, save_id: str) -> Metadata:
    storage = {w.index.to_dcp(): _StorageInfo(w.relative_path, w.offset, w.length)
               for rank in range(RANKS) for w in _rank_items(rank)}
    return Metadata(plan.state_dict_metadata, plan.planner_data, storage,
                    StorageMeta(checkpoint_id=step_dir, save_id=save_id), "1.0.0")


def test_assembled_metadata_equals_a_plain_pickle_and_every_unpickler_reads_it():
    plan, step_dir, save_id = _plan(), "/ckpt/step_00000002", "a" * 32
    entries = [encode_entries(_rank_items(rank)) for rank in range(RANKS)]
    data = b"".join(assemble(encode_head(plan, "1.0.0"), step_dir, save_id, entries))
    expected = _classic(plan, step_dir, save_id)

    assert pickle.loads(data) == expected  # the C unpickler (stock dcp.load)
    assert pickle._Unpickler(io.BytesIO(data)).load() == expected  # the pure-Python one checks frames strictly
    assert load_metadata(data, "test") == expected  # asyncckpt's restricted unpickler
    assert list(pickletools.genops(data))[-1][0].name == "STOP"  # a well-formed opcode stream
    assert list(pickle.loads(data).storage_data) == list(expected.storage_data)  # rank order kept
    assert len(data) <= len(pickle.dumps(expected))  # no larger than the plain pickle DCP writes


def test_a_head_with_payloads_outside_frames_still_assembles():
    """The C pickler writes large strings and bytes between frames; the head keeps them."""
    plan = _plan(planner_data={"blob": b"x" * 200_000, "text": "y" * 100_000})
    data = b"".join(assemble(encode_head(plan, "1.0.0"), "/d", "b" * 32, [encode_entries(_rank_items(0))]))
    loaded = pickle._Unpickler(io.BytesIO(data)).load()
    assert loaded.planner_data == plan.planner_data
    assert len(loaded.storage_data) == TENSORS + 1


def test_entries_encode_the_same_bytes_for_the_same_layout():
    """What lets a steady save send nothing: equal layouts give equal bytes, a moved item does not."""
    assert encode_entries(_rank_items(1)) == encode_entries(_rank_items(1))
    moved = [ItemWritten(w.index, w.relative_path, w.offset + 1, w.length) for w in _rank_items(1)]
    assert encode_entries(moved) != encode_entries(_rank_items(1))
