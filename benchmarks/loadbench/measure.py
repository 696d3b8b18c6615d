"""bench_load.py's measuring: the raw-read ceiling, cold and warm timings with peak memory, the
rows taken in turns, the table and its ratios, and the restart and S3 fixtures it loads from."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from savebench.measure import PeakSampler, family_pss
from asyncckpt import AsyncCheckpointer, CheckpointConfig
from asyncckpt.loading.byte_sources import LocalFiles
from asyncckpt.memory_file import memory_file_name


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
