"""DCP planning for one rank or many, with a plan cache.

Uses DCP's own `DefaultSavePlanner` (or the caller's planner class), so deduplication of
replicated tensors, DTensor/ShardedTensor chunks, flattening and the global `Metadata` are
exactly DCP's. Every save sets the planner up on the new state dict (that is how objects get their new values);
the local plan is rebuilt only when the flattened state's layout changed (the common steady
state reuses it), and only when some rank's local plan changed are plans gathered and the
global plan rebuilt.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful

from ..errors import CheckpointError
from ..loading.safety import collector_paused
from .metadata_bytes import EntriesPlan, encode_head, head_refs
from .ranks import RankGroup


@dataclass
class LocalPlan:
    """A planner set up on this save's state dict and the local plan it produced."""

    planner: SavePlanner
    plan: SavePlan
    signature: tuple


@dataclass
class PlannedSave:
    """What a rank writes (final plan), the global metadata (coordinator only), how its
    `.metadata` is put together and the key of the plan's structure."""

    planner: SavePlanner
    plan: SavePlan
    metadata: Optional[Metadata]
    entries_plan: EntriesPlan
    structure_key: str
    reused_plan: bool


@dataclass
class PlanningCounters:
    plans_built: int = 0
    plans_reused: int = 0
    plan_gathers: int = 0
    local_plans_reused: int = 0


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
                else (tuple(td.chunk.offsets), tuple(td.chunk.sizes), td.properties, tuple(td.size)),
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
    _entries_plan: Optional[EntriesPlan] = None
    _key: str = ""
    _layout: Optional[tuple] = None  # of the last state whose local plan was built
    _local_plan: Optional[SavePlan] = None
    _local_signature: Optional[tuple] = None

    def local(self, state_dict: dict[str, Any], is_coordinator: bool) -> LocalPlan:
        planner = self.planner_factory()
        planner.set_up_planner(_plain_state(state_dict), storage_meta=None, is_coordinator=is_coordinator)
        layout = flat_layout(planner)
        if layout is not None and layout == self._layout:
            self.counters.local_plans_reused += 1
            return LocalPlan(planner, self._local_plan, self._local_signature)
        plan = planner.create_local_plan()
        self._layout, self._local_plan, self._local_signature = layout, plan, plan_signature(plan)
        return LocalPlan(planner, plan, self._local_signature)

    def changed(self, local: LocalPlan) -> bool:
        return local.signature != self._signature

    def reuse(self, local: LocalPlan) -> PlannedSave:
        """Every rank's local plan is unchanged: the cached final plan and metadata still hold."""
        self.counters.plans_reused += 1
        return PlannedSave(local.planner, self._final_plan, self._metadata, self._entries_plan, self._key, True)

    def build(self, local: LocalPlan, group: RankGroup) -> PlannedSave:
        """Global planning: gather local plans, the coordinator builds the global plan and the
        metadata (DCP dedup + validation) and the head of `.metadata`; each rank gets its final plan
        back with the head's references its entries use (metadata_bytes.py)."""
        with collector_paused():  # the coordinator unpickles every rank's plan and builds the global one
            all_plans = group.gather(local.plan)
            replies: Optional[list] = None
            metadata = head = None
            if group.is_coordinator:
                try:
                    global_plans, metadata = local.planner.create_global_plan(all_plans)
                    head = encode_head(metadata)
                    replies = [(plan, head_refs(head, plan)) for plan in global_plans]
                except Exception as exc:  # tell every rank, so none waits on a scatter that never comes
                    replies = [f"global planning failed on the coordinator: {type(exc).__name__}: {exc}"] * group.size
        mine = group.scatter(replies)
        if isinstance(mine, str):
            raise CheckpointError(f"rank {group.rank}: {mine}")
        mine, refs = mine
        try:
            entries_plan = EntriesPlan(refs.bind(mine), head)
        except ValueError as exc:  # the coordinator's references do not fit the plan it sent: a bug
            raise CheckpointError(f"rank {group.rank}: {exc}") from exc
        final = local.planner.finish_plan(mine)
        self.counters.plans_built += 1
        if group.size > 1:
            self.counters.plan_gathers += 1
        self._signature, self._final_plan, self._metadata = local.signature, final, metadata
        self._entries_plan = entries_plan
        self._key = structure_key(final)
        return PlannedSave(local.planner, final, metadata, self._entries_plan, self._key, False)


def flat_layout(planner: SavePlanner) -> Optional[tuple]:
    """Everything DCP's default local plan is made from, read off the planner's flattened state:
    each entry's name and nesting path, and for a plain tensor the properties its write item
    records. Equal layouts give equal local plans, so the plan is reused. None (always plan)
    for other planners and for DTensors and other objects that make their own write items."""
    if type(planner) is not DefaultSavePlanner:
        return None
    flat, mappings = getattr(planner, "state_dict", None), getattr(planner, "mappings", None)
    if not isinstance(flat, dict):
        return None
    rows = []
    for fqn, value in flat.items():
        if type(value) in (torch.Tensor, torch.nn.Parameter):
            rows.append((fqn, value.dtype, value.shape, value.layout, value.requires_grad, value.is_pinned(), value.device))
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            return None
        else:
            rows.append((fqn, type(value)))
    return tuple(rows), tuple(mappings.items()) if isinstance(mappings, dict) else None


def _plain_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace Stateful values (model/optimizer wrappers) by their state dicts, as DCP does."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}


def is_tensor_item(item) -> bool:
    return item.type != WriteItemType.BYTE_IO
