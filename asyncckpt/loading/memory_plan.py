"""The memory tier's plan: what a rank's final save plan says of its items, as JSON the worker
keeps in the header of its memory file (asyncckpt/memory_file.py), and DCP `Metadata` rebuilt
from every rank's, as the coordinator would have built it at the commit: each item's storage is
(its rank's memory file, offset, length).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ..memory_file import MemoryCopy


def encode_plan(plan: SavePlan) -> bytes:
    """One row per write item (the worker's item positions), and the planner's data (DCP's
    flattening mappings) when it is plain data."""
    rows = []
    for item in plan.items:
        row: dict[str, Any] = {
            "fqn": item.index.fqn,
            "offset": list(item.index.offset) if item.index.offset is not None else None,
            "type": item.type.name,
        }
        td = item.tensor_data
        if td is not None:
            p = td.properties
            row.update(chunk_offsets=list(td.chunk.offsets), chunk_sizes=list(td.chunk.sizes), size=list(td.size),
                       dtype=_name(p.dtype), layout=_name(p.layout), memory_format=_name(p.memory_format),
                       requires_grad=bool(p.requires_grad), pin_memory=bool(p.pin_memory))
        rows.append(row)
    try:
        planner_data = json.dumps(plan.planner_data)
    except (TypeError, ValueError):
        planner_data = "null"  # only a load without a target needs it
    return json.dumps({"items": rows, "planner_data": json.loads(planner_data)}).encode()


def _name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _torch_attr(name: str, kind: type) -> Any:
    value = getattr(torch, str(name), None)
    if not isinstance(value, kind):
        raise ValueError(f"{name!r} is not a torch {kind.__name__}")
    return value


def rebuild_metadata(copies: Sequence[MemoryCopy]) -> tuple[Metadata, dict[tuple[str, int, int], int]]:
    """The global Metadata of the save every copy (one per rank, in rank order) belongs to, and
    the checksums of its items by (file name, offset, length). ValueError when a plan does not
    match its copy's items."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    checksums: dict[tuple[str, int, int], int] = {}
    planner_data: dict[str, Any] = {}
    for copy in copies:
        plan = json.loads(copy.plan)
        if len(plan["items"]) != len(copy.items):
            raise ValueError(f"{copy.path}: its plan names {len(plan['items'])} items, its header {len(copy.items)}")
        name = os.path.basename(copy.path)
        for row, stored in zip(plan["items"], copy.items):
            fqn = str(row["fqn"])
            offset = torch.Size(row["offset"]) if row["offset"] is not None else None
            if WriteItemType[row["type"]] == WriteItemType.BYTE_IO:
                state[fqn] = BytesStorageMetadata()
            else:
                meta = state.setdefault(fqn, TensorStorageMetadata(_properties(row), torch.Size(row["size"]), []))
                meta.chunks.append(ChunkStorageMetadata(torch.Size(row["chunk_offsets"]), torch.Size(row["chunk_sizes"])))
            storage[MetadataIndex(fqn, offset)] = _StorageInfo(name, stored.at, stored.length)
            checksums[(name, stored.at, stored.length)] = stored.crc32
        if isinstance(plan.get("planner_data"), dict):
            planner_data.update({k: tuple(v) if isinstance(v, list) else v for k, v in plan["planner_data"].items()})
    token = copies[0].token if copies else None
    directory = os.path.dirname(copies[0].path) if copies else ""
    metadata = Metadata(state, planner_data or None, storage, storage_meta=StorageMeta(checkpoint_id=directory, save_id=token))
    return metadata, checksums


def _properties(row: dict[str, Any]) -> TensorProperties:
    return TensorProperties(
        dtype=_torch_attr(row["dtype"], torch.dtype),
        layout=_torch_attr(row["layout"], torch.layout),
        requires_grad=bool(row["requires_grad"]),
        memory_format=_torch_attr(row["memory_format"], torch.memory_format),
        pin_memory=bool(row["pin_memory"]),
    )

