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
import logging
import time
from typing import Callable, Optional

from asyncckpt.formats import SafetensorsEntry, safetensors_header, tensor_digest
from asyncckpt.layout import METADATA_FILE, SAFETENSORS
from asyncckpt.protocol import (
    TENSOR, WORKER_DEADLINE_SHARE, ItemSpec, ItemWritten, SaveRequest, WriteDone, WriteOptions, WriteStaged,
)
from asyncckpt.storage import Storage, storage_for

from .buckets import Bucket, Round, make_buckets, plan_rounds
from .cache import CachedStructure
from .reuse import item_key, reusable
from .staging import StagingPool
from .parts import OpenFile, SaveData, WriteError, describe, write_streamed
from .writers import Writers

log = logging.getLogger("asyncckpt.worker")


def run_save(
    request: SaveRequest,
    entry: CachedStructure,
    pool: StagingPool,
    writers: Writers,
    rank: int,
    on_staged: Callable[[], None],
) -> WriteDone:
    """Stage and write one save; call `on_staged()` once every byte is copied. A memory-only
    save (the memory tier) is staged, laid out as a written one would be, and not written."""
    options = request.options
    if request.memory is not None and request.memory.memory_only:
        return _stage_only(request, entry, pool, rank, on_staged)
    if options.incremental:
        _make_data_folder(request.checkpoint_dir, request.data_folder, options)
        return _run_incremental(request, entry, pool, writers, rank, on_staged)
    object_sizes = {pos: len(data) for pos, data in request.byte_items.items()}
    buckets = make_buckets(
        entry.items, object_sizes, rank, options.io_workers, options.separation_hint, options.format, request.file_tag,
        folder=request.data_folder,
    )
    rounds = plan_rounds(entry.items, buckets, options.staging_budget_bytes)
    views = _views(entry, pool, rounds, options.staging_budget_bytes)
    data = SaveData(entry.items, views, request.byte_items, options, pool.share())
    # The files are created right before the first write: with one round (no staging budget),
    # after Staged, so creating them (on an object store: the client's first connection, an
    # upload started per file) is never on the trainer's blocked time
    files: list[OpenFile] = []
    file_of: dict[int, OpenFile] = {}

    def open_once() -> None:
        if files or not buckets:
            return
        _make_data_folder(request.checkpoint_dir, request.data_folder, options)
        files.extend(open_files(storage_for(request.checkpoint_dir), request.checkpoint_dir, buckets, entry.items,
                                options))
        file_of.update((pos, file) for file in files for pos in file.bucket.positions)

    written, write_s = [], 0.0
    bound = options.timeout_s * WORKER_DEADLINE_SHARE
    deadline = time.monotonic() + bound  # rounds before Staged count against the staging bound
    try:
        for n, round_ in enumerate(rounds):
            last = n == len(rounds) - 1
            if round_.streamed:
                open_once()
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
                if not last:
                    open_once()
                    parts = [(f, p) for f, p in _parts(files, file_of, round_) if p]
            if last:
                on_staged()
                deadline = time.monotonic() + bound  # the writes get their own bound, as in the trainer
                open_once()
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


def write_staged(
    request: WriteStaged, entry: CachedStructure, objects: dict[int, bytes], pool: StagingPool, writers: Writers,
    rank: int,
) -> WriteDone:
    """Write the copy a memory-only save staged (`entry.views`, still in the slab, and its
    pickled `objects`) into `request.checkpoint_dir`, as that save would have been written (a
    preempted close persists it). Nothing is copied; the copy in the memory tier stays complete."""
    options = request.options
    _make_data_folder(request.checkpoint_dir, request.data_folder, options)
    object_sizes = {pos: len(data) for pos, data in objects.items()}
    buckets = make_buckets(entry.items, object_sizes, rank, options.io_workers, options.separation_hint,
                           options.format, request.file_tag, folder=request.data_folder)
    data = SaveData(entry.items, entry.views, objects, options, pool.share())
    files = open_files(storage_for(request.checkpoint_dir), request.checkpoint_dir, buckets, entry.items, options)
    started = time.perf_counter()
    try:
        parts = [(file, list(file.bucket.positions)) for file in files]
        written = writers.run(data, parts, final=True, deadline=time.monotonic() + options.timeout_s * WORKER_DEADLINE_SHARE)
    except BaseException:
        abort(files)
        raise
    return WriteDone(save_id=request.save_id, items=tuple(written), bytes_written=sum(item.length for item in written),
                     write_s=time.perf_counter() - started)


def _make_data_folder(checkpoint_dir: str, data_folder: str, options: WriteOptions) -> None:
    """Prefix spreading: this rank's files go in a folder of the step directory (layout.py)."""
    if not data_folder:
        return
    folder = storage_for(checkpoint_dir).join(checkpoint_dir, data_folder)
    try:
        storage_for(folder).make_dir(folder, options.fsync)
    except OSError as exc:
        raise WriteError(folder, describe(exc)) from exc


def _stage_only(
    request: SaveRequest, entry: CachedStructure, pool: StagingPool, rank: int, on_staged: Callable[[], None]
) -> WriteDone:
    options = request.options
    object_sizes = {pos: len(data) for pos, data in request.byte_items.items()}
    buckets = make_buckets(entry.items, object_sizes, rank, options.io_workers, options.separation_hint, options.format)
    views = _views(entry, pool, plan_rounds(entry.items, buckets, None), None)
    positions = [pos for pos, view in enumerate(views) if view is not None]
    pool.copy_in([entry.sources[p] for p in positions], [views[p] for p in positions], options.staging_threads)
    on_staged()
    return WriteDone(save_id=request.save_id, items=(), bytes_written=0, write_s=0.0)


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
    committed_here = storage.exists(storage.join(request.checkpoint_dir, METADATA_FILE))
    unchanged, reused, links = reusable(
        request.bases, entry.items, digests, storage, request.checkpoint_dir, options.format, rank, request.file_tag,
        committed_here, deadline, request.data_folder,
    )
    to_write = [pos for pos in everything.positions if pos not in reused]
    object_sizes = {pos: len(b) for pos, b in request.byte_items.items()}
    # unchanged tensors written again (their old file was mostly stale) get files of their own,
    # apart from the changed ones, so the next save can reuse those files whole
    settled = [pos for pos in to_write if pos in unchanged]
    buckets = make_buckets(entry.items, object_sizes, rank, options.io_workers, options.separation_hint,
                           options.format, request.file_tag, positions=settled, first=links, folder=request.data_folder)
    buckets += make_buckets(entry.items, object_sizes, rank, options.io_workers, options.separation_hint,
                            options.format, request.file_tag, positions=[p for p in to_write if p not in unchanged],
                            first=links + len(buckets), folder=request.data_folder)
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
    position = {item_key(spec): pos for pos, spec in enumerate(entry.items)}
    items = [dataclasses.replace(w, digest=digests.get(position[item_key(w)])) for w in written]
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
