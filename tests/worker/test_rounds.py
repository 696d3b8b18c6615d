"""One save's rounds in the worker on their own (no worker process): the trainer waits for Staged,
so nothing but the copy may come before it. Creating the data files (on an object store: the
worker's first client, an upload per file) comes after it whenever the save is one round."""

from __future__ import annotations

import os

import torch

from asyncckpt.protocol import TENSOR, ItemIndex, ItemSpec, SaveRequest, WriteOptions
from asyncckpt_worker.cache import StructureCache
from asyncckpt_worker.rounds import run_save
from asyncckpt_worker.staging import StagingPool
from asyncckpt_worker.writers import Writers


def _request(directory: str, data_folder: str = "", **options) -> SaveRequest:
    items = tuple(ItemSpec(ItemIndex(name), TENSOR, torch.float32, (1024,)) for name in ("a", "b", "c"))
    tensors = {pos: torch.full((1024,), float(pos)) for pos in range(len(items))}
    return SaveRequest(save_id=1, checkpoint_dir=directory, structure_key="k", items=items, fresh_tensors=tensors,
                       options=WriteOptions(io_workers=2, fsync=False, **options), data_folder=data_folder)


def _save(directory: str, request: SaveRequest) -> tuple[list[str], list[str]]:
    """Run the save; return what the directory held when Staged was sent, and after."""
    at_staged: list[str] = []
    entry, _ = StructureCache().apply(request)
    pool, writers = StagingPool(), Writers()
    try:
        done = run_save(request, entry, pool, writers, 0, lambda: at_staged.extend(sorted(os.listdir(directory))))
    finally:
        writers.close()
        pool.close()
    assert len(done.items) == 3 and done.bytes_written > 3 * 4096
    return at_staged, sorted(os.listdir(directory))


def test_a_one_round_save_creates_its_files_after_staged(tmp_path):
    at_staged, after = _save(str(tmp_path), _request(str(tmp_path), data_folder="r0"))
    assert at_staged == []  # neither the data folder nor a file: none of that on the trainer's wait
    assert after == ["r0"] and len(os.listdir(tmp_path / "r0")) == 2  # two writers, two files


def test_a_save_in_rounds_creates_its_files_before_its_first_write(tmp_path):
    """Under a staging budget the first rounds are written before the last is staged."""
    at_staged, after = _save(str(tmp_path), _request(str(tmp_path), staging_budget_bytes=4096))
    assert at_staged and at_staged == after
