"""What each rank reports once its files are written, for a final plan: asyncckpt's RankOutcome
(items placed in files by the worker's own bucketing, `asyncckpt_worker.buckets.make_buckets`)
and DCP's list of WriteResult (FileSystemWriter: one file per rank, `thread_count=1`); and what
such a save costs in files and object-store requests."""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from asyncckpt.protocol import BYTES, TENSOR, ItemIndex, ItemSpec, ItemWritten, WriteDone
from asyncckpt.save.commit import RankOutcome
from asyncckpt_worker.buckets import make_buckets

from .shapes import item_nbytes

IO_WORKERS = 4  # CheckpointConfig's default: files per rank
OBJECT_BYTES = 64  # a torch.save'd float or short list, roughly: objects are a handful of small items
try:  # multi-storage-client's S3 defaults: one PUT up to the threshold, else multipart in chunks
    from multistorageclient.providers.s3 import MULTIPART_CHUNKSIZE, MULTIPART_THRESHOLD
except ImportError:  # the msc extra is not installed: S3's usual transfer defaults
    MULTIPART_THRESHOLD, MULTIPART_CHUNKSIZE = 64 << 20, 32 << 20


@dataclass
class RankFiles:
    """One rank's data files (sizes in bytes)."""

    sizes: list[int]


def archive_overhead(dtype: torch.dtype) -> int:
    """Bytes a standalone torch.save archive of one chunk adds to its data (the torch_save format
    writes each chunk so): measured on a 1-element tensor."""
    buffer = io.BytesIO()
    torch.save(torch.zeros(1, dtype=dtype), buffer)
    return buffer.tell() - dtype.itemsize


class Results:
    """Builds every rank's write results for a global plan, reproducibly (CRCs are random)."""

    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)
        self._overheads: dict[torch.dtype, int] = {}
        self._buckets: dict[tuple, list] = {}  # make_buckets depends only on the items' kinds and sizes

    def _length(self, item) -> int:
        if item.type == WriteItemType.BYTE_IO:
            return OBJECT_BYTES
        dtype = item.tensor_data.properties.dtype
        if dtype not in self._overheads:
            self._overheads[dtype] = archive_overhead(dtype)
        return item_nbytes(item) + self._overheads[dtype]

    def ours(self, rank: int, plan: SavePlan) -> tuple[RankOutcome, RankFiles]:
        """The RankOutcome the worker reports for this final plan (torch_save format, checksums)."""
        lengths = [self._length(item) for item in plan.items]
        kinds = tuple(BYTES if item.type == WriteItemType.BYTE_IO else TENSOR for item in plan.items)
        signature = (kinds, tuple(lengths))
        if signature not in self._buckets:
            specs = [ItemSpec(ItemIndex(str(pos)), kind, torch.uint8, (n,)) for pos, (kind, n) in enumerate(zip(kinds, lengths))]
            self._buckets[signature] = [b.positions for b in make_buckets(specs, {}, 0, IO_WORKERS)]
        written, sizes = [], []
        for n, positions in enumerate(self._buckets[signature]):
            name, offset = f"__{rank}_{n}.distcp", 0
            for pos in positions:
                index = ItemIndex.of(plan.items[pos].index)
                written.append(ItemWritten(index, name, offset, lengths[pos], self._random.getrandbits(32)))
                offset += lengths[pos]
            sizes.append(offset)
        done = WriteDone(save_id=2, items=tuple(written), bytes_written=sum(sizes), write_s=1.0)
        return RankOutcome(rank, done), RankFiles(sizes)

    def dcp(self, rank: int, plan: SavePlan) -> tuple[list[WriteResult], RankFiles]:
        """DCP FileSystemWriter's results: every item into `__{rank}_0.distcp`, in plan order."""
        results, offset, name = [], 0, f"__{rank}_0.distcp"
        for item in plan.items:
            length = self._length(item)
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, offset, length)))
            offset += length
        return results, RankFiles([offset])  # an empty plan still writes its (empty) file


def requests_for(file_sizes: list[int]) -> int:
    """S3 requests to upload files of these sizes: one PUT each up to the multipart threshold,
    else create + one per part + complete."""
    total = 0
    for size in file_sizes:
        total += 1 if size <= MULTIPART_THRESHOLD else 2 + -(-size // MULTIPART_CHUNKSIZE)
    return total
