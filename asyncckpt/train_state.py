"""TrainState: model, optimizer(s) and any other training state as one DCP `Stateful`.

A bare optimizer cannot be saved and restored through DCP: DCP loads only the keys its target
already has, and a fresh optimizer's `state_dict()` has no state until its first `step()`, so a
resume would come back without Adam's moments. torch's `get_state_dict` / `set_state_dict` solve
that by creating the state first (`_init_optim_state`: one `step()` with zero gradients and a zero
learning rate), which changes training when it happens before the first step: Adam's step count
starts at 1 instead of 0. TrainState keeps torch's way and undoes that change, so a run that
checkpoints (or calls `prepare()`) before its first step trains bit for bit as one that does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

# Optimizers whose own first step creates only zero tensors (step count and moments): for these the
# state torch creates is reset to those zeros and kept, which is exactly what the first step would
# create. Exact types: a subclass may initialise its state otherwise.
ZERO_INITIAL_STATE = (torch.optim.Adam, torch.optim.AdamW)


class TrainState(Stateful):
    """Model, optimizer(s) and `extra` items as one DCP Stateful: `{"train": TrainState(model, opt)}`.

    Save it with `schedule_save`, restore it with `load_latest` / `asyncckpt.load` (or stock DCP):
    weights and optimizer state come back exactly, whatever the optimizer had at save time.

    - `optimizer`: one optimizer, several (a list), or None for the model alone.
    - `options`: torch's `StateDictOptions` (default: sharded tensors stay sharded, DCP's way;
      `StateDictOptions(full_state_dict=True)` gathers them).
    - `extra`: other things to save with it, by name. A `Stateful` (an LR scheduler, a data loader
      with `state_dict()`) and a dict or tensor are restored in place; a plain value (a step count,
      a string) is replaced in `self.extra`: read it back as `train.extra["name"]`.

    Before the optimizer's first step torch's `get_state_dict` creates its state (see the module's
    docstring). TrainState undoes it: for Adam and AdamW the state is reset to the zeros their first
    step would create (kept, so `prepare()` readies it); any other optimizer's is dropped again and
    saved as placeholders marked as not yet created, which a load drops again too. torch's step runs
    the optimizer's step hooks once (an LR scheduler only notes that the optimizer has stepped).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer], None] = None,
        *,
        options: Optional[StateDictOptions] = None,
        **extra: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TrainState: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is None:
            optimizers = ()
        elif isinstance(optimizer, torch.optim.Optimizer):
            optimizers = (optimizer,)
        else:
            optimizers = tuple(optimizer)
        wrong = [type(o).__name__ for o in optimizers if not isinstance(o, torch.optim.Optimizer)]
        if wrong:
            raise TypeError(f"TrainState: optimizer must be a torch.optim.Optimizer (or a list of them), got {wrong}")
        self.model = model
        self.optimizers = optimizers
        self.options = options
        self.extra = extra

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer (the first one when there are several; None without one)."""
        return self.optimizers[0] if self.optimizers else None

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state as torch's `get_state_dict` returns them, plus the extras.
        Called by DCP for a save and, to learn what to load into, for a load."""
        extra = {name: value.state_dict() if _is_stateful(value) else value for name, value in self.extra.items()}
        if not self.optimizers:
            return {"model": get_model_state_dict(self.model, options=self.options), "extra": extra}
        stateless = [o for o in self.optimizers if not o.state]
        with _gradients_set_aside(stateless):
            for optimizer in stateless:  # torch creates its state here (a zero-gradient step) ...
                get_optimizer_state_dict(self.model, optimizer, options=self.options)
                _reset_to_initial(optimizer)  # ... which this undoes, or keeps where it is exact
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=self.options)
        for optimizer in stateless:
            if type(optimizer) not in ZERO_INITIAL_STATE:  # saved as placeholders; it creates its own
                optimizer.state.clear()
        has_state = [bool(o.state) for o in self.optimizers]
        return {"model": model_sd, "optim": optim_sd, "optim_has_state": has_state, "extra": extra}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore model and optimizer with torch's `set_state_dict`; an optimizer that had no state
        at save time has none afterwards either."""
        if self.optimizers:
            set_state_dict(
                self.model, self.optimizers, model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optim"], options=self.options,
            )
            for optimizer, has_state in zip(self.optimizers, state_dict["optim_has_state"]):
                if not has_state:  # saved before its first step: it starts its state itself
                    optimizer.state.clear()
        else:
            set_model_state_dict(self.model, state_dict["model"], options=self.options)
        for name, value in state_dict["extra"].items():
            current = self.extra[name]
            if _is_stateful(current):
                current.load_state_dict(value)
            elif not isinstance(current, (dict, torch.Tensor)):  # DCP loaded dicts and tensors in place
                self.extra[name] = value


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _reset_to_initial(optimizer: torch.optim.Optimizer) -> None:
    """Adam and AdamW: set the state torch just created to the zeros their own first step creates
    (same tensors, same memory: the state `prepare()` hands over is the one training then uses)."""
    if type(optimizer) in ZERO_INITIAL_STATE:
        with torch.no_grad():
            for per_param in optimizer.state.values():
                for value in per_param.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()


class _gradients_set_aside:
    """Set the `.grad` of these optimizers' parameters aside for the `with` block: torch's
    `get_state_dict` creates no state when any gradient exists, and what is saved must not depend on
    whether a save comes before or after a backward pass. The same gradients come back after."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
        self.grads: list[Optional[torch.Tensor]] = []

    def __enter__(self) -> None:
        self.grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def __exit__(self, *exc: object) -> None:
        for p, grad in zip(self.params, self.grads):
            p.grad = grad
