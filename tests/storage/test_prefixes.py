"""Prefix spreading (layout.py; docs/usage.md, "Object storage"): a save's data files spread over
data folders of the step directory (`step_N/p01/__1_0.distcp`), one key prefix each, so a large
job stays under S3's ~3,500 writes/s per prefix. Stock DCP readers and asyncckpt's own read the
sub-paths `.metadata` records; listing, verifying, retention, incremental saves, failed-save
removal, cleanup and the upload sweep see the files in the folders."""

from __future__ import annotations

import os
import re
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, cleanup, verify_checkpoint
from asyncckpt.layout import WRITES_PER_PREFIX, data_folder, is_checksums_part, is_data_file, list_files, prefix_count
from asyncckpt.loading.load import uploads_left_open
from asyncckpt.storage import OpenUpload, storage_for
from asyncckpt.testing.s3_faults import Fault, FaultyS3
from asyncckpt.testing.s3_server import PROFILE, write_msc_config
from conftest import assert_loads_on_s3, assert_state_equal, step_path, zeros_like_state
from multirank import run_ranks

MiB = 1 << 20


def test_prefix_count_keeps_every_folder_under_the_limit():
    # docs/benchmark.md's 1,000-rank job: 44 writes a rank (4 files, 32 MiB parts)
    assert prefix_count(1000, 44) == 13
    for ranks, writes in ((1000, 44), (1000, 208), (16384, 4), (7, 3000), (3, 9000), (1, 10)):
        count = prefix_count(ranks, writes)
        busiest = -(-ranks // count) * writes  # ranks r, r + count, ... share a folder
        assert busiest <= max(WRITES_PER_PREFIX, writes), (ranks, writes, count)
        assert 1 <= count <= ranks
    assert prefix_count(8, 44) == 1  # a small job keeps the flat layout
    assert [data_folder(r, 13) for r in (0, 7, 13, 25)] == ["p00", "p07", "p00", "p12"]
    assert data_folder(5, 1) == "" and data_folder(1234, 1000) == "p234"
    assert is_data_file("p07/__7_0.distcp") and is_data_file("p07/__7_1.0123abcd.safetensors", tag=".0123abcd")
    assert not is_data_file("x7/__7_0.distcp") and not is_data_file("p07/p01/__7_0.distcp")


def test_config_refuses_a_bad_count():
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="prefixes"):
            CheckpointConfig(prefixes=bad)


def test_upload_sweep_finds_uploads_in_data_folders():
    root = "msc://p/run"
    uploads = [OpenUpload(f"{root}/step_00000003/p01/__1_0.distcp", "a", None),
               OpenUpload(f"{root}/step_00000003/__0_0.distcp", "b", None),
               OpenUpload(f"{root}/step_00000003/p01/notes.txt", "c", None),
               OpenUpload(f"{root}/other/p01/__1_0.distcp", "d", None)]
    found = uploads_left_open(uploads, root=root)
    assert {d: [u.upload_id for u in us] for d, us in found.items()} == {f"{root}/step_00000003": ["a", "b"]}


def test_expected_writes_match_a_real_save(s3_server, request):
    """The count `prefixes=None` is chosen from: each rank's expected write requests, which must
    be what its save then issues (two 12 MiB files in the test profile's 5 MiB parts: 2 x
    (create + 3 parts + complete)); a 1,000-rank job of that shape gets 3 folders."""
    from asyncckpt.save.planning import Planning
    from asyncckpt.save.prefixes import data_folder_for, expected_writes

    root = s3_server.url("msc", s3_server.unique_prefix(request.node.name))
    state = {"a": torch.rand(3 * MiB), "b": torch.rand(3 * MiB), "step": 4}
    config = CheckpointConfig(io_workers=2)
    plan = Planning().local(state, True).plan
    expected = expected_writes(config, storage_for(root), step_path(root, 1), plan)
    with AsyncCheckpointer(root, config) as ckpt:
        ckpt.schedule_save(state, step=1)
        (report,) = ckpt.finalize(blocking=True)
    counted = sum(report.requests.get(kind, 0) for kind in ("put", "part", "create", "complete"))
    assert expected == counted == 10, (expected, report.requests)
    assert not any("/p0" in k for k in s3_server.keys(root.split("/", 3)[3]))  # one rank: flat
    assert prefix_count(1000, expected) == 3
    assert data_folder_for(config, 7, 1000, expected, step_path(root, 1)) == "p01"
    assert data_folder_for(config, 7, 1000, expected, "/local/step_00000001") == ""
    assert expected_writes(CheckpointConfig(prefixes=4), storage_for(root), step_path(root, 1), plan) == 0


def _state(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(100 * rank + seed)
    return {"frozen": torch.rand(6 * MiB // 4, generator=g), "head": torch.full((1000,), float(seed + rank)),
            "meta": {"seed": seed}}


def _sharded(rank: int, seed: int) -> dict:
    """Rank r's part of the state: its own tensors (other names per rank) and a shared object."""
    state = _state(rank, seed)
    return {"shared": state.pop("meta"), f"rank{rank}": state}


def _two_ranks(rank: int, world_size: int, root: str) -> None:
    """Two saves with prefixes=2, keep_last=1, incremental: the second copies the frozen
    tensor's file server-side into its own folder, and retention removes the first."""
    config = CheckpointConfig(prefixes=2, keep_last=1, incremental=True, io_workers=2, timeout_s=60)
    state = _sharded(rank, 1)
    with AsyncCheckpointer(root, config) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
        state[f"rank{rank}"]["head"] += 1
        state["shared"] = {"seed": 2}
        ckpt.schedule_save(state, step=2)
        (report,) = ckpt.finalize(blocking=True)
        assert report.requests.get("copy", 0) >= 1, report.requests  # the frozen tensor was not uploaded again


def test_two_ranks_spread_over_prefixes_on_s3(s3_server, request):
    prefix = s3_server.unique_prefix(request.node.name)
    root = s3_server.url("msc", prefix)
    run_ranks(_two_ranks, 2, root, timeout_s=240)

    keys = s3_server.keys(prefix + "/")
    step2 = f"{prefix}/step_00000002/"
    assert not any("/step_00000001/" in k for k in keys), keys  # retention removed it, folders and all
    data = sorted(k[len(step2):] for k in keys if k.startswith(step2) and "__" in k)
    assert {name.split("/")[0] for name in data} == {"p00", "p01"}, data
    assert all(name.startswith("p00/__0_") or name.startswith("p01/__1_") for name in data), data
    beside = sorted(k[len(step2):] for k in keys if k.startswith(step2) and "__" not in k)
    assert len(beside) == 3 and beside[0].startswith(".checksums") and beside[1] == ".metadata", beside
    assert is_checksums_part(beside[2]) and beside[2].startswith("p01/.checksums.r1"), beside  # rank 1's, in its folder
    assert s3_server.pending_multipart_uploads(prefix + "/") == []

    path = step_path(root, 2)
    assert verify_checkpoint(path) == []
    assert sorted(n for n in list_files(storage_for(path), path) if is_data_file(n)) == data
    expected = {"shared": {"seed": 2}}
    for rank in (0, 1):
        state = _state(rank, 1)
        state["head"] += 1
        state.pop("meta")
        expected[f"rank{rank}"] = state
    assert_loads_on_s3(path, expected)  # stock dcp.load through msc's reader, and asyncckpt.load
    with AsyncCheckpointer(root) as reader:  # load_latest, then a save resumed from it
        target = zeros_like_state(expected)
        assert reader.load_latest(target) == 2
        assert_state_equal(target, expected)
    assert cleanup(root) == []  # nothing in the folders looks torn


def test_local_prefixes_load_with_stock_filesystem_reader(tmp_path):
    """Asked for (a filesystem keeps the flat layout by default: test_expected_writes...), data
    folders work locally too: stock dcp.load reads them, a re-save and cleanup look inside."""
    root = str(tmp_path / "ckpt")
    state = _state(0, 3)
    with AsyncCheckpointer(root, CheckpointConfig(prefixes=4, keep_last=1)) as ckpt:
        for step in (1, 2):
            ckpt.schedule_save(state, step=step)
            ckpt.finalize(blocking=True)
        assert ckpt.wait_tidy()
        assert sorted(os.listdir(step_path(root, 2))) == [".checksums.json", ".metadata", "p00"]
        assert not os.path.exists(step_path(root, 1))
        state["head"] += 1  # a resumed run saves step 2 again: the replaced files in p00 go
        ckpt.schedule_save(state, step=2)
        ckpt.finalize(blocking=True)
        assert ckpt.wait_tidy()
    replaced = os.listdir(os.path.join(step_path(root, 2), "p00"))
    assert replaced and all(re.match(r"^__0_\d+\.[0-9a-f]{8}\.distcp$", n) for n in replaced), replaced
    target = zeros_like_state(state)
    dcp.load(target, checkpoint_id=step_path(root, 2), no_dist=True)
    assert_state_equal(target, state)
    # a torn save's files in a folder are found and removed by cleanup
    torn = step_path(root, 5)
    os.makedirs(os.path.join(torn, "p00"))
    open(os.path.join(torn, "p00", "__0_0.distcp"), "wb").close()
    assert cleanup(root) == [torn] and not os.path.exists(torn)
    # a committed checkpoint's stray file in a data folder of its own goes, and so does the folder
    stray = os.path.join(step_path(root, 2), "p03", "__3_0.distcp")
    os.makedirs(os.path.dirname(stray))
    open(stray, "wb").close()
    assert cleanup(root) == [stray]
    assert not os.path.exists(os.path.dirname(stray)) and os.listdir(os.path.join(step_path(root, 2), "p00"))


def test_failed_save_leaves_nothing_in_any_prefix(s3_server, tmp_path, monkeypatch, request):
    """Credentials expire while the files upload: the small files already PUT into the data
    folder are removed, the multipart upload aborted, and the earlier checkpoint stays."""
    proxy = FaultyS3(s3_server.server.endpoint, seed=3)
    profile = f"spread-{uuid.uuid4().hex[:8]}"
    config_path = tmp_path / "msc.yaml"
    write_msc_config(str(config_path), {PROFILE: s3_server.server.endpoint, profile: proxy.endpoint})
    monkeypatch.setenv("MSC_CONFIG", str(config_path))
    monkeypatch.setenv("ASYNCCKPT_RETRY_WINDOW_S", "2")
    prefix = s3_server.unique_prefix(request.node.name)
    root = f"msc://{profile}/{prefix}"
    state = {"big": torch.rand(10 * MiB // 4), "a": torch.rand(1000), "b": torch.rand(2000)}
    try:
        with AsyncCheckpointer(root, CheckpointConfig(prefixes=3, io_workers=3, timeout_s=60)) as ckpt:
            ckpt.schedule_save(state, step=1)
            ckpt.finalize(blocking=True)
            proxy.inject(Fault("expired", kinds=("part", "complete"), window_s=60.0))
            with pytest.raises(CheckpointError, match="credentials expired"):
                ckpt.schedule_save(state, step=2)
                ckpt.finalize(blocking=True)
            proxy.clear()
            ckpt.schedule_save(state, step=3)  # the next commit's sweep aborts what is left open
            ckpt.finalize(blocking=True)
    finally:
        proxy.close()
    keys = s3_server.keys(prefix + "/")
    assert not any("/step_00000002/" in k for k in keys), keys
    assert any("/step_00000001/p00/__0_" in k for k in keys) and any("/step_00000003/p00/__0_" in k for k in keys), keys
    assert s3_server.pending_multipart_uploads(prefix + "/") == []
    assert verify_checkpoint(step_path(root, 1)) == []
