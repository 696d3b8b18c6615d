"""Step-time slowdown: the same training loop on the device without saves, and with a save every K
steps (asyncckpt eager, dcp.async_save with its default stager)."""

from __future__ import annotations

import os
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from savebench.common import Progress
from savebench.measure import ComputeLoop, remove, short_error

from .saves import close, release_memory
from .savers import Saver, make_saver

# asyncckpt last: its last checkpoint is kept for the loads, so the disk never holds more than one loop's saves
LOOP_METHODS = {"dcp": "dcp.async_save", "eager": "asyncckpt eager"}


@dataclass
class LoopRow:
    """One run of the loop: every step's time (a save step includes its call), and each save's call."""

    label: str
    every: int = 0  # steps between saves (0: no saves)
    step_s: list[float] = field(default_factory=list)
    save_call_s: list[float] = field(default_factory=list)
    status: str = "ok"
    note: str = ""

    @property
    def median_s(self) -> Optional[float]:
        return statistics.median(self.step_s) if self.step_s else None

    @property
    def mean_s(self) -> Optional[float]:
        return statistics.fmean(self.step_s) if self.step_s else None

    def slowdown(self, baseline: "LoopRow", attr: str) -> Optional[float]:
        """Percent more than the loop without saves, by median or mean step time."""
        mine, base = getattr(self, attr), getattr(baseline, attr)
        return 100 * (mine / base - 1) if mine is not None and base else None


def save_interval(durable_s: float, step_s: float) -> int:
    """Steps between saves: a quarter more than a save takes to become durable, so a save never
    waits for the one before (a training loop saves far less often; this is the most often that
    measures only the save itself)."""
    return max(10, int(1.25 * durable_s / step_s) + 1)


def run_loops(state: dict[str, Any], device: torch.device, root: str, loop: ComputeLoop, every: int,
              saves: int, timeout_s: float, progress: Progress) -> tuple[list[LoopRow], Optional[str]]:
    """The loop without saves, then with each method of LOOP_METHODS: `saves` saves, the first at
    step 0, `every` steps apart, each saver warmed up by an untimed save first. Returns the rows
    and the directory of asyncckpt's last checkpoint (the state as it is now), kept for the loads."""
    steps = every * saves
    progress.update(label=f"loop: {steps} steps without saves")
    baseline = LoopRow("no saves", step_s=loop.run(steps))
    rows, kept = [baseline], None
    for method, label in LOOP_METHODS.items():
        row = LoopRow(f"{label} every {every}", every)
        saver = make_saver(method, state, os.path.join(root, f"loop_{method}"), timeout_s, device)
        try:
            progress.update(label=f"loop: {label}, warm-up save")
            saver.open()
            saver.save(0)
            saver.wait_durable()
            saver.discard(0)
            progress.saved()
            progress.update(label=f"loop: {label}, {steps} steps, a save every {every}")
            last = run_with_saves(saver, loop, row, steps, every)
            progress.saved()
            if method == "eager":
                kept = saver.path(last)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            row.status, row.note = "error", short_error(exc)
            progress.log(f"loop {label}: ERROR {row.note}\n{traceback.format_exc()}")
        finally:
            closing = close(saver)
            if closing:
                row.note = f"{row.note}; {closing}" if row.note else closing
            for entry in os.listdir(saver.workdir) if os.path.isdir(saver.workdir) else []:
                path = os.path.join(saver.workdir, entry)
                if path != kept:
                    remove(path)
            release_memory(device)
        progress.log(f"loop {row.label}: median step {fmt_ms(row.median_s)}, mean {fmt_ms(row.mean_s)} "
                     f"(no saves: {fmt_ms(baseline.median_s)}, {fmt_ms(baseline.mean_s)})")
        rows.append(row)
    return rows, kept


def run_with_saves(saver: Saver, loop: ComputeLoop, row: LoopRow, steps: int, every: int) -> int:
    """The loop with a save at the start of every `every`-th step, as a training loop would: every
    step polls (asyncckpt's finalize()), a save first waits for the previous one to be durable
    (torchtitan's future.result(); schedule_save would wait by itself); then waits for the last
    save. Returns the last save's step."""
    pending, last = False, 0
    for step in range(steps):
        start = time.perf_counter()
        saver.poll()
        if step % every == 0:
            if pending:
                saver.wait_durable()
            call_start = time.perf_counter()
            saver.save(step + 1)  # step 0 is the warm-up's
            row.save_call_s.append(time.perf_counter() - call_start)
            pending, last = True, step + 1
        loop.step()
        row.step_s.append(time.perf_counter() - start)
    saver.wait_durable()
    return last


def fmt_ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"
