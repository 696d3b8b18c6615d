"""One save inside the worker: open its data files, then stage and write them round by round.

Without a staging budget there is one round: stage everything, send `Staged`, write. With
`staging_budget_bytes` the items are cut into rounds whose staged bytes fit the budget, all staged
through one budget-sized slab. The trainer's tensors must not change until every byte is copied,
so every round but the last is staged *and written* before `Staged`; the last is staged, then
`Staged` goes out, then it is written. Memory stays at the budget; the trainer waits longer (eager
mode) for that. A tensor larger than the budget is copied through the slab in pieces while it is
written, before `Staged` too. Files are appended to round after round, so they come out the same
as without a budget.

An incremental save (`options.incremental`, never with a budget) stages everything first, then
hashes each tensor: one whose digest equals a base's is not written, the base file holding it is
hard-linked into the new directory instead, and only the others go into new files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import time
from typing import Callable, Optional

from asyncckpt.formats import (
    DCP_SHARDING_INFO, SAFETENSORS, TORCH_SAVE, SafetensorsEntry, data_file_name, is_safetensors_file,
    safetensors_header, tensor_digest,
)
from asyncckpt.protocol import (
    TENSOR, WORKER_DEADLINE_SHARE, IncrementalBase, ItemSpec, ItemWritten, SaveRequest, WriteDone, WriteOptions,
)
from asyncckpt.storage import Storage, storage_for

from asyncckpt_worker.buckets import Bucket, Round, make_buckets, plan_rounds
from asyncckpt_worker.cache import CachedStructure
from asyncckpt_worker.staging import StagingPool
from asyncckpt_worker.writers import OpenFile, SaveData, WriteError, Writers, describe, write_streamed

log = logging.getLogger("asyncckpt.worker")
COMMIT_FILE = ".metadata"  # safe_reader.METADATA_FILE (the worker does not import the trainer side)


def run_save(
    request: SaveRequest,
    entry: CachedStructure,
    pool: StagingPool,
    writers: Writers,
    rank: int,
    on_staged: Callable[[], None],
) -> WriteDone:
    """Stage and write one save; call `on_staged()` once every byte is copied."""
    options = request.options
    if options.incremental:
        return _run_incremental(request, entry, pool, writers, rank, on_staged)
    object_sizes = {pos: len(data) for pos, data in request.byte_items.items()}
    buckets = make_buckets(
        entry.items, object_sizes, rank, options.io_workers, options.separation_hint, options.format, request.file_tag
    )
    rounds = plan_rounds(entry.items, buckets, options.staging_budget_bytes)
    views = _views(entry, pool, rounds, options.staging_budget_bytes)
    data = SaveData(entry.items, views, request.byte_items, options, pool.share())
    files = open_files(storage_for(request.checkpoint_dir), request.checkpoint_dir, buckets, entry.items, options)
    file_of = {pos: file for file in files for pos in file.bucket.positions}
    written, write_s = [], 0.0
    bound = options.timeout_s * WORKER_DEADLINE_SHARE
    deadline = time.monotonic() + bound  # rounds before Staged count against the staging bound
    try:
        for n, round_ in enumerate(rounds):
            last = n == len(rounds) - 1
            if round_.streamed:
                pos = round_.positions[0]
                started = time.perf_counter()
                written += write_streamed(data, file_of[pos], pos, pool.pieces(entry.sources[pos]))
                write_s += time.perf_counter() - started
                parts = []
            else:
                pool.copy_in(
                    [entry.sources[p] for p in round_.positions],
                    [data.staged[p] for p in round_.positions],
                    options.staging_threads,
                )
                parts = [(f, p) for f, p in _parts(files, file_of, round_) if p]
            if last:
                on_staged()
                deadline = time.monotonic() + bound  # the writes get their own bound, as in the trainer
                parts = _parts(files, file_of, Round([]) if round_.streamed else round_)
            started = time.perf_counter()
            if parts:
                written += writers.run(data, parts, final=last, deadline=deadline)
            write_s += time.perf_counter() - started
    except BaseException:
        abort(files)
        raise
    return WriteDone(
        save_id=request.save_id,
        items=tuple(written),
        bytes_written=sum(item.length for item in written),
        write_s=write_s,
    )


def _run_incremental(
    request: SaveRequest,
    entry: CachedStructure,
    pool: StagingPool,
    writers: Writers,
    rank: int,
    on_staged: Callable[[], None],
) -> WriteDone:
    """One round: stage everything, say Staged, hash the staged tensors, link the base files
    that hold unchanged ones, and write the rest (every object, every changed tensor) into new
    files, named with the save's own tag so they never meet a linked name."""
    options = request.options
    storage = storage_for(request.checkpoint_dir)
    everything = Round(list(range(len(entry.items))))
    views = _views(entry, pool, [everything], None)
    data = SaveData(entry.items, views, request.byte_items, options, pool.share())
    bound = options.timeout_s * WORKER_DEADLINE_SHARE
    pool.copy_in([entry.sources[p] for p in everything.positions], [views[p] for p in everything.positions],
                 options.staging_threads)
    on_staged()
    deadline = time.monotonic() + bound
    digests = {pos: tensor_digest(views[pos]) for pos, spec in enumerate(entry.items) if spec.kind == TENSOR}
    committed_here = storage.exists(storage.join(request.checkpoint_dir, COMMIT_FILE))
    unchanged, reused, links = _reusable(
        request.bases, entry.items, digests, storage, request.checkpoint_dir, options.format, rank, request.file_tag,
        committed_here, deadline,
    )
    to_write = [pos for pos in everything.positions if pos not in reused]
    object_sizes = {pos: len(b) for pos, b in request.byte_items.items()}
    # unchanged tensors written again (their old file was mostly stale) get files of their own,
    # apart from the changed ones, so the next save can reuse those files whole
    settled = [pos for pos in to_write if pos in unchanged]
    buckets = make_buckets(entry.items, object_sizes, rank, options.io_workers, options.separation_hint,
                           options.format, request.file_tag, positions=settled, first=links)
    buckets += make_buckets(entry.items, object_sizes, rank, options.io_workers, options.separation_hint,
                            options.format, request.file_tag, positions=[p for p in to_write if p not in unchanged],
                            first=links + len(buckets))
    # a fresh 32-bit tag meeting the name of a file a committed checkpoint uses (one reused here, or
    # one of the checkpoint this save replaces): fail rather than write over it. A torn save's
    # leftovers are fair game.
    taken = {w.relative_path for w in reused.values()}
    for bucket in buckets:
        path = storage.join(request.checkpoint_dir, bucket.file_name)
        if bucket.file_name in taken or (committed_here and storage.exists(path)):
            raise WriteError(path, "the save's file name is taken (a tag collision); the next save picks another")
    files = open_files(storage, request.checkpoint_dir, buckets, entry.items, options)
    started = time.perf_counter()
    try:
        parts = [(file, list(file.bucket.positions)) for file in files]  # bucket order: a safetensors header's
        written = writers.run(data, parts, final=True, deadline=deadline) if files else []
    except BaseException:
        abort(files)
        raise
    position = {_key(spec): pos for pos, spec in enumerate(entry.items)}
    items = [dataclasses.replace(w, digest=digests.get(position[_key(w)])) for w in written]
    items += [ItemWritten(entry.items[pos].index, old.relative_path, old.offset, old.length, old.crc32, old.digest)
              for pos, old in reused.items()]
    linked = sum(old.length for old in reused.values())
    log.debug("incremental save %s: %d items written, %d reused (%d bytes linked)", request.checkpoint_dir,
              len(written), len(reused), linked)
    return WriteDone(
        save_id=request.save_id,
        items=tuple(items),
        bytes_written=sum(item.length for item in items),
        write_s=time.perf_counter() - started,
        bytes_linked=linked,
    )


def _reusable(
    bases: tuple[IncrementalBase, ...], items: tuple[ItemSpec, ...], digests: dict[int, bytes], storage: Storage,
    directory: str, fmt: str, rank: int, file_tag: str, committed_here: bool, deadline: float,
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
    directory is linked in under a name of this save's own (`__{rank}_{n}{file_tag}`, n from 0;
    the new files' numbers follow), so it never meets a file of a checkpoint committed here. A
    file that cannot be linked (its base was deleted meanwhile, another filesystem) only means its
    tensors are written again."""
    if not bases or not storage.supports_links:
        return set(), {}, 0
    unchanged: set[int] = set()
    reused: dict[int, ItemWritten] = {}
    links = 0
    for base in bases:
        stored = {_key(w): w for w in base.items
                  if w.digest is not None and is_safetensors_file(w.relative_path) == (fmt == SAFETENSORS)}
        same = {pos: stored[_key(items[pos])] for pos, digest in digests.items()
                if pos not in reused and _key(items[pos]) in stored and stored[_key(items[pos])].digest == digest}
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
                if is_safetensors_file(name) and _header_keys(storage, source) != {_key(same[p]) for p in positions}:
                    continue
                here = name
                if base.checkpoint_dir != directory:
                    here = data_file_name(rank, links, SAFETENSORS if is_safetensors_file(name) else TORCH_SAVE, file_tag)
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


def _key(item) -> tuple:
    """What identifies an item across saves: its name and chunk offset (ItemSpec or ItemWritten)."""
    index = item.index
    return index.fqn, tuple(index.offset) if index.offset is not None else None


def open_files(
    storage: Storage, directory: str, buckets: list[Bucket], items: tuple[ItemSpec, ...], options: WriteOptions
) -> list[OpenFile]:
    """Create every data file of the save (a safetensors file starts with its header)."""
    files: list[OpenFile] = []
    try:
        for bucket in buckets:
            path = storage.join(directory, bucket.file_name)
            try:
                file = OpenFile(bucket, path, storage.create(path, options.fsync, options.timeout_s * WORKER_DEADLINE_SHARE))
                files.append(file)
                if bucket.format == SAFETENSORS:
                    file.offset = file.handle.write(_safetensors_header(bucket, items))
            except (OSError, ValueError) as exc:
                raise WriteError(path, describe(exc)) from exc
    except BaseException:
        abort(files)
        raise
    return files


def abort(files: list[OpenFile]) -> None:
    """Remove every file not yet committed (a failed save leaves no partial data file)."""
    for file in files:
        if not file.committed:
            file.handle.abort()


def _safetensors_header(bucket: Bucket, items: tuple[ItemSpec, ...]) -> bytes:
    entries = []
    for pos in bucket.positions:
        spec = items[pos]
        offsets = tuple(spec.index.offset) if spec.index.offset is not None else None
        entries.append(SafetensorsEntry(spec.index.fqn, spec.dtype, spec.shape, offsets))
    return safetensors_header(entries)


def _parts(files: list[OpenFile], file_of: dict[int, OpenFile], round_: Round) -> list[tuple[OpenFile, list[int]]]:
    """The round's items per file, in file order; every file appears (the last round commits all)."""
    per_file: dict[int, list[int]] = {id(f): [] for f in files}
    for pos in round_.positions:
        per_file[id(file_of[pos])].append(pos)
    return [(f, per_file[id(f)]) for f in files]


def _views(entry: CachedStructure, pool: StagingPool, rounds: list[Round], budget: Optional[int]) -> list:
    """Staging views for every item, laid out round by round; cached while nothing changed."""
    groups = tuple(tuple(r.positions) for r in rounds if not r.streamed)
    reserve = budget if budget is not None and any(r.streamed for r in rounds) else 0
    key = (groups, reserve)
    if entry.layout_key != key or entry.views_generation != pool.generation or not entry.views:
        entry.views = pool.layout(entry.items, groups, reserve, budget)
        entry.views_generation = pool.generation
        entry.layout_key = key
    return entry.views
