"""Lazy staging's guard: the calls that change saved tensors wait for staging first.

Exactly two calls are covered: an optimizer's `step()` (a step pre-hook: the parameters, the
optimizer's state, whatever its step hooks change) and a module's `forward` (a forward pre-hook on
the module given: BatchNorm running statistics and every buffer a forward changes, in it or its
submodules). A tensor changed anywhere else (an EMA your code updates, an in-place edit, another
model) is not: call `wait_staged()` before changing it.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


class GuardHandles:
    """The hooks `guard` registered; `remove()` takes them all off."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def guard_calls(owners: Iterable[torch.optim.Optimizer | torch.nn.Module], wait: Callable[[], None]) -> GuardHandles:
    """Make each optimizer's `step()` and each module's `forward` call `wait()` first."""
    handles = []
    for owner in owners:
        if isinstance(owner, torch.optim.Optimizer):
            handles.append(owner.register_step_pre_hook(lambda *_: wait()))
        elif isinstance(owner, torch.nn.Module):
            handles.append(owner.register_forward_pre_hook(lambda *_: wait()))
        else:
            for handle in handles:
                handle.remove()
            raise TypeError(f"guard takes optimizers and modules, not {type(owner).__name__}")
    return GuardHandles(handles)
