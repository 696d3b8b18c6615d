"""Loading a checkpoint into tensors on the device: asyncckpt.load and stock dcp.load, cold and warm."""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from loadbench.measure import drop_cache
from savebench.common import Progress
from savebench.measure import short_error

from .limits import synchronize
from .saves import release_memory
from .state import first_difference, zeros_like


@dataclass
class LoadRow:
    """Median seconds of cold (pages dropped first) and warm loads, and whether the target then
    held the state."""

    label: str
    cold_samples: list[float] = field(default_factory=list)
    warm_samples: list[float] = field(default_factory=list)
    difference: Optional[str] = None  # the first entry that differs from the state; "" when none
    status: str = "ok"
    note: str = ""

    @property
    def cold_s(self) -> Optional[float]:
        return statistics.median(self.cold_samples) if self.cold_samples else None

    @property
    def warm_s(self) -> Optional[float]:
        return statistics.median(self.warm_samples) if self.warm_samples else None


def run_loads(state: dict[str, Any], device: torch.device, path: str, repeat: int, progress: Progress) -> list[LoadRow]:
    """Each method loads the checkpoint at `path` (of the state as it is now) into a fresh target
    on the device, `repeat` times cold and `repeat` times warm; the target must equal the state.
    One target at a time."""
    import asyncckpt
    import torch.distributed.checkpoint as dcp

    methods: dict[str, Callable[[dict[str, Any]], None]] = {
        "asyncckpt.load": lambda target: asyncckpt.load(target, path),
        "dcp.load": lambda target: dcp.load(target, checkpoint_id=path),
    }
    rows = []
    for label, load in methods.items():
        row = LoadRow(label)
        target = None
        try:
            target = zeros_like(state)
            for mode, samples in (("cold", row.cold_samples), ("warm", row.warm_samples)):
                if mode == "warm":
                    load(target)  # the pages are in the cache now
                for i in range(repeat):
                    progress.update(label=f"{label} {mode} {i + 1}/{repeat}")
                    if mode == "cold":
                        drop_cache(path)
                    synchronize(device)
                    start = time.perf_counter()
                    load(target)
                    synchronize(device)
                    samples.append(time.perf_counter() - start)
            row.difference = first_difference(target, state) or ""
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            row.status, row.note = "error", short_error(exc)
            progress.log(f"{label}: ERROR {row.note}\n{traceback.format_exc()}")
        finally:
            target = None  # one target on the device at a time
            release_memory(device)
        progress.log(f"{label}: cold {row.cold_samples}, warm {row.warm_samples}"
                     + (f"; LOADED WRONG at {row.difference}" if row.difference else ""))
        rows.append(row)
    return rows
