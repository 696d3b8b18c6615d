"""Side-by-side load benchmark: asyncckpt.load against what a user would otherwise resume with.

One state (savebench.state.build_state: float32/bf16 tensors of mixed sizes plus small items), saved
once per format to the same disk, then loaded in one process run, each method cold (every file
fsynced and its pages dropped with posix_fadvise(DONTNEED)) and warm (just read once):

  raw read, 1 thread           the asyncckpt checkpoint's data files into one buffer of their size, 8 MiB preads
  raw read, N threads          the same on as many threads as asyncckpt.load reads with (64 MiB pieces);
                               the faster of the two is the ceiling the ratios use
  torch.load                   a torch.save file of the state
  dcp.load (asyncckpt files)   stock dcp.load on an asyncckpt checkpoint (torch_save format)
  dcp.load (dcp.save files)    stock dcp.load on a dcp.save checkpoint
  asyncckpt.load               asyncckpt.load on an asyncckpt checkpoint (torch_save, safetensors)
  asyncckpt.load (dcp.save)    asyncckpt.load on the dcp.save checkpoint
  restart from memory           load_latest of a root whose newest save the memory tier holds (/dev/shm; cold:
                               the disk's pages dropped, the tier is memory), beside load_latest from the disk
  N-rank DDP restart            --ddp-ranks (default 4) gloo ranks each loading the whole checkpoint: shared (the job's
                               process group: .metadata and every item read by one rank, sent to the others)
                               against every rank reading on its own, taken in turns; with the storage bytes all
                               ranks read over the checkpoint's size, and cold the bytes fetched from the disk
                               (loadbench/ddp.py). --ddp-only: just these; with --s3 also from the S3 server.
  .metadata to the ranks       --metadata-only: how `.metadata`'s bytes reach the ranks (plain broadcast, a node at
                               a time on one node and as two nodes; loadbench/metadata.py)
  with --s3, warm only, the torch_save checkpoint put on a local S3 server (moto_server, loopback):
  asyncckpt.load (s3)          ranged GETs on a pool of threads
  dcp.load (msc reader, s3)    stock dcp.load with multi-storage-client's MultiStorageFileSystemReader

The raw-read ratios also come from the raw reads and asyncckpt.load taken in turns (--turns rounds,
each loading once with each of them cold, then warm): on a shared box, rows measured one after
another catch different busy spells.

Loads go into preallocated tensors (torch.load allocates its own). Figures: median seconds of
--repeat loads, GB/s of tensor bytes, and the peak extra PSS (this process and its children,
sampled by pss_sampler.py, in one more load: never during a timed one) over the PSS before it.

    python benchmarks/bench_load.py --size-mb 512 --out bench_out/bench_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from savebench.state import build_state, state_tensors  # noqa: E402
from loadbench import ddp, metadata  # noqa: E402
from loadbench.measure import (MiB, RAW_ROWS, check_equal, data_files, empty_like_state,  # noqa: E402
                               in_turns, local_s3, measure, ratios, raw_read, render, restart_rows, turn_ratios)

import asyncckpt  # noqa: E402
from asyncckpt import AsyncCheckpointer, CheckpointConfig  # noqa: E402
from asyncckpt.loading.byte_sources import LocalFiles  # noqa: E402

def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=512, help="tensor bytes of the state (default 512)")
    parser.add_argument("--repeat", type=int, default=3, help="loads per method and mode; the median is shown (default 3)")
    parser.add_argument("--turns", type=int, default=7,
                        help="rounds of the raw reads and asyncckpt.load taken in turns, for the raw-read ratios (default 7)")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir under bench_out/)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--s3", action="store_true", help="add the object-store rows (a local moto_server; warm only)")
    parser.add_argument("--ddp-ranks", type=int, default=4, help="ranks of the DDP restart rows (0: none; default 4)")
    parser.add_argument("--ddp-only", action="store_true", help="only the DDP restart rows")
    parser.add_argument("--metadata-only", action="store_true", help="only the .metadata rows (16 and 256 MiB)")
    args = parser.parse_args(argv)
    if args.metadata_only:
        print(metadata.metadata_rows(args.ddp_ranks, [16, 256], max(args.repeat, 5)))
        return 0
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    os.makedirs("bench_out", exist_ok=True)
    root = args.dir or tempfile.mkdtemp(prefix="bench_load-", dir="bench_out")
    try:
        state = build_state(args.size_mb * MiB)
        state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(state))
        print(f"state: {len(state_tensors(state))} tensors, {state_bytes / MiB:.0f} MiB; saving ...", file=sys.stderr)
        paths = {fmt: os.path.join(root, fmt) for fmt in ("torch_save", "safetensors")}
        if args.ddp_only:
            return _ddp_only(state, paths["torch_save"], args)
        for fmt, path in paths.items():
            with AsyncCheckpointer(config=CheckpointConfig(format=fmt)) as ckpt:
                ckpt.schedule_save(state, checkpoint_dir=path)
        paths["dcp"] = os.path.join(root, "dcp")
        dcp.save(state, checkpoint_id=paths["dcp"], no_dist=True)
        paths["torch"] = os.path.join(root, "state.pt")
        torch.save(state, paths["torch"])
        target = empty_like_state(state)
        raw_dest = torch.ones(sum(os.path.getsize(f) for f in data_files(paths["torch_save"])), dtype=torch.uint8)
        raw_view = memoryview(raw_dest.numpy())

        def dcp_load(path: str) -> Callable[[], None]:
            return lambda: dcp.load(target, checkpoint_id=path, no_dist=True)

        def ours(path: str) -> Callable[[], None]:
            return lambda: asyncckpt.load(target, path, no_dist=True)

        rows = [
            (RAW_ROWS[0], paths["torch_save"], lambda: raw_read(paths["torch_save"], raw_view, 1)),
            (RAW_ROWS[1], paths["torch_save"], lambda: raw_read(paths["torch_save"], raw_view, LocalFiles.threads)),
            ("torch.load", paths["torch"], lambda: torch.load(paths["torch"], weights_only=True)),
            ("dcp.load (asyncckpt files)", paths["torch_save"], dcp_load(paths["torch_save"])),
            ("dcp.load (dcp.save files)", paths["dcp"], dcp_load(paths["dcp"])),
            ("asyncckpt.load", paths["torch_save"], ours(paths["torch_save"])),
            ("asyncckpt.load (safetensors)", paths["safetensors"], ours(paths["safetensors"])),
            ("asyncckpt.load (dcp.save files)", paths["dcp"], ours(paths["dcp"])),
        ]
        results = []
        for name, path, load in rows:
            results.append(measure(name, path, load, args.repeat))
            if name.startswith(("dcp.load", "asyncckpt.load")):
                check_equal(target, state)
                target = empty_like_state(state)  # the next method starts from zeros again
        in_turn_loads = [(name, load) for name, _, load in rows[:2]] + [("asyncckpt.load", ours(paths["torch_save"]))]
        turns = in_turns(paths["torch_save"], in_turn_loads, args.turns)
        check_equal(target, state)
        target = empty_like_state(state)
        box = [target]
        with restart_rows(os.path.join(root, "restart"), state, box) as restarts:
            for name, load in restarts:
                results.append(measure(name, os.path.join(root, "restart"), load, args.repeat))
                check_equal(box[0], state)
                box[0] = empty_like_state(state)
        target = box[0]
        if args.s3:
            with local_s3(os.path.join(root, "s3"), paths["torch_save"]) as (pid, url):
                from multistorageclient.contrib.torch import MultiStorageFileSystemReader

                def msc_reader() -> None:
                    reader = MultiStorageFileSystemReader(url, thread_count=LocalFiles.threads)
                    dcp.load(target, storage_reader=reader, no_dist=True)

                for name, load in (("asyncckpt.load (s3)", ours(url)), ("dcp.load (msc reader, s3)", msc_reader)):
                    results.append(measure(name, url, load, args.repeat, exclude=frozenset([pid])))
                    check_equal(target, state)
                    target = empty_like_state(state)
        raw_dest = torch.ones(sum(os.path.getsize(f) for f in data_files(paths["torch_save"])), dtype=torch.uint8)
        raw_view = memoryview(raw_dest.numpy())
        ddp_rows = _ddp_rows(paths["torch_save"], args, root) if args.ddp_ranks > 1 else []
        table = render(results, state_bytes) + ("\n\n" + ddp.render(ddp_rows) if ddp_rows else "")
        figures = {**ratios(results), **turn_ratios(turns)}
        print(f"\nload, {state_bytes / MiB:.0f} MiB state, {len(state_tensors(state))} tensors, one run, "
              f"median of {args.repeat}; "
              f"asyncckpt: {LocalFiles.threads} threads, {LocalFiles.piece_bytes // MiB} MiB pieces read "
              f"{LocalFiles.step_bytes >> 10} KiB per preadv\n{table}\n")
        for text, value in figures.items():
            print(f"{text}: {'-' if value is None else f'{value:.2f}'}")
        print(f"taken in turns, median s of {args.turns} rounds: " + "; ".join(
            f"{mode} " + ", ".join(f"{name} {t:.3f}" for name, t in by_name.items()) for mode, by_name in turns.items()))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"state_bytes": state_bytes, "threads": LocalFiles.threads, "piece_bytes": LocalFiles.piece_bytes,
                           "results": [asdict(r) for r in results], "ratios": figures,
                           "ddp_restart": [asdict(r) for r in ddp_rows],
                           "in_turns": {"rounds": args.turns, "median_s": turns}}, f, indent=1)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def _ddp_rows(path: str, args, root: str) -> list:
    """The DDP restart rows of the checkpoint at `path`; with --s3 also of a copy on a local S3 server."""
    rows = ddp.ddp_rows(path, args.ddp_ranks, args.repeat)
    if args.s3:
        with local_s3(os.path.join(root, "s3-ddp"), path) as (_, url):
            rows += ddp.ddp_rows(path, args.ddp_ranks, args.repeat, stored_at=url)
    return rows


def _ddp_only(state: dict[str, Any], path: str, args) -> int:
    """The DDP restart rows alone (a quick run on a busy box)."""
    with AsyncCheckpointer(config=CheckpointConfig()) as ckpt:
        ckpt.schedule_save(state, checkpoint_dir=path)
    rows = _ddp_rows(path, args, os.path.dirname(path))
    state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(state))
    print(f"\nrestart, {state_bytes / MiB:.0f} MiB state, {args.ddp_ranks} gloo ranks, one run, median of {args.repeat} "
          f"rounds taken in turns\n{ddp.render(rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"state_bytes": state_bytes, "ddp_restart": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
