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
                               ranks read over the checkpoint's size (loadbench/ddp.py). --ddp-only: just these.
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
import contextlib
from concurrent.futures import ThreadPoolExecutor
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from savebench.measure import PeakSampler, family_pss  # noqa: E402
from savebench.state import build_state, state_tensors  # noqa: E402
from loadbench import ddp  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt import AsyncCheckpointer, CheckpointConfig  # noqa: E402
from asyncckpt.loading.byte_sources import LocalFiles  # noqa: E402
from asyncckpt.memory_file import memory_file_name  # noqa: E402

MiB = 1 << 20
RAW_CHUNK = 8 * MiB
RAW_PIECE = 64 * MiB
RAW_ROWS = ("raw read, 1 thread", f"raw read, {LocalFiles.threads} threads")


@dataclass
class LoadResult:
    method: str
    cold_s: Optional[float] = None
    warm_s: Optional[float] = None
    cold_extra_mib: Optional[float] = None
    warm_extra_mib: Optional[float] = None
    error: Optional[str] = None


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)


def drop_cache(path: str) -> None:
    """fsync every file under `path` and drop its pages from the page cache."""
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    """A target of the same structure: tensors allocated and touched, objects to be replaced."""
    target = {k: (v if not isinstance(v, (list, dict, str, int)) else None) for k, v in state.items()}
    target["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    target["optim"] = {k: torch.zeros_like(v) for k, v in state["optim"].items()}
    target["extra"] = {k: None for k in state["extra"]}
    return target


def data_files(path: str) -> list[str]:
    return [f for f in files_under(path) if not os.path.basename(f).startswith(".")]


def raw_read(path: str, dest: memoryview, threads: int) -> None:
    """The fastest honest read of the checkpoint's data: every byte of its data files lands in
    `dest` (a touched buffer of their size, as a load fills its targets), by positional reads of
    RAW_CHUNK, in RAW_PIECE pieces spread over `threads` threads. No metadata, no checksum."""
    pieces, at = [], 0
    for file in data_files(path):
        size = os.path.getsize(file)
        pieces += [(file, offset, min(RAW_PIECE, size - offset), at + offset) for offset in range(0, size, RAW_PIECE)]
        at += size

    def read(piece: tuple[str, int, int, int]) -> None:
        file, offset, n, to = piece
        fd = os.open(file, os.O_RDONLY)
        try:
            done = 0
            while done < n:
                got = os.preadv(fd, [dest[to + done:to + min(n, done + RAW_CHUNK)]], offset + done)
                if got == 0:
                    raise OSError(f"{file}: ends at {offset + done}")
                done += got
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(read, pieces))


def check_equal(target: dict[str, Any], state: dict[str, Any]) -> None:
    for group in ("model", "optim"):
        for key, value in state[group].items():
            if not torch.equal(target[group][key], value):
                raise AssertionError(f"{group}.{key} loaded wrong")


def measure(name: str, path: str, load: Callable[[], None], repeat: int, exclude: frozenset[int] = frozenset()) -> LoadResult:
    """Median seconds of `repeat` cold and `repeat` warm loads, then one more of each with the
    memory sampler running (sampling /proc every 5 ms slows the load it watches, so it never
    runs during a timed one): its peak extra PSS, leaving out the processes in `exclude`. An
    object-store path (a URL) is measured warm only."""
    result = LoadResult(name)
    try:
        for mode in ("cold", "warm") if "://" not in path else ("warm",):
            times = []
            if mode == "warm":
                load()  # warms the page cache (and the method)
            for _ in range(repeat):
                if mode == "cold":
                    drop_cache(path)
                t0 = time.perf_counter()
                load()
                times.append(time.perf_counter() - t0)
            if mode == "cold":
                drop_cache(path)
            base = family_pss(exclude)
            sampler = PeakSampler(interval_s=0.005, exclude=exclude)
            sampler.start()
            load()
            extra = sampler.stop().peak - base
            setattr(result, f"{mode}_s", statistics.median(times))
            setattr(result, f"{mode}_extra_mib", max(0, extra) / MiB)
    except Exception as exc:  # a row that fails says why; the others still run
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    print(f"  {name}: {result}", file=sys.stderr)
    return result


def render(results: list[LoadResult], state_bytes: int) -> str:
    def cell(seconds: Optional[float]) -> str:
        return "-" if seconds is None else f"{seconds:.3f} ({state_bytes / seconds / 1e9:.2f})"

    def mib(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.0f}"

    header = f"{'method':<34} {'cold s (GB/s)':>15} {'warm s (GB/s)':>15} {'cold +MiB':>9} {'warm +MiB':>9}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.method:<34} {cell(r.cold_s):>15} {cell(r.warm_s):>15} {mib(r.cold_extra_mib):>9} {mib(r.warm_extra_mib):>9}"
            + (f"  {r.error}" if r.error else "")
        )
    return "\n".join(lines)


def ratios(results: list[LoadResult]) -> dict[str, Optional[float]]:
    by = {r.method: r for r in results}

    def ratio(a: str, b: str, mode: str) -> Optional[float]:
        x, y = getattr(by[a], f"{mode}_s", None), getattr(by[b], f"{mode}_s", None)
        return None if not x or not y else x / y

    fastest = {mode: min((r for r in results if r.method in RAW_ROWS and getattr(r, f"{mode}_s")),
                         key=lambda r: getattr(r, f"{mode}_s"), default=None) for mode in ("cold", "warm")}
    return {  # the acceptance figures
        "cold: fastest raw read time / asyncckpt.load time (>= 0.9)":
            fastest["cold"] and ratio(fastest["cold"].method, "asyncckpt.load", "cold"),
        "warm: fastest raw read time / asyncckpt.load time (>= 0.6)":
            fastest["warm"] and ratio(fastest["warm"].method, "asyncckpt.load", "warm"),
        "warm: dcp.load / asyncckpt.load, same files (>= 3)": ratio("dcp.load (asyncckpt files)", "asyncckpt.load", "warm"),
        "warm: dcp.load / asyncckpt.load, dcp.save files (>= 2)": ratio(
            "dcp.load (dcp.save files)", "asyncckpt.load (dcp.save files)", "warm"),
        "cold: dcp.load / asyncckpt.load, dcp.save files (>= 2)": ratio(
            "dcp.load (dcp.save files)", "asyncckpt.load (dcp.save files)", "cold"),
        "cold: restart from disk / restart from memory (>= 5)": ratio(
            "restart from disk (load_latest)", "restart from memory", "cold"),
        "s3 load / restart from memory (>= 20)": ratio("asyncckpt.load (s3)", "restart from memory", "warm")
        if "asyncckpt.load (s3)" in by else None,
    }


def in_turns(path: str, loads: list[tuple[str, Callable[[], None]]], rounds: int) -> dict[str, dict[str, float]]:
    """Median seconds per mode and method of loads taken in turns: every round loads once with
    each method cold (pages dropped before each), then once each warm. On a shared box a busy
    spell then slows every method alike, where the table's rows, measured one method after
    another, can each catch a different spell (runs here moved the warm ratio from 0.36 to 0.69
    with the same code)."""
    times: dict[str, dict[str, list[float]]] = {mode: {name: [] for name, _ in loads} for mode in ("cold", "warm")}
    for _ in range(rounds):
        for mode in ("cold", "warm"):  # the cold round's loads leave every file in the page cache
            for name, load in loads:
                if mode == "cold":
                    drop_cache(path)
                t0 = time.perf_counter()
                load()
                times[mode][name].append(time.perf_counter() - t0)
    return {mode: {name: statistics.median(t) for name, t in by_name.items()} for mode, by_name in times.items()}


def turn_ratios(medians: dict[str, dict[str, float]]) -> dict[str, Optional[float]]:
    """The raw-read goals from loads taken in turns: fastest raw read / asyncckpt.load."""
    return {f"{mode}, taken in turns: fastest raw read time / asyncckpt.load time (>= {goal})":
            min(medians[mode][name] for name in RAW_ROWS) / medians[mode]["asyncckpt.load"]
            for mode, goal in (("cold", 0.9), ("warm", 0.6))}


@contextlib.contextmanager
def restart_rows(root: str, state: dict[str, Any], target_box: list):
    """A root whose newest save is committed and held by the memory tier (kept past close), and a
    checkpointer with and one without the tier on it: yields the two rows' load functions. A
    restart costs the same process start and construction either way: what differs is load_latest."""
    memory = CheckpointConfig(memory_tier=True, memory_keep=True)
    with AsyncCheckpointer(root, memory) as ckpt:
        ckpt.schedule_save(state, step=1)
    with AsyncCheckpointer(root, memory) as from_memory, AsyncCheckpointer(root) as from_disk:
        def restart(ckpt: AsyncCheckpointer, source: str) -> Callable[[], None]:
            def load() -> None:
                ckpt.load_latest(target_box[0])
                assert ckpt.resume_report.source == source, ckpt.resume_report
            return load

        try:
            yield [("restart from memory", restart(from_memory, "memory")),
                   ("restart from disk (load_latest)", restart(from_disk, "disk"))]
        finally:
            os.unlink(os.path.join(memory.memory_dir, memory_file_name(root, 0)))


@contextlib.contextmanager
def local_s3(workdir: str, checkpoint: str):
    """A moto_server on loopback (the tests' helper) holding the files of `checkpoint` under
    PREFIX, with the environment msc reads; yields (its pid, the checkpoint's s3:// URL)."""
    from asyncckpt.testing import s3_server

    os.makedirs(workdir, exist_ok=True)
    server = s3_server.MotoServer.start(workdir)
    config_path = os.path.join(workdir, "msc_config.yaml")
    env = s3_server.session_env(config_path, server.endpoint)
    saved_env = {name: os.environ.get(name) for name in (*env, "AWS_PROFILE")}
    try:
        server.create_bucket(s3_server.BUCKET)
        s3_server.write_msc_config(config_path, {s3_server.PROFILE: server.endpoint})
        os.environ.update(env)
        os.environ.pop("AWS_PROFILE", None)
        client = server.s3_client()
        for name in os.listdir(checkpoint):
            with open(os.path.join(checkpoint, name), "rb") as f:
                client.put_object(Bucket=s3_server.BUCKET, Key=f"bench/{name}", Body=f)
        yield server.process.pid, f"s3://{s3_server.BUCKET}/bench"
    finally:
        server.stop()
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
    args = parser.parse_args(argv)
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
        ddp_rows = ddp.ddp_rows(paths["torch_save"], args.ddp_ranks, args.repeat) if args.ddp_ranks > 1 else []
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


def _ddp_only(state: dict[str, Any], path: str, args) -> int:
    """The DDP restart rows alone (a quick run on a busy box)."""
    with AsyncCheckpointer(config=CheckpointConfig()) as ckpt:
        ckpt.schedule_save(state, checkpoint_dir=path)
    rows = ddp.ddp_rows(path, args.ddp_ranks, args.repeat)
    state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(state))
    print(f"\nrestart, {state_bytes / MiB:.0f} MiB state, {args.ddp_ranks} gloo ranks, one run, median of {args.repeat} "
          f"rounds taken in turns\n{ddp.render(rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"state_bytes": state_bytes, "ddp_restart": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
