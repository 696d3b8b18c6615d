"""torchtitan's real CheckpointManager over asyncckpt.async_save, installed the way a user does
(`torch.distributed.checkpoint.async_save = asyncckpt.async_save`), in both of its async modes:
`step-N` directories, `.result()` before the next save, `maybe_wait_for_staging()` before
`optimizer.step()`, `keep_latest_k` purging older `step-*` directories from its thread while the
newer save is in flight, then its own `load()` (and stock `dcp.load`) reading the values of each
save bitwise. `make venv` installs torchtitan (without its data/logging dependencies)."""

from __future__ import annotations

import os
from concurrent.futures import Future

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpoint", reason="torchtitan is not installed (make venv installs it)")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt import CheckpointConfig, torch_dcp  # noqa: E402
from multirank import run_ranks  # noqa: E402

MODES = ("async", "async_with_pinned_mem")
STEPS = 4
KEEP = 2  # keep_latest_k: steps 1..STEPS-KEEP are purged while a later save is in flight


class TrainState(Stateful):
    """What torchtitan's Trainer registers as `train_state`."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


class Loader(Stateful):
    """A dataloader's state as torchtitan's keeps it: one entry per data-parallel rank."""

    def __init__(self, rank: int, world: int) -> None:
        self.key, self.world, self.position = f"dp_rank_{rank}", world, 0

    def state_dict(self):
        return {self.key: {"position": self.position}, "world_size": self.world}

    def load_state_dict(self, state):
        self.position = state[self.key]["position"]


def _trainer(world: int, seed: int, rank: int, root: str, mode: str, group=None):
    """torchtitan's pieces: the model (FSDP2-sharded on several ranks, as torchtitan shards it),
    its OptimizersContainer and LRSchedulersContainer, and the CheckpointManager over them."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if world > 1:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=100)
    train_state, loader = TrainState(), Loader(rank, world)
    config = CheckpointManager.Config(enable=True, folder=mode, interval=1, async_mode=mode, keep_latest_k=KEEP)
    manager = CheckpointManager(
        config, dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": train_state}, sd_adapter=None, base_folder=root,
    )
    if mode == "async_with_pinned_mem" and not torch.cuda.is_available():
        # torchtitan's own stager (pinned memory, non-blocking copies) cannot even be built
        # without CUDA (torch's DefaultStager asserts): the same stager less what needs a GPU.
        # asyncckpt never calls it; it only decides the AsyncSaveResponse return type.
        manager.stager = DefaultStager(StagingOptions(False, True, True, False))
    if group is not None:
        # a real run has one manager; this test runs one per mode in the same processes (to
        # start them once) and lets the later ones save on the first one's group, so asyncckpt
        # reuses that group's worker instead of starting another (seconds on a busy box)
        manager.pg = group
    return model, optimizers, lr_schedulers, train_state, loader, manager


def _full(obj):
    """A saved state as plain values: Stateful entries resolved, DTensors gathered (a collective:
    every rank calls it), tensors copied."""
    if isinstance(obj, Stateful):
        obj = obj.state_dict()
    if isinstance(obj, dict):
        return {k: _full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_full(v) for v in obj)
    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    return obj


def _assert_same(actual, expected, path: str = "") -> None:
    """Bitwise: the same keys, dtypes, shapes and bytes; plain values equal."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (path, sorted(actual), sorted(expected))
        for key in expected:
            _assert_same(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)), path
    else:
        assert actual == expected, (path, actual, expected)


def _train_save_resume(rank: int, world: int, root: str) -> None:
    dcp.async_save = asyncckpt.async_save  # the one-line switch, in each rank's process
    torch_dcp.configure(CheckpointConfig(io_workers=2, timeout_s=60.0))
    group = None
    for mode in MODES:
        model, optimizers, lr_schedulers, train_state, loader, manager = _trainer(world, 0, rank, root, mode, group)
        group = manager.pg
        batch = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
        expected = {}
        for step in range(1, STEPS + 1):  # torchtitan's train loop, less the data
            model(batch).square().mean().backward()
            manager.maybe_wait_for_staging()
            optimizers.step()
            lr_schedulers.step()
            optimizers.zero_grad()
            train_state.step, train_state.ntokens_seen = step, step * batch.numel()
            loader.position = step
            manager.save(step)  # waits for step-1's .result(), saves, queues the purge
            assert isinstance(manager.save_future, Future)
            expected[step] = _full(manager._flattened_model_states_sd())
        manager.maybe_wait_for_saving()
        manager.close()  # joins the purge thread
        if rank == 0:
            torch.save({s: expected[s] for s in range(STEPS - KEEP + 1, STEPS + 1)}, os.path.join(root, f"{mode}.pt"))

        # a fresh trainer (other initial values) resumes through torchtitan's own load()
        *_, resumed = _trainer(world, 1, rank, root, mode)
        assert resumed.load()  # the latest step-N with a .metadata
        _assert_same(_full(resumed._flattened_model_states_sd()), expected[STEPS])
        assert resumed.load(step=STEPS - 1)
        _assert_same(_full(resumed._flattened_model_states_sd()), expected[STEPS - 1])
        resumed.close()
    torch_dcp.shutdown()


@pytest.mark.parametrize("world", [1, 2])
def test_torchtitan_checkpoint_manager_saves_purges_and_resumes_in_both_async_modes(world, tmp_path):
    root = str(tmp_path)
    run_ranks(_train_save_resume, world, root, timeout_s=180)
    kept = [f"step-{s}" for s in range(STEPS - KEEP + 1, STEPS + 1)]
    for mode in MODES:
        folder = os.path.join(root, mode)
        assert sorted(os.listdir(folder)) == kept  # the older ones purged; nothing else written
        expected = torch.load(os.path.join(root, f"{mode}.pt"), weights_only=False)
        for name, step in zip(kept, range(STEPS - KEEP + 1, STEPS + 1)):
            assert os.path.exists(os.path.join(folder, name, ".metadata"))
            target = _zeros_like(expected[step])
            dcp.load(target, checkpoint_id=os.path.join(folder, name), no_dist=True)  # stock reader
            _assert_same(target, expected[step])


def _zeros_like(obj):
    """A load target: the same structure, every value wrong (so each one must come from disk)."""
    if isinstance(obj, dict):
        return {k: _zeros_like(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_zeros_like(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return torch.full_like(obj, 7) if obj.dtype != torch.bool else ~obj
    return "unset"
