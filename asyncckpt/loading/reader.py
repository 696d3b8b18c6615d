"""The parallel reader behind `SafeReader.read_data`: DCP's planner says what to read, this
module reads it fast, from local files or object stores (byte_sources.py says how each is read).

Every item of the plan becomes segments of its file: byte ranges each with a destination. A
tensor whose stored layout matches its target (whole chunk, same dtype, both contiguous, target
in CPU memory) is read straight into the target's memory; its archive framing (torch_save) goes
to small scratch buffers. Any other tensor is read a slab of rows at a time into its thread's
reused buffer and copied once into the target (resharding, dtype or layout changes, GPU
targets). Segments are sorted by offset and coalesced into pieces of up to the source's
`piece_bytes`, one task each on a pool of threads, read `step_bytes` at a time (locally by
`os.preadv` through the thread's own descriptor; on an object store, one ranged GET per piece);
each step's CRC32C is computed right after it is read, by the thread that read it (the GIL
released: formats.crc32c), and the parts of one item are combined and checked once all reads ended.

"Through a buffer" means through a slot of the ring (ring.py): a slab is read into a free slot
and checksummed there, then its copy into the target is queued (a side stream for a CUDA target,
pinned slots; one copy thread otherwise) while the thread reads the next piece into another
slot. A CUDA target whose bytes are stored as it holds them goes through in slot-sized pieces
of bytes; any other in slabs of rows.

A failed read or checksum leaves the targets partly overwritten: the error says so.
"""

from __future__ import annotations

import ctypes
import io
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from .archive import ArchiveError, TensorRecord, locate_tensor
from .byte_sources import ByteSource, LocalFiles
from ..errors import CheckpointError, PartialLoadError
from ..formats import Sidecar
from .ring import DEVICE_RING_BYTES, CopyInto, LoadCancelled, Ring, copy_step_for


@dataclass
class ItemRead:
    """One ReadItem of the plan: its bytes in the file and what becomes of them."""

    req: ReadItem
    path: str  # the data file
    name: str  # for errors: file and fqn (with the chunk's offsets)
    start: int
    length: int
    expected_crc: Optional[int]
    target: Optional[torch.Tensor] = None  # tensors: where they go, their stored dtype and chunk size
    dtype: Optional[torch.dtype] = None
    chunk: tuple[int, ...] = ()
    torch_save: bool = True  # a torch.save archive (else raw bytes); False for objects
    data: Optional[bytearray] = None  # objects and fallback items: the whole item
    partial_crcs: list[tuple[int, int, int]] = field(default_factory=list)  # (order, crc, length)


@dataclass
class Segment:
    """A byte range of one item: into `dest`, or (dest None) into a slot of the ring and then
    through `copy` into the target (None: read for the checksum only)."""

    item: ItemRead
    order: int  # position inside the item, for combining checksums
    offset: int  # in the file
    length: int
    dest: Optional[memoryview] = None
    copy: Optional[CopyInto] = None


@dataclass
class Piece:
    """Consecutive segments of one file, read by one thread (`step_bytes` per read call)."""

    path: str
    offset: int
    segments: list[Segment]
    nbytes: int


@dataclass(frozen=True)
class StoredTensor:
    """A tensor item's bytes: `nbytes` at file offset `data_start`, dense in `stride` order."""

    data_start: int
    nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]


def fetch_items(
    items: list[ItemRead], sidecar: Optional[Sidecar], source: ByteSource, ring_bytes: int = DEVICE_RING_BYTES
) -> None:
    """Read every item from `source`: a tensor whose layout is understood lands in its target,
    anything else (objects included) whole in `item.data`; then check every checksum. Every path
    and range must have been checked. Reading objects only touches no target. `ring_bytes`:
    host memory for the bytes that go through buffers (see ring.py)."""
    threads = source.threads
    # every thread gets pieces to read: 512 MiB in 64 MiB pieces would keep 8 of 16 threads idle
    piece_bytes = min(source.piece_bytes, max(source.step_bytes, sum(item.length for item in items) // (2 * threads)))
    ring = Ring(copy_step_for([item.target for item in items if item.target is not None]), ring_bytes)
    try:
        source.open({item.path for item in items})
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="asyncckpt-load") as pool:
            batches = [items[n::threads] for n in range(threads)]  # a task per thread, not per item
            found = pool.map(lambda batch: [tensor_layout(item, source) for item in batch], batches)
            layouts = {id(item): layout for batch, done in zip(batches, found) for item, layout in zip(batch, done)}
            segments: list[Segment] = []
            for item in items:
                layout = layouts[id(item)]
                if layout is None:
                    item.data = bytearray(item.length)
                    segments.append(Segment(item, 0, item.start, item.length, memoryview(item.data)))
                else:
                    segments += _tensor_segments(item, layout, piece_bytes, ring.slot_bytes)
            pieces = _coalesce(sorted(segments, key=lambda s: (s.item.path, s.offset)), piece_bytes)
            _run(pool, pieces, sidecar.checksum if sidecar is not None else None, source, ring)
    finally:
        copy_error = ring.drain()  # no copy still running once this returns or raises
        source.close()
    if copy_error is not None:
        raise copy_error
    if sidecar is not None:
        for item in items:
            _check_crc(item, sidecar)


def place_items(items: list[ItemRead], planner: LoadPlanner, decode: Callable[[ItemRead], None]) -> None:
    """Once every item was fetched and matched its checksum: objects go to `planner.load_bytes`,
    items read whole to `decode` (on this thread), tensors read in place are committed."""
    for item in items:
        if item.req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item.req, io.BytesIO(item.data))
        elif item.data is not None:
            decode(item)
        else:
            planner.commit_tensor(item.req, item.target)


def tensor_layout(item: ItemRead, source: ByteSource) -> Optional[StoredTensor]:
    """Where the tensor bytes of `item` lie: a raw item is C-contiguous; a torch_save item is
    parsed from its archive. None: read it whole (an object, not a plain one-tensor archive, or
    an archive small enough for the source to read whole)."""
    if item.req.type == LoadItemType.BYTE_IO or item.dtype is None:
        return None
    if not item.torch_save:
        if item.length != _numel(item.chunk) * item.dtype.itemsize:
            raise CheckpointError(
                f"{item.name}: {item.length} bytes stored, {_numel(item.chunk) * item.dtype.itemsize} expected "
                f"for {item.dtype} {list(item.chunk)}"
            )
        return StoredTensor(item.start, item.length, item.dtype, item.chunk, _contiguous_strides(item.chunk))
    if item.length <= source.whole_item_bytes:
        return None
    try:
        record = locate_tensor(lambda offset, n: _read_exact(source, item, item.start + offset, n), item.length, item.dtype)
    except ArchiveError:
        return None
    if record.size != item.chunk or not _dense(record):
        return None
    return StoredTensor(item.start + record.data_start, record.nbytes, item.dtype, record.size, record.stride)


def _read_exact(source: ByteSource, item: ItemRead, offset: int, n: int) -> bytes:
    try:
        data = source.read(item.path, offset, n)
    except OSError as exc:
        raise CheckpointError(f"{item.name}: reading bytes {offset}..{offset + n} failed ({exc.strerror or exc})") from None
    if len(data) != n:
        raise CheckpointError(f"{item.name}: the file ends at byte {offset + len(data)}, inside the item (truncated)")
    return data


def _dense(record: TensorRecord) -> bool:
    """Whether the storage holds exactly the tensor's elements, in some order of its dims."""
    if record.storage_offset != 0 or record.storage_numel != _numel(record.size):
        return False
    return _storage_order(record.size, record.stride) is not None


def _storage_order(size: tuple[int, ...], stride: tuple[int, ...]) -> Optional[list[int]]:
    """The dims from outermost to innermost in memory, if the tensor is dense in that order."""
    order = sorted((d for d in range(len(size)) if size[d] > 1), key=lambda d: -stride[d])
    order += [d for d in range(len(size)) if size[d] <= 1]
    expected = 1
    for d in reversed(order):
        if size[d] > 1 and stride[d] != expected:
            return None
        expected *= size[d]
    return order


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(size):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def _numel(size) -> int:
    n = 1
    for dim in size:
        n *= dim
    return n


def _tensor_segments(item: ItemRead, layout: StoredTensor, piece_bytes: int, slot_bytes: int) -> list[Segment]:
    """Framing before and after the data to scratch; the data straight into a CPU target, in
    slot-sized pieces of bytes into a device target stored as it is held, else in slabs of rows
    through the ring."""
    target, req = item.target, item.req
    head = layout.data_start - item.start
    tail = item.start + item.length - layout.data_start - layout.nbytes
    segments = [Segment(item, 0, item.start, head, memoryview(bytearray(head)))] if head else []
    whole = (
        all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == layout.size
        and layout.nbytes == target.numel() * target.element_size()  # never past the target's end
    )
    same_layout = (
        whole and target.dtype == layout.dtype and target.is_contiguous() and layout.stride == _contiguous_strides(layout.size)
    )
    if same_layout and not in_host_memory(target):
        flat = target.reshape(-1).view(torch.uint8)
        for begin in range(0, layout.nbytes, slot_bytes):
            end = min(begin + slot_bytes, layout.nbytes)
            segments.append(Segment(item, len(segments), layout.data_start + begin, end - begin, copy=_bytes_copy(flat, begin, end)))
    elif same_layout or whole and layout.nbytes == 0:
        memory = _memory_of(target, layout.nbytes)
        for begin in range(0, layout.nbytes, piece_bytes):
            end = min(begin + piece_bytes, layout.nbytes)
            segments.append(Segment(item, len(segments), layout.data_start + begin, end - begin, memory[begin:end]))
    else:
        segments += _slab_segments(item, layout, len(segments), slot_bytes)
    if tail:
        segments.append(Segment(item, len(segments), item.start + item.length - tail, tail, memoryview(bytearray(tail))))
    return segments


def _memory_of(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable (any dtype, the tensor kept alive by the caller)."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def in_host_memory(target: torch.Tensor) -> bool:
    """Whether the reading threads may write into `target` themselves (else: through the ring)."""
    return target.device.type == "cpu"


def _bytes_copy(flat: torch.Tensor, begin: int, end: int) -> CopyInto:
    return lambda host, non_blocking: flat[begin:end].copy_(host, non_blocking=non_blocking)


def _slab_segments(item: ItemRead, layout: StoredTensor, first_order: int, slot_bytes: int) -> list[Segment]:
    """The data of a tensor that cannot be read in place, as slabs of its outermost stored dim
    (up to a slot each, at least one row), each copied into the part of the target it covers."""
    size = layout.size or (1,)
    stride = layout.stride or (1,)
    order = _storage_order(size, stride)
    stored_shape = [size[d] for d in order]
    row_bytes = _numel(stored_shape[1:]) * layout.dtype.itemsize
    rows_per_slab = max(1, slot_bytes // max(row_bytes, 1))
    segments = []
    for first in range(0, stored_shape[0], rows_per_slab):
        rows = min(rows_per_slab, stored_shape[0] - first)
        copy = _slab_copy(item, layout, order, stored_shape, first, rows)
        segments.append(
            Segment(item, first_order + len(segments), layout.data_start + first * row_bytes, rows * row_bytes, copy=copy)
        )
    return segments


def _slab_copy(item: ItemRead, layout: StoredTensor, order, stored_shape, first: int, rows: int):
    """Copies rows [first, first + rows) of the outermost stored dim from a buffer into the target."""
    req = item.req
    offsets = list(req.storage_offsets) or [0]
    lengths = list(req.lengths) or [1]
    outer = order[0]
    lo, hi = max(first, offsets[outer]), min(first + rows, offsets[outer] + lengths[outer])
    if lo >= hi:
        return None  # read for the checksum only
    inverse = [order.index(d) for d in range(len(order))]

    def copy(buffer: torch.Tensor, non_blocking: bool) -> None:
        src = buffer.view(layout.dtype).view([rows] + stored_shape[1:]).permute(inverse)
        dst = item.target if item.target.dim() else item.target.view(1)
        for d in range(len(order)):
            if d == outer:
                src, dst = src.narrow(d, lo - first, hi - lo), dst.narrow(d, lo - offsets[d], hi - lo)
            else:
                src = src.narrow(d, offsets[d], lengths[d])
        dst.copy_(src, non_blocking=non_blocking)

    return copy


def _coalesce(segments: list[Segment], piece_bytes: int) -> list[Piece]:
    """Adjacent in-place segments of one file share a piece, up to `piece_bytes` (and IOV_MAX segments)."""
    pieces: list[Piece] = []
    for seg in segments:
        last = pieces[-1] if pieces else None
        if (
            last is not None and seg.dest is not None and last.segments[-1].dest is not None
            and last.path == seg.item.path and last.offset + last.nbytes == seg.offset
            and last.nbytes + seg.length <= piece_bytes and len(last.segments) < LocalFiles.iov_max
        ):
            last.segments.append(seg)
            last.nbytes += seg.length
        else:
            pieces.append(Piece(seg.item.path, seg.offset, [seg], seg.length))
    return pieces


def _run(pool: ThreadPoolExecutor, pieces: list[Piece], checksum: Optional[Callable], source: ByteSource, ring: Ring) -> None:
    """Read every piece on the pool; the first failure cancels what has not started (and the
    reads waiting for a slot)."""
    futures = [pool.submit(_read_piece, p, ring, checksum, source) for p in pieces]
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    if pending:
        ring.cancel()
    for future in pending:
        future.cancel()
    wait(futures)
    for piece, future in zip(pieces, futures):
        exc = None if future.cancelled() else future.exception()
        if isinstance(exc, CheckpointError):
            raise exc
        if exc is not None and not isinstance(exc, LoadCancelled):  # a copy into a target that failed: name the item
            raise PartialLoadError(f"{piece.segments[0].item.name}: {type(exc).__name__}: {exc}") from exc


def _read_piece(piece: Piece, ring: Ring, checksum: Optional[Callable], source: ByteSource) -> None:
    seg = piece.segments[0]
    if seg.dest is not None:
        _read_checked(source, piece, [(s, s.dest) for s in piece.segments], checksum)
        return
    buffer = ring.acquire(seg.length)  # one slab or piece through a slot, then into the target
    try:
        view = buffer[: seg.length]
        _read_checked(source, piece, [(seg, memoryview(view.numpy()))], checksum)
    except BaseException:
        ring.release(buffer)
        raise
    if seg.copy is None:
        ring.release(buffer)
    else:
        ring.submit(buffer, lambda host, non_blocking: seg.copy(host[: seg.length], non_blocking), seg.item.target.device, seg.item.name)


def _read_checked(
    source: ByteSource, piece: Piece, parts: list[tuple[Segment, memoryview]], checksum: Optional[Callable]
) -> None:
    """Read `parts` (laid end to end from the piece's offset) `step_bytes` per read call,
    checksumming each step right after it is read; each item's run of bytes gives one partial checksum."""
    step, offset = source.step_bytes, piece.offset
    chunks = [(seg, mem[i:i + step]) for seg, mem in parts for i in range(0, len(mem), step)]
    run: Optional[list] = None  # [segment that began it, crc, length]
    with source.piece(piece.path, offset, sum(len(mem) for _, mem in parts)):  # (a peer streams them)
        while chunks:
            window, size = [], 0
            while chunks and (not window or size + len(chunks[0][1]) <= step):
                window.append(chunks.pop(0))
                size += len(window[-1][1])
            source.read_into(piece.path, offset, [mem for _, mem in window], window[0][0].item.name)
            offset += size
            for seg, mem in window:
                if run is not None and run[0].item is not seg.item:
                    _record_crc(run, checksum)
                    run = None
                if run is None:
                    run = [seg, 0, 0]
                if checksum is not None and seg.item.expected_crc is not None:
                    run[1] = checksum(mem, run[1])
                run[2] += len(mem)
    if run is not None:
        _record_crc(run, checksum)


def _record_crc(run: list, checksum: Optional[Callable]) -> None:
    seg, crc, length = run
    if checksum is not None and seg.item.expected_crc is not None:
        seg.item.partial_crcs.append((seg.order, crc, length))  # list.append is atomic: threads share items


def _check_crc(item: ItemRead, sidecar: Sidecar) -> None:
    if item.expected_crc is None:
        return
    crc = None
    for _, part, length in sorted(item.partial_crcs):
        crc = part if crc is None else sidecar.combine(crc, part, length)
    if (crc or 0) != item.expected_crc:
        raise PartialLoadError(f"{item.name}: checksum mismatch (the data file is damaged)")
