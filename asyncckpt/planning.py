"""DCP planning for one rank or many, with a plan cache.

Uses DCP's own `DefaultSavePlanner` (or the caller's planner class), so deduplication of
replicated tensors, DTensor/ShardedTensor chunks, flattening and the global `Metadata` are
exactly DCP's. The local plan is built every save (it is cheap and needs the new state dict);
only when some rank's local plan changed are plans gathered and the global plan rebuilt.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful

from .errors import CheckpointError
from .ranks import RankGroup


@dataclass
class LocalPlan:
    """A planner set up on this save's state dict and the local plan it produced."""

    planner: SavePlanner
    plan: SavePlan
    signature: tuple


@dataclass
class PlannedSave:
    """What a rank writes (final plan), the global metadata (coordinator only) and the key of
    the plan's structure."""

    planner: SavePlanner
    plan: SavePlan
    metadata: Optional[Metadata]
    structure_key: str
    reused_plan: bool


@dataclass
class PlanningCounters:
    plans_built: int = 0
    plans_reused: int = 0
    plan_gathers: int = 0


def plan_signature(plan: SavePlan) -> tuple:
    """Everything about a plan that decides the files and metadata, in a comparable form."""
    rows = []
    for item in plan.items:
        td = item.tensor_data
        rows.append(
            (
                item.index.fqn,
                tuple(item.index.offset) if item.index.offset is not None else None,
                item.type.value,
                None
                if td is None
                else (tuple(td.chunk.offsets), tuple(td.chunk.sizes), str(td.properties.dtype), tuple(td.size)),
            )
        )
    return tuple(rows)


def structure_key(plan: SavePlan) -> str:
    return hashlib.sha256(repr(plan_signature(plan)).encode()).hexdigest()


@dataclass
class Planning:
    """Plans saves for one rank and caches the last final plan and global metadata."""

    planner_factory: Callable[[], SavePlanner] = DefaultSavePlanner
    counters: PlanningCounters = field(default_factory=PlanningCounters)
    _signature: Optional[tuple] = None
    _final_plan: Optional[SavePlan] = None
    _metadata: Optional[Metadata] = None
    _key: str = ""

    def local(self, state_dict: dict[str, Any], is_coordinator: bool) -> LocalPlan:
        planner = self.planner_factory()
        planner.set_up_planner(_plain_state(state_dict), storage_meta=None, is_coordinator=is_coordinator)
        plan = planner.create_local_plan()
        return LocalPlan(planner, plan, plan_signature(plan))

    def changed(self, local: LocalPlan) -> bool:
        return local.signature != self._signature

    def reuse(self, local: LocalPlan) -> PlannedSave:
        """Every rank's local plan is unchanged: the cached final plan and metadata still hold."""
        self.counters.plans_reused += 1
        return PlannedSave(local.planner, self._final_plan, self._metadata, self._key, True)

    def build(self, local: LocalPlan, group: RankGroup) -> PlannedSave:
        """Global planning: gather local plans, the coordinator builds the global plan and the
        metadata (DCP dedup + validation), each rank gets its final plan back."""
        all_plans = group.gather(local.plan)
        replies: Optional[list] = None
        metadata = None
        if group.is_coordinator:
            try:
                global_plans, metadata = local.planner.create_global_plan(all_plans)
                replies = list(global_plans)
            except Exception as exc:  # tell every rank, so none waits on a scatter that never comes
                replies = [f"global planning failed on the coordinator: {type(exc).__name__}: {exc}"] * group.size
        mine = group.scatter(replies)
        if isinstance(mine, str):
            raise CheckpointError(f"rank {group.rank}: {mine}")
        final = local.planner.finish_plan(mine)
        self.counters.plans_built += 1
        if group.size > 1:
            self.counters.plan_gathers += 1
        self._signature, self._final_plan, self._metadata = local.signature, final, metadata
        self._key = structure_key(final)
        return PlannedSave(local.planner, final, metadata, self._key, False)


def _plain_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace Stateful values (model/optimizer wrappers) by their state dicts, as DCP does."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}


def is_tensor_item(item) -> bool:
    return item.type != WriteItemType.BYTE_IO
