"""One save method's row: its first save right after the constructor, its first save after some
training, steady saves, and a consistency check on the last one."""

from __future__ import annotations

import gc
import os
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from savebench.common import Progress, Skip
from savebench.measure import ComputeLoop, remove, short_error

from .savers import OURS, Saver, make_saver
from .state import change_every_tensor, first_difference, host_copy, zeros_like


@dataclass
class SaveTiming:
    """One save as the caller saw it."""

    step: int
    call_s: float  # the call itself
    blocked_s: float  # until the caller may change the state
    durable_s: float  # call to committed


@dataclass
class SaveRow:
    """Everything measured for one save method."""

    method: str
    label: str
    status: str = "ok"  # ok | error | skipped
    note: str = ""
    fresh: Optional[SaveTiming] = None  # the first save right after the constructor
    trained: Optional[SaveTiming] = None  # the first save of a saver built before --train-s of training
    trained_steps: int = 0
    steady: list[SaveTiming] = field(default_factory=list)  # the last one is the checked one
    consistent: Optional[bool] = None
    difference: str = ""  # the first entry that did not hold the values at the call

    def median(self, attr: str) -> Optional[float]:
        return statistics.median(getattr(s, attr) for s in self.steady) if self.steady else None

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text


@dataclass
class SaveSettings:
    """How much to measure per method."""

    saves: int  # steady saves, the checked one included
    train_s: float
    timeout_s: float


class SaveRunner:
    """Runs each save method on the shared state, in its own directory under `root`."""

    def __init__(self, state: dict[str, Any], device: torch.device, root: str, settings: SaveSettings,
                 loop: ComputeLoop, progress: Progress) -> None:
        self.state = state
        self.device = device
        self.root = root
        self.settings = settings
        self.loop = loop
        self.progress = progress
        self.step = 0

    def saves_of(self, name: str) -> int:
        """Saves one method makes (for the progress line): first ones, then the steady ones."""
        return (2 if name in OURS else 1) + self.settings.saves

    def saver(self, name: str, part: str) -> Saver:
        workdir = os.path.join(self.root, name, part)
        return make_saver(name, self.state, workdir, self.settings.timeout_s, self.device)

    def run(self, name: str) -> SaveRow:
        saver = self.saver(name, "main")
        row = SaveRow(name, saver.label)
        done_before = self.progress.done
        try:
            if name in OURS:
                row.fresh = self.first_save(name)
                self.progress.update(label=f"{row.label}: {self.settings.train_s:g} s of training, then a first save")
            saver.open()
            if name in OURS:
                row.trained_steps = self.train()
                row.trained = self.timed(saver, "first save after training")
            else:
                row.fresh = self.timed(saver, "first save")
            for i in range(self.settings.saves - 1):
                row.steady.append(self.timed(saver, f"save {i + 1}/{self.settings.saves}"))
            timing, row.difference = self.checked(saver)
            row.steady.append(timing)
            row.consistent = not row.difference
        except Skip as exc:
            row.status, row.note = "skipped", str(exc)
            self.progress.log(f"{row.label}: skipped: {exc}")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            row.status, row.note = "error", short_error(exc)
            self.progress.log(f"{row.label}: ERROR {row.note}\n{traceback.format_exc()}")
        finally:
            closing = close(saver)
            if closing:
                row.add_note(closing)
            remove(os.path.join(self.root, name))
            release_memory(self.device)
            if saver.note:
                row.add_note(saver.note)
            self.progress.update(label=f"{row.label} {row.status}", done=done_before + self.saves_of(name))
        return row

    def first_save(self, name: str) -> SaveTiming:
        """A fresh saver's first save, right after its constructor; then it is closed."""
        saver = self.saver(name, "fresh")
        try:
            saver.open()
            return self.timed(saver, "first save after the constructor")
        finally:
            closing = close(saver)
            if closing:
                self.progress.log(f"{saver.label}, the fresh one: {closing}")

    def train(self) -> int:
        """--train-s of training steps on the device; returns how many."""
        start, steps = time.perf_counter(), 0
        while time.perf_counter() - start < self.settings.train_s:
            self.loop.step()
            steps += 1
        return steps

    def next_step(self) -> int:
        self.step += 1
        self.state["step"] = self.step
        return self.step

    def timed(self, saver: Saver, what: str) -> SaveTiming:
        """One save, to durable; its output is deleted after."""
        self.progress.update(label=f"{saver.label} {what}")
        step = self.next_step()
        start = time.perf_counter()
        call = saver.save(step)
        saver.wait_durable()
        timing = SaveTiming(step, call.call_s, call.blocked_s, time.perf_counter() - start)
        saver.discard(step)
        self.progress.log(f"{saver.label}: {what}: blocked {timing.blocked_s:.3f}s durable {timing.durable_s:.3f}s")
        self.progress.saved()
        return timing

    def checked(self, saver: Saver) -> tuple[SaveTiming, str]:
        """A steady save after which every tensor changes in place as soon as the caller may change
        it; the committed checkpoint, loaded into host tensors, must hold the values at the call.
        Returns the timing and the first entry that differs ("" when none)."""
        import asyncckpt

        self.progress.update(label=f"{saver.label} checked save")
        step = self.next_step()
        expected = host_copy(self.state)
        start = time.perf_counter()
        call = saver.save(step)
        change_every_tensor(self.state)
        saver.wait_durable()
        timing = SaveTiming(step, call.call_s, call.blocked_s, time.perf_counter() - start)
        loaded = zeros_like(expected)
        asyncckpt.load(loaded, saver.path(step), no_dist=True)
        difference = first_difference(loaded, expected) or ""
        del loaded, expected
        saver.discard(step)
        verdict = f"CONSISTENCY CHECK FAILED at {difference}" if difference else "holds the values at the call"
        self.progress.log(f"{saver.label}: checked save: blocked {timing.blocked_s:.3f}s durable "
                          f"{timing.durable_s:.3f}s; {verdict}")
        self.progress.saved()
        return timing, difference


def close(saver: Saver) -> str:
    """Close a saver; returns what went wrong closing it ("" when nothing did)."""
    try:
        saver.close()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        return f"close: {short_error(exc)}"
    return ""


def release_memory(device: torch.device) -> None:
    """Give back what a finished part held (host memory, cached device blocks)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
