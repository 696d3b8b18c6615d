"""asyncckpt.TrainState: model + optimizer + extras as one DCP Stateful that restores all of it
exactly, and that leaves training bit for bit as it is without checkpointing, also when
`prepare()` or a save comes before the optimizer's first step (torch's get_state_dict creates the
optimizer's state there with a zero-gradient step, which shifts Adam's bias correction)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions

from asyncckpt import AsyncCheckpointer, CheckpointConfig, TrainState, load

from conftest import assert_state_equal, clone_state, step_path
from multirank import run_ranks

OPTIMIZERS = {
    # L2 weight decay makes the zero-gradient step leave non-zero moments behind
    "adam-l2": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2}),
    # momentum with dampening: a buffer created by a zero step differs from the first gradient's
    "sgd-momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.5}),
}


def make(kind: str, seed: int = 0):
    cls, kwargs = OPTIMIZERS[kind]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, cls(model.parameters(), **kwargs)


def train(model, optimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def weights(model) -> dict:
    return clone_state(model.state_dict())


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_prepare_and_saves_before_the_first_step_leave_training_bitwise_unchanged(kind, tmp_path):
    """The same run with and without asyncckpt: `prepare()` and a save before the first step, a
    save after step 0; the weights after steps 0 and 1 and the optimizer state are identical."""
    plain_model, plain_optim = make(kind)
    train(plain_model, plain_optim, range(0, 1))
    after_step0 = weights(plain_model)
    train(plain_model, plain_optim, range(1, 2))

    model, optimizer = make(kind)
    state = {"train": TrainState(model, optimizer)}
    with AsyncCheckpointer(str(tmp_path / "ckpt"), CheckpointConfig(io_workers=1)) as ckpt:
        ckpt.prepare(state)
        ckpt.schedule_save(state, step=0)  # before the first step
        if kind == "sgd-momentum":  # no state made up for it: its first step creates its own
            assert not optimizer.state
        train(model, optimizer, range(0, 1))
        assert_state_equal(weights(model), after_step0, "after step 0")
        ckpt.schedule_save(state, step=1)
        train(model, optimizer, range(1, 2))
    assert_state_equal(weights(model), weights(plain_model), "after step 1")
    assert_state_equal(optimizer.state_dict(), plain_optim.state_dict(), "optimizer")


class Counter:
    """An extra item with state_dict / load_state_dict, as a data loader's position would be."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict) -> None:
        self.seen = sd["seen"]


def train_state(kind: str, seed: int):
    model, optimizer = make(kind, seed)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    extra = {"step": 0, "progress": {"tokens": 0, "phase": ""}, "rng": torch.zeros(8, dtype=torch.int64),
             "scheduler": scheduler, "loader": Counter()}
    return TrainState(model, optimizer, **extra)


@pytest.mark.parametrize("kind", ["adamw", "sgd-momentum"])
def test_a_fresh_model_and_optimizer_load_everything_back_exactly(kind, tmp_path):
    """Saved after 3 steps, loaded into a freshly built model, optimizer, scheduler and extras
    (another seed): weights, optimizer state, scheduler and every extra come back, and the next
    step of both runs gives identical weights."""
    saved = train_state(kind, seed=0)
    for step in range(3):
        train(saved.model, saved.optimizer, range(step, step + 1))
        saved.extra["scheduler"].step()
    saved.extra.update(step=3)
    saved.extra["progress"].update(tokens=18, phase="warmup")
    saved.extra["rng"].copy_(torch.arange(8) * 7)
    saved.extra["loader"].seen = 18
    resumed = train_state(kind, seed=1)
    with AsyncCheckpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.schedule_save({"train": saved}, step=3)
        ckpt.finalize(blocking=True)
        assert ckpt.load_latest({"train": resumed}) == 3
    assert_state_equal(weights(resumed.model), weights(saved.model), "model")
    assert_state_equal(resumed.optimizer.state_dict(), saved.optimizer.state_dict(), "optimizer")
    assert resumed.extra["step"] == 3
    assert resumed.extra["progress"] == {"tokens": 18, "phase": "warmup"}
    assert torch.equal(resumed.extra["rng"], torch.arange(8) * 7)
    assert resumed.extra["loader"].seen == 18
    assert resumed.extra["scheduler"].state_dict() == saved.extra["scheduler"].state_dict()
    assert resumed.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"] == 5e-3
    train(saved.model, saved.optimizer, range(3, 4))
    train(resumed.model, resumed.optimizer, range(3, 4))
    assert_state_equal(weights(resumed.model), weights(saved.model), "after one more step")


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_save_before_the_first_step_resumes_as_that_run_would_have_gone_on(kind, tmp_path):
    """Saved before any step (stock DCP here: TrainState is a plain DCP Stateful), loaded into an
    optimizer that has trained meanwhile: it is back to its state before the first step, and
    training from there matches a run never interrupted."""
    model, optimizer = make(kind)
    path = str(tmp_path / "step0")
    dcp.save({"train": TrainState(model, optimizer)}, checkpoint_id=path, no_dist=True)
    train(model, optimizer, range(0, 2))
    expected = weights(model)

    other_model, other_optim = make(kind, seed=1)
    train(other_model, other_optim, range(5, 8))
    dcp.load({"train": TrainState(other_model, other_optim)}, checkpoint_id=path, no_dist=True)
    if kind == "sgd-momentum":
        assert not other_optim.state
    train(other_model, other_optim, range(0, 2))
    assert_state_equal(weights(other_model), expected)


def test_the_model_alone_and_full_state_options(tmp_path):
    """No optimizer: the model alone. `options` go to torch's get_state_dict / set_state_dict."""
    model, _ = make("adamw")
    path = step_path(str(tmp_path), 1)
    dcp.save({"train": TrainState(model, options=StateDictOptions(full_state_dict=True))}, checkpoint_id=path,
             no_dist=True)
    fresh, _ = make("adamw", seed=1)
    load({"train": TrainState(fresh, None, options=StateDictOptions(full_state_dict=True))}, path)
    assert_state_equal(weights(fresh), weights(model))


def test_what_is_not_a_model_or_an_optimizer_is_refused_at_once():
    model, optimizer = make("adamw")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        TrainState(optimizer, model)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer.*\['dict'\]"):
        TrainState(model, [optimizer, {}])


# several ranks: FSDP2 (DTensor shards), sharded and full state dicts ------------------------------
def _fsdp_ranks(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def build(seed: int):
        model, optimizer = make("adam-l2", seed)
        fully_shard(model, mesh=mesh)
        return model, type(optimizer)(model.parameters(), **OPTIMIZERS["adam-l2"][1])

    def full(model) -> dict:
        return {k: v.full_tensor() for k, v in model.state_dict().items()}

    plain_model, plain_optim = build(0)
    train(plain_model, plain_optim, range(0, 2))
    with AsyncCheckpointer(root) as ckpt:
        for n, options in enumerate([None, StateDictOptions(full_state_dict=True)]):
            model, optimizer = build(0)
            state = {"train": TrainState(model, optimizer, options=options)}
            ckpt.prepare(state)  # before the first step: training stays the same
            train(model, optimizer, range(0, 2))
            assert_state_equal(full(model), full(plain_model), f"options {n}, after step 1")
            ckpt.schedule_save(state, step=10 * n + 2)
            ckpt.finalize(blocking=True)
            fresh_model, fresh_optim = build(1)
            assert ckpt.load_latest({"train": TrainState(fresh_model, fresh_optim, options=options)}) == 10 * n + 2
            assert_state_equal(full(fresh_model), full(model), f"options {n}, loaded")
            train(model, optimizer, range(2, 3))
            train(fresh_model, fresh_optim, range(2, 3))  # the optimizer state came back too
            assert_state_equal(full(fresh_model), full(model), f"options {n}, one step after the load")


def test_fsdp_shards_with_sharded_and_full_state_dicts(tmp_path):
    """On 2 gloo ranks with FSDP2: `prepare()` before the first step leaves training unchanged,
    and a save loads back into a fresh sharded model and optimizer, with torch's default (sharded)
    options and with full_state_dict=True."""
    run_ranks(_fsdp_ranks, 2, str(tmp_path / "ckpt"), timeout_s=240)
