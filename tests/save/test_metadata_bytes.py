"""`.metadata` assembled from a plan's head and each rank's encoded entries (save/metadata_bytes.py)
is the same `Metadata` a plain pickle gives, readable by every unpickler stock DCP or a tool may use."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import sys

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties, TensorStorageMetadata,
)

from conftest import REPO

from asyncckpt.layout import step_dir_name
from asyncckpt.loading.safety import load_metadata
from asyncckpt.protocol import ItemIndex, ItemWritten, WriteDone
from asyncckpt.save.commit import CommitMemory, RankOutcome, SaveTarget, finish_save, rank_share
from asyncckpt.save.retention import Janitor
from asyncckpt.storage import storage_for
from asyncckpt.save.metadata_bytes import (
    NAME_SLOTS, EntriesPlan, EntryRefs, MetadataHead, build_image, encode_entries, encode_head, head_refs,
)

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


def _refs(head: MetadataHead, items: list[ItemWritten]) -> EntryRefs:
    """What planning hands the rank writing `items`: the head's references for its plan."""
    plan = SavePlan([WriteItem(w.index.to_dcp(), WriteItemType.BYTE_IO) for w in items])
    return head_refs(head, plan).bind(plan)


def _assembled(plan: Metadata, step_dir: str, save_id: str, items: dict[int, list[ItemWritten]]) -> bytes:
    head = encode_head(plan)
    image = build_image(head, {rank: (0, encode_entries(i, _refs(head, i))) for rank, i in items.items()})
    return bytes(image.with_tail(step_dir, save_id).view())


def test_assembled_metadata_equals_a_plain_pickle_and_every_unpickler_reads_it():
    plan, step_dir, save_id = _plan(), "/ckpt/step_00000002", "a" * 32
    data = _assembled(plan, step_dir, save_id, {rank: _rank_items(rank) for rank in range(RANKS)})
    expected = _classic(plan, step_dir, save_id)

    assert pickle.loads(data) == expected  # the C unpickler (stock dcp.load)
    assert pickle._Unpickler(io.BytesIO(data)).load() == expected  # the pure-Python one checks frames strictly
    assert load_metadata(data, "test") == expected  # asyncckpt's restricted unpickler
    assert list(pickletools.genops(data))[-1][0].name == "STOP"  # a well-formed opcode stream
    assert list(pickle.loads(data).storage_data) == list(expected.storage_data)  # rank order kept
    assert len(data) <= len(pickle.dumps(expected))  # no larger than the plain pickle DCP writes
    # each fqn is written once, by the head: every rank's entries refer to it
    assert [data.count(f"layers.{t}.weight".encode()) for t in (0, 7, TENSORS - 1)] == [1, 1, 1]


def test_a_rank_with_more_files_than_name_slots_writes_the_rest_out():
    plan = _plan()
    items = [ItemWritten(w.index, f"p00/__0_{n}.distcp", w.offset, w.length)
             for n, w in enumerate(_rank_items(0) * 2)][:NAME_SLOTS + 5]
    items = list({w.index: w for w in items}.values())
    data = _assembled(plan, "/d", "c" * 32, {0: items})
    assert {k: (v.relative_path, v.offset, v.length) for k, v in pickle.loads(data).storage_data.items()} == \
        {w.index.to_dcp(): (w.relative_path, w.offset, w.length) for w in items}


def test_a_head_with_payloads_outside_frames_still_assembles():
    """The C pickler writes large strings and bytes between frames; the head keeps them."""
    plan = _plan(planner_data={"blob": b"x" * 200_000, "text": "y" * 100_000})
    data = _assembled(plan, "/d", "b" * 32, {0: _rank_items(0)})
    loaded = pickle._Unpickler(io.BytesIO(data)).load()
    assert loaded.planner_data == plan.planner_data
    assert len(loaded.storage_data) == TENSORS + 1


def test_entries_encode_the_same_bytes_for_the_same_layout():
    """What lets a steady save send nothing: equal layouts give equal bytes, a moved item does not."""
    refs = _refs(encode_head(_plan()), _rank_items(1))
    assert encode_entries(_rank_items(1), refs) == encode_entries(_rank_items(1), refs)
    moved = [ItemWritten(w.index, w.relative_path, w.offset + 1, w.length) for w in _rank_items(1)]
    assert encode_entries(moved, refs) != encode_entries(_rank_items(1), refs)


def _without_checksums(items: list[ItemWritten]) -> list[ItemWritten]:
    return [ItemWritten(w.index, w.relative_path, w.offset, w.length) for w in items]


def test_a_steady_commit_writes_the_kept_image_again_with_its_own_tail(tmp_path):
    """Three ranks commit four saves through the real commit (`finish_save`; the collectives
    simulated): a first save, a steady one (no rank sends entries, the coordinator writes the
    image it kept), one where a rank's item moved (that rank alone sends); then two that must
    fail and leave no `.metadata`: a rank claims entries the coordinator never committed, a rank
    encoded its entries for another plan's head (its fqns would name other tensors).
    Every committed `.metadata` is exactly the plain pickle of its own save, and writing a later
    one into the kept buffer never changes an earlier file."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from scalesim.wire import SimulatedGroup

    plan, root = _plan(), str(tmp_path / "ckpt")
    storage, group, janitor = storage_for(root), SimulatedGroup(RANKS), Janitor()
    coordinator_memory, rank_memories = CommitMemory(), {r: CommitMemory() for r in range(1, RANKS)}
    moved = [ItemWritten(w.index, w.relative_path, w.offset + 8, w.length) for w in _rank_items(1)]
    head = encode_head(plan)
    entries_plans = {r: EntriesPlan(_refs(head, _rank_items(r)), head if r == 0 else None) for r in range(RANKS)}

    def save(step: int, items: dict[int, list[ItemWritten]]):
        step_dir = storage.join(root, step_dir_name(step))
        storage.prepare_dir(step_dir)
        targets = {r: SaveTarget(root, step, step_dir_name(step), step_dir, entries_plans[r]) for r in range(RANKS)}
        outcomes = {r: RankOutcome(r, WriteDone(step, tuple(_without_checksums(items[r])), 1, 0.0)) for r in items}
        shares = {r: rank_share(storage, targets[r], outcomes[r], False, rank_memories[r], own_part=True)
                  for r in range(1, RANKS)}
        group.inbox = [pickle.dumps(shares[r][0]) for r in range(1, RANKS)]
        verdict = finish_save(group, storage, targets[0], outcomes[0], False, None, janitor, coordinator_memory)
        for r, (_, entries) in shares.items():  # what finish_save does on each rank with the verdict
            rank_memories[r].own_entries = entries if verdict.committed else None
        return verdict, step_dir, [shares[r][0].entries is not None for r in range(1, RANKS)]

    def expected(step_dir: str, save_id: str, items: dict[int, list[ItemWritten]]) -> Metadata:
        storage_data = {w.index.to_dcp(): _StorageInfo(w.relative_path, w.offset, w.length)
                        for r in range(RANKS) for w in items[r]}
        return Metadata(plan.state_dict_metadata, plan.planner_data, storage_data,
                        StorageMeta(checkpoint_id=step_dir, save_id=save_id), "1.0.0")

    layout = {r: _rank_items(r) for r in range(RANKS)}
    committed, images = [], []
    for step, items, senders in ((1, layout, [True, True]), (2, layout, [False, False]),
                                 (3, {**layout, 1: moved}, [True, False])):
        verdict, step_dir, sent = save(step, items)
        assert verdict.committed, verdict.error
        assert sent == senders, step
        images.append(coordinator_memory.image)
        with open(os.path.join(step_dir, ".metadata"), "rb") as f:
            data = f.read()
        assert pickle.loads(data) == expected(step_dir, verdict.save_id, items), step
        committed.append((step_dir, data))
    assert images[1] is images[0] and images[2] is not images[0]  # kept while steady, rebuilt when an item moved
    for step_dir, data in committed:  # later saves wrote into the kept buffer, never into these files
        with open(os.path.join(step_dir, ".metadata"), "rb") as f:
            assert f.read() == data

    rank_memories[2].own_entries = encode_entries(moved, entries_plans[2].refs)  # a layout never committed
    verdict, step_dir, _ = save(4, {**layout, 1: moved, 2: moved})
    assert not verdict.committed and "rank 2 sent no .metadata entries" in verdict.error
    assert not os.path.exists(os.path.join(step_dir, ".metadata"))

    other_head = encode_head(_plan(planner_data={"another": "plan"}))
    entries_plans[1] = EntriesPlan(_refs(other_head, _rank_items(1)))
    verdict, step_dir, _ = save(5, layout)
    janitor.close(10.0)
    assert not verdict.committed and "rank 1 encoded its .metadata entries for another plan" in verdict.error
    assert not os.path.exists(os.path.join(step_dir, ".metadata"))
