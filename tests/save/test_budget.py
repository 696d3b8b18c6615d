"""staging_budget_bytes: the worker stages and writes in rounds through a budget-sized slab, so its
memory stays near the budget, and the checkpoint is the same as an unbudgeted one."""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import AsyncCheckpointer, CheckpointConfig, load
from conftest import MemorySampler, assert_state_equal, clone_state, step_path, zeros_like_state

MiB = 1 << 20
STATE_BYTES = 32 * MiB
BUDGET = STATE_BYTES // 4
SLACK = 6 * MiB  # the worker's own transient allocations during a save (pickles, thread stacks)



def big_state() -> dict:
    """32 MiB: one tensor larger than the budget (1-D), one whose rows are (2-D), many small
    ones, and plain objects."""
    g = torch.Generator().manual_seed(0)
    state = {
        "huge": torch.randn(3 * MiB, generator=g),  # 12 MiB > budget: streamed in pieces
        "wide": torch.randn(2, (9 * MiB) // 8, generator=g),  # 9 MiB, each row 4.5 MiB
        "meta": {"step": 11, "tags": ["a", "b"]},
    }
    used = state["huge"].nbytes + state["wide"].nbytes
    n = 0
    while used < STATE_BYTES:
        t = torch.randn(int(torch.randint(1, 96 * 1024, (1,), generator=g)), generator=g).to(
            [torch.float32, torch.bfloat16, torch.float64][n % 3]
        )
        state[f"layer{n}"] = {"w": t, "count": torch.tensor(n)}
        used += t.nbytes
        n += 1
    return state


def _save_measured(root: str, state: dict, config: CheckpointConfig):
    with AsyncCheckpointer(root, config) as ckpt:
        ckpt.schedule_save({"warmup": torch.ones(16)}, step=0)  # thread pools, imports, caches
        ckpt.finalize(blocking=True)
        with MemorySampler(ckpt.worker_pid) as sampler:
            _, baseline = sampler.sample()
            ckpt.schedule_save(state, step=1)
            [report] = ckpt.finalize(blocking=True)
    return report, sampler.peak_owned - baseline


@pytest.mark.parametrize("io", ["thread", "process"])
def test_quarter_budget_bounds_worker_memory_and_loads_bitwise_equal(tmp_path, io):
    state = big_state()
    expected = clone_state(state)
    root = str(tmp_path / "budget")
    report, extra = _save_measured(root, state, CheckpointConfig(io=io, io_workers=3, staging_budget_bytes=BUDGET))
    assert report.bytes >= STATE_BYTES
    print(f"\n{io}: budget {BUDGET / MiB:.0f} MiB, worker peak extra USS {extra / MiB:.1f} MiB, "
          f"blocked {report.blocked_s:.3f}s, staging {report.staging_s:.3f}s, write {report.write_s:.3f}s")
    assert extra < BUDGET + SLACK, f"worker grew by {extra / MiB:.1f} MiB with a {BUDGET / MiB:.0f} MiB budget"

    for loader in ("dcp", "asyncckpt"):
        target = zeros_like_state(expected)
        if loader == "dcp":
            dcp.load(target, checkpoint_id=step_path(root, 1), no_dist=True)
        else:
            load(target, step_path(root, 1), verify=True)
        assert_state_equal(target, expected)


def test_budgeted_files_are_identical_to_unbudgeted_and_memory_is_lower(tmp_path):
    state = big_state()
    reports, extras, files = {}, {}, {}
    for name, budget in (("whole", None), ("budget", BUDGET)):
        root = str(tmp_path / name)
        config = CheckpointConfig(io_workers=3, staging_budget_bytes=budget)
        reports[name], extras[name] = _save_measured(root, state, config)
        files[name] = {
            os.path.basename(p): open(p, "rb").read()
            for p in sorted(glob.glob(os.path.join(step_path(root, 1), "__0_*.distcp")))
        }
    print(f"\nworker peak extra USS: whole {extras['whole'] / MiB:.1f} MiB, budget {extras['budget'] / MiB:.1f} MiB; "
          f"blocked: whole {reports['whole'].blocked_s:.3f}s, budget {reports['budget'].blocked_s:.3f}s")
    assert files["whole"].keys() == files["budget"].keys() and len(files["whole"]) == 3
    for name in files["whole"]:
        assert files["whole"][name] == files["budget"][name], name
    assert extras["whole"] > STATE_BYTES * 0.9  # the measurement sees a whole-state slab
    assert extras["budget"] < extras["whole"] / 2


def test_the_staging_slab_has_room_for_a_few_new_small_tensors_but_not_beyond_the_budget():
    """A new slab's pages are faulted in on the trainer's blocked time, so a state that gains a
    scalar (Lightning's top-k scores) keeps its slab; a budgeted slab stays within the budget."""
    from asyncckpt.protocol import TENSOR, ItemIndex, ItemSpec
    from asyncckpt_worker.staging import StagingPool

    def specs(*numels):
        return [ItemSpec(ItemIndex(f"t{n}"), TENSOR, torch.float32, (numel,)) for n, numel in enumerate(numels)]

    pool = StagingPool()
    try:
        items = specs(4 * MiB, MiB)  # 20 MiB
        pool.layout(items, [range(2)])
        generation, capacity = pool.generation, pool.capacity
        grown = specs(4 * MiB, MiB, 1, 1, 1)
        views = pool.layout(grown, [range(5)])
        assert (pool.generation, pool.capacity) == (generation, capacity)
        assert [v.shape for v in views] == [(4 * MiB,), (MiB,), (1,), (1,), (1,)]
        pool.layout(specs(8 * MiB), [range(1)])  # twice the size: a new, larger slab
        assert pool.generation == generation + 1 and pool.capacity >= 32 * MiB
    finally:
        pool.close()
    budgeted = StagingPool()
    try:
        budgeted.layout(specs(MiB // 4, MiB // 4), [[0], [1]], reserve=MiB, budget=MiB)
        assert budgeted.capacity == MiB
    finally:
        budgeted.close()
