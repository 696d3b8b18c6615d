"""Several ranks: per-save blocked time and time to durable, asyncckpt vs dcp.async_save.

Runs 2 gloo ranks on this machine (each with its own per-rank state, so nothing is deduplicated)
and one single-process asyncckpt run with the same per-rank state for comparison.

    python benchmarks/bench_ranks.py --mb-per-rank 256 --saves 5 --out bench_out/ranks.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from asyncckpt import AsyncCheckpointer, CheckpointConfig


@dataclass
class RankResult:
    method: str
    ranks: int
    mb_per_rank: int
    first_blocked_s: float
    blocked_s: float  # median over steady-state saves
    durable_s: float  # median: schedule call to commit done
    collectives_per_save: float


def make_state(rank: int, mb: int) -> dict:
    """Per-rank tensors of mixed sizes (64 KiB .. 16 MiB) plus small items."""
    sizes, total, i = [], 0, 0
    while total < mb << 20:
        size = (64 << 10) << (i % 9)
        sizes.append(size)
        total += size
        i += 1
    gen = torch.Generator().manual_seed(rank)
    tensors = {f"rank{rank}.t{j}": torch.randn(s // 4, generator=gen) for j, s in enumerate(sizes)}
    return {"tensors": tensors, "meta": {"rank": rank, "name": "bench"}}


def mutate(state: dict) -> None:
    for t in list(state["tensors"].values())[:4]:
        t.add_(1.0)


def run_asyncckpt(rank: int, state: dict, root: str, saves: int) -> tuple[list, list, list]:
    blocked, durable, collectives = [], [], []
    with AsyncCheckpointer(root, CheckpointConfig()) as ckpt:
        for step in range(saves + 1):
            _barrier()
            started = time.perf_counter()
            ckpt.schedule_save(state, step=step)
            blocked.append(time.perf_counter() - started)
            mutate(state)
            [report] = ckpt.finalize(blocking=True)
            durable.append(time.perf_counter() - started)
            collectives.append(report.collectives)
    return blocked, durable, collectives


def run_dcp_async(rank: int, state: dict, root: str, saves: int) -> tuple[list, list, list]:
    blocked, durable = [], []
    for step in range(saves + 1):
        _barrier()
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=os.path.join(root, f"step_{step}"))
        blocked.append(time.perf_counter() - started)
        mutate(state)
        future.result()
        durable.append(time.perf_counter() - started)
    return blocked, durable, []


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank_main(rank: int, world: int, port: int, method: str, mb: int, saves: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        state = make_state(rank, mb)
        runner = run_asyncckpt if method == "asyncckpt" else run_dcp_async
        blocked, durable, collectives = runner(rank, state, root, saves)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"blocked": blocked, "durable": durable, "collectives": collectives}, f)
    finally:
        dist.destroy_process_group()


def measure(method: str, world: int, mb: int, saves: int, workdir: str) -> RankResult:
    root = os.path.join(workdir, f"{method}-{world}")
    out = os.path.join(workdir, f"{method}-{world}.json")
    print(f"  running {method} on {world} rank(s), {mb} MiB per rank, {saves} saves ...", file=sys.stderr, flush=True)
    if world == 1:
        blocked, durable, collectives = run_asyncckpt(0, make_state(0, mb), root, saves)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank_main, args=(world, port, method, mb, saves, root, out), nprocs=world, start_method="spawn")
        with open(out) as f:
            data = json.load(f)
        blocked, durable, collectives = data["blocked"], data["durable"], data["collectives"]
    shutil.rmtree(root, ignore_errors=True)
    return RankResult(
        method, world, mb, blocked[0], statistics.median(blocked[1:]), statistics.median(durable[1:]),
        statistics.mean(collectives[1:]) if collectives else float("nan"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb-per-rank", type=int, default=256)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--out", default="bench_out/ranks.json")
    args = parser.parse_args()
    workdir = args.dir or tempfile.mkdtemp(prefix="bench_ranks_")
    os.makedirs(workdir, exist_ok=True)
    results = [
        measure("asyncckpt", 1, args.mb_per_rank, args.saves, workdir),
        measure("asyncckpt", 2, args.mb_per_rank, args.saves, workdir),
        measure("dcp.async_save", 2, args.mb_per_rank, args.saves, workdir),
    ]
    print(f"\n{'method':<16}{'ranks':>6}{'MiB/rank':>10}{'first blocked s':>17}{'blocked s':>11}{'durable s':>11}{'collectives':>13}")
    for r in results:
        print(f"{r.method:<16}{r.ranks:>6}{r.mb_per_rank:>10}{r.first_blocked_s:>17.3f}{r.blocked_s:>11.4f}"
              f"{r.durable_s:>11.3f}{r.collectives_per_save:>13.1f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump([asdict(r) for r in results], f, indent=1)
    if not args.dir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
