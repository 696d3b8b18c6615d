"""What this rank's worker holds, as the trainer keeps track of it: per cache slot, a structure
and its tensors with their fingerprints, so a request carries only what the worker lacks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .snapshot import Snapshot


@dataclass
class WorkerHolds:
    """What the worker has cached: a structure, and each tensor with its fingerprint.

    The tensors are kept referenced here on purpose: while they live, their storage cannot be
    freed, so a new tensor can never reuse the address and pass the pointer comparison (a freed
    shared-memory mapping is otherwise handed straight back to the next allocation)."""

    structure_key: str
    fingerprints: list
    tensors: list

    @classmethod
    def of(cls, snapshot: Snapshot) -> "WorkerHolds":
        """What the worker holds once it took `snapshot`: every tensor but the copies made for
        this save alone (sent again each save, and let go by the worker once staged: keeping
        them here would hold +1x their memory, on the GPU for a DTensor's or subclass's copy,
        until the next save)."""
        keep = [pos not in snapshot.always_fresh for pos in range(len(snapshot.tensors))]
        return cls(snapshot.structure_key,
                   [fp if kept else None for fp, kept in zip(snapshot.fingerprints, keep)],
                   [t if kept else None for t, kept in zip(snapshot.tensors, keep)])


@dataclass
class TensorsToSend:
    """What a request hands over: whether the worker knows the structure, the tensors it must be
    sent (by position), and for a new structure the positions whose tensor the worker already
    holds under the previous one (new position -> held position)."""

    known_structure: bool
    fresh: dict[int, torch.Tensor]
    kept: dict[int, int]


def tensors_to_send(snapshot: Snapshot, held: Optional[WorkerHolds]) -> TensorsToSend:
    """Send a tensor only if the worker does not hold it: always for one copied fresh on every
    save, else when no held tensor has its fingerprint (the same structure: at its own position;
    a new structure: at any position of the held one)."""
    known = held is not None and held.structure_key == snapshot.structure_key
    held_at = {} if held is None else {fp: pos for pos, fp in enumerate(held.fingerprints) if fp is not None}
    fresh, kept = {}, {}
    for pos, tensor in enumerate(snapshot.tensors):
        if tensor is None:
            continue
        fingerprint = snapshot.fingerprints[pos]
        if pos in snapshot.always_fresh:
            fresh[pos] = tensor
        elif known:
            if fingerprint != held.fingerprints[pos]:
                fresh[pos] = tensor
        elif fingerprint in held_at:
            kept[pos] = held_at[fingerprint]
        else:
            fresh[pos] = tensor
    return TensorsToSend(known, fresh, kept)
