"""Job shapes and the local save plans their ranks would make, without a tensor's memory.

A rank's plan is built the way DCP's `DefaultSavePlanner.create_local_plan` builds it for a
flattened `{"model": ..., "optim": ...}` state (HF Llama names, Adam with a `step` per parameter):
one WriteItem per tensor chunk, with DCP's own chunk arithmetic (`Shard.local_shard_size_and_offset`,
the rule DTensor and FSDP2 use), fresh index / chunk / properties objects per item as DCP makes
them (so pickles are as large as a real rank's), and the flattening mappings as `planner_data`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import Shard

ADAM_STATES = ("exp_avg", "exp_avg_sq")
PARAM_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
                    "differentiable", "fused", "params")  # torch.optim.Adam's param_group, one group


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    tp_dim: Optional[int]  # the dimension tensor parallelism splits (None: replicated over TP)


@dataclass(frozen=True)
class Model:
    """A Llama-style decoder: the tensor list of the HF checkpoint (7B: Llama-2-7B, 70B: Llama-2-70B)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    kv_dim: int
    vocab: int = 32000

    def params(self) -> list[Param]:
        h, f = self.hidden, self.intermediate
        out = [Param("model.embed_tokens.weight", (self.vocab, h), 0)]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                Param(p + "self_attn.q_proj.weight", (h, h), 0),  # column-parallel: TP splits dim 0
                Param(p + "self_attn.k_proj.weight", (self.kv_dim, h), 0),
                Param(p + "self_attn.v_proj.weight", (self.kv_dim, h), 0),
                Param(p + "self_attn.o_proj.weight", (h, h), 1),  # row-parallel: dim 1
                Param(p + "mlp.gate_proj.weight", (f, h), 0),
                Param(p + "mlp.up_proj.weight", (f, h), 0),
                Param(p + "mlp.down_proj.weight", (h, f), 1),
                Param(p + "input_layernorm.weight", (h,), None),
                Param(p + "post_attention_layernorm.weight", (h,), None),
            ]
        return out + [Param("model.norm.weight", (h,), None), Param("lm_head.weight", (self.vocab, h), 0)]

    def numel(self) -> int:
        return sum(_numel(p.shape) for p in self.params())


LLAMA_7B = Model("7B", hidden=4096, intermediate=11008, layers=32, kv_dim=4096)
LLAMA_70B = Model("70B", hidden=8192, intermediate=28672, layers=80, kv_dim=1024)
# 70B's widths, one decoder layer: the per-rank part of a steady commit (shares, checksums parts)
# does not depend on the number of tensors, so this runs it at 16,384 ranks for real
LLAMA_70B_ONE_LAYER = Model("70B-1L", hidden=8192, intermediate=28672, layers=1, kv_dim=1024)
TINY = Model("tiny", hidden=8, intermediate=12, layers=1, kv_dim=4, vocab=16)  # tests: real tensors


@dataclass(frozen=True)
class JobShape:
    """How a model's training state is spread over the ranks.

    fsdp: every tensor split on dim 0 over all ranks (FSDP2). fsdp_tp: a (ranks/tp, tp) mesh,
    TP splitting column/row-parallel weights, FSDP then splitting dim 0 of each TP shard; norms
    are replicated over TP (DCP deduplicates them). ddp: every rank holds everything; with
    `lowest_rank_writes` DCP's dedup gives every item to rank 0 (the HF / Lightning layout)."""

    model: Model
    parallel: str  # "fsdp" | "fsdp_tp" | "ddp"
    tp: int = 1

    @property
    def name(self) -> str:
        return {"fsdp": f"{self.model.name} FSDP", "fsdp_tp": f"{self.model.name} FSDPxTP{self.tp}",
                "ddp": f"{self.model.name} DDP"}[self.parallel]

    @property
    def lowest_rank_writes(self) -> bool:
        return self.parallel == "ddp"

    def check_ranks(self, ranks: int) -> None:
        if ranks < 1 or ranks % self.tp:
            raise ValueError(f"{self.name}: {ranks} ranks is not a positive multiple of TP={self.tp}")

    def chunk(self, param: Param, ranks: int, rank: int) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) of the piece of `param` this rank holds; None for a plain
        (unsharded) tensor."""
        shape = list(param.shape)
        offsets = [0] * len(shape)
        if self.parallel == "ddp":
            return None
        dp, dp_rank = ranks // self.tp, rank // self.tp
        if self.parallel == "fsdp_tp" and param.tp_dim is not None:
            size, offset = Shard.local_shard_size_and_offset(shape[param.tp_dim], self.tp, rank % self.tp)
            shape[param.tp_dim], offsets[param.tp_dim] = size, offset
        size, offset = Shard.local_shard_size_and_offset(shape[0], dp, dp_rank)
        shape[0], offsets[0] = size, offsets[0] + offset
        for dim, size in enumerate(shape):  # DTensor places an empty shard at the end of the dim
            if size == 0:
                offsets[dim] = param.shape[dim]
        return tuple(offsets), tuple(shape)

    def local_plan(self, ranks: int, rank: int, dtype: torch.dtype = torch.float32) -> SavePlan:
        """The local SavePlan rank `rank` of `ranks` sends to the coordinator."""
        items, mappings = [], {}
        for param in self.model.params():
            chunk = self.chunk(param, ranks, rank)
            for fqn, path in ((f"model.{param.name}", ("model", param.name)),
                              *((f"optim.state.{param.name}.{s}", ("optim", "state", param.name, s)) for s in ADAM_STATES)):
                items.append(_tensor_item(fqn, param.shape, chunk, dtype))
                mappings[fqn] = path
            step = f"optim.state.{param.name}.step"  # a plain scalar tensor on every rank
            items.append(_tensor_item(step, (), None, torch.float32))
            mappings[step] = ("optim", "state", param.name, "step")
        for key in PARAM_GROUP_KEYS:
            fqn = f"optim.param_groups.0.{key}"
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
            mappings[fqn] = ("optim", "param_groups", 0, key)
        return SavePlan(items, planner_data=mappings)


def _tensor_item(fqn: str, shape: tuple[int, ...], chunk, dtype: torch.dtype) -> WriteItem:
    """DCP's WriteItem for a DTensor's local chunk (`chunk` given) or a plain tensor."""
    if chunk is None:
        offsets, sizes, kind = torch.Size([0] * len(shape)), torch.Size(shape), WriteItemType.TENSOR
    else:
        offsets, sizes, kind = torch.Size(chunk[0]), torch.Size(chunk[1]), WriteItemType.SHARD
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=kind,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
        ),
    )


def item_nbytes(item: WriteItem) -> int:
    """The bytes of a tensor item's chunk (0 for an object)."""
    if item.tensor_data is None:
        return 0
    return _numel(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class FabricatedPlanner(DefaultSavePlanner):
    """DCP's DefaultSavePlanner whose local plan is given (global planning, dedup, validation and
    `finish_plan` are DCP's own). `tensors` maps fqn -> the rank's local tensor for a rank that
    really saves (tests); a simulated rank resolves nothing."""

    def __init__(self, plan: SavePlan, lowest_rank_writes: bool = False,
                 tensors: Optional[dict[str, torch.Tensor]] = None, objects: Optional[dict[str, object]] = None) -> None:
        super().__init__(dedup_save_to_lowest_rank=lowest_rank_writes)
        self._given = plan
        self._tensors, self._objects = tensors or {}, objects or {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner({}, storage_meta, is_coordinator)
        self.mappings = dict(self._given.planner_data or {})

    def create_local_plan(self) -> SavePlan:
        self.plan = self._given
        return self._given

    def lookup_object(self, index: MetadataIndex):
        return self._tensors[index.fqn] if index.fqn in self._tensors else self._objects[index.fqn]
