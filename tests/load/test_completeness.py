"""No silent loss on resume: a saved entry the target has no place for is loaded into it (a fresh
optimizer's empty `state`) or refused by name; strict=False / allow_partial=True load part on purpose."""

from __future__ import annotations

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointError, load
from conftest import assert_state_equal, clone_state, make_model_and_optimizer, step_path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A root with step 3 saved from `{"model": m.state_dict(), "optim": o.state_dict()}` after
    training steps, and the values it holds."""
    root = str(tmp_path_factory.mktemp("completeness"))
    model, optimizer = make_model_and_optimizer(seed=1)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    with AsyncCheckpointer(root) as ckpt:
        ckpt.schedule_save(state, step=3)
    return root, clone_state(state)


def fresh():
    """A model of other values and an optimizer before its first step (no state)."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def test_fresh_optimizer_state_dict_is_restored_by_load_latest(saved):
    root, expected = saved
    model, optimizer = fresh()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    assert state["optim"]["state"] == {}
    with AsyncCheckpointer(root) as ckpt:
        assert ckpt.load_latest(state) == 3
    optimizer.load_state_dict(state["optim"])
    model.load_state_dict(state["model"])
    assert_state_equal(optimizer.state_dict()["state"], expected["optim"]["state"])
    assert_state_equal(model.state_dict(), expected["model"])


def test_optimizer_only_target_restores_the_optimizer(saved):
    root, expected = saved
    _, optimizer = fresh()
    state = {"optim": optimizer.state_dict()}
    load(state, step_path(root, 3))
    optimizer.load_state_dict(state["optim"])
    assert_state_equal(optimizer.state_dict()["state"], expected["optim"]["state"])
    _, passed_as_is = fresh()  # the optimizer object itself, before its first step
    load({"optim": passed_as_is}, step_path(root, 3))
    assert_state_equal(passed_as_is.state_dict()["state"], expected["optim"]["state"])


def test_model_only_target_loads_the_model_and_leaves_the_optimizer_out(saved):
    root, expected = saved
    model, _ = fresh()
    load({"model": model}, step_path(root, 3))  # naming only "model" is a deliberate selection
    assert_state_equal(model.state_dict(), expected["model"])


def test_a_nested_target_missing_keys_is_refused_by_name_and_left_unchanged(saved):
    root, expected = saved
    model, optimizer = fresh()
    partial = {k: v for k, v in model.state_dict().items() if k != "2.bias"}
    before = clone_state(partial)
    state = {"model": partial, "optim": optimizer.state_dict()}
    with pytest.raises(CheckpointError, match=r"1 saved entries \(model\.2\.bias\).*asyncckpt\.TrainState.*strict=False"):
        load(state, step_path(root, 3))
    assert_state_equal(partial, before)
    assert state["optim"]["state"] == {}  # what was added to receive the moments is gone again
    with AsyncCheckpointer(root) as ckpt, pytest.raises(CheckpointError, match="model.2.bias.*allow_partial=True"):
        ckpt.load_latest(state)
    assert state["optim"]["state"] == {}


def test_strict_false_and_allow_partial_load_only_what_the_target_holds(saved):
    root, expected = saved
    model, _ = fresh()
    partial = {k: v for k, v in model.state_dict().items() if k != "2.bias"}
    load({"model": partial}, step_path(root, 3), strict=False)
    assert_state_equal(partial, {k: v for k, v in expected["model"].items() if k != "2.bias"})
    model, optimizer = fresh()
    state = {"model": dict(model.state_dict()), "optim": {"param_groups": optimizer.state_dict()["param_groups"]}}
    del state["model"]["0.weight"]
    with AsyncCheckpointer(root) as ckpt:
        assert ckpt.load_latest(state, allow_partial=True) == 3
    assert_state_equal(state["model"]["2.bias"], expected["model"]["2.bias"])
    assert "state" not in state["optim"]


def test_a_ctrl_c_while_the_ranks_agree_on_what_lacks_leaves_no_placeholder(saved):
    """The fresh optimizer's empty `state` gets placeholders for the saved moments, then the ranks
    agree (a collective) on what lacks: a Ctrl-C there takes the placeholders out again, so the
    KeyboardInterrupt's "nothing in state_dict was changed" is true."""
    from asyncckpt.loading.completeness import receive_everything
    from asyncckpt.loading.opened import open_checkpoint

    root, _ = saved
    model, optimizer = fresh()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    path = step_path(root, 3)

    class Interrupted:
        def any(self, _):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        receive_everything(state, open_checkpoint(path).metadata, path, True, Interrupted())
    assert state["optim"]["state"] == {}
