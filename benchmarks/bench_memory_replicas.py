"""The memory tier across nodes (CheckpointConfig(memory_replicas=R)), on one box: 4 gloo ranks as
2 "nodes" of 2 (each node its own memory_dir under /dev/shm, `node_of`, loopback addresses).

1. Blocked time, R=1 against R=0: two checkpointers per rank on two roots, memory-only saves
   alternating (the order rotates each round); a save's replication runs in its worker meanwhile.
   Median of --saves; goal R=1 <= 1.05x R=0.
2. Replication time: from a save's finalize to its copy landing, checked whole, on the other node
   (every rank's at once, as in a job), against a plain loopback `sendfile` of the same bytes by
   every rank at once, received into memory. Median; goal <= 1.5x. Also, for what the box costs:
   the same sendfile written on into a new tmpfs file (memory the node keeps, as a replica).
3. Restart (load_latest, the slowest rank), alternating: every rank's copy local (each node holds
   its ranks' copies and the other node's replicas); node 1 lost (its memory_dir wiped: it pulls
   the copies from node 0); the cold disk (a committed checkpoint of the same state, its pages
   dropped, no tier). Median of --restarts; goals: lost node <= 1.5x local, >= 2x faster than disk.

    python benchmarks/bench_memory_replicas.py --mb-per-rank 256 --saves 9 --restarts 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loadbench.measure import drop_cache  # noqa: E402

from asyncckpt import AsyncCheckpointer, CheckpointConfig  # noqa: E402
from asyncckpt.memory_file import NotACopy, memory_file_name, read_copy  # noqa: E402
from asyncckpt.save.replication import replica_targets  # noqa: E402

WORLD = 4
TENSORS = 16


def node_of(rank: int) -> int:
    return rank // 2


def rank_state(rank: int, nbytes: int, step: int) -> dict:
    numel = nbytes // 4 // TENSORS
    return {**{f"r{rank}.t{i}": torch.full((numel,), float(step + i)) for i in range(TENSORS)}, "step": step}


def config(shm: str, rank: int, replicas: int, **kw) -> CheckpointConfig:
    return CheckpointConfig(memory_tier=True, memory_dir=os.path.join(shm, f"node{node_of(rank)}"),
                            memory_replicas=replicas, node_of=node_of, replica_host="127.0.0.1", keep_last=1, **kw)


def slowest(seconds: float) -> float:
    box = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def wait_landed(path: str, token: str, deadline: float) -> None:
    while True:
        try:
            if read_copy(path).token == token:
                return
        except NotACopy:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never held save {token[:8]}")
        time.sleep(0.002)


def plain_sendfile(path: str, rank: int, into_file: Optional[str] = None) -> float:
    """Every rank sends its copy's bytes to another rank's receiving thread at once (loopback TCP,
    sendfile): seconds of this rank's send, to the last byte taken. Received into one reused 8 MiB
    buffer, or with `into_file` written on into that new file (tmpfs: memory the node keeps, as a
    replica is; removed after)."""
    server = socket.create_server(("127.0.0.1", 0))
    ports = [None] * WORLD
    dist.all_gather_object(ports, server.getsockname()[1])
    sink = bytearray(8 << 20)

    def take() -> None:
        conn, _ = server.accept()
        with conn, (open(into_file, "wb") if into_file else contextlib.nullcontext()) as file:
            size = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
            view, got = memoryview(sink), 0
            while got < size:
                n = conn.recv_into(view)
                if not n:
                    break
                if file is not None:
                    file.write(view[:n])
                got += n
            conn.sendall(b"k")

    receiver = threading.Thread(target=take)
    receiver.start()
    target = (rank + 2) % WORLD  # the other node
    dist.barrier()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", ports[target])) as sock, open(path, "rb") as file:
        sock.sendall(os.path.getsize(path).to_bytes(8, "little"))
        sock.sendfile(file)
        sock.recv(1)
    took = time.perf_counter() - started
    receiver.join()
    server.close()
    if into_file:
        os.unlink(into_file)
    return took


def run(rank: int, args: argparse.Namespace, store: str, work: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    shm = os.path.join(args.shm, os.path.basename(work))
    nbytes = args.mb_per_rank << 20
    results: dict[str, list[float]] = {}
    try:
        # 1 and 2: blocked time, replication time
        roots = {0: os.path.join(work, "r0"), 1: os.path.join(work, "r1")}
        ckpts = {r: AsyncCheckpointer(roots[r], config(shm, rank, r)) for r in (0, 1)}
        state = rank_state(rank, nbytes, 0)
        for ckpt in ckpts.values():
            ckpt.prepare(state)
            ckpt.schedule_save(state, step=0, memory_only=True)
            ckpt.finalize(blocking=True)
        targets = replica_targets([node_of(r) for r in range(WORLD)], rank, 1)
        landing = os.path.join(shm, f"node{node_of(targets[0])}", memory_file_name(roots[1], rank))
        for step in range(1, args.saves + 1):
            for replicas in ((0, 1) if step % 2 else (1, 0)):
                dist.barrier()
                ckpts[replicas].schedule_save(state, step=step, memory_only=True)
                done = ckpts[replicas].finalize(blocking=True)[-1]
                results.setdefault(f"blocked R={replicas}", []).append(slowest(done.blocked_s))
                if replicas == 1:
                    started = time.perf_counter()
                    token = read_copy(ckpts[1]._memory.path).token
                    wait_landed(landing, token, time.monotonic() + 120)
                    results.setdefault("replication", []).append(slowest(time.perf_counter() - started))
                    results.setdefault("plain sendfile", []).append(
                        slowest(plain_sendfile(ckpts[1]._memory.path, rank)))
                    sink = os.path.join(shm, f"node{node_of(targets[0])}", f"plain-sendfile-{rank}")
                    results.setdefault("plain sendfile to a file", []).append(
                        slowest(plain_sendfile(ckpts[1]._memory.path, rank, into_file=sink)))
        for ckpt in ckpts.values():
            ckpt.close()

        # 3: restarts
        root, disk_root = os.path.join(work, "restart"), os.path.join(work, "disk")
        with AsyncCheckpointer(root, config(shm, rank, 1, memory_keep=True)) as ckpt:
            state = rank_state(rank, nbytes, 7)
            ckpt.schedule_save(state, step=7, memory_only=True)
            ckpt.finalize(blocking=True)
            token = read_copy(ckpt._memory.path).token
            wait_landed(os.path.join(shm, f"node{node_of(targets[0])}", memory_file_name(root, rank)), token,
                        time.monotonic() + 120)
            dist.barrier()  # every copy landed before any worker (a receiver) stops
        with AsyncCheckpointer(disk_root, CheckpointConfig()) as ckpt:
            ckpt.schedule_save(state, step=7)
        target = rank_state(rank, nbytes, -1)
        node1, kept = os.path.join(shm, "node1"), os.path.join(shm, "node1-as-saved")
        if rank == 2:
            shutil.copytree(node1, kept)  # node 1 as the saves left it: its ranks' copies and node 0's
        for n in range(args.restarts):
            for row in ("local", "lost node", "disk"):
                dist.barrier()
                if rank == 2 and row != "disk":  # lost: wiped; local: as saved (a restart from peers keeps
                    shutil.rmtree(node1)         # only the items it read of the other node's copies)
                    shutil.copytree(kept, node1) if row == "local" else os.mkdir(node1)
                if row == "disk":
                    drop_cache(disk_root)
                dist.barrier()
                use_tier = row != "disk"
                with AsyncCheckpointer(root if use_tier else disk_root,
                                       config(shm, rank, 1, memory_keep=True, memory_persist_restored=False)
                                       if use_tier else CheckpointConfig()) as ckpt:
                    started = time.perf_counter()
                    step = ckpt.load_latest(target)
                    took = slowest(time.perf_counter() - started)
                    source = ckpt.resume_report.source
                expect = {"local": "memory", "lost node": "peer", "disk": "disk"}[row]
                assert (step, source) == (7, expect), (row, step, source)
                results.setdefault(f"restart: {row}", []).append(took)
                for key, value in target.items():
                    if isinstance(value, torch.Tensor) and not torch.equal(value, state[key]):
                        raise AssertionError(f"{row}: {key} loaded wrong")
            if rank == 0:
                print(f"  restarts {n + 1}/{args.restarts}", flush=True)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb-per-rank", type=int, default=256)
    parser.add_argument("--saves", type=int, default=9)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--shm", default="/dev/shm")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.makedirs("bench_out", exist_ok=True)
    work = os.path.abspath(tempfile.mkdtemp(prefix="bench_memory_replicas-", dir="bench_out"))
    shm = os.path.join(args.shm, os.path.basename(work))
    for node in (0, 1):
        os.makedirs(os.path.join(shm, f"node{node}"))
    out = os.path.join(work, "results.json")
    print(f"memory tier across nodes: {WORLD} ranks as 2 nodes, {args.mb_per_rank} MiB per rank", flush=True)
    try:
        mp.start_processes(run, args=(args, os.path.join(work, "store"), work, out), nprocs=WORLD, start_method="spawn")
        with open(out) as f:
            results = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    med = {name: statistics.median(values) for name, values in results.items()}
    print(f"\n{'row':<28} {'median s':>9}  ratio")
    rows = [("blocked R=0", None, ""), ("blocked R=1", "blocked R=0", "R=1 / R=0 (goal <= 1.05)"),
            ("plain sendfile", None, ""), ("plain sendfile to a file", None, ""),
            ("replication", "plain sendfile", "/ plain sendfile (goal <= 1.5)"),
            ("replication ", "plain sendfile to a file", "/ plain sendfile into a tmpfs file (info)"),
            ("restart: local", None, ""), ("restart: lost node", "restart: local", "/ local (goal <= 1.5)"),
            ("restart: disk", "restart: lost node", "disk / lost node (goal >= 2)")]
    for name, base, what in rows:
        ratio = f"{med[name.strip()] / med[base]:.2f}x {what}" if base else ""
        print(f"{name:<28} {med[name.strip()]:>9.3f}  {ratio}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"mb_per_rank": args.mb_per_rank, "seconds": results, "medians": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
