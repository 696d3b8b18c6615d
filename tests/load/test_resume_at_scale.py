"""Resume at scale (loading/broadcast.py, loading/replicated.py): a job opens a checkpoint once,
not once per rank, and reads the bytes several ranks load once.

Four gloo ranks load one checkpoint the way DDP resumes (every rank the whole state), through
`asyncckpt.load` and through `load_latest`'s resume; every read of the storage is counted in
each rank (the local storage's whole-file reads, the reader's positional reads). The ranks are
told they are four nodes (`node_key`): the ranks of one node read a file system through the
node's page cache, which reads the storage once for them (tested apart). `.metadata` and the
checksums sidecar must be read once per job, every item's bytes once (1.0x the checkpoint,
spread over the ranks), the state must equal what was saved; the same with 2x2 HSDP-like ranks
(two replicas of two shards). A reading rank that dies in the broadcast makes
the others raise within the group's timeout."""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from asyncckpt import CheckpointError, load
from asyncckpt.layout import METADATA_FILE
from conftest import assert_state_equal, damaged_copy, pid_of_an_exited_process, saved_step_one
from multirank import run_ranks

WORLD = 4


def replicated_state() -> dict:
    g = torch.Generator().manual_seed(45)
    state = {f"layer{n}.weight": torch.randn(64, 96 + n, generator=g) for n in range(6)}
    state["step"] = 12
    state["meta"] = {"run": "resume-at-scale"}
    return state


def zeroed(state: dict) -> dict:
    """A target of the same structure, holding none of the values."""
    def empty(v):
        return torch.zeros_like(v) if isinstance(v, torch.Tensor) else zeroed(v) if isinstance(v, dict) else None
    return {k: empty(v) for k, v in state.items()}


class ReadCounter:
    """Every read this process makes of the checkpoint's files, by kind (patched in a rank)."""

    def __init__(self) -> None:
        from asyncckpt.loading.byte_sources import LocalFiles
        from asyncckpt.storage.local import LocalStorage

        self.counts = {"metadata": 0, "sidecar": 0, "data_bytes": 0}
        read_bytes, read, read_into = LocalStorage.read_bytes, LocalFiles.read, LocalFiles.read_into
        counter = self

        def counted_read_bytes(storage, path, offset=0, length=None):
            data = read_bytes(storage, path, offset, length)
            name = os.path.basename(path)
            if name == METADATA_FILE:
                counter.counts["metadata"] += 1
            elif name.startswith(".checksums"):
                counter.counts["sidecar"] += 1
            elif name.endswith(".distcp"):  # not `latest`, which every rank reads (a few bytes)
                counter.counts["data_bytes"] += len(data)
            return data

        def counted_read(source, path, offset, n):
            data = read(source, path, offset, n)
            counter.counts["data_bytes"] += len(data)
            return data

        def counted_read_into(source, path, offset, buffers, what):
            counter.counts["data_bytes"] += sum(len(b) for b in buffers)
            return read_into(source, path, offset, buffers, what)

        LocalStorage.read_bytes, LocalFiles.read, LocalFiles.read_into = counted_read_bytes, counted_read, counted_read_into

    def take(self) -> dict:
        counts, self.counts = self.counts, {k: 0 for k in self.counts}
        return counts


def as_nodes(node_of_rank: str) -> None:
    """This rank tells the load it is on node `node_of_rank` (one machine playing several)."""
    import asyncckpt.loading.node_share as node_share
    import asyncckpt.loading.safe_reader as safe_reader

    safe_reader.node_key = node_share.node_key = lambda: node_of_rank


def as_on_an_object_store() -> None:
    """The load treats the checkpoint as an object store's (no page cache the ranks of a node
    share): a node's ranks get their reader's items through shared memory."""
    import asyncckpt.loading.safe_reader as safe_reader

    safe_reader.SafeReader.page_cache_shared = lambda self: False


def _ddp_resume(rank: int, world: int, root: str, path: str, out: str) -> None:
    from asyncckpt.config import CheckpointConfig
    from asyncckpt.loading.resume import resume
    from asyncckpt.save.ranks import RankGroup

    as_nodes(f"node{rank}")
    counter = ReadCounter()
    expected = replicated_state()
    state = zeroed(expected)
    load(state, path)
    assert_state_equal(state, expected)
    by_load = counter.take()
    state = zeroed(expected)
    report = resume(state, root, RankGroup(None, CheckpointConfig()), trusted=False, strict=True, checksums=True)
    assert report is not None and report.step == 1
    assert_state_equal(state, expected)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"load": by_load, "load_latest": counter.take()}, f)


def stored_bytes(path: str) -> int:
    """The bytes of every item the checkpoint's .metadata names."""
    from asyncckpt.loading.opened import open_checkpoint

    return sum(info.length for info in open_checkpoint(path).metadata.storage_data.values())


def object_bytes(path: str) -> int:
    """The bytes of the objects (not tensors) the checkpoint's .metadata names."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from asyncckpt.loading.opened import open_checkpoint

    metadata = open_checkpoint(path).metadata
    return sum(info.length for index, info in metadata.storage_data.items()
               if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata))


def test_ddp_resume_reads_metadata_once_and_every_byte_once_per_job(tmp_path):
    root = str(tmp_path / "root")
    path = saved_step_one(root, replicated_state())
    out = tmp_path / "counts"
    out.mkdir()
    run_ranks(_ddp_resume, WORLD, root, path, str(out))
    counts = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for call in ("load", "load_latest"):
        assert sum(c[call]["metadata"] for c in counts) == 1, (call, counts)
        assert sum(c[call]["sidecar"] for c in counts) == 1, (call, counts)
        assert counts[0][call]["metadata"] == 1  # the group's rank 0 reads; the others read none of it
        # replicated items: each read by one rank, sent to the others: 1.0x the checkpoint's bytes, not 4x
        assert sum(c[call]["data_bytes"] for c in counts) == stored_bytes(path), (call, counts)
        assert all(c[call]["data_bytes"] < stored_bytes(path) * 0.6 for c in counts), (call, counts)  # spread


def _reader_dies(rank: int, world: int, path: str, out: str, nodes: str) -> None:
    import asyncckpt.loading.broadcast as broadcast
    import asyncckpt.loading.node_share as node_share

    # "two": ranks 0, 1 and 2, 3 (rank 2 waits for rank 0's bytes, ranks 1 and 3 for their node's
    # file); "own": every rank a node of its own (the plain broadcast)
    node_share.node_key = (lambda: f"node{rank // 2}") if nodes == "two" else (lambda: "")
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    if rank == 0:
        broadcast.spread_blobs = lambda *args, **kwargs: os._exit(0)  # dies with .metadata read, before sending it
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="opening .*(broadcast from|passing it on with|inside the nodes).* failed"):
        load(zeroed(replicated_state()), path, process_group=group)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"raised_after_s": time.monotonic() - started}, f)
    os._exit(0)  # rank 0 is gone: no barrier at the end


@pytest.mark.parametrize("nodes", ["two", "own"])
def test_a_reader_that_dies_in_the_broadcast_fails_the_others_within_the_timeout(tmp_path, nodes):
    path = saved_step_one(str(tmp_path / "root"), replicated_state())
    out = tmp_path / "raised"
    out.mkdir()
    run_ranks(_reader_dies, WORLD, path, str(out), nodes, timeout_s=180)
    raised = [json.loads((out / f"rank{r}.json").read_text())["raised_after_s"] for r in range(1, WORLD)]
    assert max(raised) < 40, raised  # the group's 30 s at most, not gloo's default 30 min
    assert not (out / "rank0.json").exists()


def test_without_a_process_group_each_process_reads_itself_and_says_so(tmp_path, caplog):
    expected = replicated_state()
    path = saved_step_one(str(tmp_path / "root"), expected)
    state = zeroed(expected)
    with caplog.at_level(logging.DEBUG, logger="asyncckpt.loading.broadcast"):
        load(state, path)
    assert_state_equal(state, expected)
    assert any("on this rank alone" in r.getMessage() for r in caplog.records)


def hsdp_state() -> dict:
    """Two shards (each held by one rank of each of two replicas) and an object every rank loads."""
    g = torch.Generator().manual_seed(46)
    state = {f"shard{s}.layer{n}": torch.randn(48, 80 + n, generator=g) for s in range(2) for n in range(3)}
    state["step"] = 9
    return state


def _hsdp_load(rank: int, world: int, path: str, out: str) -> None:
    as_nodes(f"node{rank}")
    counter = ReadCounter()
    shard = rank % 2  # ranks 0, 1: replica 0; ranks 2, 3: replica 1
    expected = {k: v for k, v in hsdp_state().items() if k.startswith(f"shard{shard}.") or k == "step"}
    state = zeroed(expected)
    load(state, path)
    assert_state_equal(state, expected)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(counter.take(), f)


def test_hsdp_like_resume_reads_every_byte_once_per_job(tmp_path):
    path = saved_step_one(str(tmp_path / "root"), hsdp_state())
    out = tmp_path / "counts"
    out.mkdir()
    run_ranks(_hsdp_load, WORLD, path, str(out))
    counts = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert sum(c["data_bytes"] for c in counts) == stored_bytes(path), counts
    assert sum(c["metadata"] for c in counts) == 1, counts


def _load_counting_paths(rank: int, world: int, path: str, out: str, nodes: str) -> None:
    """Load as DDP does, counting the bytes each rank got through shared memory and through gloo,
    and those it checksummed. `nodes`: "one" (every rank on this machine), "two" (ranks 0, 1 and
    2, 3 told they are two nodes), "no room" (one node, but rank 0's /dev/shm cannot hold its
    payload) or "two, no room to relay" (node 1's /dev/shm cannot hold what it receives); as on an
    object store unless "file system" (the checkpoint's files as they are)."""
    import asyncckpt.loading.broadcast as broadcast
    import asyncckpt.loading.metadata_share as metadata_share
    import asyncckpt.loading.node_share as node_share
    import asyncckpt.loading.replicated as replicated
    from asyncckpt.formats import Sidecar

    if nodes.startswith("two"):
        as_nodes(f"node{rank // 2}")
    if not nodes.endswith("file system"):
        as_on_an_object_store()
    checksummed = [0]
    checksum = Sidecar.checksum

    def counted_checksum(sidecar, data, value=0):
        checksummed[0] += len(data)
        return checksum(sidecar, data, value)

    Sidecar.checksum = counted_checksum
    crc32c = replicated.crc32c  # (what a receiver or a relay checks against a CRC32C the reader sent)

    def counted_crc32c(data, value=0):
        checksummed[0] += len(data)
        return crc32c(data, value)

    replicated.crc32c = counted_crc32c
    if nodes == "no room" and rank == 0:
        node_share.MemoryPayload.create = classmethod(lambda cls, p, size: None)
        replicated.MemoryPayload = metadata_share.MemoryPayload = node_share.MemoryPayload
    if nodes == "two, no room to relay" and rank >= 2:
        create = node_share.MemoryPayload.create
        node_share.MemoryPayload.create = classmethod(lambda cls, p, size: None if "-relay" in p else create(p, size))
        replicated.MemoryPayload = node_share.MemoryPayload
    metadata_by = []  # how .metadata reached this rank: "memory", "tree" (from another node), "broadcast"
    mapped, along_the_tree, broadcast_blobs = metadata_share._mapped, metadata_share._along_the_tree, broadcast.broadcast_blobs

    def counted_mapped(placed):
        blobs = mapped(placed)
        metadata_by.extend(["memory"] if blobs is not None else [])
        return blobs

    def counted_along_the_tree(blobs, count, group, tree_nodes, what):
        metadata_by.extend(["tree"] if group.rank != 0 else [])
        return along_the_tree(blobs, count, group, tree_nodes, what)

    def counted_broadcast(*args):
        metadata_by.append("broadcast")
        return broadcast_blobs(*args)

    metadata_share._mapped, metadata_share._along_the_tree = counted_mapped, counted_along_the_tree
    broadcast.broadcast_blobs = counted_broadcast
    got = {"memory": 0, "gloo": 0, "relay": 0}  # relay: mapped from the file of a rank that received it for its node
    from_memory, receive_round = replicated._mapped, replicated._receive_round

    def counted_from_memory(*args):
        items = from_memory(*args)
        got["relay" if args[-1] == "relay" else "memory"] += sum(len(v) for v in items.values())
        return items

    def counted_receive(*args):
        items = receive_round(*args)
        got["gloo"] += sum(len(v) for v in items.values())
        return items

    replicated._mapped, replicated._receive_round = counted_from_memory, counted_receive
    counter = ReadCounter()
    expected = replicated_state()
    state = zeroed(expected)
    load(state, path)
    assert_state_equal(state, expected)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"got": got, "read": counter.take(), "metadata_by": metadata_by, "checksummed": checksummed[0]}, f)


@pytest.mark.parametrize("nodes", ["one", "two", "no room", "two, no room to relay"])
def test_ranks_of_one_node_share_through_shared_memory_and_other_nodes_through_gloo(tmp_path, nodes):
    """On an object store: inside a node a reader's items go through a file in /dev/shm (no
    bytes through gloo), to another node through gloo once: to one of its ranks (the relay,
    taking turns by reader), which receives them into a /dev/shm file its node's other ranks map;
    a reader whose /dev/shm has no room sends through gloo, and to a node whose relay has no room
    each of its ranks receives its own. Every byte is still read from storage once, the state is
    whole, and no payload file is left behind. An item that reached a rank through shared memory
    is checksummed once, by its reader, in the memory the others copy it from; one that came by
    gloo again by the rank it came to (for its node, when that is a relay). `.metadata` too: read by rank 0 once, sent to one rank of
    each other node, to the other ranks of a node through /dev/shm; by the plain broadcast to all
    when a node has no room for it."""
    path = saved_step_one(str(tmp_path / "root"), replicated_state())
    out = tmp_path / "counts"
    out.mkdir()
    before = set(os.listdir("/dev/shm"))
    run_ranks(_load_counting_paths, WORLD, path, str(out), nodes)
    counts = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    total = stored_bytes(path)
    assert sum(c["read"]["data_bytes"] for c in counts) == total, counts
    assert sum(c["read"]["metadata"] for c in counts) == 1 and counts[0]["read"]["metadata"] == 1, counts
    routes = [c["metadata_by"] for c in counts]
    two = [[], ["memory"], ["tree"], ["memory"]]
    assert routes == {"one": [[], ["memory"], ["memory"], ["memory"]], "two": two, "two, no room to relay": two,
                      "no room": [["broadcast"]] * WORLD}[nodes], routes
    memory, gloo = sum(c["got"]["memory"] for c in counts), sum(c["got"]["gloo"] for c in counts)
    relayed = [c["got"]["relay"] for c in counts]
    shared = sum(c["got"]["memory"] + c["got"]["gloo"] for c in counts)
    checksummed = sum(c["checksummed"] for c in counts)
    if nodes == "one":
        assert gloo == 0 and memory == shared > 0 and relayed == [0] * WORLD, counts
        assert checksummed == total, counts  # each item by its reader only
    elif nodes == "two":  # each item crosses to the other node once, to one of its ranks
        assert memory > 0 and gloo == total and sum(relayed) == total, counts
        assert relayed[0] > 0 and relayed[1] > 0 and relayed[2] > 0 and relayed[3] > 0, counts  # turns
        assert checksummed == total + gloo, counts  # and again by the rank it came to, for its node
    elif nodes == "two, no room to relay":  # node 0 still gets each item once; node 1's ranks each theirs
        node1_items = counts[0]["got"]["gloo"] + counts[1]["got"]["gloo"]
        assert relayed[2:] == [0, 0] and sum(relayed[:2]) == node1_items > 0, counts
        assert counts[2]["got"]["gloo"] == counts[3]["got"]["gloo"] == total - node1_items, counts
        assert checksummed == total + gloo, counts
    else:  # rank 0's share goes through gloo, the others' through memory
        assert counts[0]["got"]["memory"] > 0 and gloo > 0 and memory > 0, counts
        assert checksummed == total + gloo, counts
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("asyncckpt-load-")]


@pytest.mark.parametrize("nodes", ["one", "two"])
def test_ranks_of_one_node_read_a_file_system_through_its_page_cache(tmp_path, nodes):
    """On a file system the ranks of one node read what they load themselves: the node's page
    cache reads the storage once for them, and each rank copying from it is cheaper than any
    hand-over (a reader's /dev/shm payload measured 2.2-2.8x slower on one node). The node's
    ranks read the same cached bytes, so one of them checks each item's checksum (spread: each
    checks some), not every one. One node: no item is handed over at all. Two nodes: each item is
    read from storage on one node only (by its reader and its node's other rank, which does not
    check it again) and sent to the other node once (to one rank, which hands it to the other
    through /dev/shm)."""
    path = saved_step_one(str(tmp_path / "root"), replicated_state())
    out = tmp_path / "counts"
    out.mkdir()
    run_ranks(_load_counting_paths, WORLD, path, str(out), f"{nodes}, file system")
    counts = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    total = stored_bytes(path)
    assert sum(c["read"]["metadata"] for c in counts) == 1 and counts[0]["read"]["metadata"] == 1, counts
    assert sum(c["got"]["memory"] for c in counts) == 0, counts
    read, by_gloo = [c["read"]["data_bytes"] for c in counts], [c["got"]["gloo"] for c in counts]
    relayed, checksummed = [c["got"]["relay"] for c in counts], [c["checksummed"] for c in counts]
    if nodes == "one":  # every rank read all (and the archives' headers to find the tensors: more than `total`)
        assert read == [read[0]] * WORLD and read[0] >= total and by_gloo == [0] * WORLD, counts
        # each tensor item once, by one rank (objects, a few bytes read before any tensor, by every rank)
        objects = object_bytes(path)
        assert sum(checksummed) == total + (WORLD - 1) * objects and all(objects < c < total for c in checksummed), counts
    else:  # the ranks of a node read the same (their node's items, no other) and got the other node's once by gloo
        assert read[0] == read[1] and read[2] == read[3] and total <= read[0] + read[2] < 2 * total, counts
        node0, node1 = by_gloo[0] + by_gloo[1], by_gloo[2] + by_gloo[3]
        assert node0 > 0 and node1 > 0 and node0 + node1 == total, counts
        assert relayed[0] + relayed[1] == node0 and relayed[2] + relayed[3] == node1, counts
        # each item is checked by its reader, and by the relay that receives it for the other node
        assert sum(checksummed) == total + sum(by_gloo), counts


def _load_a_damaged_item_on_one_node(rank: int, world: int, path: str, out: str) -> None:
    as_nodes("node0")
    checks = []
    from asyncckpt.formats import Sidecar
    checksum = Sidecar.checksum
    Sidecar.checksum = lambda sidecar, data, value=0: checks.append(len(data)) or checksum(sidecar, data, value)
    state = zeroed(replicated_state())
    with pytest.raises(CheckpointError, match=r"layer3\.weight.*checksum mismatch") as raised:
        load(state, path)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"error": str(raised.value), "type": type(raised.value).__name__, "checks": len(checks)}, f)


def test_an_item_damaged_on_disk_fails_every_rank_of_a_node_though_one_checks_it(tmp_path):
    """One rank of a node checks each item the node's ranks read through its page cache: when
    that item is damaged, every rank's load fails naming it (the others copied the damaged bytes
    unchecked: their state is partly loaded, and says so)."""
    path = damaged_copy(saved_step_one(str(tmp_path / "root"), replicated_state()), str(tmp_path / "damaged"),
                        "layer3.weight")
    out = tmp_path / "raised"
    out.mkdir()
    run_ranks(_load_a_damaged_item_on_one_node, WORLD, path, str(out))
    told = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert all(t["type"] == "PartialLoadError" and "PARTLY LOADED" in t["error"] for t in told), told
    assert len({t["error"].split(": ", 1)[1] for t in told}) == 1, told  # the same cause on every rank
    assert sum(t["checks"] for t in told) < WORLD * 8, told  # (not every rank checked every item)


def test_a_payload_file_whose_process_is_gone_is_removed_by_the_next_reader(tmp_path, monkeypatch):
    """A reader killed before it removed its /dev/shm file: the next load's reader removes it
    (never the file of a process still running)."""
    import asyncckpt.loading.node_share as node_share

    monkeypatch.setattr(node_share, "SHM_DIR", str(tmp_path))
    dead = pid_of_an_exited_process()
    stale = tmp_path / f"{node_share.PAYLOAD_PREFIX}abc-r1-p{dead}"
    live = tmp_path / f"{node_share.PAYLOAD_PREFIX}abc-r2-p{os.getpid()}"
    stale.write_bytes(b"x" * 100)
    live.write_bytes(b"x" * 100)
    payload = node_share.MemoryPayload.create(node_share.payload_name("def", 0, os.getpid()), 4096)
    assert payload is not None
    payload.view(0, 4)[:] = b"abcd"
    assert bytes(node_share.open_payload(payload.path, 4096)[:4]) == b"abcd"
    payload.remove()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]


def _one_rank_gets_a_damaged_item(rank: int, world: int, path: str, out: str, nodes: str) -> None:
    import asyncckpt.loading.replicated as replicated

    if nodes == "two":
        as_nodes(f"node{rank // 2}")
    as_on_an_object_store()
    if rank == 3:
        def damaged(item, data, crc, checked_later, whence):
            raise replicated.Damaged(f"{item.relative_path}: {whence} arrived damaged")
        replicated._check = damaged
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="rank 3: .* arrived damaged"):
        load(zeroed(replicated_state()), path)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"raised_after_s": time.monotonic() - started}, f)


def test_an_item_that_arrives_damaged_fails_every_rank_at_once(tmp_path):
    """A rank that gets a damaged item (rank 3, two nodes: reader 2's items through shared
    memory; reader 1's as node 1's relay, by gloo; reader 0's from rank 2's relay file) goes on
    taking part, and the exchange after the relays received (or the one that ends the sharing)
    fails every rank, naming it: none waits for a timeout."""
    path = saved_step_one(str(tmp_path / "root"), replicated_state())
    out = tmp_path / "raised"
    out.mkdir()
    run_ranks(_one_rank_gets_a_damaged_item, WORLD, path, str(out), "two", timeout_s=180)
    raised = [json.loads((out / f"rank{r}.json").read_text())["raised_after_s"] for r in range(WORLD)]
    assert max(raised) < 30, raised


@pytest.mark.parametrize("layout", ["ddp", "hsdp"])
def test_the_plans_stay_small_at_thousands_of_ranks(layout):
    """The shared reads ride on every rank's plan, which the coordinator sends each rank: their
    size must not grow as ranks x items (DDP at 4,096 ranks and 300 items would be ~4 MB per rank
    and 16 GB from the coordinator). Members are ranges, nodes runs of consecutive ranks; ranks
    whose plans read the same items are gone through once."""
    import pickle
    from types import SimpleNamespace

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan

    from dataclasses import replace

    from asyncckpt.loading.read_shares import assign_shared_reads, plan_note

    ranks, items, per_node, shards = 4096, 300, 8, 16
    index = [MetadataIndex(f"layer{i}.weight") for i in range(items)]
    storage = {index[i]: SimpleNamespace(relative_path=f"__{i % 64}_0.distcp", offset=i * 4096, length=4096)
               for i in range(items)}
    def wanted(rank: int) -> list:  # DDP: every item; HSDP: the items of this rank's shard
        return [i for i in range(items) if layout == "ddp" or i % shards == rank % shards]
    plans = [LoadPlan(items=[SimpleNamespace(storage_index=index[i]) for i in wanted(r)]) for r in range(ranks)]
    plans = [LoadPlan(plan.items, storage_data=plan_note(plan, f"node{r // per_node}")) for r, plan in enumerate(plans)]
    started = time.process_time()
    planned = assign_shared_reads(plans, SimpleNamespace(storage_data=storage))
    assert time.process_time() - started < 5  # one pass over the items of each distinct plan (was ranks x items, twice)
    shares = planned[0].storage_data
    assert len(shares.items) == items
    assert len(pickle.dumps(planned[123])) < 64 * 1024, len(pickle.dumps(planned[123]))
    assert shares.same_node(8, 15) and not shares.same_node(7, 8)
    readers = {item.reader for item in shares.items}
    assert len(readers) == items  # spread: one item each
    item = shares.items[5]
    assert item.reader in item.members and len(item.members) == (ranks if layout == "ddp" else ranks // shards)
    # on a file system, an item whose ranks are all of one node is theirs to read through its page cache
    on_file_system = assign_shared_reads(plans, SimpleNamespace(storage_data=storage), page_cache=True)
    assert len(on_file_system[0].storage_data.items) == items and on_file_system[0].storage_data.page_cache
    one_node = plans[:per_node]
    on_one_node = assign_shared_reads(one_node, SimpleNamespace(storage_data=storage), page_cache=True)
    if layout == "ddp":  # nothing handed over: each rank reads through the cache, one checks each item (spread)
        through_cache = on_one_node[0].storage_data
        assert through_cache.items == () and len(through_cache.checked) == items
        assert {i.reader for i in through_cache.checked} == set(range(per_node))
        assert assign_shared_reads(one_node, SimpleNamespace(storage_data=storage)) is not one_node
        # a rank that checks no checksum (checksums=False, no sidecar) checks nothing for the others
        unchecking = [LoadPlan(p.items, storage_data=replace(p.storage_data, checks=r != 3)) for r, p in enumerate(one_node)]
        assert assign_shared_reads(unchecking, SimpleNamespace(storage_data=storage), page_cache=True) is unchecking
    else:  # (HSDP's first eight ranks read nothing twice: 16 shards)
        assert on_one_node is one_node


def test_each_other_node_gets_a_round_through_one_relay():
    """ReadShares.relay: for a round (its ranks, its reader) every node but the reader's with two
    or more of its ranks has exactly one relay, one of those ranks, whichever of them asks; a node
    with one rank, a rank without shared memory (-1) and the reader's node have none; relays
    take turns by reader; `relayed` lists what each rank relays, every item once per other node."""
    from asyncckpt.loading.read_shares import ReadShares, SharedItem

    # nodes: ranks 0-3 node 0, 4-7 node 1, 8-9 node 0 again, 10-11 no shared memory, 12-15 node 2
    runs = ((0, 0), (4, 1), (8, 0), (10, -1), (12, 2))
    for members in (range(16), range(1, 16, 3), (0, 2, 5, 6, 9, 10, 11, 13, 14)):
        items = tuple(SharedItem("f", 100 * reader, 10, reader, members) for reader in members)
        shares = ReadShares(items, runs)
        for reader in members:
            for node in (0, 1, 2, -1):
                on_node = [m for m in members if shares.node(m) == node]
                assert shares.node_members(members, node) == (on_node if node >= 0 else [m for m in members if 10 <= m < 12])
                relays = {shares.relay(members, reader, m) for m in on_node}
                if node < 0 or node == shares.node(reader) or len(on_node) < 2:
                    assert relays <= {None}, (members, reader, node, relays)
                else:
                    assert len(relays) == 1 and relays <= set(on_node), (members, reader, node, relays)
        relayed = [item for rank in range(16) for item in shares.relayed(rank)]
        for item in items:  # once per other node where two or more of its ranks need it
            other_nodes = [n for n in (0, 1, 2) if n != shares.node(item.reader)
                           and len([m for m in members if shares.node(m) == n]) >= 2]
            assert relayed.count(item) == len(other_nodes), (members, item)
        if members == range(16):  # turns: node 1's four ranks each relay some reader's items
            assert all(shares.relayed(rank) for rank in range(4, 8))
    # an HSDP replicate group (every 4th rank) over nodes of 8: each node's two members take turns too
    members = range(1, 32, 4)
    shares = ReadShares(tuple(SharedItem("f", 100 * r, 10, r, members) for r in members),
                        tuple((8 * n, n) for n in range(4)))
    assert all(shares.relayed(rank) for rank in members), [shares.relayed(rank) for rank in members]


def test_metadata_goes_to_each_node_once_along_a_tree_of_log2_hops():
    """The leaders' tree (metadata_share): every leader but the reader gets the bytes from exactly
    one other, that one sends them on to it, nobody sends more than log2(nodes) times, and every
    rank's leader is its node's first rank ("" = a node of its own)."""
    from asyncckpt.loading.metadata_share import nodes_of, tree_children, tree_parent

    for count in range(1, 70):
        parents = {child: index for index in range(count) for child in tree_children(index, count)}
        assert sorted(parents) == list(range(1, count)), count
        assert all(tree_parent(child) == parent for child, parent in parents.items()), count
        assert max(len(tree_children(i, count)) for i in range(count)) == (count - 1).bit_length(), count
    nodes = nodes_of(["a", "a", "b", "", "b", "c"])
    assert nodes.leaders == (0, 2, 3, 5) and nodes.leader_of == (0, 0, 2, 3, 2, 5) and nodes.shared
    assert not nodes_of(["a", "b", ""]).shared


def _spread_over_four_nodes(rank: int, world: int, out: str) -> None:
    """Ranks 0, 1 one node, ranks 2, 3, 4 a node each: leaders 0, 2, 3, 4, and rank 4 gets the bytes
    from rank 2 (the tree's relay), not from rank 0."""
    import asyncckpt.loading.metadata_share as metadata_share
    from asyncckpt.loading.broadcast import broadcast_blobs, load_group

    keys = ["a", "a", "b", "c", "d"]
    blobs = [None, bytes(range(256)) * 4096, b"sidecar", b""] if rank == 0 else None
    sources = []
    recv = dist.recv

    def counted_recv(tensor, src=None, **kwargs):
        sources.append(src)
        return recv(tensor, src=src, **kwargs)

    metadata_share.dist.recv = counted_recv
    try:
        got = metadata_share.spread_blobs(blobs, 4, load_group(), "test", keys, broadcast_blobs)
    finally:
        metadata_share.dist.recv = recv
    assert got == [None, bytes(range(256)) * 4096, b"sidecar", b""], [len(b) if b else b for b in got]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"from": sorted(set(sources))}, f)


def test_metadata_relayed_by_a_leader_reaches_every_node(tmp_path):
    """Five ranks as four nodes: the bytes reach each leader once, rank 4's through rank 2 (a leader
    passes them on), and rank 1 through its node's file; every rank holds them exactly."""
    before = set(os.listdir("/dev/shm"))
    run_ranks(_spread_over_four_nodes, 5, str(tmp_path), timeout_s=180)
    came_from = [json.loads((tmp_path / f"rank{r}.json").read_text())["from"] for r in range(5)]
    assert came_from == [[], [], [0], [0], [2]], came_from
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("asyncckpt-load-")]


@pytest.mark.parametrize("fstype, shared", [("ext4", True), ("nfs4", True), ("fuse.mountpoint-s3", False), ("fuse", False),
                                            ("fuse.fuse-overlayfs", True), ("fuseblk", True)])
def test_only_a_file_system_with_a_page_cache_is_read_through_it_by_a_nodes_ranks(tmp_path, monkeypatch, fstype, shared):
    """A local path is read by each rank of a node itself (their page cache reads it once), but not
    on a FUSE mount: an object store mounted as files may cache nothing, so there the node's
    ranks get a shared item through shared memory, as from the object store itself (FUSE over
    local disks, a rootless container's fuse-overlayfs root or fuseblk, is a file system)."""
    from asyncckpt.loading.opened import open_checkpoint
    from asyncckpt.loading.safe_reader import SafeReader
    from asyncckpt.storage import mounts

    path = saved_step_one(str(tmp_path / "root"), replicated_state())
    info = tmp_path / "mountinfo"
    info.write_text(f"22 1 0:21 / / rw - ext4 /dev/vda rw\n40 22 0:30 / {os.path.realpath(tmp_path)} rw - {fstype} x rw\n")
    monkeypatch.setattr(mounts, "MOUNTINFO", str(info))
    assert SafeReader(open_checkpoint(path)).page_cache_shared() is shared
