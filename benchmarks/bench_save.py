"""Side-by-side save benchmark: asyncckpt against the baselines a user would otherwise pick.

Every method saves the SAME in-memory state (default 1 GiB of float32/bf16 tensors of mixed sizes
plus a few plain Python items) to the SAME disk directory, in one process run, so the numbers are
comparable even on a noisy shared disk (docs/benchmark.md):

  raw_write            one sequential file of the same byte count, fsync'd (disk ceiling)
  memcpy               copy of every tensor into reused host buffers on the threads asyncckpt's eager
                       staging uses (copy ceiling)
  torch.save+fsync     torch.save(state, path) then fsync
  dcp.save             torch.distributed.checkpoint.save (sync, no process group)
  dcp.async_save thread / process (process with a reused CPU-safe DefaultStager; DCP's process
                       mode needs a process group: "process" runs without one as a user would
                       try first, "process+gloo" inside a one-rank gloo group)
  asyncckpt thread / process / lazy / no-checksums / nice0 / safetensors / budget
  asyncckpt s3         asyncckpt to s3://BUCKET/PREFIX on a local S3 server (moto_server on loopback,
                       started for the row and stopped after it; skipped, with the reason, without one)

Per method: a first save (reported apart) and --saves steady-state saves. Figures: caller-blocked
seconds, seconds to durable, throughput as a fraction of the raw-write ceiling measured in the same
run (pooled, plus a probe written just before the method), peak extra PSS (trainer + descendants)
over the state size, and the slowdown of a CPU compute loop while a save is in flight. A progress
line on stderr (redrawn in place on a terminal) counts the saves done and the time spent.

    python benchmarks/bench_save.py --quick --plot bench_out/quick.png
    python benchmarks/bench_save.py --size-mb 1024 --saves 5 --out bench_out/bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import psutil
import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
for _path in (REPO_ROOT, BENCH_DIR):  # asyncckpt from this checkout; pss_sampler beside this file
    if _path not in sys.path:
        sys.path.insert(0, _path)

from pss_sampler import pss_bytes  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
ALL_METHODS = (
    "raw_write",
    "memcpy",
    "torch.save+fsync",
    "dcp.save",
    "dcp.async_save thread",
    "dcp.async_save process",
    "dcp.async_save process+gloo",
    "asyncckpt thread",
    "asyncckpt process",
    "asyncckpt lazy",
    "asyncckpt no-checksums",
    "asyncckpt nice0",
    "asyncckpt safetensors",
    "asyncckpt budget",
    "asyncckpt s3",
)


def log(message: str) -> None:
    """A log line on stderr (the table goes to stdout)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Progress:
    """One status line on stderr, e.g. `[bench] 23/84 saves  asyncckpt thread save 3/5  02:41 elapsed`.

    On a terminal it is redrawn in place (log lines go above it); otherwise it is printed as a plain
    line when a method starts and at most every `interval_s` seconds. Redrawn only when something
    happens (no ticker thread: it would take GIL time from the methods being measured)."""

    def __init__(self, total: int, stream=None, interval_s: float = 10.0) -> None:
        self.total = total
        self.done = 0
        self.label = ""
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s
        self.start = time.monotonic()
        self._last_print = -math.inf
        self._shown = False  # a status line is on the terminal's last line

    def line(self) -> str:
        elapsed = int(time.monotonic() - self.start)
        return f"[bench] {self.done}/{self.total} saves  {self.label}  {elapsed // 60:02d}:{elapsed % 60:02d} elapsed"

    def update(self, label: Optional[str] = None, done: Optional[int] = None, force: bool = False) -> None:
        """Set the label and/or the saves done, and show the line (on a non-terminal: if `force`
        or `interval_s` has passed since the last one)."""
        if label is not None:
            self.label = label
        if done is not None:
            self.done = done
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line())
            self.stream.flush()
            self._shown = True
        elif force or now - self._last_print >= self.interval_s:
            print(self.line(), file=self.stream, flush=True)
            self._last_print = now

    def saved(self) -> None:
        """One more save done."""
        self.update(done=self.done + 1)

    def log(self, message: str) -> None:
        """A log line, kept above the status line on a terminal."""
        if self._shown:
            self.stream.write("\r\x1b[K")
        log(message)
        if self._shown:
            self.stream.write(self.line())
            self.stream.flush()

    def close(self) -> None:
        """Leave the final status on a line of its own."""
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line() + "\n")
            self.stream.flush()
            self._shown = False
        else:
            print(self.line(), file=self.stream, flush=True)


class Skip(Exception):
    """The method cannot be measured here; the row keeps the reason."""


# state ---------------------------------------------------------------------------------------------
@dataclass
class StateInfo:
    """What the benchmark state holds."""

    tensor_bytes: int
    tensors: int
    float32: int
    bfloat16: int
    smallest: int
    largest: int
    objects: int


def build_state(total_bytes: int, seed: int = 0) -> dict[str, Any]:
    """A DCP state dict of mixed-size float32/bf16 tensors (4 KiB .. 64 MiB) plus small items.

    Half the draws are small (4-256 KiB: biases, norms), half large (256 KiB .. min(64 MiB,
    total/8)), log-uniform; bf16 goes under "model", float32 under "optim"."""
    gen = torch.Generator().manual_seed(seed)
    largest = max(256 * KiB, min(64 * MiB, total_bytes // 8))
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    remaining, i = total_bytes, 0
    while remaining >= 4 * KiB:
        lo, hi = (4 * KiB, 256 * KiB) if i % 2 == 0 else (256 * KiB, largest)
        u = torch.rand(1, generator=gen).item()
        nbytes = min(remaining, int(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))))
        nbytes -= nbytes % 4
        bf16 = torch.rand(1, generator=gen).item() < 0.35
        dtype = torch.bfloat16 if bf16 else torch.float32
        numel = nbytes // (2 if bf16 else 4)
        cols = 1024 if numel >= 1024 * 4 else 1
        tensor = torch.randn(numel // cols, cols, generator=gen, dtype=torch.float32).to(dtype)
        (model if bf16 else optim)[f"layer{i:04d}.weight"] = tensor
        remaining -= tensor.numel() * tensor.element_size()
        i += 1
    return {
        "model": model,
        "optim": optim,
        "step": 0,
        "run_name": "bench_save",
        "lr_schedule": [1e-3, 5e-4, 2.5e-4],
        "extra": {"epoch": 3, "tags": ["bench", "cpu"]},
    }


def state_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of the state, in a stable order."""
    return [t for group in ("model", "optim") for t in state[group].values()]


def describe_state(state: dict[str, Any]) -> StateInfo:
    """Byte count and composition of the state."""
    tensors = state_tensors(state)
    sizes = [t.numel() * t.element_size() for t in tensors]
    return StateInfo(
        tensor_bytes=sum(sizes),
        tensors=len(tensors),
        float32=sum(t.dtype == torch.float32 for t in tensors),
        bfloat16=sum(t.dtype == torch.bfloat16 for t in tensors),
        smallest=min(sizes),
        largest=max(sizes),
        objects=sum(1 for key in state if key not in ("model", "optim")),
    )


def mutate(state: dict[str, Any], step: int) -> None:
    """Change the state a little, in place, so every save writes new values."""
    state["step"] = step
    for t in state_tensors(state)[step % 16 :: 16]:
        t.add_(1e-3)


# measurement helpers -------------------------------------------------------------------------------
def family_pss(exclude: frozenset[int] = frozenset()) -> int:
    """PSS of this process plus all its descendants (asyncckpt workers, forked writers, daemons),
    leaving out the processes in `exclude` and their descendants (services such as a local S3
    server, which are not the trainer's memory)."""
    me = psutil.Process()
    left_out = set(exclude)
    for pid in exclude:
        try:
            left_out.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            pass
    try:
        children = [c for c in me.children(recursive=True) if c.pid not in left_out]
    except psutil.Error:
        children = []
    return pss_bytes(me.pid) + sum(pss_bytes(c.pid) for c in children)


@dataclass
class PeakMemory:
    """Peak PSS of the trainer and its descendants over a sampling window."""

    peak: int = 0
    trainer: int = 0  # at the peak
    descendants: int = 0  # at the peak
    samples: int = 0


class PeakSampler:
    """Peak PSS of the trainer + descendants, sampled every `interval_s` by a separate process
    (benchmarks/pss_sampler.py), so sampling never holds this process's GIL."""

    SCRIPT = os.path.join(BENCH_DIR, "pss_sampler.py")

    def __init__(self, interval_s: float = 0.02, exclude: frozenset[int] = frozenset()) -> None:
        self.interval_s = interval_s
        self.exclude = exclude  # descendants left out, with their subtrees (see family_pss)
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        exclude = ",".join(str(pid) for pid in sorted(self.exclude))
        self._proc = subprocess.Popen(
            [sys.executable, self.SCRIPT, str(os.getpid()), str(self.interval_s), exclude],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self._proc.stdout.readline()  # "ready": it samples from now on

    def stop(self) -> PeakMemory:
        proc, self._proc = self._proc, None
        if proc is None:
            return PeakMemory()
        try:
            out, _ = proc.communicate("stop\n", timeout=30)
            data = json.loads(out.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            proc.kill()
            proc.wait()
            return PeakMemory()
        return PeakMemory(data["peak"], data["root"], data["descendants"], data["samples"])


class ComputeLoop:
    """A fixed CPU-bound "training step" (small matmuls) whose time shows interference.

    It runs with `threads` torch threads (default 1): with 2 threads on a 2-core box, any other
    runnable thread turns every parallel matmul into a barrier stall, and the ratio measures the
    scheduler more than the save."""

    def __init__(self, dim: int = 256, target_step_s: float = 0.025, threads: int = 1) -> None:
        self.dim = dim
        self.threads = threads
        self.a = torch.randn(dim, dim)
        self.b = torch.randn(dim, dim)
        self.c = torch.empty(dim, dim)
        self.iters = 1
        with self.own_threads():
            self.calibrate(target_step_s)

    @contextlib.contextmanager
    def own_threads(self):
        """Run the enclosed steps with this loop's torch thread count, then restore it."""
        saved = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(saved)

    def calibrate(self, target_step_s: float) -> None:
        """Pick the matmul count per step so an uncontended step takes about `target_step_s`.
        Uses the fastest of several batches: other tenants of the box only ever add time."""
        for _ in range(20):
            torch.mm(self.a, self.b, out=self.c)
        batches = []
        for _ in range(15):
            start = time.perf_counter()
            for _ in range(10):
                torch.mm(self.a, self.b, out=self.c)
            batches.append((time.perf_counter() - start) / 10)
        self.iters = max(1, round(target_step_s / min(batches)))

    def step(self) -> float:
        start = time.perf_counter()
        for _ in range(self.iters):
            torch.mm(self.a, self.b, out=self.c)
        return time.perf_counter() - start

    def run(self, steps: int) -> list[float]:
        return [self.step() for _ in range(steps)]


def tensor_bytes_view(tensor: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU tensor. Not via `.numpy()`: that marks the storage
    non-resizable for good, which makes asyncckpt copy it into fresh shared memory every save."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def fsync_path(path: str) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(path: str) -> int:
    """Bytes on disk under `path` (a file or a directory tree)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def remove(path: str) -> None:
    """Delete a file or a directory tree if it exists."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def remove_output(method: "Method", step: int) -> None:
    """Delete what one save wrote (the disk is shared; outputs never pile up)."""
    method.discard(step)


def short_error(exc: BaseException) -> str:
    """The exception's class and message on one line (DCP wraps the cause; keep its last line)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    tail = [line for line in lines if "Error" in line or "Exception" in line]
    message = tail[-1] if tail else (lines[0] if lines else type(exc).__name__)
    return message if len(message) <= 240 else message[:237] + "..."


# methods -------------------------------------------------------------------------------------------
class Method:
    """One way of saving. `begin` returns when the caller is free; `poll` says durable without
    waiting; `end` waits until durable. Sync methods do everything in `begin`."""

    name = "?"
    sync = True

    def __init__(self, state: dict[str, Any], workdir: str) -> None:
        self.state = state
        self.workdir = workdir
        self.note = ""

    def prepare(self) -> None:
        """Start what the method needs beside the trainer (a server), before the memory baseline;
        raise Skip if it cannot. The processes it starts go in `outside_pids`."""

    def outside_pids(self) -> frozenset[int]:
        """Descendant processes that are not the saving side (left out of the memory figures)."""
        return frozenset()

    def setup(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)

    def begin(self, step: int) -> None:
        raise NotImplementedError

    def poll(self) -> bool:
        return True

    def end(self) -> dict[str, Any]:
        """Wait until durable; return extra figures of this save."""
        return {}

    def output_of(self, step: int) -> str:
        return os.path.join(self.workdir, f"step_{step:06d}")

    def output_size(self, step: int) -> int:
        """Bytes one save wrote."""
        out = self.output_of(step)
        return tree_bytes(out) if out else 0

    def discard(self, step: int) -> None:
        """Delete what one save wrote."""
        out = self.output_of(step)
        if out:
            remove(out)

    def check_first(self, step: int) -> None:
        """Called once after the first save: raise Skip if the output is not what was asked."""

    def teardown(self) -> None:
        pass


class RawWrite(Method):
    """Sequential write of the tensor bytes into one file, fsync'd: the disk ceiling."""

    name = "raw_write"

    def begin(self, step: int) -> None:
        path = self.output_of(step)
        with open(path, "wb", buffering=16 * MiB) as f:
            for t in state_tensors(self.state):
                f.write(tensor_bytes_view(t))
            f.flush()
            os.fsync(f.fileno())


class Memcpy(Method):
    """Copy of every tensor into buffers allocated once and reused: the copy ceiling.

    The first save also faults the buffer's pages in (cold copy); later saves are warm. It copies
    with asyncckpt's own staging copy (worker/staging.py, `StagingPool.copy_in`) in this process,
    with the eager-staging thread count: the same copy, without the worker hand-off, so "blocked /
    memcpy" is what the hand-off and planning cost on top."""

    name = "memcpy"

    def setup(self) -> None:
        from asyncckpt.config import eager_staging_threads
        from asyncckpt_worker.staging import StagingPool

        tensors = state_tensors(self.state)
        total = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)
        self.slab = torch.empty(total, dtype=torch.uint8)  # not yet faulted in
        self.views, offset = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            self.views.append(self.slab[offset : offset + n].view(t.dtype).view(t.shape))
            offset += -(-n // 64) * 64  # 64-byte aligned, like the staging pool
        self.threads = eager_staging_threads()
        self.copier = StagingPool()
        self.note = f"{self.threads} thread(s)"

    def begin(self, step: int) -> None:
        saved = torch.get_num_threads()
        torch.set_num_threads(1)  # as in the worker: each copy on one torch thread
        try:
            self.copier.copy_in(state_tensors(self.state), self.views, self.threads)
        finally:
            torch.set_num_threads(saved)

    def output_of(self, step: int) -> str:
        return ""

    def teardown(self) -> None:
        if getattr(self, "copier", None) is not None:
            self.copier.close()
            self.copier = None
        self.views, self.slab = [], None


class TorchSave(Method):
    """torch.save of the whole state into one file, then fsync."""

    name = "torch.save+fsync"

    def begin(self, step: int) -> None:
        path = self.output_of(step)
        torch.save(self.state, path)
        fsync_path(path)
        fsync_path(self.workdir)


class DcpSave(Method):
    """Synchronous torch.distributed.checkpoint.save without a process group."""

    name = "dcp.save"

    def begin(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, checkpoint_id=self.output_of(step))


class DcpAsync(Method):
    """dcp.async_save in THREAD mode, or PROCESS mode with a reused CPU-safe DefaultStager."""

    sync = False

    def __init__(self, state, workdir, process: bool, with_group: bool = False) -> None:
        super().__init__(state, workdir)
        self.process = process
        self.with_group = with_group
        self.name = "dcp.async_save " + ("process" if process else "thread") + ("+gloo" if with_group else "")
        self.stager = None
        self.future = None

    def setup(self) -> None:
        super().setup()
        if self.with_group:
            start_single_rank_group(os.path.join(self.workdir, "pg_store"))
        if self.process:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            options = StagingOptions(
                use_pinned_memory=False, use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=False
            )
            self.stager = DefaultStager(options)

    def begin(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        kwargs = {"async_stager": self.stager} if self.stager is not None else {}
        response = dcp.async_save(
            self.state, checkpoint_id=self.output_of(step), async_checkpointer_type=kind, **kwargs
        )
        staging = getattr(response, "staging_completion", None)
        if staging is not None:  # AsyncSaveResponse: the caller is free once staging completes
            staging.result()
        self.future = getattr(response, "upload_completion", response)

    def poll(self) -> bool:
        return self.future is None or self.future.done()

    def end(self) -> dict[str, Any]:
        if self.future is not None:
            future, self.future = self.future, None
            future.result()
        return {}

    def teardown(self) -> None:
        if self.future is not None:
            try:
                self.future.result()
            except BaseException:
                pass
        if self.stager is not None:
            self.stager.close()
        if self.with_group:
            stop_dcp_daemon()
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def start_single_rank_group(store_path: str) -> None:
    """A one-rank gloo process group (file store), which DCP's PROCESS mode insists on."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise Skip("a process group is already initialized")
    store = dist.FileStore(store_path, 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def stop_dcp_daemon() -> None:
    """End DCP's checkpoint daemon process so it does not linger into later methods (DCP keeps
    it in a private module global for the life of the trainer)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    daemon = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if daemon is not None:
        executor._CHECKPOINT_PROCESS = None
        daemon.__del__()  # sends TERMINATE, joins, terminates if needed


class AsyncCkpt(Method):
    """asyncckpt's AsyncCheckpointer with one CheckpointConfig variant."""

    sync = False

    def __init__(self, state, workdir, name: str, config_kwargs: dict[str, Any]) -> None:
        super().__init__(state, workdir)
        self.name = name
        self.config_kwargs = config_kwargs
        self.ckpt = None
        self.pending: list = []
        self.last_path: Optional[str] = None

    def setup(self) -> None:
        from asyncckpt import AsyncCheckpointer, CheckpointConfig

        try:
            config = CheckpointConfig(**self.config_kwargs)
        except (TypeError, ValueError) as exc:
            raise Skip(f"CheckpointConfig rejects {self.config_kwargs}: {exc}") from exc
        self.ckpt = AsyncCheckpointer(self.root, config)

    @property
    def root(self) -> str:
        """The checkpointer's root (a directory here; an object-store URL in AsyncCkptS3)."""
        return self.workdir

    def begin(self, step: int) -> None:
        self.ckpt.schedule_save(self.state, step)

    def poll(self) -> bool:
        self.pending.extend(self.ckpt.finalize())
        return bool(self.pending)

    def end(self) -> dict[str, Any]:
        start = time.perf_counter()
        self.ckpt.wait_staged()
        wait_staged_s = time.perf_counter() - start
        reports = self.pending + self.ckpt.finalize(blocking=True)
        self.pending = []
        report = reports[-1].as_dict()
        self.last_path = report.get("path")
        report["wait_staged_s"] = wait_staged_s
        return report

    def output_of(self, step: int) -> str:
        from asyncckpt.loading import step_dir_name

        return os.path.join(self.workdir, step_dir_name(step))

    def check_first(self, step: int) -> None:
        if self.config_kwargs.get("format") == "safetensors":
            self.note = check_safetensors_dir(self.output_of(step))

    def teardown(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None


class AsyncCkptS3(AsyncCkpt):
    """asyncckpt saving to `s3://BUCKET/PREFIX` on a local S3 server: moto_server on loopback,
    started by asyncckpt/testing/s3_server.py's MotoServer for this row and stopped in teardown (also after an
    error). The server's own memory is left out of the row's memory figures."""

    PREFIX = "bench"

    def __init__(self, state, workdir, name: str) -> None:
        super().__init__(state, workdir, name, {})
        self.server = None
        self.bucket = ""
        self._saved_env: dict[str, Optional[str]] = {}

    def prepare(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        try:  # the moto_server helper the tests use too; needs the test extras (moto[server], boto3)
            for module in ("boto3", "multistorageclient"):
                importlib.import_module(module)
            from asyncckpt.testing import s3_server
        except ImportError as exc:
            raise Skip(f"no local S3 server: needs the test extras (moto[server], boto3, "
                       f"multi-storage-client): {exc}") from exc
        try:
            self.server = s3_server.MotoServer.start(self.workdir)
        except (RuntimeError, OSError) as exc:
            raise Skip(f"no local S3 server: {exc}") from exc
        self.bucket = s3_server.BUCKET
        self.server.create_bucket(self.bucket)
        config_path = os.path.join(self.workdir, "msc_config.yaml")
        s3_server.write_msc_config(config_path, {s3_server.PROFILE: self.server.endpoint})
        env = s3_server.session_env(config_path, self.server.endpoint)
        # Set before the checkpointer starts, so its worker process inherits them; restored in teardown.
        self._saved_env = {name: os.environ.get(name) for name in (*env, "AWS_PROFILE")}
        os.environ.update(env)
        os.environ.pop("AWS_PROFILE", None)
        self.note = "local moto_server (its memory not counted)"

    def outside_pids(self) -> frozenset[int]:
        return frozenset([self.server.process.pid]) if self.server is not None else frozenset()

    @property
    def root(self) -> str:
        return f"s3://{self.bucket}/{self.PREFIX}"

    def output_of(self, step: int) -> str:
        return ""  # nothing on the local disk; see output_size / discard

    def _step_keys(self, step: int) -> list[tuple[str, int]]:
        from asyncckpt.loading import step_dir_name

        prefix = f"{self.PREFIX}/{step_dir_name(step)}/"
        pages = self.server.s3_client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [(item["Key"], item["Size"]) for page in pages for item in page.get("Contents", [])]

    def output_size(self, step: int) -> int:
        return sum(size for _, size in self._step_keys(step))

    def discard(self, step: int) -> None:
        """Delete the step's objects (moto keeps them in memory)."""
        keys = [key for key, _ in self._step_keys(step)]
        client = self.server.s3_client()
        for start in range(0, len(keys), 1000):
            batch = [{"Key": key} for key in keys[start : start + 1000]]
            client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if self.server is not None:
                self.server.stop()
                self.server = None
            for name, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            self._saved_env = {}


def check_safetensors_dir(path: str) -> str:
    """Raise Skip unless the tensor data under `path` is in safetensors files (objects may sit in
    a torch_save file of their own); return a short description of what was found."""
    from safetensors import safe_open

    files = [f for f in sorted(os.listdir(path)) if not f.startswith(".")]
    readable, tensors = [], 0
    for name in files:
        try:
            with safe_open(os.path.join(path, name), framework="pt") as f:
                tensors += len(list(f.keys()))
            readable.append(name)
        except Exception:
            continue
    if not readable or tensors == 0:
        raise Skip(
            f"format='safetensors' accepted and the save committed, but none of {files} opens as a "
            "safetensors file holding tensors (format ignored?)"
        )
    return f"{len(readable)}/{len(files)} files safetensors ({tensors} tensors)"


def make_method(name: str, state: dict[str, Any], root: str, state_bytes: int) -> Method:
    """The Method object for one name of ALL_METHODS."""
    workdir = os.path.join(root, name.replace(" ", "_").replace("+", "_").replace(".", "_"))
    simple: dict[str, Callable[..., Method]] = {
        "raw_write": RawWrite, "memcpy": Memcpy, "torch.save+fsync": TorchSave, "dcp.save": DcpSave,
    }
    if name in simple:
        return simple[name](state, workdir)
    if name.startswith("dcp.async_save"):
        return DcpAsync(state, workdir, process="process" in name, with_group=name.endswith("+gloo"))
    variants = {
        "asyncckpt thread": {},
        "asyncckpt process": {"io": "process"},
        "asyncckpt lazy": {"staging": "lazy"},
        "asyncckpt no-checksums": {"checksums": False},
        "asyncckpt nice0": {"worker_nice": 0},
        "asyncckpt safetensors": {"format": "safetensors"},
        "asyncckpt budget": {"staging_budget_bytes": max(MiB, state_bytes // 4)},
    }
    if name in variants:
        return AsyncCkpt(state, workdir, name, variants[name])
    if name == "asyncckpt s3":
        return AsyncCkptS3(state, workdir, name)
    raise ValueError(f"unknown method {name!r}; known: {', '.join(ALL_METHODS)}")


# results -------------------------------------------------------------------------------------------
@dataclass
class SaveSample:
    """One save as the caller saw it."""

    step: int
    blocked_s: float  # caller-blocked, measured here around the call
    durable_s: float  # call to durable (commit done), measured here
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the library's SaveReport


@dataclass
class Interference:
    """Compute-loop step times around one save (idle) and while it was in flight (busy)."""

    idle_step_s: list[float]
    busy_step_s: list[float]
    save_in_helper_thread: bool

    @property
    def slowdown(self) -> Optional[float]:
        """Median step time while the save is in flight ÷ median idle step time (robust to the
        odd spike from other tenants of the box)."""
        if not self.busy_step_s or not self.idle_step_s:
            return None
        return statistics.median(self.busy_step_s) / statistics.median(self.idle_step_s)

    @property
    def slowdown_mean(self) -> Optional[float]:
        """Mean in-flight step time ÷ median idle: includes bursts (and spikes)."""
        if not self.busy_step_s or not self.idle_step_s:
            return None
        return statistics.fmean(self.busy_step_s) / statistics.median(self.idle_step_s)


@dataclass
class MethodResult:
    """Everything measured for one method; the table and the JSON are built from these."""

    name: str
    status: str = "ok"  # ok | error | skipped
    note: str = ""
    setup_s: float = 0.0
    teardown_s: float = 0.0
    first: Optional[SaveSample] = None
    steady: list[SaveSample] = field(default_factory=list)
    output_bytes: int = 0
    baseline_pss: int = 0  # trainer + descendants just before setup
    memory: PeakMemory = field(default_factory=PeakMemory)  # setup, first and steady saves
    raw_probe_gbps: Optional[float] = None
    loadavg: tuple[float, float, float] = (0.0, 0.0, 0.0)  # 1/5/15-min load when the method started
    interference: list[Interference] = field(default_factory=list)

    @property
    def blocked(self) -> Optional[float]:
        return statistics.median(s.blocked_s for s in self.steady) if self.steady else None

    @property
    def durable(self) -> Optional[float]:
        return statistics.median(s.durable_s for s in self.steady) if self.steady else None

    @property
    def wait_staged(self) -> Optional[float]:
        values = [s.extra["wait_staged_s"] for s in self.steady if "wait_staged_s" in s.extra]
        return statistics.median(values) if values else None

    @property
    def slowdown(self) -> Optional[float]:
        values = [i.slowdown for i in self.interference if i.slowdown is not None]
        return statistics.median(values) if values else None

    @property
    def slowdown_mean(self) -> Optional[float]:
        values = [i.slowdown_mean for i in self.interference if i.slowdown_mean is not None]
        return statistics.median(values) if values else None

    @property
    def helper_thread(self) -> bool:
        """The slowdown was measured with this (blocking) method run in a helper thread."""
        return any(i.save_in_helper_thread for i in self.interference)

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text

    def extra_memory(self, state_bytes: int) -> Optional[float]:
        """Peak PSS over the baseline, as a multiple of the state's bytes."""
        if not self.memory.peak:
            return None
        return max(0, self.memory.peak - self.baseline_pss) / state_bytes

    def summary(self, state_bytes: int, raw_gbps: Optional[float]) -> dict[str, Any]:
        """The row's figures (medians of the steady saves; throughput is state bytes / durable)."""
        gbps = state_bytes / self.durable / 1e9 if self.durable and self.name != "memcpy" else None
        return {
            "blocked_s": self.blocked,
            "first_blocked_s": self.first.blocked_s if self.first else None,
            "durable_s": self.durable,
            "first_durable_s": self.first.durable_s if self.first else None,
            "wait_staged_s": self.wait_staged,
            "throughput_gbps": gbps,
            "fraction_of_raw": gbps / raw_gbps if gbps and raw_gbps else None,
            "fraction_of_raw_probe": gbps / self.raw_probe_gbps if gbps and self.raw_probe_gbps else None,
            "peak_extra_over_state": self.extra_memory(state_bytes),
            "slowdown": self.slowdown,
            "slowdown_mean": self.slowdown_mean,
            "steps_in_flight": [len(i.busy_step_s) for i in self.interference],
        }


# running -------------------------------------------------------------------------------------------
@dataclass
class RunSettings:
    """How much to measure per method."""

    saves: int
    interference_saves: int
    idle_steps: int
    raw_probe: bool
    sample_interval_s: float


class Runner:
    """Runs each method on the shared state and collects MethodResults."""

    def __init__(self, state: dict[str, Any], root: str, settings: RunSettings, loop: ComputeLoop,
                 progress: Optional[Progress] = None) -> None:
        self.state = state
        self.root = root
        self.settings = settings
        self.loop = loop
        self.progress = progress if progress is not None else Progress(0)
        self.state_bytes = describe_state(state).tensor_bytes
        self.step = 0
        self.raw_gbps_samples: list[float] = []

    @property
    def saves_per_method(self) -> int:
        """First save + steady saves + interference saves: what the progress line counts."""
        return 1 + self.settings.saves + self.settings.interference_saves

    def log(self, message: str) -> None:
        self.progress.log(message)

    def next_step(self) -> int:
        self.step += 1
        mutate(self.state, self.step)
        return self.step

    def raw_probe(self) -> float:
        """One raw sequential write right before a method: the disk ceiling at that moment."""
        probe = RawWrite(self.state, os.path.join(self.root, "raw_probe"))
        probe.setup()
        start = time.perf_counter()
        probe.begin(0)
        gbps = self.state_bytes / (time.perf_counter() - start) / 1e9
        remove(probe.workdir)
        self.raw_gbps_samples.append(gbps)
        return gbps

    def run(self, name: str) -> MethodResult:
        result = MethodResult(name, loadavg=os.getloadavg())
        method = make_method(name, self.state, self.root, self.state_bytes)
        done_before = self.progress.done
        self.progress.update(label=f"{name} starting", force=True)
        if self.settings.raw_probe and name not in ("raw_write", "memcpy"):
            self.progress.update(label=f"{name} raw probe")
            result.raw_probe_gbps = self.raw_probe()
            self.log(f"{name}: raw probe {result.raw_probe_gbps:.2f} GB/s")
        sampler: Optional[PeakSampler] = None
        try:
            method.prepare()  # e.g. start a local server, before the memory baseline
            gc.collect()
            outside = method.outside_pids()
            result.baseline_pss = family_pss(outside)
            sampler = PeakSampler(self.settings.sample_interval_s, outside)
            sampler.start()
            self._measure(method, result, sampler)
        except Skip as exc:
            result.status, result.note = "skipped", str(exc)
            self.log(f"{name}: skipped: {exc}")
        except Exception as exc:
            result.status, result.note = "error", short_error(exc)
            self.log(f"{name}: ERROR {result.note}\n{traceback.format_exc()}")
        finally:
            if method.note:
                result.add_note(method.note)
            memory = sampler.stop() if sampler is not None else PeakMemory()  # no-op if _measure stopped it
            result.memory = result.memory if result.memory.samples else memory
            self.progress.update(label=f"{name} teardown")
            self._teardown(method, result)
            # a skipped or failed method still counts its saves, so the total stays right
            self.progress.update(label=f"{name} {result.status}", done=done_before + self.saves_per_method)
        if name == "raw_write":
            self.raw_gbps_samples.extend(self.state_bytes / s.durable_s / 1e9 for s in result.steady)
        return result

    def _measure(self, method: Method, result: MethodResult, sampler: PeakSampler) -> None:
        """Setup, first save, steady saves (memory sampled throughout), then interference."""
        start = time.perf_counter()
        method.setup()
        result.setup_s = time.perf_counter() - start
        self.log(f"{method.name}: setup {result.setup_s:.2f}s; first save")
        self.progress.update(label=f"{method.name} first save")
        result.first = self._timed_save(method, self.next_step())
        method.check_first(result.first.step)
        result.output_bytes = method.output_size(result.first.step)
        remove_output(method, result.first.step)
        self.progress.saved()
        for i in range(self.settings.saves):
            self.progress.update(label=f"{method.name} save {i + 1}/{self.settings.saves}")
            sample = self._timed_save(method, self.next_step())
            self.log(f"{method.name}: save {i + 1}/{self.settings.saves} blocked {sample.blocked_s:.3f}s "
                     f"durable {sample.durable_s:.3f}s")
            result.steady.append(sample)
            remove_output(method, sample.step)
            self.progress.saved()
        result.memory = sampler.stop()
        for i in range(self.settings.interference_saves):
            label = f"step-time interference {i + 1}/{self.settings.interference_saves}"
            self.log(f"{method.name}: {label}")
            self.progress.update(label=f"{method.name} {label}")
            result.interference.append(self._interference(method))
            self.progress.saved()

    def _timed_save(self, method: Method, step: int) -> SaveSample:
        start = time.perf_counter()
        method.begin(step)
        blocked = time.perf_counter() - start
        extra = method.end()
        return SaveSample(step, blocked, time.perf_counter() - start, extra)

    def _interference(self, method: Method) -> Interference:
        with self.loop.own_threads():
            return self._interference_steps(method)

    def _interference_steps(self, method: Method) -> Interference:
        """Compute-loop step times while one save is in flight (after the caller is free), and
        idle just before and after it. A blocking method runs in a helper thread here (it would
        otherwise stop the loop altogether)."""
        idle = self.loop.run(self.settings.idle_steps // 2)
        step = self.next_step()
        busy: list[float] = []
        if method.sync:
            errors: list[BaseException] = []
            helper = threading.Thread(target=_call_catching, args=(method.begin, step, errors), name="bench-sync-save")
            helper.start()
            while helper.is_alive():
                busy.append(self.loop.step())
            helper.join()
            if errors:
                raise errors[0]
        else:
            method.begin(step)
            while not method.poll():
                busy.append(self.loop.step())
            method.end()
        idle += self.loop.run(self.settings.idle_steps - self.settings.idle_steps // 2)  # idle: before + after
        remove_output(method, step)
        return Interference(idle, busy, method.sync)

    def _teardown(self, method: Method, result: MethodResult) -> None:
        start = time.perf_counter()
        try:
            method.teardown()
        except Exception as exc:
            result.add_note(f"teardown: {short_error(exc)}")
        result.teardown_s = time.perf_counter() - start
        remove(method.workdir)
        gc.collect()

    @property
    def raw_gbps(self) -> Optional[float]:
        return statistics.median(self.raw_gbps_samples) if self.raw_gbps_samples else None


def _call_catching(fn: Callable[[int], None], arg: int, errors: list[BaseException]) -> None:
    """Run fn(arg) in a helper thread, keeping its exception for the caller."""
    try:
        fn(arg)
    except BaseException as exc:
        errors.append(exc)


# reporting -----------------------------------------------------------------------------------------
def fmt(value: Optional[float], spec: str = ".3f", suffix: str = "") -> str:
    """A number for the table, or "-" when there is none."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def annotate(results: list[MethodResult], state_bytes: int) -> None:
    """Notes that need more than one row (e.g. whether the staging budget lowered memory)."""
    by_name = {r.name: r for r in results}
    budget, thread = by_name.get("asyncckpt budget"), by_name.get("asyncckpt thread")
    if budget and thread and budget.status == "ok" and thread.status == "ok":
        b, t = budget.extra_memory(state_bytes), thread.extra_memory(state_bytes)
        if b is not None and t is not None and b > 0.8 * t:
            budget.add_note(f"peak extra {b:.2f}x vs {t:.2f}x without a budget: budget not honoured?")
    lazy = by_name.get("asyncckpt lazy")
    if lazy and lazy.wait_staged is not None:
        lazy.add_note(f"wait_staged {lazy.wait_staged:.3f}s")


def render_table(results: list[MethodResult], state_bytes: int, raw_gbps: Optional[float]) -> str:
    """The aligned results table."""
    headers = ["method", "status", "first blk s", "blocked s", "durable s", "GB/s", "x raw", "x probe",
               "mem +x", "slowdown", "load", "note"]
    rows = []
    for r in results:
        s = r.summary(state_bytes, raw_gbps)
        rows.append([
            r.name, r.status, fmt(s["first_blocked_s"]), fmt(s["blocked_s"]), fmt(s["durable_s"]),
            fmt(s["throughput_gbps"], ".2f"), fmt(s["fraction_of_raw"], ".2f"), fmt(s["fraction_of_raw_probe"], ".2f"),
            fmt(s["peak_extra_over_state"], ".2f"), fmt(s["slowdown"], ".2f", "*" if r.helper_thread else " "),
            f"{r.loadavg[0]:.1f}", r.note,
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if i < len(headers) - 1 else len(h)
              for i, h in enumerate(headers)]
    numeric = set(range(2, len(headers) - 1))

    def line(cells: list[str]) -> str:
        out = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(row) for row in rows)])


@dataclass
class Ratio:
    """A headline ratio, its target and the figures it was computed from."""

    name: str
    value: Optional[float]
    target: str
    detail: str


def compute_ratios(results: list[MethodResult], state_bytes: int) -> list[Ratio]:
    """The headline ratios the README's "Benchmark" section reports."""
    by = {r.name: r for r in results if r.status == "ok"}

    def get(name: str, attr: str) -> Optional[float]:
        r = by.get(name)
        return getattr(r, attr) if r is not None else None

    def div(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a is not None and b else None

    ack_blk, ack_dur = get("asyncckpt thread", "blocked"), get("asyncckpt thread", "durable")
    first = by.get("asyncckpt thread")
    first_blk = first.first.blocked_s if first and first.first else None
    proc_dur, nock_dur = get("asyncckpt process", "durable"), get("asyncckpt no-checksums", "durable")
    s3_dur = get("asyncckpt s3", "durable")
    return [
        Ratio("asyncckpt blocked / memcpy", div(ack_blk, get("memcpy", "blocked")), "<= 1.5",
              f"{fmt(ack_blk)}s / {fmt(get('memcpy', 'blocked'))}s"),
        Ratio("torch.save+fsync / asyncckpt blocked", div(get("torch.save+fsync", "durable"), ack_blk), ">= 10",
              f"{fmt(get('torch.save+fsync', 'durable'))}s / {fmt(ack_blk)}s"),
        Ratio("dcp.async_save thread blocked / asyncckpt blocked", div(get("dcp.async_save thread", "blocked"), ack_blk),
              "> 1", f"{fmt(get('dcp.async_save thread', 'blocked'))}s / {fmt(ack_blk)}s"),
        Ratio("dcp.async_save process+gloo blocked / asyncckpt blocked",
              div(get("dcp.async_save process+gloo", "blocked"), ack_blk), "> 1",
              f"{fmt(get('dcp.async_save process+gloo', 'blocked'))}s / {fmt(ack_blk)}s"),
        Ratio("lazy blocked / eager blocked", div(get("asyncckpt lazy", "blocked"), ack_blk), "<< 1",
              f"{fmt(get('asyncckpt lazy', 'blocked'))}s / {fmt(ack_blk)}s"),
        Ratio("first / steady blocked (asyncckpt thread)", div(first_blk, ack_blk), ">= 2.5",
              f"{fmt(first_blk)}s / {fmt(ack_blk)}s"),
        Ratio("process / thread throughput", div(ack_dur, proc_dur), "~1",
              f"durable thread {fmt(ack_dur)}s, process {fmt(proc_dur)}s"),
        Ratio("checksum cost: durable with / without", div(ack_dur, nock_dur), "~1",
              f"{fmt(ack_dur)}s vs {fmt(nock_dur)}s"),
        Ratio("s3 / local disk throughput", div(ack_dur, s3_dur), "info",
              f"durable to local S3 server {fmt(s3_dur)}s, to local disk {fmt(ack_dur)}s (asyncckpt thread)"),
        Ratio("slowdown nice0 / nice10", div(get("asyncckpt nice0", "slowdown"), get("asyncckpt thread", "slowdown")),
              ">= 1", f"{fmt(get('asyncckpt nice0', 'slowdown'), '.2f')} vs "
                      f"{fmt(get('asyncckpt thread', 'slowdown'), '.2f')}"),
        Ratio("slowdown process io / thread io", div(get("asyncckpt process", "slowdown"),
                                                      get("asyncckpt thread", "slowdown")), "<= 1",
              f"{fmt(get('asyncckpt process', 'slowdown'), '.2f')} vs "
              f"{fmt(get('asyncckpt thread', 'slowdown'), '.2f')}"),
    ]


def render_ratios(ratios: list[Ratio]) -> str:
    """The ratios, one aligned line each, with their targets and the figures behind them."""
    width = max(len(r.name) for r in ratios)
    lines = ["Ratios:"]
    for r in ratios:
        lines.append(f"  {r.name.ljust(width)}  {fmt(r.value, '.2f'):>7}   target {r.target:<7}  ({r.detail})")
    return "\n".join(lines)


def machine_info(directory: str) -> dict[str, Any]:
    """Where the numbers came from."""
    usage = shutil.disk_usage(directory)
    try:
        commit = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "disk_dir": os.path.abspath(directory),
        "disk_total_bytes": usage.total,
        "disk_free_bytes": usage.free,
        "loadavg": os.getloadavg(),
        "git_commit": commit,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write the raw results (numbers, machine, settings) as indented JSON."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def plot(results: list[MethodResult], state_bytes: int, path: str) -> None:
    """Bars of caller-blocked and time-to-durable seconds per method (log scale), first save as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok" and r.steady]
    names = [r.name for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(ok) + 2), sharey=True)
    panels = [("caller-blocked s", "blocked", "blocked_s"), ("time to durable s", "durable", "durable_s")]
    for ax, (title, attr, first_attr) in zip(axes, panels):
        values = [max(getattr(r, attr), 1e-4) for r in ok]
        firsts = [max(getattr(r.first, first_attr), 1e-4) for r in ok]
        ys = range(len(ok))
        ax.barh(ys, values, color=["tab:blue" if n.startswith("asyncckpt") else "tab:gray" for n in names])
        ax.scatter(firsts, ys, color="tab:red", marker="o", zorder=3, label="first save")
        for y, v in zip(ys, values):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
        ax.set_xscale("log")
        ax.set_title(f"{title} (median of steady saves)")
        ax.grid(axis="x", which="both", alpha=0.3)
    axes[0].set_yticks(range(len(ok)), names)
    axes[0].invert_yaxis()
    axes[1].legend(loc="lower right")
    fig.suptitle(f"bench_save: {state_bytes / MiB:.0f} MiB state")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# main ----------------------------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024, help="tensor bytes of the state, MiB (default 1024)")
    p.add_argument("--saves", type=int, default=5, help="steady-state saves per method (default 5)")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 3 saves")
    p.add_argument("--dir", default="bench_out/data", help="directory on the disk under test")
    p.add_argument("--out", default="bench_out/bench.json", help="JSON with every raw number")
    p.add_argument("--plot", default=None, help="write a PNG of blocked / durable times here")
    p.add_argument("--methods", default=None, help=f"comma list, subset of: {', '.join(ALL_METHODS)}")
    p.add_argument("--interference-saves", type=int, default=2, help="saves timed against the compute loop")
    p.add_argument("--idle-steps", type=int, default=20, help="idle compute steps around each of those")
    p.add_argument("--step-ms", type=float, default=25.0, help="uncontended compute-step time, ms")
    p.add_argument("--step-threads", type=int, default=1, help="torch threads of the compute loop (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads otherwise (default: torch's)")
    p.add_argument("--no-raw-probe", action="store_true", help="skip the raw write before each method")
    p.add_argument("--sample-ms", type=float, default=20.0, help="PSS sampling interval, ms")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.size_mb, args.saves = 128, 3
    args.methods = [m.strip() for m in args.methods.split(",")] if args.methods else list(ALL_METHODS)
    unknown = [m for m in args.methods if m not in ALL_METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; known: {', '.join(ALL_METHODS)}")
    if args.saves < 1:
        p.error("--saves must be >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    os.makedirs(args.dir, exist_ok=True)
    progress = Progress(len(args.methods) * (1 + args.saves + args.interference_saves))
    progress.update(label="building the state", force=True)
    progress.log(f"building a {args.size_mb} MiB state")
    state = build_state(args.size_mb * MiB, args.seed)
    info = describe_state(state)
    progress.log(f"state: {info.tensors} tensors ({info.float32} fp32, {info.bfloat16} bf16), "
                 f"{info.tensor_bytes / MiB:.0f} MiB, {info.smallest} B .. {info.largest / MiB:.1f} MiB, + {info.objects} objects")
    loop = ComputeLoop(target_step_s=args.step_ms / 1000, threads=args.step_threads)
    settings = RunSettings(args.saves, args.interference_saves, args.idle_steps, not args.no_raw_probe,
                           args.sample_ms / 1000)
    runner = Runner(state, args.dir, settings, loop, progress)
    machine = machine_info(args.dir)
    results = []
    for name in args.methods:
        progress.log(f"=== {name}")
        results.append(runner.run(name))
    progress.update(label="done")
    progress.close()
    annotate(results, info.tensor_bytes)
    raw = runner.raw_gbps
    table = render_table(results, info.tensor_bytes, raw)
    ratios = compute_ratios(results, info.tensor_bytes)
    print(f"\nState {info.tensor_bytes / MiB:.0f} MiB in {info.tensors} tensors + {info.objects} objects; "
          f"{args.saves} steady saves per method (medians); disk {os.path.abspath(args.dir)}")
    print(f"Raw-write ceiling (median of {len(runner.raw_gbps_samples)} writes this run): {fmt(raw, '.2f')} GB/s; "
          f"compute step {loop.iters} x {loop.dim}^3 matmul on {loop.threads} thread(s); "
          f"load average at start {machine['loadavg'][0]:.1f}, end {os.getloadavg()[0]:.1f}")
    print("x raw: throughput / pooled raw ceiling; x probe: / raw write just before the method; "
          "mem +x: peak PSS (trainer + children) - baseline, over state;\n"
          "slowdown: median compute-step time while the save is in flight / idle (* = blocking method run in a helper "
          "thread);\nload: 1-minute load average when the method started (2 cores; others share the box)\n")
    print(table)
    print()
    print(render_ratios(ratios))
    machine["loadavg_end"] = os.getloadavg()
    payload = {
        "args": vars(args),
        "machine": machine,
        "state": asdict(info),
        "compute_loop": {"matmul_dim": loop.dim, "iters_per_step": loop.iters, "threads": loop.threads, "target_step_s": args.step_ms / 1000},
        "raw_ceiling_gbps": raw,
        "raw_gbps_samples": runner.raw_gbps_samples,
        "results": [{**asdict(r), "summary": r.summary(info.tensor_bytes, raw)} for r in results],
        "ratios": [asdict(r) for r in ratios],
        "table": table,
    }
    write_json(args.out, payload)
    log(f"wrote {args.out}")
    if args.plot:
        plot(results, info.tensor_bytes, args.plot)
        log(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
