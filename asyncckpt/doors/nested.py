"""Any nested dict through DCP and back, exactly.

DCP flattens nested state by joining keys with "." after `str()`: int keys come back as strings
(an optimizer's state is keyed by int), "a.b" collides with {"a": {"b": ...}}, empty dicts and
lists vanish, tuples holding tensors are pickled whole. So a framework's checkpoint dict (e.g.
Lightning's) is saved as a flat DCP state instead: every tensor under a key of its own (its path
joined with ".", made unique), plus one object, STRUCTURE_KEY, that holds the dict with each
tensor replaced by None and the path of every tensor. Only plain dict/OrderedDict/list/tuple are
walked; anything else is a leaf, pickled with the structure at save time. Loading the structure
needs nothing beyond `weights_only=True` for plain values.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ..errors import CheckpointError

STRUCTURE_KEY = "asyncckpt.structure"
_FORMAT = "asyncckpt.nested/1"


def flatten_exact(state: dict) -> dict[str, Any]:
    """A flat DCP state dict: {tensor key: tensor, ..., STRUCTURE_KEY: (format, skeleton, paths)}.
    Tensors are not copied; the structure is pickled by the save that takes this dict."""
    if not isinstance(state, dict):
        raise TypeError(f"expected a dict, not {type(state).__name__}")
    flat: dict[str, Any] = {}
    paths: list[tuple[tuple, str]] = []

    def walk(node: Any, path: tuple) -> Any:
        if isinstance(node, torch.Tensor):
            key = _unique_key(".".join(str(k) for k in path), flat)
            flat[key] = node
            paths.append((path, key))
            return None
        kind = type(node)
        if kind in (dict, OrderedDict):
            return kind((k, walk(v, path + (k,))) for k, v in node.items())
        if kind in (list, tuple):
            return kind(walk(v, path + (i,)) for i, v in enumerate(node))
        return node

    skeleton = walk(state, ())
    flat[STRUCTURE_KEY] = (_FORMAT, skeleton, paths)
    return flat


def unflatten_exact(flat: dict[str, Any], source: str = "checkpoint") -> dict:
    """The dict `flatten_exact` was given, from its flat state (as loaded from DCP, or as
    `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` wrote it)."""
    entry = flat.get(STRUCTURE_KEY)
    if not (isinstance(entry, (tuple, list)) and len(entry) == 3 and entry[0] == _FORMAT):
        raise CheckpointError(
            f"{source}: no {STRUCTURE_KEY!r} record of format {_FORMAT!r}: it was not saved from a nested "
            "dict by asyncckpt (load it with asyncckpt.load into a state dict of your own)"
        )
    _, skeleton, paths = entry
    tensors = {}
    for path, key in paths:
        if key not in flat:
            raise CheckpointError(f"{source}: the tensor {key!r} its structure names is missing")
        tensors[tuple(path)] = flat[key]

    def build(node: Any, path: tuple) -> Any:
        if path in tensors:
            return tensors[path]
        kind = type(node)
        if kind in (dict, OrderedDict):
            return kind((k, build(v, path + (k,))) for k, v in node.items())
        if kind in (list, tuple):
            return kind(build(v, path + (i,)) for i, v in enumerate(node))
        return node

    return build(skeleton, ())


def map_tensors(node: Any, fn) -> Any:
    """`node` with `fn` applied to every tensor inside the containers flatten_exact walks."""
    if isinstance(node, torch.Tensor):
        return fn(node)
    kind = type(node)
    if kind in (dict, OrderedDict):
        return kind((k, map_tensors(v, fn)) for k, v in node.items())
    if kind in (list, tuple):
        return kind(map_tensors(v, fn) for v in node)
    return node


def _unique_key(name: str, taken: dict) -> str:
    name = name or "tensor"
    candidate, n = name, 1
    while candidate in taken or candidate == STRUCTURE_KEY:
        candidate, n = f"{name}#{n}", n + 1
    return candidate
