"""Export the model of a DCP checkpoint (ours, or any stock one) as a Hugging Face
`save_pretrained`-style folder: `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards
with `model.safetensors.index.json`, plus `config.json` and tokenizer files copied from a folder
you name (or the checkpoint's own, as in a Trainer `checkpoint-N`). `from_pretrained(folder)`
loads it. The model is found where the layouts asyncckpt writes keep it (MODEL_PREFIXES).

It streams: one shard's tensors are read (with `asyncckpt.load`, checksums checked, resharded
whole), written and freed before the next, so memory peaks at about one shard, not the model.
The folder appears complete or not at all: it is written under a temporary name beside the
destination and renamed into place at the end. Bad arguments raise ValueError, before anything is
written; a checkpoint that cannot be read or exported raises CheckpointError.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointError
from ..formats import SAFETENSORS_DTYPES, raw_bytes
from ..loading.load import load
from ..loading.opened import OpenCheckpoint, as_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json")
# where the model's state_dict sits in the layouts asyncckpt writes: the Transformers door's
# checkpoint-N (and any {"model": model.state_dict(), ...}), examples/train_loop.py's TrainState
# under "train", the Lightning plugin's checkpoint dict
MODEL_PREFIXES = ("model.", "train.model.", "state_dict.")
SHOWN_CANDIDATES = 12
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class ExportedTensor:
    key: str  # its name in the checkpoint
    name: str  # its name in the folder: the model's state_dict name
    shape: tuple[int, ...]
    stored_dtype: torch.dtype
    dtype: torch.dtype  # as written (--dtype casts floating-point tensors)

    @property
    def prefix(self) -> str:
        """The prefix it was found under: `key` less `name`."""
        return self.key[: len(self.key) - len(self.name)]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def parse_size(text: str) -> int:
    """Bytes in a Hugging Face size string: "5GB" = 5 * 10**9, "100KB" = 100,000, "2GiB" = 2 * 2**30."""
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB, 100KB, 2GiB)")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if size <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return size


def find_model_prefix(checkpoint: str, tensor_keys: Iterable[str]) -> str:
    """The one prefix of MODEL_PREFIXES the checkpoint has tensors under; a ValueError listing
    where its tensors are when there is none, or more than one."""
    keys = list(tensor_keys)
    found = [prefix for prefix in MODEL_PREFIXES if any(k.startswith(prefix) for k in keys)]
    if len(found) == 1:
        return found[0]
    counts = {prefix: sum(k.startswith(prefix) for k in keys) for prefix in found or _groups(keys)}
    shown = ", ".join(f"{prefix} ({n} tensors)" for prefix, n in list(counts.items())[:SHOWN_CANDIDATES])
    more = f", ... ({len(counts) - SHOWN_CANDIDATES} more)" if len(counts) > SHOWN_CANDIDATES else ""
    why = "more than one model" if found else f"no model where asyncckpt keeps one ({', '.join(MODEL_PREFIXES)})"
    raise ValueError(f"{checkpoint}: {why}; name the model's prefix with --prefix, one of: {shown or 'none'}{more}")


def _groups(keys: list[str]) -> list[str]:
    """Every prefix of one or two names that holds tensors ("train.", "train.model."), sorted."""
    groups = set()
    for key in keys:
        parts = key.split(".")
        groups.update(".".join(parts[:depth]) + "." for depth in (1, 2) if depth < len(parts))
    return sorted(groups)


def model_tensors(
    checkpoint: str | OpenCheckpoint, prefix: Optional[str], dtype: Optional[torch.dtype], trusted: bool = False
) -> list[ExportedTensor]:
    """The checkpoint's tensors under `prefix` (None: find_model_prefix), named without it, in the
    checkpoint's order."""
    opened = as_open(checkpoint, trusted=trusted)
    checkpoint, metadata = opened.path, opened.metadata
    tensors = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    if prefix is None:
        prefix = find_model_prefix(checkpoint, tensors)
    chosen = [ExportedTensor(k, k[len(prefix):], tuple(m.size), m.properties.dtype,
                             dtype if dtype is not None and m.properties.dtype.is_floating_point else m.properties.dtype)
              for k, m in tensors.items() if k.startswith(prefix) and len(k) > len(prefix)]
    if not chosen:
        raise ValueError(f"{checkpoint}: no tensors under {prefix!r}")
    for tensor in chosen:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{tensor.key}: dtype {tensor.dtype} cannot be stored in safetensors format")
    return chosen


def plan_shards(tensors: list[ExportedTensor], max_shard_bytes: int) -> list[list[ExportedTensor]]:
    """Consecutive tensors up to `max_shard_bytes` a shard (a bigger tensor gets one of its own),
    as `save_pretrained` cuts them."""
    shards: list[list[ExportedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def export_hf(
    checkpoint: str | OpenCheckpoint,
    out_dir: str,
    *,
    max_shard_size: str = "5GB",
    dtype: Optional[str] = None,
    config_from: Optional[str] = None,
    prefix: Optional[str] = None,
    trusted: bool = False,
    progress: Optional[Callable[[int, str], None]] = None,
) -> list[str]:
    """Write the folder; returns the names of the files in it. `progress(bytes, label)` is called
    as tensors are written. `config_from` None: the checkpoint's own folder, where it holds a
    config.json. Raises ValueError (bad arguments) or CheckpointError, naming the problem,
    before writing anything where it can, and never leaves a partial folder at `out_dir`."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"{out_dir}: exists and is not an empty directory; export writes a new folder")
    opened = as_open(checkpoint, trusted=trusted)  # read once for the tensors and every shard's load
    checkpoint = opened.path
    copied = _config_files(config_from, checkpoint)
    tensors = model_tensors(opened, prefix, DTYPES.get(dtype))
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise CheckpointError(f"{checkpoint}: two tensors would get the same name in the folder")
    shards = plan_shards(tensors, max_bytes)
    staging = _make_staging_dir(out_dir)
    try:
        files = [SINGLE_FILE] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
        ]
        for file, shard in zip(files, shards):
            _write_shard(opened, os.path.join(staging, file), shard, trusted, progress)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                     "weight_map": {t.name: file for file, shard in zip(files, shards) for t in shard}}
            with open(os.path.join(staging, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
            files.append(INDEX_FILE)
        for source in copied:
            shutil.copyfile(source, os.path.join(staging, os.path.basename(source)))
            files.append(os.path.basename(source))
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return files


def _config_files(config_from: Optional[str], checkpoint: str) -> list[str]:
    """The files to copy: from `config_from`, which must hold a config.json; without it, from the
    checkpoint's own folder if it holds one (AsyncCheckpointTrainer writes it into checkpoint-N)."""
    if config_from is None:
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            return []
        config_from = checkpoint
    if not os.path.isfile(os.path.join(config_from, "config.json")):
        raise ValueError(f"{config_from}: no config.json to copy (--config-from names the model's folder)")
    return [os.path.join(config_from, n) for n in COPIED_FILES if os.path.isfile(os.path.join(config_from, n))]


def _make_staging_dir(out_dir: str) -> str:
    """A new, empty directory beside `out_dir`, to be renamed to it; made with os.mkdir, so the
    folder gets the user's umask (tempfile.mkdtemp's would stay 0700 after the rename)."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        while True:
            staging = os.path.join(parent, f".{os.path.basename(out_dir)}.export-{secrets.token_hex(4)}")
            try:
                os.mkdir(staging)
                return staging
            except FileExistsError:
                continue
    except OSError as exc:
        raise ValueError(f"{out_dir}: cannot create the folder: {exc}") from None


def _write_shard(checkpoint: OpenCheckpoint, path: str, shard: list[ExportedTensor], trusted: bool,
                 progress: Optional[Callable[[int, str], None]]) -> None:
    """Read the shard's tensors (one load: one pass over the checkpoint's files), then write a
    safetensors file: header, then each tensor's bytes in order."""
    state = {t.key: torch.empty(t.shape, dtype=t.stored_dtype) for t in shard}
    load(state, checkpoint, trusted=trusted, no_dist=True)
    header, offset = {}, 0
    for t in shard:
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    header["__metadata__"] = {"format": "pt"}
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body)
        for t in shard:
            tensor = state.pop(t.key).to(t.dtype).contiguous()
            if tensor.nbytes:
                f.write(raw_bytes(tensor))
            if progress is not None:
                progress(t.nbytes, t.name)
            del tensor
        f.flush()
        os.fsync(f.fileno())
