"""Messages that cross the trainer/worker boundary. Each is a dataclass; nothing rides in tuples.

Flow for one save: the trainer sends `SaveRequest`; the worker answers `Staged` once its copy
is taken (the trainer may mutate its tensors from then on), then `WriteDone` or `SaveFailed`.
`WriteStaged` writes a memory-only save's copy after the fact (the same answers).
A `prepare_only` request (AsyncCheckpointer.prepare) is answered `Prepared` or `SaveFailed`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

TENSOR = "tensor"
BYTES = "bytes"


@dataclass(frozen=True)
class ItemIndex:
    """DCP's MetadataIndex, minus the import: unpickling DCP's class in the worker would load
    torch.distributed.checkpoint (DTensor, sympy: about a second of every worker's start-up).
    Compares and hashes as MetadataIndex does (`index` is only a lookup hint)."""

    fqn: str
    offset: Optional[tuple[int, ...]] = None
    index: Optional[int] = field(default=None, compare=False, hash=False)

    @classmethod
    def of(cls, dcp_index) -> "ItemIndex":
        offset = tuple(dcp_index.offset) if dcp_index.offset is not None else None
        return cls(dcp_index.fqn, offset, dcp_index.index)

    def to_dcp(self):
        from torch.distributed.checkpoint.metadata import MetadataIndex  # the trainer side only

        return MetadataIndex(self.fqn, self.offset, self.index)


@dataclass(frozen=True)
class Replication:
    """The memory tier across nodes (asyncckpt/replica_wire.py): the job's `secret`, the socket
    this rank's worker receives peers' copies on (the trainer's: a restarted worker keeps its
    address), the workers (rank, host, port) each sealed copy is sent to, and the ranks whose
    copies it keeps (`sources`: any other is refused)."""

    secret: bytes
    listener: Any  # socket.socket, handed to the spawned worker
    targets: tuple[tuple[int, str, int], ...]
    sources: tuple[int, ...]
    timeout_s: float


@dataclass(frozen=True)
class MemoryTier:
    """The memory tier (asyncckpt/memory_file.py): the staging slab lives in the file at `path`,
    whose header names `root` and `world_size`. `hold_s` bounds how long a worker whose trainer
    died keeps staging the save under way, so that the copy is complete, before it exits (and
    sending it to its peers, with `replication`)."""

    path: str
    root: str
    world_size: int
    hold_s: float
    replication: Optional[Replication] = None


@dataclass(frozen=True)
class WorkerSettings:
    """Sent once, when the worker is spawned."""

    rank: int
    parent_pid: int
    log_level: int = logging.WARNING
    nice: Optional[int] = None
    ionice: Optional[str] = None
    memory: Optional[MemoryTier] = None
    ignored_signals: tuple[int, ...] = ()  # the preemption signals: the trainer decides, the save in flight ends


@dataclass(frozen=True)
class ItemSpec:
    """One plan item: a tensor chunk or a pickled object, addressed by its DCP index."""

    index: ItemIndex
    kind: str  # TENSOR or BYTES
    dtype: Optional[torch.dtype] = None
    shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        if self.kind != TENSOR:
            return 0
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class WriteOptions:
    """How the worker lays out and writes one save."""

    io: str = "thread"
    io_workers: int = 4
    format: str = "torch_save"
    fsync: bool = True
    checksums: bool = True
    separation_hint: Optional[str] = None
    staging_budget_bytes: Optional[int] = None
    staging_threads: int = 1  # CPU copy threads: the trainer waits idle in eager mode, computes in lazy
    incremental: bool = False  # hash every staged tensor (digests go to the sidecar); see IncrementalBase
    # the trainer's bound on staging and, separately, on the writes; the worker fails a write still
    # running after WORKER_DEADLINE_SHARE of it (naming the file) so its verdict arrives first
    timeout_s: float = 600.0


WORKER_ENTRY = "asyncckpt_worker.main"  # the worker's entry module: the trainer names it, never imports it


def run_worker(entry: str, conn, settings: "WorkerSettings") -> None:
    """The spawned worker's first call: import its entry module by name and serve `conn`. It
    lives here because the worker imports this module anyway; the trainer side imports nothing
    of the worker package. Ctrl-C is the trainer's to handle (a terminal sends SIGINT to the
    whole process group): the worker starts with SIGINT blocked (client.py) and ignores it from
    here on, so no import is cut short; its fork server and writers inherit that. The same holds
    for the preemption signals (`settings.ignored_signals`, CheckpointConfig.preemption_signals)."""
    import importlib
    import signal

    for number in (signal.SIGINT, *settings.ignored_signals):
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, *settings.ignored_signals})  # one that came meanwhile is dropped
    importlib.import_module(entry).run(conn, settings)


WORKER_DEADLINE_SHARE = 0.9
CACHE_SLOTS = 2  # structures a worker keeps cached at once (SaveRequest.slot)


@dataclass(frozen=True)
class IncrementalBase:
    """A committed checkpoint of this rank an incremental save may reuse: where each of its items
    lies and the digest of its bytes. An item whose digest is unchanged is not written again: its
    file is hard-linked into the new checkpoint directory."""

    checkpoint_dir: str
    items: tuple["ItemWritten", ...]
    save_id: Optional[str] = None  # its `.metadata`'s: a re-save of its directory reuses files only while it is still the committed one


@dataclass
class SaveRequest:
    """Trainer -> worker. `items` travels only with a new structure; `fresh_tensors` carries the
    tensors the worker does not hold yet (by item position), `byte_items` every pickled object.
    A new structure names the tensors the worker already holds under the previous one in
    `kept_tensors` (new position -> its position in structure `kept_from`) instead of resending
    them: a few changed keys (Lightning's top-k paths) cost no handle transfers. The worker keeps
    one structure per `slot` (CACHE_SLOTS of them): a trainer whose saves alternate between two
    sets of tensors (its model's, and a held copy of them) keeps both cached."""

    save_id: int
    checkpoint_dir: str
    structure_key: str
    options: WriteOptions
    items: Optional[tuple[ItemSpec, ...]] = None
    file_tag: str = ""  # in every data file name: a save replacing a committed step never touches its files
    data_folder: str = ""  # the folder of checkpoint_dir this rank's data files go in (layout.py: prefix spreading)
    fresh_tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    # positions of fresh_tensors copied for this save only (a subclass's values, a storage that
    # cannot be shared): the worker lets go of them once staged, so they never outlive the save
    transient: frozenset[int] = frozenset()
    byte_items: dict[int, bytes] = field(default_factory=dict)
    bases: tuple[IncrementalBase, ...] = ()  # incremental: link what did not change from these, in order
    kept_from: str = ""
    kept_tensors: dict[int, int] = field(default_factory=dict)
    slot: int = 0
    prepare_only: bool = False  # cache the structure and ready the slab for it; stage and write nothing
    memory: Optional["MemorySave"] = None  # with the memory tier: what its header records of this save


@dataclass(frozen=True)
class MemorySave:
    """What the memory tier's header records of one save. `plan` (the trainer's description of
    the items, opaque to the worker) travels only with a new structure; the worker keeps it with
    the structure. `memory_only`: stage into the tier, write nothing (answered by an empty WriteDone)."""

    step: int
    token: str
    memory_only: bool = False
    plan: Optional[bytes] = None
    root_id: Optional[str] = None  # the history it belongs to (loading/history.py): the root's id,
    base_step: Optional[int] = None  # and the newest committed checkpoint when it was staged
    base_token: Optional[str] = None


@dataclass(frozen=True)
class WriteStaged:
    """Trainer -> worker: write the copy the memory-only save `token` staged (the slab still holds
    it) into `checkpoint_dir`, copying nothing: a preempted close persists the newest save this
    way (asyncckpt/save/preemption.py). Answered as a save is: `Staged` at once, then `WriteDone`,
    or `SaveFailed` (a later save staged over that copy, or a write failed)."""

    save_id: int
    token: str
    checkpoint_dir: str
    options: WriteOptions
    file_tag: str = ""
    data_folder: str = ""


@dataclass(frozen=True)
class Ready:
    """Worker -> trainer, once, when it can serve: bounded waits start counting from here, so a
    slow interpreter start is not mistaken for a stuck save."""


@dataclass(frozen=True)
class Shutdown:
    """Trainer -> worker: finish nothing new, exit the serve loop."""


@dataclass(frozen=True)
class Prepared:
    """Worker -> trainer, for a `prepare_only` request: it holds the structure, and its staging
    slab is allocated, faulted in (pinned, for CUDA tensors) and big enough for a save of it."""

    save_id: int
    seconds: float
    slab_bytes: int


@dataclass(frozen=True)
class Staged:
    """Worker -> trainer: the snapshot is copied; the trainer's tensors are free again."""

    save_id: int
    staging_s: float
    cache_hit: bool
    worker_pid: int


@dataclass(frozen=True)
class ItemWritten:
    """Where one item landed: DCP's (relative_path, offset, length), plus its checksum."""

    index: ItemIndex
    relative_path: str
    offset: int
    length: int
    crc32: Optional[int] = None
    digest: Optional[bytes] = None  # incremental saves: XXH3-128 of the tensor (formats.tensor_digest)


@dataclass(frozen=True)
class WriteDone:
    """Worker -> trainer: every file of the save is written (and fsynced if asked)."""

    save_id: int
    items: tuple[ItemWritten, ...]
    bytes_written: int  # every item's bytes (the logical size), linked ones included
    write_s: float
    bytes_linked: int = 0  # of them, in files hard-linked from the base instead of written
    requests: dict = field(default_factory=dict)  # object-store requests the worker issued, by kind (storage/requests.py)
    memory_problem: str = ""  # the memory tier's copy of this save could not be sealed (the disk save went on)


@dataclass(frozen=True)
class SaveFailed:
    """Worker -> trainer: the save failed in `phase` ("request", "cache", "staging", "write");
    `path` names the file when one was involved. The worker keeps serving. `save_id` is None when
    the request itself could not be read (it then fails the one save in flight)."""

    save_id: Optional[int]
    phase: str
    message: str
    path: Optional[str] = None
    worker_exits: bool = False  # it cannot serve another save (its writers' fork server died)
