"""Incremental saves: which tensors of a save a committed base checkpoint already holds, byte for
byte, and which of its files to link into the new checkpoint instead of writing them again."""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import time

from asyncckpt.formats import DCP_SHARDING_INFO
from asyncckpt.layout import SAFETENSORS, TORCH_SAVE, data_file_name, in_folder, is_safetensors_file
from asyncckpt.protocol import IncrementalBase, ItemSpec, ItemWritten
from asyncckpt.storage import Storage

from .parts import WriteError, describe

log = logging.getLogger("asyncckpt.worker")


def reusable(
    bases: tuple[IncrementalBase, ...], items: tuple[ItemSpec, ...], digests: dict[int, bytes], storage: Storage,
    directory: str, fmt: str, rank: int, file_tag: str, committed_here: bool, deadline: float, folder: str = "",
) -> tuple[set[int], dict[int, ItemWritten], int]:
    """The positions of the tensors stored unchanged in a base (same name, chunk, digest and
    format), those of them reused, with where they now lie, and how many files were linked in.

    Bases are tried in order, each for the tensors the ones before it did not provide. A base
    file is reused only while at least half its bytes are still wanted (otherwise its unchanged
    tensors are written again: stale bytes never pile up, and what a checkpoint keeps on disk stays
    under twice its size), and a safetensors file only when every tensor its header lists is
    reused (readers that index the headers, like DCP's HuggingFaceStorageReader, must never meet an
    old value of a changed tensor). A re-save of a base's own directory keeps its files where they
    are (the replaced save's removal spares what the new `.metadata` names); a file of another
    directory is linked in under a name of this save's own (`__{rank}_{n}{file_tag}` in its data `folder`, n from 0;
    the new files' numbers follow), so it never meets a file of a checkpoint committed here. A
    file that cannot be linked (its base was deleted meanwhile, another filesystem) only means its
    tensors are written again."""
    if not bases or not storage.supports_links:
        return set(), {}, 0
    unchanged: set[int] = set()
    reused: dict[int, ItemWritten] = {}
    links = 0
    for base in bases:
        stored = {item_key(w): w for w in base.items
                  if w.digest is not None and is_safetensors_file(w.relative_path) == (fmt == SAFETENSORS)}
        same = {pos: stored[item_key(items[pos])] for pos, digest in digests.items()
                if pos not in reused and item_key(items[pos]) in stored and stored[item_key(items[pos])].digest == digest}
        unchanged.update(same)
        wanted: dict[str, list[int]] = {}
        for pos, w in same.items():
            wanted.setdefault(w.relative_path, []).append(pos)
        for name, positions in sorted(wanted.items()):
            if time.monotonic() > deadline:
                raise WriteError(storage.join(directory, name), "linking the unchanged files did not finish in time")
            source = storage.join(base.checkpoint_dir, name)
            try:
                if 2 * sum(same[pos].length for pos in positions) < storage.size(source):
                    log.debug("incremental save: %s is mostly stale; writing its %d unchanged tensors again",
                              source, len(positions))
                    continue
                if is_safetensors_file(name) and _header_keys(storage, source) != {item_key(same[p]) for p in positions}:
                    continue
                here = name
                if base.checkpoint_dir != directory:
                    fmt_here = SAFETENSORS if is_safetensors_file(name) else TORCH_SAVE
                    here = in_folder(folder, data_file_name(rank, links, fmt_here, file_tag))
                    target = storage.join(directory, here)
                    if committed_here and storage.exists(target):  # never replace a committed checkpoint's file
                        raise WriteError(target, "the save's file name is taken (a tag collision); the next save picks another")
                    storage.link(source, target)
                    links += 1
            except (OSError, ValueError, KeyError, TypeError) as exc:  # (a damaged header among them)
                log.info("incremental save: cannot reuse %s from %s (%s); writing its tensors again",
                         name, base.checkpoint_dir, describe(exc))
                continue
            for pos in positions:
                reused[pos] = dataclasses.replace(same[pos], relative_path=here)
    return unchanged, reused, links


def _header_keys(storage: Storage, path: str) -> set[tuple]:
    """(name, chunk offset) of every tensor a safetensors data file of ours holds."""
    (length,) = struct.unpack("<Q", storage.read_bytes(path, 0, 8))
    if length > 100 << 20:
        raise ValueError(f"{path}: a safetensors header of {length} bytes")
    header = json.loads(storage.read_bytes(path, 8, length))
    sharding = json.loads(header.get("__metadata__", {}).get(DCP_SHARDING_INFO, "{}"))
    keys = set()
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = sharding.get(name, {}).get("saved_offsets", [0] * len(entry["shape"]))
        keys.add((name.split("@[", 1)[0], tuple(offsets)))
    return keys


def item_key(item) -> tuple:
    """What identifies an item across saves: its name and chunk offset (ItemSpec or ItemWritten)."""
    index = item.index
    return index.fqn, tuple(index.offset) if index.offset is not None else None
