"""Asynchronous checkpoints for the Hugging Face Transformers `Trainer`.

`AsyncCheckpointTrainer` is `transformers.Trainer` with the same arguments; `AsyncCheckpointMixin`
gives any Trainer subclass the same (`class MyTrainer(AsyncCheckpointMixin, SFTTrainer)`). At each
`save_steps` the model, optimizer, scheduler, scaler, RNG states and trainer state are staged and
the call returns; the worker writes `output_dir/checkpoint-{step}` while training goes on, and the
save commits when its `.metadata` lands (polled at every step's end, and before `train()` returns).

`checkpoint-N` is a stock DCP checkpoint. Its items: `model.*` (the model's `state_dict()`),
`optimizer.*` (torch.distributed.checkpoint.state_dict's form, keyed by parameter names),
`scheduler.*`, `scaler.*`, `rng.*` (tensors, no pickled NumPy; `rng_{rank}.*` under DDP) and
`trainer_state` (the JSON text of `TrainerState`). Beside them, `trainer_state.json` and
`config.json` for the tools that read them.

Resuming picks the newest *committed* `checkpoint-N` (a folder a killed run left without
`.metadata` is never used); `trainer.train(resume_from_checkpoint=path)` also accepts a stock
Trainer checkpoint folder. Rotation (`save_total_limit`) runs after each commit and never deletes
the save in flight, the newest committed checkpoint or the best one.

Preemption: with `CheckpointConfig(preemption_signals=(signal.SIGTERM,))` as `checkpoint_config`,
the signal stops training at the end of the step it lands in (`control.should_training_stop`),
and `train()` returns once the newest staged save is committed; end the script with
`asyncckpt.requeue_exit()`. The Trainer must be built on the main thread (signal handlers).

This module imports Transformers (`pip install asyncckpt[hf]`); `import asyncckpt` does not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Optional

import torch

try:
    import transformers
    from transformers.trainer_callback import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # asyncckpt itself does not depend on Transformers
    raise ImportError("asyncckpt.transformers needs Transformers: pip install 'asyncckpt[hf]'") from exc

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from ..save.checkpointer import AsyncCheckpointer
from ..command import cli_command
from ..config import CheckpointConfig
from .door_config import check_door_config
from ..errors import CheckpointError
from ..loading.load import load
from .rng import rng_state, set_rng_state
from ..loading.opened import OpenCheckpoint, open_checkpoint
from ..storage import storage_for
from .trainer_folders import checkpoint_folders, is_committed, is_complete, remove_folder, resume_target, written_at

log = logging.getLogger("asyncckpt")

__all__ = ["AsyncCheckpointMixin", "AsyncCheckpointTrainer"]

TRAINER_STATE_FILE = "trainer_state.json"


class AsyncCheckpointMixin:
    """Put before a `transformers.Trainer` subclass in the bases. The constructor takes exactly
    that Trainer's arguments; set `checkpoint_config` (a CheckpointConfig; class attribute or on
    the instance before `train()`) to change how saves are written."""

    checkpoint_config: Optional[CheckpointConfig] = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self)
        self._checkpointer: Optional[AsyncCheckpointer] = None
        self._opened_with: Optional[CheckpointConfig] = None
        self.add_callback(_CommitPoller(self))
        self._open_checkpointer()  # its worker starts now, so the first save need not wait for it

    # training --------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """Trainer.train, with saves in the background. `resume_from_checkpoint=True` resumes from
        the newest committed checkpoint; every save is committed before this returns."""
        resume = resume_target(self.args.output_dir, resume_from_checkpoint)
        if resume is not None and is_committed(resume):
            _restore_trainer_state_file(resume, write=self.args.should_save)
        self._open_checkpointer()  # a train() after another one starts a fresh worker
        try:
            output = super().train(resume, *args, **kwargs)
        except BaseException:
            self._close_checkpointer(quietly=True)  # saves already staged still commit
            raise
        self._close_checkpointer()
        return output

    def _finalize_training(self, *args, **kwargs):  # recent Transformers: best-model loading and
        self._commit(blocking=True)  # save_total_limit=1 cleanup come next; they need final folders
        return super()._finalize_training(*args, **kwargs)

    def _sorted_checkpoints(self, *args, **kwargs):  # older Transformers: lists the folders that the
        self._commit(blocking=True)  # save_total_limit=1 cleanup at the end of training deletes
        return super()._sorted_checkpoints(*args, **kwargs)

    # saving ----------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        step = self.state.global_step
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        best_step = getattr(self.state, "best_global_step", None)  # older Transformers set best_model_checkpoint themselves
        if best_step and self.args.save_strategy in ("steps", "epoch", "best"):
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
            if best_step == step or os.path.isdir(best_dir):  # this save, or one before it
                self.state.best_model_checkpoint = best_dir
        elif self.args.save_strategy == "best":  # every save is a new best (older Transformers leave best_global_step unset)
            self.state.best_model_checkpoint = output_dir
        if self.args.should_save:
            _record_stateful_callbacks(self)
        trainer_state = json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"
        self._open_checkpointer().schedule_save(self._checkpoint_state(trainer_state), step, checkpoint_dir=output_dir)
        if self.args.should_save:  # before the commit can happen: a committed folder has them. Not
            storage = storage_for(output_dir)  # fsynced: a resume rewrites the first from the checkpoint's own copy
            storage.write_atomic(os.path.join(output_dir, TRAINER_STATE_FILE), trainer_state.encode(), fsync=False)
            config = getattr(self.model, "config", None)
            if hasattr(config, "to_json_string"):
                storage.write_atomic(os.path.join(output_dir, "config.json"), config.to_json_string().encode(), fsync=False)

    def _checkpoint_state(self, trainer_state: str) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if self.args.process_index == 0:  # its copy alone: other ranks' TrainerState differs (callbacks, rank flags)
            state["trainer_state"] = trainer_state
        if self.args.save_only_model:
            return state
        try:
            state["optimizer"] = get_optimizer_state_dict(self.model, _torch_optimizer(self.optimizer))
        except (KeyError, ValueError, RuntimeError) as exc:  # e.g. a parameter that is not the model's
            raise CheckpointError(f"cannot save the optimizer by parameter name ({type(exc).__name__}: {exc}): every "
                                  "parameter it holds must be one of the model's") from exc
        if self.lr_scheduler is not None:
            state["scheduler"] = self.lr_scheduler.state_dict()
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        state[_rng_key(self.args)] = rng_state()
        return state

    # resuming --------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        if not is_committed(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_model(resume_from_checkpoint, model if model is not None else self.model)
        self._open_checkpointer().resumed_from(resume_from_checkpoint)  # incremental saves continue from it

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        self._commit(blocking=True)  # the best checkpoint may still be in flight
        if not is_committed(best):
            return super()._load_best_model()
        log.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        self._load_model(best, self.model)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None or not is_committed(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        opened = open_checkpoint(checkpoint)
        saved = _saved_groups(opened)
        optimizer = _torch_optimizer(self.optimizer)
        state: dict[str, Any] = {}
        if "optimizer" in saved:
            state["optimizer"] = _saved_entries_only(get_optimizer_state_dict(self.model, optimizer), opened)
        if "scheduler" in saved and self.lr_scheduler is not None:
            state["scheduler"] = self.lr_scheduler.state_dict()
        if not state:
            return  # saved with save_only_model: Trainer's own resume does the same
        self._load(state, opened)
        if "optimizer" in state:
            set_optimizer_state_dict(self.model, optimizer, state["optimizer"],  # parameters saved stateless stay so
                                     options=StateDictOptions(strict=False))
        if "scheduler" in state:
            self.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, checkpoint) -> None:
        if checkpoint is None or not is_committed(checkpoint):
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        opened = open_checkpoint(checkpoint) if scaler is not None else None
        if opened is not None and "scaler" in _saved_groups(opened):
            state = {"scaler": scaler.state_dict()}
            self._load(state, opened)
            scaler.load_state_dict(state["scaler"])

    def _load_rng_state(self, checkpoint) -> None:
        if checkpoint is None or not is_committed(checkpoint):
            return super()._load_rng_state(checkpoint)
        key = _rng_key(self.args)
        opened = open_checkpoint(checkpoint)
        state: dict[str, Any] = {}
        if key in _saved_groups(opened):
            state[key] = rng_state(cuda="cuda" in _saved_keys(opened, key))
        else:  # e.g. resumed on more ranks than saved; this rank still joins the (collective) load
            log.info("%s holds no RNG state for %s: the resumed run's randomness will differ", checkpoint, key)
        self._load(state, opened)
        if state:
            set_rng_state(state[key])

    def _load_model(self, checkpoint: str, model) -> None:
        template = {"model": model.state_dict()}
        self._load(template, open_checkpoint(checkpoint))
        model.load_state_dict(template["model"])  # the tensors were read in place; this checks the keys

    def _load(self, state: dict[str, Any], checkpoint: OpenCheckpoint) -> None:
        """From the memory tier when it holds this checkpoint's very save (memory_tier=True), else its files."""
        tier = self._open_checkpointer().memory_tier
        if tier is None or not tier.load_saved(state, checkpoint, trusted=False):
            load(state, checkpoint)

    # the checkpointer ------------------------------------------------------------------------
    def _open_checkpointer(self) -> AsyncCheckpointer:
        if self._checkpointer is not None and self._opened_with is not self.checkpoint_config:
            self._close_checkpointer()  # checkpoint_config was set on the instance after construction
        if self._checkpointer is None:
            self._opened_with = self.checkpoint_config
            config = self.checkpoint_config or CheckpointConfig()
            check_door_config(config, "The Trainer", "TrainingArguments.save_total_limit")
            self._checkpointer = AsyncCheckpointer(config=config, memory_folder=self.args.output_dir)
        return self._checkpointer

    def _commit(self, blocking: bool) -> None:
        """Commit the save in flight if its writes are done (or, blocking, once they are); then
        apply save_total_limit. A failed save raises CheckpointError here."""
        if self._checkpointer is None:
            return
        for report in self._checkpointer.finalize(blocking=blocking):
            if self.args.should_save:
                self._rotate(os.path.dirname(report.path))

    def _close_checkpointer(self, quietly: bool = False) -> None:
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is None:
            return
        try:
            for report in checkpointer.close():
                if self.args.should_save:
                    self._rotate(os.path.dirname(report.path))
        except Exception:
            if not quietly:
                raise
            log.exception("a checkpoint save failed while train() was ending with an error")

    def _rotate(self, run_dir: str) -> None:
        """Keep the save_total_limit most recently written complete checkpoints (and the best
        one); remove older ones, and folders that interrupted saves left at steps before the
        newest one."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        in_flight = self._checkpointer.in_flight_dir if self._checkpointer is not None else None
        found = checkpoint_folders(run_dir)
        complete = sorted(((written_at(path), step, path) for step, path in found if is_complete(path)))
        if not complete:
            return
        keep = {path for _, _, path in complete[-limit:]}  # the newest written (rewound runs included)
        best = self.state.best_model_checkpoint
        protected = {os.path.normpath(p) for p in (in_flight, best) if p}
        newest_step = complete[-1][1]
        for step, path in found:
            if path in keep or os.path.normpath(path) in protected:
                continue
            if is_complete(path) or step < newest_step:
                log.info("deleting %s (save_total_limit=%d)", path, limit)
                remove_folder(path)


class AsyncCheckpointTrainer(AsyncCheckpointMixin, transformers.Trainer):
    """`transformers.Trainer` whose checkpoints are written in the background by asyncckpt."""


class _CommitPoller(TrainerCallback):
    """Commits finished saves at the end of every optimizer step (a cheap check while one is in
    flight), so save_total_limit and `.metadata` follow the writes closely. After a preemption
    signal (CheckpointConfig.preemption_signals) it stops training at the end of that step:
    `train()` then returns once the newest staged save is committed (within grace_s)."""

    def __init__(self, trainer: AsyncCheckpointMixin) -> None:
        self._trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self._trainer._commit(blocking=False)
        checkpointer = self._trainer._checkpointer
        if checkpointer is not None and checkpointer.preempted:
            control.should_training_stop = True


def _rng_key(args) -> str:
    return "rng" if args.world_size <= 1 else f"rng_{args.process_index}"


def _restore_trainer_state_file(checkpoint: str, write: bool) -> None:
    """Trainer reads trainer_state.json; the committed checkpoint's own copy is the truth (an
    interrupted re-save of this step may have replaced the file). Every rank reads (a collective
    load); the rank that saves (`write`) rewrites the file if it differs."""
    opened = open_checkpoint(checkpoint)
    if "trainer_state" not in _saved_groups(opened):
        return
    state = {"trainer_state": ""}
    load(state, opened)
    if not write:
        return
    path = os.path.join(checkpoint, TRAINER_STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == state["trainer_state"]:
                return
    except FileNotFoundError:
        pass
    storage_for(checkpoint).write_atomic(path, state["trainer_state"].encode())


def _saved_keys(checkpoint: OpenCheckpoint, group: str, depth: Optional[int] = 1) -> set[str]:
    """The keys under `group.` in a checkpoint's `.metadata`: their first level, or whole (depth=None)."""
    prefix = f"{group}."
    keys = [k[len(prefix):] for k in checkpoint.metadata.state_dict_metadata if k.startswith(prefix)]
    return set(keys) if depth is None else {k.split(".", 1)[0] for k in keys}


def _saved_groups(checkpoint: OpenCheckpoint) -> set[str]:
    return {k.split(".", 1)[0] for k in checkpoint.metadata.state_dict_metadata}


def _saved_entries_only(optimizer_state: dict[str, Any], checkpoint: OpenCheckpoint) -> dict[str, Any]:
    """The optimizer template minus the parameters the checkpoint holds no state for (one that
    never had a gradient, e.g. an unused head): building the template gives every parameter
    state, and DCP would refuse the missing keys; loading leaves those parameters stateless, as
    in the saved run."""
    saved = {key.rsplit(".", 1)[0] for key in _saved_keys(checkpoint, "optimizer.state", depth=None)}  # minus the moment's name
    optimizer_state["state"] = {fqn: moments for fqn, moments in optimizer_state["state"].items() if fqn in saved}
    return optimizer_state


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps it


def _record_stateful_callbacks(trainer) -> None:
    """Trainer's own step before writing trainer state: callbacks' and TrainerControl's state."""
    from transformers.trainer_callback import ExportableState

    for callback in trainer.callback_handler.callbacks + [trainer.control]:
        if not isinstance(callback, ExportableState):
            continue
        name = type(callback).__name__
        if isinstance(trainer.state.stateful_callbacks.get(name), list):
            trainer.state.stateful_callbacks[name].append(callback.state())
        else:
            trainer.state.stateful_callbacks[name] = callback.state()


def _refuse_unsupported(trainer) -> None:
    """Set-ups whose checkpoints this integration does not write: a clear error at construction."""
    why = None
    if getattr(trainer, "is_deepspeed_enabled", False):
        why = "DeepSpeed saves its own engine state"
    elif getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False):
        why = "FSDP checkpoints are not supported yet"
    if why is not None:
        raise ValueError(f"{type(trainer).__name__}: {why}; use transformers.Trainer for this run")
    if trainer.args.push_to_hub:
        log.warning("%s: checkpoint folders are DCP checkpoints, not save_pretrained files, so they are not "
                    "pushed during training; trainer.push_to_hub() after train() pushes the model (or export "
                    "a checkpoint with `%s export CKPT OUT --hf`)", type(trainer).__name__, cli_command())
