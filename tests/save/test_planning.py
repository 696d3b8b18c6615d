"""The plan cache: a steady-state save reuses the local plan, and any change to what the plan is
made from (a key, a dtype, a shape, requires_grad, the nesting behind a name) rebuilds it, so
a cached plan never describes a state that is no longer there."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from asyncckpt import AsyncCheckpointer, load
from asyncckpt.save.planning import Planning, is_tensor_item, plan_signature
from asyncckpt.save.ranks import RankGroup
from conftest import assert_state_equal, step_path, zeros_like_state


def base_state() -> dict:
    return {
        "model": {"w": torch.randn(4, 8), "b": torch.zeros(8)},
        "optim": {"state": {0: {"exp_avg": torch.randn(4, 8), "step": torch.tensor(3.0)}}, "lr": 0.1},
        "step": 1,
    }


def mutated(change: str) -> dict:
    state = base_state()
    if change == "value only":
        state["step"] = 2
        state["model"]["w"] = torch.ones(4, 8)
        state["optim"]["state"][0]["exp_avg"].add_(1.0)
        state["optim"]["lr"] = 0.05
    elif change == "new key":
        state["model"]["extra"] = torch.zeros(3)
    elif change == "removed key":
        del state["model"]["b"]
    elif change == "dtype":
        state["model"]["w"] = state["model"]["w"].to(torch.bfloat16)
    elif change == "shape":
        state["model"]["w"] = torch.randn(5, 8)
    elif change == "requires_grad":
        state["model"]["w"].requires_grad_(True)
    elif change == "object becomes tensor":
        state["step"] = torch.tensor(1)
    elif change == "same name, other nesting":  # "model.w" from {"model.w": ...} instead of {"model": {"w": ...}}
        state["model.w"] = state["model"].pop("w")
    else:
        raise AssertionError(change)
    return state


def plan_for(planning: Planning, state: dict):
    group = RankGroup()
    local = planning.local(state, is_coordinator=True)
    return planning.build(local, group) if planning.changed(local) else planning.reuse(local)


def resolved_values(planned) -> dict:
    values = {}
    for item in planned.plan.items:
        data = planned.planner.resolve_data(item)
        if is_tensor_item(item):
            values[item.index.fqn] = data.clone()
        else:
            values[item.index.fqn] = torch.load(io.BytesIO(data.getvalue()), weights_only=False)
    return values


CHANGES = ["new key", "removed key", "dtype", "shape", "requires_grad", "object becomes tensor", "same name, other nesting"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_layout_rebuilds_the_plan_exactly_as_a_fresh_planner_would(change):
    cached = Planning()
    plan_for(cached, base_state())
    state = mutated(change)
    planned = plan_for(cached, state)
    fresh = plan_for(Planning(), copy.deepcopy(state))
    assert cached.counters.local_plans_reused == 0
    assert not planned.reused_plan
    assert plan_signature(planned.plan) == plan_signature(fresh.plan)
    assert planned.plan.planner_data == fresh.plan.planner_data
    assert planned.metadata == fresh.metadata


def test_an_unchanged_layout_reuses_the_plan_and_still_resolves_the_new_values():
    planning = Planning()
    plan_for(planning, base_state())
    state = mutated("value only")
    planned = plan_for(planning, state)
    assert planning.counters.local_plans_reused == 1 and planned.reused_plan
    values = resolved_values(planned)
    assert values["step"] == 2 and torch.equal(values["model.w"], torch.ones(4, 8))
    assert plan_signature(planned.plan) == plan_signature(plan_for(Planning(), state).plan)


def test_saves_across_layout_changes_load_back_what_each_step_held(tmp_path):
    root = str(tmp_path / "root")
    states = {1: base_state(), 2: mutated("value only"), 3: mutated("shape"), 4: mutated("same name, other nesting")}
    with AsyncCheckpointer(root) as ckpt:
        for step, state in states.items():
            ckpt.schedule_save(state, step)
            ckpt.finalize(blocking=True)
    for step, state in states.items():
        target = zeros_like_state(state)  # every tensor (model and optimizer) zeroed, every value replaced
        load(target, step_path(root, step))
        assert_state_equal(target, state)  # the optimizer's moments and lr too, not only the weights
