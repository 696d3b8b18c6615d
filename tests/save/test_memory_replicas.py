"""The memory tier across nodes (CheckpointConfig(memory_replicas=R)): each worker sends its sealed
copy to a worker on another node, so a restart after losing a node restores from memory; the wire
refuses a stranger and keeps only whole copies. Nodes are simulated on loopback: 4 ranks as 2
nodes of 2 ranks, each node with its own memory_dir and `node_of`; losing a node = its memory_dir
wiped (its processes are gone: the whole job restarts)."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time

import pytest
import torch
import torch.distributed as dist

from asyncckpt import AsyncCheckpointer, CheckpointConfig, load
from asyncckpt.layout import list_checkpoints
from asyncckpt.memory_file import NotACopy, memory_file_name, read_copy, root_key
from asyncckpt.replica_server import CopyServer
from asyncckpt.replica_wire import Address, Expected, Push, Ranges, ReplicaError, listener, new_secret
from asyncckpt.save.replication import replica_targets
from conftest import assert_state_equal
from multirank import run_ranks


def node_of(rank: int) -> int:
    return rank // 2


def rank_state(rank: int, step: int) -> dict:
    """A state of rank-own tensors and tensors every rank holds (saved once, by one rank: a
    restart reads them from another rank's copy)."""
    return {f"own{rank}": torch.arange(1 << 18, dtype=torch.float32) * (rank + 1) + step,
            "shared": {"w": torch.arange(2048, dtype=torch.float64) + step, "b": torch.full((7,), float(step))},
            "step": step}


def zeros_of(state: dict) -> dict:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else zeros_of(v) if isinstance(v, dict) else v)
            for k, v in state.items()}


def node_config(shm: str, rank: int, replicas: int, **kw) -> CheckpointConfig:
    return CheckpointConfig(**{**dict(memory_tier=True, memory_dir=os.path.join(shm, f"node{node_of(rank)}"),
                                      memory_replicas=replicas, node_of=node_of, replica_host="127.0.0.1",
                                      worker_nice=None, worker_ionice=None, timeout_s=60.0, memory_keep=True), **kw})


def wait_for_copy(path: str, step: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if read_copy(path).step == step:
                return
        except NotACopy:
            pass
        assert time.monotonic() < deadline, f"{path} never held step {step}"
        time.sleep(0.05)


def _lose_nodes(rank: int, shm: str, nodes: list[int]) -> None:
    dist.barrier()
    if rank == 0:
        for node in nodes:
            shutil.rmtree(os.path.join(shm, f"node{node}"))
            os.mkdir(os.path.join(shm, f"node{node}"))
    dist.barrier()


def _restart(rank: int, root: str, shm: str, replicas: int):
    target = zeros_of(rank_state(rank, 0))
    with AsyncCheckpointer(root, node_config(shm, rank, replicas, memory_persist_restored=False)) as ckpt:
        step = ckpt.load_latest(target)
        return step, ckpt.resume_report, target


def _four_ranks_two_nodes(rank: int, world: int, root: str, shm: str) -> None:
    nodes = [node_of(r) for r in range(world)]
    with AsyncCheckpointer(root, node_config(shm, rank, 1)) as ckpt:
        for step in (1, 2, 3):  # 1 on disk, 2 and 3 in memory only
            ckpt.schedule_save(rank_state(rank, step), step=step, memory_only=step > 1)
            ckpt.finalize(blocking=True)
        for target in replica_targets(nodes, rank, 1):  # the copy of step 3 reached the other node
            wait_for_copy(os.path.join(shm, f"node{node_of(target)}", memory_file_name(root, rank)), 3)
        dist.barrier()
    assert [c.step for c in list_checkpoints(root)] == [1]

    _lose_nodes(rank, shm, [1])  # node 1 lost and replaced: its tier is empty
    step, report, target = _restart(rank, root, shm, 1)
    assert (step, report.source) == (3, "peer"), report
    assert_state_equal(target, rank_state(rank, 3))
    # node 1's ranks read from node 0 what they load, straight into their state: each its own copy
    # whole, and of the others' only the entries saved once by another rank (the "shared" ones)
    pulled = sorted((c.rank, c.into, c.nbytes, c.node) for c in report.pulled)
    assert [(r, into) for r, into, *_ in pulled if r == into] == [(2, 2), (3, 3)], pulled
    assert all(nbytes >= 1 << 20 for r, into, nbytes, _ in pulled if r == into), pulled  # own{rank}: 1 MiB
    assert all(nbytes < 64 << 10 for r, into, nbytes, _ in pulled if r != into), pulled
    assert all(into in (2, 3) and by == 0 for _, into, _, by in pulled), pulled
    assert not [n for n in os.listdir(os.path.join(shm, "node1")) if n.startswith(".")]  # nothing written there
    assert [c.step for c in list_checkpoints(root)] == [1]  # nothing read from nor written to the disk meanwhile

    _lose_nodes(rank, shm, [0, 1])  # both nodes: no copy is left anywhere
    step, report, target = _restart(rank, root, shm, 1)
    assert (step, report.source) == (1, "disk"), report
    assert_state_equal(target, rank_state(rank, 1))


def two_nodes(tmp_path) -> str:
    """The memory_dir of each simulated node, under one folder (returned)."""
    shm = tmp_path / "shm"
    for node in (0, 1):
        (shm / f"node{node}").mkdir(parents=True)
    return str(shm)


@pytest.mark.timeout(400)
def test_after_losing_a_node_the_restart_restores_from_the_other_nodes_copies(tmp_path):
    run_ranks(_four_ranks_two_nodes, 4, str(tmp_path / "ckpt"), two_nodes(tmp_path), timeout_s=360)


THREE_NODES = {0: 0, 1: 0, 2: 1, 3: 2}  # ranks 0 and 1 on node 0, rank 2 on node 1, rank 3 on node 2


def _damaged_holder(rank: int, world: int, root: str, shm: str) -> None:
    """R=2 over 3 nodes: rank 2's copy is on nodes 0 and 2 too. Node 1 is lost, and node 0's copy
    of rank 2 (the one rank 2 reads first: holders 0, 3, 1, nodes in turn, rotated by 2) damaged,
    one byte of a tensor (its header still reads): rank 2's restart finds the mismatch, leaves
    node 0's copy and reads node 2's. The restart persists what it restored (the default): rank 2
    holds no file of its copy, so its part is taken from the state just loaded; step 2 commits."""
    node_of3 = THREE_NODES.__getitem__
    config = dict(memory_dir=os.path.join(shm, f"node{node_of3(rank)}"), node_of=node_of3)
    with AsyncCheckpointer(root, node_config(shm, rank, 2, **config)) as ckpt:
        for step in (1, 2):
            ckpt.schedule_save(rank_state(rank, step), step=step, memory_only=step > 1)
            ckpt.finalize(blocking=True)
        for target in replica_targets([node_of3(r) for r in range(world)], rank, 2):
            wait_for_copy(os.path.join(shm, f"node{node_of3(target)}", memory_file_name(root, rank)), 2)
        dist.barrier()
    if rank == 0:
        damaged = os.path.join(shm, "node0", memory_file_name(root, 2))
        item = max(read_copy(damaged).items, key=lambda item: item.length)
        with open(damaged, "r+b") as file:
            file.seek(item.at + 100)
            byte = file.read(1)
            file.seek(item.at + 100)
            file.write(bytes([byte[0] ^ 0xFF]))
    _lose_nodes(rank, shm, [1])
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    logging.getLogger("asyncckpt").addHandler(handler)
    target = zeros_of(rank_state(rank, 0))
    with AsyncCheckpointer(root, node_config(shm, rank, 2, **config)) as ckpt:
        step = ckpt.load_latest(target)
        report = ckpt.resume_report
    assert (step, report.source) == (2, "peer"), report
    assert [c.step for c in list_checkpoints(root)] == [1, 2]  # persisted at close
    if rank == 0:
        disk = zeros_of(rank_state(2, 0))  # rank 2's part, from the disk: the state it had restored
        load(disk, next(c.path for c in list_checkpoints(root) if c.step == 2), no_dist=True)
        assert_state_equal(disk, rank_state(2, 2))
    assert_state_equal(target, rank_state(rank, 2))
    served = {c.node for c in report.pulled if c.rank == 2 and c.into == 2}
    assert served == {2}, report.pulled  # rank 2's own copy, from node 2's file
    if rank == 2:
        assert any("reading from other holders" in r.getMessage() and "node 0" in r.getMessage() for r in seen), \
            [r.getMessage() for r in seen]


@pytest.mark.timeout(400)
def test_a_damaged_copy_on_another_node_is_skipped_for_another_holder(tmp_path):
    shm = tmp_path / "shm"
    for node in (0, 1, 2):
        (shm / f"node{node}").mkdir(parents=True)
    run_ranks(_damaged_holder, 4, str(tmp_path / "ckpt"), str(shm), timeout_s=360)


def _without_replicas(rank: int, world: int, root: str, shm: str) -> None:
    with AsyncCheckpointer(root, node_config(shm, rank, 0)) as ckpt:
        for step in (1, 2):
            ckpt.schedule_save(rank_state(rank, step), step=step, memory_only=step > 1)
            ckpt.finalize(blocking=True)
    step, report, target = _restart(rank, root, shm, 0)  # each node holds its own ranks' copies only
    assert (step, report.source) == (1, "disk"), report
    assert_state_equal(target, rank_state(rank, 1))


@pytest.mark.timeout(300)
def test_without_replicas_two_nodes_restart_from_the_disk(tmp_path):
    run_ranks(_without_replicas, 4, str(tmp_path / "ckpt"), two_nodes(tmp_path), timeout_s=240)


def _four_save(rank: int, world: int, root: str, shm: str) -> None:
    nodes = [node_of(r) for r in range(world)]
    with AsyncCheckpointer(root, node_config(shm, rank, 1)) as ckpt:
        for step in (1, 2):
            ckpt.schedule_save(rank_state(rank, step), step=step, memory_only=step > 1)
            ckpt.finalize(blocking=True)
        for target in replica_targets(nodes, rank, 1):
            wait_for_copy(os.path.join(shm, f"node{node_of(target)}", memory_file_name(root, rank)), 2)
        dist.barrier()


def _two_restart(rank: int, world: int, root: str, shm: str) -> None:
    """Two ranks, both on node 0, which holds every copy of the four-rank job's step 2."""
    step, report, target = _restart(rank, root, shm, 1)
    assert (step, report.source) == (1, "disk"), report
    assert_state_equal(target, rank_state(rank, 1))


@pytest.mark.timeout(400)
def test_a_job_restarted_with_another_world_size_loads_from_the_disk(tmp_path):
    root, shm = str(tmp_path / "ckpt"), two_nodes(tmp_path)
    run_ranks(_four_save, 4, root, shm, timeout_s=240)
    held = sorted(read_copy(os.path.join(shm, "node0", memory_file_name(root, r))).step for r in range(4))
    assert held == [2, 2, 2, 2]  # node 0 holds the whole step 2 of the four ranks
    run_ranks(_two_restart, 2, root, shm, timeout_s=240)


# placement ----------------------------------------------------------------------------------------

def test_placement_sends_each_copy_to_other_nodes_so_any_r_lost_nodes_leave_one():
    nodes = [r // 4 for r in range(16)]  # 4 nodes of 4 ranks
    for replicas in (1, 2, 3):
        for rank in range(16):
            targets = replica_targets(nodes, rank, replicas)
            assert len(targets) == replicas and all(nodes[t] != nodes[rank] for t in targets)
        for lost in _subsets(range(4), replicas):
            for rank in range(16):
                keepers = {nodes[rank], *(nodes[t] for t in replica_targets(nodes, rank, replicas))}
                assert keepers - set(lost), (replicas, lost, rank)
    assert replica_targets([0, 0, 0], 1, 1) == []  # one node: nowhere to send


def _subsets(items, k):
    items = list(items)
    if k == 0:
        yield ()
        return
    for i, item in enumerate(items):
        for rest in _subsets(items[i + 1:], k - 1):
            yield (item, *rest)


# the wire -----------------------------------------------------------------------------------------

@pytest.fixture
def sealed_copy(tmp_path):
    """A real sealed copy of rank 0 of a 1-rank job, and an empty 'other node' to send it to."""
    root, here, there = str(tmp_path / "ckpt"), tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    config = CheckpointConfig(memory_tier=True, memory_dir=str(here), memory_keep=True, worker_nice=None,
                              worker_ionice=None, timeout_s=60.0)
    with AsyncCheckpointer(root, config) as ckpt:
        ckpt.schedule_save({"w": torch.arange(1 << 20, dtype=torch.float32), "step": 5}, step=5, memory_only=True)
        ckpt.finalize(blocking=True)
    path = str(here / memory_file_name(root, 0))
    expected = Expected(str(there), root_key(root), 1, lambda rank: memory_file_name(root, rank))
    return path, read_copy(path), expected


def _server(expected: Expected, secret: bytes, **kw) -> CopyServer:
    return CopyServer(listener("127.0.0.1"), secret, expected, **kw).start()


def test_a_pushed_copy_is_kept_whole_under_its_ranks_name(sealed_copy):
    path, copy, expected = sealed_copy
    secret = new_secret()
    server = _server(expected, secret, put=True, get=False)
    try:
        sent = Push(Address(*server.address), secret, path, 0, copy.token, 30.0).run()
    finally:
        server.stop()
    assert sent == os.path.getsize(path)
    kept = read_copy(expected.path_of(0))
    assert (kept.step, kept.token) == (5, copy.token)
    with open(path, "rb") as a, open(expected.path_of(0), "rb") as b:
        assert a.read() == b.read()
    assert os.stat(expected.path_of(0)).st_mode & 0o777 == 0o600


def test_a_connection_without_the_jobs_secret_is_refused_and_nothing_written(sealed_copy, caplog):
    path, copy, expected = sealed_copy
    server = _server(expected, new_secret(), put=True, get=True)
    try:
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            with pytest.raises(ReplicaError):
                Push(Address(*server.address), new_secret(), path, 0, copy.token, 30.0).run()
            with pytest.raises(ReplicaError):  # a restart's read of it
                Ranges(Address(*server.address), new_secret(), 0, copy.token, [(0, 100)], 30.0)
    finally:
        server.stop()
    assert os.listdir(expected.directory) == []
    assert "does not know this job's secret" in caplog.text


def test_a_read_from_a_peer_that_trickles_its_bytes_ends_within_its_bound(tmp_path):
    """A peer that answers and then sends a byte every 20 ms never trips the socket's per-receive
    timeout; a restart's read of its copy still gives up once timeout_s has passed in all."""
    from asyncckpt.replica_wire import NONCE_BYTES, receive_exactly, send_message

    sock, stop = listener("127.0.0.1"), threading.Event()

    def trickle() -> None:
        conn, _ = sock.accept()
        with conn:
            conn.sendall(os.urandom(NONCE_BYTES))
            head = receive_exactly(conn, 32 + 4)
            receive_exactly(conn, int.from_bytes(head[32:], "little"))  # the request
            send_message(conn, {"length": 1 << 20, "size": 1 << 20})
            while not stop.is_set():
                try:
                    conn.sendall(b"x")
                except OSError:
                    return
                time.sleep(0.02)

    def pulling() -> None:
        try:
            Ranges(Address(*sock.getsockname()[:2]), new_secret(), 0, "token", [(0, 1 << 20)], 1.0).receive(
                memoryview(bytearray(1 << 20)))
        except ReplicaError as exc:
            outcome.append(exc)

    outcome: list = []
    threading.Thread(target=trickle, daemon=True).start()
    puller = threading.Thread(target=pulling, daemon=True)
    puller.start()
    puller.join(15)  # (without the bound: 1 MiB at 50 bytes a second)
    stop.set()
    sock.close()
    assert not puller.is_alive(), "the read was still receiving 15 s later"
    assert outcome and "time ran out" in str(outcome[0])


def test_a_holder_that_stops_mid_read_fails_the_read_and_is_blamed(tmp_path):
    """A restart reading another node's copy straight into its state: the holder closes half-way
    (killed). The read fails at once, naming the holder, and the load blames that node's file
    (the restart then reads it from another holder, or the disk)."""
    from asyncckpt.errors import PartialLoadError
    from asyncckpt.loading.peer_source import Holder, PeerFiles, RemoteCopy
    from asyncckpt.replica_wire import NONCE_BYTES, receive_exactly, send_message

    sock = listener("127.0.0.1")

    def half_then_gone() -> None:
        conn, _ = sock.accept()
        with conn:
            conn.sendall(os.urandom(NONCE_BYTES))
            head = receive_exactly(conn, 32 + 4)
            receive_exactly(conn, int.from_bytes(head[32:], "little"))
            send_message(conn, {"length": 1 << 20, "size": 1 << 20})
            conn.sendall(bytes(1 << 19))

    threading.Thread(target=half_then_gone, daemon=True).start()
    path = str(tmp_path / "copy-of-rank-3")
    holder = Holder(5, "node-b", Address(*sock.getsockname()[:2]))
    source = PeerFiles({path: RemoteCopy(3, "token", (holder,))}, new_secret(), 30.0)
    target = bytearray(1 << 20)
    started = time.monotonic()
    with pytest.raises(PartialLoadError, match="from rank 5 .*sender stopped"):
        with source.piece(path, 0, len(target)):
            source.read_into(path, 0, [memoryview(target)], "own3")
    assert time.monotonic() - started < 10
    assert source.failed == {("copy-of-rank-3", "node-b")}
    sock.close()


def test_a_copy_that_does_not_fit_is_refused_before_a_byte_is_received(tmp_path, monkeypatch):
    """Its file system has less room than the copy: ENOSPC at once (the sender is not waited for)."""
    import errno
    import socket
    from types import SimpleNamespace

    from asyncckpt.replica_wire import ItemChecks, receive_file

    monkeypatch.setattr(os, "fstatvfs", lambda fd: SimpleNamespace(f_bavail=10, f_frsize=4096))
    ours, theirs = socket.socketpair()
    with ours, theirs, pytest.raises(OSError) as raised:
        receive_file(ours, str(tmp_path / "copy"), 1 << 20, ItemChecks(()))
    assert raised.value.errno == errno.ENOSPC


def test_a_received_copys_items_are_checked_as_they_arrive_in_any_pieces():
    """The receiver checks each item's CRC32C from the pieces as they land (not by reading the
    copy again): pieces that cut items anywhere, an empty item, a gap between items."""
    from asyncckpt.formats import crc32c
    from asyncckpt.memory_file import StoredItem
    from asyncckpt.replica_wire import ItemChecks

    data = bytearray(os.urandom(10_000))
    places = [(3500, 6000), (0, 3000), (3000, 0)]
    items = [StoredItem(at, n, crc32c(bytes(data[at:at + n]))) for at, n in places]
    for damage in (None, 4000, 2999):
        if damage is not None:
            data[damage] ^= 0xFF
        checks = ItemChecks(items)
        for at in range(0, len(data), 777):
            checks.feed(at, memoryview(data)[at:at + 777])
        found = checks.damaged()
        assert (found.at if found else None) == {None: None, 4000: 3500, 2999: 0}[damage]
        if damage == 4000:
            data[damage] ^= 0xFF  # only the item at 0 damaged next
    checks = ItemChecks(items[1:])
    for at in range(0, len(data), 4096):
        checks.feed(at, memoryview(data)[at:at + 4096])
    assert checks.damaged().at == 0


def test_a_damaged_copy_is_not_kept(sealed_copy, tmp_path, caplog):
    path, copy, expected = sealed_copy
    item = next(i for i in copy.items if i.length > 1000)
    with open(path, "r+b") as file:  # one byte of a tensor flipped: header fine, CRC not
        file.seek(item.at + 100)
        byte = file.read(1)
        file.seek(item.at + 100)
        file.write(bytes([byte[0] ^ 0xFF]))
    secret = new_secret()
    server = _server(expected, secret, put=True, get=False)
    try:
        with caplog.at_level(logging.WARNING, logger="asyncckpt"), pytest.raises(ReplicaError, match="checksum"):
            Push(Address(*server.address), secret, path, 0, copy.token, 30.0).run()
    finally:
        server.stop()
    assert os.listdir(expected.directory) == []  # (a restart's reader checks what it reads: see above)


def test_a_push_cancelled_half_way_leaves_nothing(sealed_copy, monkeypatch):
    """A newer save begins (or the sender dies) mid-transfer: the receiver keeps nothing."""
    import asyncckpt.replica_wire as wire

    path, copy, expected = sealed_copy
    monkeypatch.setattr(wire, "CHUNK", 4096)  # many pieces, so the cancel lands half-way
    secret = new_secret()
    server = _server(expected, secret, put=True, get=False)
    push = Push(Address(*server.address), secret, path, 0, copy.token, 30.0)
    sent_pieces = threading.Event()
    real_sendfile = wire.socket.socket.sendfile

    def slow_sendfile(sock, file, offset=0, count=None):
        if offset > 64 * 4096:
            sent_pieces.set()
            time.sleep(0.01)
        return real_sendfile(sock, file, offset, count)

    monkeypatch.setattr(wire.socket.socket, "sendfile", slow_sendfile)
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(_run(push)))
    thread.start()
    assert sent_pieces.wait(30)
    push.cancel()
    thread.join(30)
    server.stop()
    assert outcome and isinstance(outcome[0], ReplicaError) and "cancelled" in str(outcome[0])
    deadline = time.monotonic() + 10
    while os.listdir(expected.directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.listdir(expected.directory) == []


def _run(push: Push):
    try:
        return push.run()
    except ReplicaError as exc:
        return exc


def test_a_worker_keeps_only_the_copies_of_the_ranks_it_keeps_for(sealed_copy):
    """A push for a rank this worker does not keep copies of (its own, a misplaced one) is refused."""
    path, copy, expected = sealed_copy
    secret = new_secret()
    server = _server(expected, secret, put=True, get=False, keeps=frozenset({1}))
    try:
        with pytest.raises(ReplicaError):  # (the refusal, or the reset of a send it did not read)
            Push(Address(*server.address), secret, path, 0, copy.token, 30.0).run()
    finally:
        server.stop()
    assert os.listdir(expected.directory) == []
