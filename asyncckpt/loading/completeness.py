"""Loads that lose nothing without a word.

DCP loads only the entries the target already holds: a saved entry the target lacks is dropped
silently. The common case is an optimizer's `state_dict()` taken before its first step (its
`state` is empty), which would resume with the Adam moments gone. Here:
- an optimizer state dict (a dict of `state` and `param_groups`, or an optimizer passed as it
  is) gets an entry for every saved state of its parameters, which the load then fills, so
  `optimizer.load_state_dict(state["optim"])` restores it;
- any other saved entry under a key the target names but cannot receive (a missing key in a
  nested dict) is refused, naming the entries, unless the caller asks for a partial load;
- top-level keys the target leaves out are a deliberate selection (e.g. only the model): logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from ..errors import CheckpointError

log = logging.getLogger("asyncckpt")

PARTIAL_HINT = (
    "save and load model and optimizer through asyncckpt.TrainState(model, optimizer) (or torch's "
    "get_state_dict / set_state_dict), or pass strict=False to asyncckpt.load (allow_partial=True to "
    "load_latest) to load only what the target holds"
)


@dataclass
class Filled:
    """Entries added to the caller's dicts so the load can fill them: removed again if it fails."""

    entries: list[tuple[dict, Any]] = field(default_factory=list)

    def undo(self) -> None:
        for container, key in reversed(self.entries):
            container.pop(key, None)
        self.entries.clear()


def expand_statefuls(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The target as DCP loads it: each top-level `Stateful` (a model, an optimizer) replaced by
    its `state_dict()`, so what is missing from it can be seen and added before the load."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


class LoadingRanks(Protocol):
    """The small collectives of the ranks that load together."""

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on some rank (an all-reduce of one number)."""

    def gather(self, obj: Any) -> list:
        """Every rank's `obj` (an all-gather of small objects)."""


def receive_everything(target: dict[str, Any], metadata: Metadata, path: str, strict: bool,
                       ranks: Optional[LoadingRanks] = None) -> Filled:
    """Make `target` (expanded) able to receive every saved entry under the keys it names, or
    raise CheckpointError naming those it cannot (with `strict=False`: load what it can).
    `ranks`: the loading ranks (None: this process loads alone). An entry another rank's target
    holds (a rank's own entries, e.g. `dataloader.dp_rank_3`) is received: every rank reaches the
    same verdict, at one all-reduce of a number when no rank lacks an entry (three collectives when
    one does)."""
    filled = Filled()
    try:  # (a Ctrl-C or a failed gather: the placeholders go, nothing of the state is changed)
        if strict:
            _fill_optimizer_states(target, metadata, filled)
        held = set(flatten_state_dict(target)[0])
        saved = metadata.state_dict_metadata
        keys = set(map(str, target))
        lacking = {fqn for fqn in saved if fqn not in held and _named(target, fqn, keys)}
        if ranks is not None and ranks.any(bool(lacking)):
            lacking = set().union(*ranks.gather(sorted(lacking)))
            # every rank agrees it is so: each says which of them it holds
            lacking -= set().union(*ranks.gather(sorted(lacking & held)))
    except BaseException:
        filled.undo()
        raise
    if lacking and strict:
        filled.undo()
        shown = ", ".join(sorted(lacking)[:8]) + (f" and {len(lacking) - 8} more" if len(lacking) > 8 else "")
        raise CheckpointError(
            f"{path!r}: the target has no place for {len(lacking)} saved entries ({shown}), which would be "
            f"dropped without a word; {PARTIAL_HINT}"
        )
    if lacking:
        log.info("loading %s partly (strict=False): %d saved entries left out", path, len(lacking))
    left_out = sorted({fqn.partition(".")[0] for fqn in saved if fqn not in held and not _named(target, fqn, keys)})
    if left_out and ranks is None:
        log.info("loading %s: saved entries under %s not loaded (the target does not name them)",
                 path, ", ".join(left_out[:8]))
    return filled


def _named(target: dict[str, Any], fqn: str, keys: Optional[set] = None) -> bool:
    """Whether a saved entry lies under a top-level key of the target (keys may hold dots)."""
    keys = set(map(str, target)) if keys is None else keys
    parts = fqn.split(".")
    return any(".".join(parts[:n]) in keys for n in range(1, len(parts) + 1))


def _fill_optimizer_states(target: Mapping, metadata: Metadata, filled: Filled, prefix: str = "") -> None:
    for key, value in target.items():
        fqn = f"{prefix}{key}"
        if not isinstance(value, Mapping):
            continue
        if _is_optimizer_state_dict(value):
            _fill_one(value, fqn, metadata, filled)
        else:
            _fill_optimizer_states(value, metadata, filled, f"{fqn}.")


def _is_optimizer_state_dict(value: Mapping) -> bool:
    groups = value.get("param_groups")
    return (isinstance(value.get("state"), dict) and isinstance(groups, list)
            and all(isinstance(g, Mapping) and "params" in g for g in groups))


def _fill_one(optim: Mapping, fqn: str, metadata: Metadata, filled: Filled) -> None:
    """Add a placeholder for each saved state entry of a parameter this optimizer has (keyed as
    torch keys them: the parameter's id in `param_groups`, an int, or a name)."""
    state: dict = optim["state"]
    params = {str(p): p for group in optim["param_groups"] for p in group["params"]}
    ordered = sorted(params, key=len, reverse=True)  # names may hold dots: "0.weight" before "0"
    head = f"{fqn}.state."
    for saved, meta in metadata.state_dict_metadata.items():
        if not saved.startswith(head):
            continue
        rest = saved[len(head):]
        param = next((p for p in ordered if rest.startswith(f"{p}.")), None)
        name = rest[len(param) + 1:] if param is not None else ""
        if not name or "." in name:
            continue  # not one this optimizer can hold: reported as lacking if nothing else holds it
        if not isinstance(meta, TensorStorageMetadata):
            continue  # an object: DCP would place it under the key's string, not the parameter's id
        key = params[param]
        entry = state.get(key)
        if entry is None:
            entry = state[key] = {}
            filled.entries.append((state, key))
            created = True
        elif not isinstance(entry, dict) or name in entry:
            continue
        else:
            created = False
        entry[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
        if not created:
            filled.entries.append((entry, name))
