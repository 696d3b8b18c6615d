"""DCP planning for a save, with a plan cache.

Uses DCP's own `DefaultSavePlanner` (or the caller's planner class), so deduplication, flattening
and the global `Metadata` are exactly DCP's. When the local plan is unchanged, the cached final
plan and metadata are reused without planning globally again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType


@dataclass
class PlannedSave:
    """A planner set up on this save's state dict, its final plan and the global metadata."""

    planner: SavePlanner
    plan: SavePlan
    metadata: Metadata
    structure_key: str
    reused_plan: bool


@dataclass
class PlanningCounters:
    """How much planning work saves did (visible in the save figures)."""

    plans_built: int = 0
    plans_reused: int = 0
    plan_gathers: int = 0


def plan_signature(plan: SavePlan) -> tuple:
    """Everything about a local plan that decides the files and metadata, in a comparable form."""
    rows = []
    for item in plan.items:
        td = item.tensor_data
        rows.append(
            (
                item.index.fqn,
                tuple(item.index.offset) if item.index.offset is not None else None,
                item.type.value,
                None if td is None else (tuple(td.chunk.offsets), tuple(td.chunk.sizes), str(td.properties.dtype), tuple(td.size)),
            )
        )
    return tuple(rows)


def structure_key(signature: tuple) -> str:
    return hashlib.sha256(repr(signature).encode()).hexdigest()


@dataclass
class Planning:
    """Plans saves for one rank, caching the last final plan and metadata."""

    planner_factory: Callable[[], SavePlanner] = DefaultSavePlanner
    counters: PlanningCounters = field(default_factory=PlanningCounters)
    _signature: Optional[tuple] = None
    _final_plan: Optional[SavePlan] = None
    _metadata: Optional[Metadata] = None

    def plan(self, state_dict: dict[str, Any]) -> PlannedSave:
        planner = self.planner_factory()
        planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=True)
        local_plan = planner.create_local_plan()
        signature = plan_signature(local_plan)
        if signature == self._signature:
            self.counters.plans_reused += 1
            return PlannedSave(planner, self._final_plan, self._metadata, structure_key(signature), True)
        global_plans, metadata = planner.create_global_plan([local_plan])
        final_plan = planner.finish_plan(global_plans[0])
        self.counters.plans_built += 1
        self._signature, self._final_plan, self._metadata = signature, final_plan, metadata
        return PlannedSave(planner, final_plan, metadata, structure_key(signature), False)

    def forget(self) -> None:
        self._signature = self._final_plan = self._metadata = None


def is_tensor_item(item) -> bool:
    return item.type != WriteItemType.BYTE_IO
