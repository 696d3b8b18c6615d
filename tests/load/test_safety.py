"""Safe loading: a checkpoint from someone else cannot run code or read outside its directory,
and checkpoints written by asyncckpt and by stock dcp.save still load through the safe path."""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, PartialLoadError, load, verify_checkpoint
from asyncckpt.cli.commands import main as cli_main
from asyncckpt.loading.safe_reader import read_metadata
from asyncckpt.storage import LocalStorage
from multirank import run_ranks
from conftest import Payload, assert_state_equal, clone_state, make_model_and_optimizer, make_state, rewrite_metadata, step_path, zeros_like_state


@dataclasses.dataclass
class Custom:
    """A plain user object in a state dict: needs full unpickling."""

    value: int


def save_async(root: str, state: dict, step: int = 1, **config) -> str:
    ckpt = AsyncCheckpointer(root, CheckpointConfig(**config))
    ckpt.schedule_save(state, step)
    ckpt.finalize(blocking=True)
    ckpt.close()
    return step_path(root, step)


def small_state() -> dict:
    return {"w": torch.arange(64.0).reshape(8, 8), "b": torch.randn(5), "meta": {"epoch": 3, "name": "x"}}


def move_item(path: str, fqn: str, **fields) -> None:
    """Point one item's storage entry elsewhere (relative_path / offset / length)."""

    def change(metadata):
        for index, info in metadata.storage_data.items():
            if index.fqn == fqn:
                metadata.storage_data[index] = dataclasses.replace(info, **fields)
        return metadata

    rewrite_metadata(path, change)


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, str]]:
    """Every ("read" | "size", path) the loader asks of local storage."""
    seen: list[tuple[str, str]] = []
    real_read, real_size = LocalStorage.read_bytes, LocalStorage.size
    monkeypatch.setattr(LocalStorage, "read_bytes", lambda self, p, *a: seen.append(("read", p)) or real_read(self, p, *a))
    monkeypatch.setattr(LocalStorage, "size", lambda self, p: seen.append(("size", p)) or real_size(self, p))
    return seen


# code execution ----------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["whole file", "inside real metadata"])
def test_crafted_metadata_is_refused_everywhere_and_runs_nothing(tmp_path, capsys, where):
    root = str(tmp_path / "root")
    path = save_async(root, small_state())
    marker = str(tmp_path / "pwned")
    if where == "whole file":
        rewrite_metadata(path, lambda md: Payload(marker))
    else:
        rewrite_metadata(path, lambda md: dataclasses.replace(md, planner_data={"w": Payload(marker)}))

    with pytest.raises(CheckpointError, match=r"refusing to unpickle posix\.mkdir.*trusted=True"):
        load(small_state(), path)
    with AsyncCheckpointer(root) as ckpt, pytest.raises(CheckpointError, match=r"posix\.mkdir.*trusted=True"):
        ckpt.load_latest(small_state())
    with pytest.raises(CheckpointError, match="posix.mkdir"):
        read_metadata(path)
    for command, target in [("inspect", path), ("verify", path), ("inspect", root), ("verify", root)]:
        assert cli_main([command, target]) != 0
        assert "refusing to unpickle posix.mkdir" in capsys.readouterr().err
    assert cli_main(["ls", root]) == 6  # ls reads each .metadata the safe way: refused, exit "unreadable"
    out, err = capsys.readouterr()
    assert "refused" in next(line for line in out.splitlines() if "step_00000001" in line)
    assert "refusing to unpickle posix.mkdir" in err and "--trusted" in err
    assert not os.path.exists(marker)


# paths and ranges --------------------------------------------------------------------------------
def outside_file(tmp_path) -> str:
    """Valid item bytes outside the checkpoint: loading them would succeed if the path were followed."""
    target = str(tmp_path / "outside.bin")
    torch.save(torch.full((8, 8), 7.0), target)
    return target


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_paths_outside_the_checkpoint_are_refused_before_any_read(tmp_path, reads, kind):
    path = save_async(str(tmp_path / "root"), small_state())
    target = outside_file(tmp_path)
    relative = {"dotdot": "../../outside.bin", "absolute": target, "symlink": "link.distcp"}[kind]
    if kind == "symlink":
        os.symlink(target, os.path.join(path, "link.distcp"))
    move_item(path, "w", relative_path=relative, offset=0, length=os.path.getsize(target))
    reads.clear()

    state = small_state()
    with pytest.raises(CheckpointError, match="refusing file"):
        load(state, path)
    with pytest.raises(CheckpointError, match="refusing file"):
        read_metadata(path)  # what the CLI reads first
    assert all(os.path.dirname(p) == path for _, p in reads), reads
    assert not torch.equal(state["w"], torch.full((8, 8), 7.0))


def test_sidecar_path_outside_is_refused_by_verify(tmp_path, reads):
    path = save_async(str(tmp_path / "root"), small_state())
    outside_file(tmp_path)
    sidecar = os.path.join(path, ".checksums.json")
    with open(sidecar) as f:
        text = f.read()
    with open(sidecar, "w") as f:
        f.write(text.replace('"__0_0.distcp"', '"../../outside.bin"'))
    reads.clear()
    with pytest.raises(CheckpointError, match="refusing file"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="refusing file"):
        load(small_state(), path, verify=True)
    assert all(os.path.dirname(p) == path for _, p in reads), reads


@pytest.mark.parametrize("field", ["offset", "length"])
def test_range_past_end_of_file_is_refused(tmp_path, reads, field):
    path = save_async(str(tmp_path / "root"), small_state())
    metadata = read_metadata(path)
    [info] = [i for x, i in metadata.storage_data.items() if x.fqn == "b"]
    size = os.path.getsize(os.path.join(path, info.relative_path))
    move_item(path, "b", **{field: size + 1})
    with pytest.raises(CheckpointError, match="past the end of the file"):
        load(small_state(), path)
    assert not [p for op, p in reads if op == "read" and p.endswith(".distcp")], "no data read before refusing"


def test_malformed_storage_entry_is_refused(tmp_path):
    path = save_async(str(tmp_path / "root"), small_state())
    move_item(path, "w", offset=-5)
    with pytest.raises(CheckpointError, match="malformed storage entry"):
        load(small_state(), path)


# compatibility -----------------------------------------------------------------------------------
def test_asyncckpt_checkpoint_loads_bitwise_through_the_safe_path(tmp_path):
    model, optimizer = make_model_and_optimizer()
    state = make_state(model, optimizer, step=7)
    expected = clone_state(state)
    path = save_async(str(tmp_path / "root"), state)
    target = zeros_like_state(expected)
    load(target, path, verify=True)
    assert_state_equal(target, expected)


def test_stock_dcp_save_checkpoint_loads_bitwise_through_the_safe_path(tmp_path):
    model, optimizer = make_model_and_optimizer()
    state = make_state(model, optimizer, step=7)
    state["extra"] = {"half": torch.randn(3, 5).bfloat16(), "empty": torch.empty(0), "scalar": torch.tensor(2.5)}
    expected = clone_state(state)
    path = str(tmp_path / "stock")
    dcp.save(state, checkpoint_id=path, no_dist=True)
    target = zeros_like_state(expected)
    load(target, path)
    assert_state_equal(target, expected)


def _stock_save_sharded(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dcp.save({"m": distribute_tensor(torch.arange(96.0).view(8, 12), mesh, [Shard(0)]), "n": 5}, checkpoint_id=path)


def _safe_load_resharded(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    target = {"m": distribute_tensor(torch.zeros(8, 12), mesh, [Shard(1)]), "n": 0}
    load(target, path)
    assert torch.equal(target["m"].full_tensor(), torch.arange(96.0).view(8, 12)) and target["n"] == 5


def test_safe_load_reshards_a_stock_dtensor_checkpoint_on_two_ranks(tmp_path):
    path = str(tmp_path / "stock")
    run_ranks(_stock_save_sharded, 2, path)
    run_ranks(_safe_load_resharded, 2, path)


def test_safetensors_checkpoint_loads_through_the_safe_path(tmp_path):
    state = small_state()
    expected = clone_state(state)
    path = save_async(str(tmp_path / "root"), state, format="safetensors")
    target = zeros_like_state(expected)
    load(target, path)
    assert_state_equal(target, expected)


@pytest.mark.parametrize("writer", ["asyncckpt", "dcp.save"])
def test_object_needing_full_unpickling_loads_only_when_trusted(tmp_path, writer):
    state = {"w": torch.randn(4), "obj": Custom(41)}
    path = str(tmp_path / "ckpt")
    if writer == "asyncckpt":
        path = save_async(str(tmp_path / "root"), state)
    else:
        dcp.save(state, checkpoint_id=path, no_dist=True)

    target = {"w": torch.zeros(4), "obj": None}
    with pytest.raises(CheckpointError, match=r"test_safety\.Custom.*pass trusted=True to opt into full unpickling"):
        load(target, path)
    load(target, path, trusted=True)
    assert target["obj"] == Custom(41) and torch.equal(target["w"], state["w"])


def refused_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "refuses by default" in r.getMessage()]


def test_objects_weights_only_refuses_are_named_once_at_save_and_refused_before_any_tensor_at_load(tmp_path, caplog):
    """NumPy arrays, NumPy RNG state and dataclasses save fine but weights_only loading refuses
    them: the save warns once (again only for a new such entry), the load refuses before writing
    anything, naming them, and trusted=True loads them."""
    root = str(tmp_path / "root")
    state = {"w": torch.arange(64.0), "arr": np.arange(3), "rng": np.random.RandomState(0).get_state(),
             "cfg": Custom(1), "epoch": 3}
    with AsyncCheckpointer(root) as ckpt, caplog.at_level(logging.WARNING, logger="asyncckpt"):
        ckpt.schedule_save(state, step=1)
        ckpt.schedule_save(state, step=2)
        [first] = refused_warnings(caplog)
        for name in ("'arr'", "'rng'", "'cfg' (test_safety.Custom)", "numpy", "trusted=True"):
            assert name in first, first
        assert "'w'" not in first and "'epoch'" not in first, first
        ckpt.schedule_save({**state, "later": Custom(2)}, step=3)
        assert len(refused_warnings(caplog)) == 2 and "'later'" in refused_warnings(caplog)[1]
        assert "'arr'" not in refused_warnings(caplog)[1]

    target = {"w": torch.full((64,), -1.0), "arr": None, "rng": None, "cfg": None, "epoch": 0}
    with pytest.raises(CheckpointError) as raised:
        load(target, step_path(root, 2))
    message = str(raised.value)
    assert not isinstance(raised.value, PartialLoadError), message
    for name in ("'arr'", "'rng'", "'cfg' (test_safety.Custom)", "trusted=True", "nothing in state_dict was changed"):
        assert name in message, message
    assert torch.equal(target["w"], torch.full((64,), -1.0)) and target["epoch"] == 0 and target["cfg"] is None
    load(target, step_path(root, 2), trusted=True)
    assert torch.equal(target["w"], state["w"]) and np.array_equal(target["arr"], state["arr"]) and target["cfg"] == Custom(1)


def test_trusted_metadata_with_extra_classes_loads(tmp_path):
    """`trusted=True` also opts into full unpickling of `.metadata` itself."""
    path = save_async(str(tmp_path / "root"), small_state())
    rewrite_metadata(path, lambda md: dataclasses.replace(md, planner_data={"note": Custom(1)}))
    with pytest.raises(CheckpointError, match=r"test_safety\.Custom.*trusted=True"):
        load(small_state(), path)
    target = zeros_like_state(small_state())
    load(target, path, trusted=True)
    assert torch.equal(target["w"], torch.arange(64.0).reshape(8, 8))


def test_reading_metadata_pauses_the_collector_and_leaves_it_as_it_was():
    """`.metadata` is unpickled with the cyclic collector off (millions of objects at scale); it
    is on again afterwards, also when the file is refused, and stays off if the caller had it off."""
    import gc
    import pickle

    from asyncckpt.loading.safety import load_metadata
    from torch.distributed.checkpoint.metadata import Metadata

    assert gc.isenabled()
    assert isinstance(load_metadata(pickle.dumps(Metadata({})), "ok"), Metadata)
    assert gc.isenabled()
    with pytest.raises(CheckpointError):
        load_metadata(pickle.dumps(os.system), "crafted")
    assert gc.isenabled()
    gc.disable()
    try:
        load_metadata(pickle.dumps(Metadata({})), "ok")
        assert not gc.isenabled()
    finally:
        gc.enable()
