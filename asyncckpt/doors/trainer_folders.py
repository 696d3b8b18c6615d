"""The `checkpoint-N` folders of a Transformers Trainer's output directory: which are complete
(committed by asyncckpt, or a stock Trainer checkpoint), which to resume from, and deleting one
so that a crash mid-delete never leaves a broken checkpoint that looks complete."""

from __future__ import annotations

import logging
import os
import re
from typing import Optional

from ..errors import CheckpointError
from ..layout import METADATA_FILE
from ..storage import storage_for

log = logging.getLogger("asyncckpt")

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR (this module does not import Transformers)
STOCK_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX}-(\d+)$")


def is_committed(path: Optional[str]) -> bool:
    """An asyncckpt (or any DCP) checkpoint whose commit happened."""
    return bool(path) and os.path.isfile(os.path.join(path, METADATA_FILE))


def is_complete(path: str) -> bool:
    """Committed, or a stock Trainer checkpoint (its model weights are there)."""
    return is_committed(path) or any(os.path.isfile(os.path.join(path, name)) for name in STOCK_WEIGHT_FILES)


def written_at(path: str) -> float:
    """When a checkpoint was committed (its `.metadata`), or for a stock one, its folder's time."""
    metadata = os.path.join(path, METADATA_FILE)
    return os.path.getmtime(metadata if os.path.isfile(metadata) else path)


def checkpoint_folders(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint-N folder in `run_dir`, oldest step first."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(run_dir, n)) for n in names if (m := _CHECKPOINT_NAME.match(n))]
    return sorted((step, path) for step, path in found if os.path.isdir(path) and not os.path.islink(path))


def resume_target(output_dir: str, requested) -> Optional[str]:
    """The folder to resume from: for True the newest complete checkpoint in output_dir; for a
    folder an interrupted save left (e.g. what `get_last_checkpoint` returns after a crash), the
    newest complete one at or before its step."""
    if requested is None or requested is False:
        return None
    if requested is True:
        complete = [path for _, path in checkpoint_folders(output_dir) if is_complete(path)]
        if not complete:
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
        return complete[-1]
    path = os.fspath(requested)
    if not os.path.isdir(path) or is_complete(path):
        return path  # Trainer reports a missing folder in its own words
    match = _CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(path)))
    parent = os.path.dirname(os.path.normpath(path))
    earlier = [p for step, p in checkpoint_folders(parent)
               if is_complete(p) and match is not None and step <= int(match.group(1))]
    if not earlier:
        raise CheckpointError(f"{path!r} is a save that never committed (no {METADATA_FILE}: the run stopped "
                              "while writing it), and no committed checkpoint precedes it")
    log.warning("%s is a save that never committed (the run stopped while writing it); resuming from %s, "
                "the newest committed checkpoint before it", path, earlier[-1])
    return earlier[-1]


def remove_folder(path: str) -> None:
    """Un-commit first: a crash mid-delete leaves a torn folder, never a broken checkpoint."""
    storage = storage_for(path)
    if storage.exists(os.path.join(path, METADATA_FILE)):
        storage.remove_file(os.path.join(path, METADATA_FILE))
    storage.remove_tree(path)
