"""Worker entry point: the serve loop that stages and writes every save of one rank.

It never dies silently: any failure of a save goes back as `SaveFailed` and the loop keeps
serving. A watchdog thread ends the worker (and its writer children) when the trainer dies.
io="process" writers come from a fork server started before any other thread (forkserver.py).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Optional

import torch

from asyncckpt.formats import use_fast_serialization
from asyncckpt.protocol import Prepared, Ready, SaveFailed, SaveRequest, Shutdown, Staged, WorkerSettings, WriteStaged
from asyncckpt.storage.requests import COUNTER

from .buckets import staging_need
from .cache import CachedStructure, CacheMiss, StructureCache
from .forked import child_main
from .forkserver import ForkServer, name_process
from .rounds import run_save, write_staged
from .staging import StagingPool
from .tier import TierFile
from .parts import WriteError
from .writers import Writers

log = logging.getLogger("asyncckpt.worker")

PARENT_CHECK_INTERVAL_S = 0.5
SHUTDOWN_REPLICAS_S = 8.0  # a clean close lets copies to and from peers end this long (the trainer waits 10 s)


@dataclass
class StagedOnly:
    """The copy the last save staged into the memory tier only, while nothing has touched the
    slab since: what a `WriteStaged` writes (its tensors in `entry.views`, its pickled objects)."""

    token: str
    entry: CachedStructure
    objects: dict[int, bytes]
    generation: int  # the slab's (StagingPool.generation): a new slab holds nothing of it


class ServeLoop:
    def __init__(self, conn, settings: WorkerSettings, forks: Optional[ForkServer] = None) -> None:
        self.conn = conn
        self.settings = settings
        self.cache = StructureCache()
        self.pool = StagingPool(settings.memory.path if settings.memory else None)
        self.writers = Writers(nice=settings.nice, forks=forks)
        self.tier = TierFile(settings.memory, settings.rank, settings.parent_pid, self.pool) if settings.memory else None
        self.staged_only: Optional[StagedOnly] = None

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                log.info("trainer connection closed; exiting")
                return
            except Exception as exc:  # read whole, but not rebuilt (e.g. a shared tensor's handle)
                self._fail(None, "request", f"could not read the save request: {type(exc).__name__}: {exc}")
                continue
            if isinstance(message, Shutdown):
                if self.tier is not None and self.tier.replicator is not None:
                    self.tier.replicator.close(SHUTDOWN_REPLICAS_S)
                return
            if isinstance(message, (SaveRequest, WriteStaged)):
                self.handle_save(message) if isinstance(message, SaveRequest) else self.handle_write_staged(message)
                del message
                if not self.writers.usable:  # it cannot be restarted safely here: a fresh worker can
                    log.error("the writers' fork server died; worker exits (the next save starts a new one)")
                    return
            else:
                log.warning("ignoring unknown message %r", type(message).__name__)

    def handle_save(self, request: SaveRequest) -> None:
        phase = "cache"
        self.staged_only = None  # (a preparation too may lay out the slab anew)
        started = time.perf_counter()
        memory = request.memory if self.tier is not None and not request.prepare_only else None
        sealing = False
        unsealed: list[str] = []

        def staged() -> None:
            nonlocal phase, sealing
            entry.release(request.transient)  # copied: the trainer's copies made for this save alone may go
            try:
                self.conn.send(Staged(request.save_id, time.perf_counter() - started, hit, os.getpid()))
            except OSError:  # the trainer died: the copy is sealed all the same (hold_for_exit waits for it)
                if memory is None:
                    raise
            phase = "write"
            if memory is not None:
                sealing = True
                try:
                    self.tier.seal(memory, entry.plan, entry.items, entry.views, request.byte_items)
                except OSError as exc:  # the copy stays incomplete; a disk save goes on without it
                    if memory.memory_only:
                        raise
                    unsealed.append(str(exc))
                    log.warning("%s; this save goes to disk only", exc)

        try:
            entry, hit = self.cache.apply(request)
            request.fresh_tensors.clear()  # the cache holds them now
            if request.prepare_only:
                phase = "prepare"
                options = request.options
                self.pool.prepare(staging_need(entry.items), options.staging_budget_bytes, entry.sources)
                entry.release(request.transient)
                self.conn.send(Prepared(request.save_id, time.perf_counter() - started, self.pool.capacity))
                return
            phase = "staging"
            if memory is not None:
                self.tier.begin()
            requests_before = COUNTER.snapshot()
            try:
                done = run_save(request, entry, self.pool, self.writers, self.settings.rank, staged)
            finally:
                if memory is not None and not sealing:
                    self.tier.abandon()
            if memory is not None and memory.memory_only:
                self.staged_only = StagedOnly(memory.token, entry, request.byte_items, self.pool.generation)
            self.conn.send(dataclasses.replace(done, requests=COUNTER.since(requests_before),
                                               memory_problem="; ".join(unsealed)))
        except WriteError as exc:
            self._fail(request.save_id, "write", str(exc), exc.path)
        except CacheMiss as exc:
            self._fail(request.save_id, "cache", str(exc))
        except Exception as exc:
            log.debug("save %d failed in %s:\n%s", request.save_id, phase, traceback.format_exc())
            self._fail(request.save_id, phase, f"{type(exc).__name__}: {exc}")

    def handle_write_staged(self, request: WriteStaged) -> None:
        """Write the memory-only save's copy the slab holds (write_staged): refused when a later
        save (or a preparation) has been given the slab since."""
        copy = self.staged_only
        if copy is None or copy.token != request.token or copy.generation != self.pool.generation:
            self._fail(request.save_id, "write", f"this worker no longer holds the copy of save {request.token[:8]}: "
                       "a later save or a new worker staged over it")
            return
        try:
            self.conn.send(Staged(request.save_id, 0.0, True, os.getpid()))
            requests_before = COUNTER.snapshot()
            done = write_staged(request, copy.entry, copy.objects, self.pool, self.writers, self.settings.rank)
            self.conn.send(dataclasses.replace(done, requests=COUNTER.since(requests_before)))
        except WriteError as exc:
            self._fail(request.save_id, "write", str(exc), exc.path)
        except Exception as exc:
            log.debug("writing the staged copy failed:\n%s", traceback.format_exc())
            self._fail(request.save_id, "write", f"{type(exc).__name__}: {exc}")

    def _fail(self, save_id: Optional[int], phase: str, message: str, path=None) -> None:
        log.debug("save %s failed in %s: %s", save_id, phase, message)
        try:
            self.conn.send(SaveFailed(save_id, phase, message, path, worker_exits=not self.writers.usable))
        except (OSError, EOFError):
            pass

    def close(self) -> None:
        self.writers.kill_children()
        self.writers.close()
        self.pool.close()
        self.cache.clear()
        self._release_cuda()

    def _release_cuda(self) -> None:
        """Free every tensor opened from a CUDA IPC handle before this process exits: freeing one
        tells the trainer (through torch's shared counter) that its block may go. A handle still
        open at exit would stay counted, and the trainer would warn "Producer process has been
        terminated before all shared CUDA tensors released" and keep those blocks."""
        if not torch.cuda.is_initialized():
            return
        gc.collect()  # the cache's tensors, and anything a failed save's traceback kept
        log.debug("released the trainer's CUDA tensors")


def run(conn, settings: WorkerSettings) -> None:
    """Process entry point (spawned by asyncckpt.save.client)."""
    logging.basicConfig(
        level=settings.log_level, format=f"%(asctime)s asyncckpt-worker[{settings.rank}] %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (already, since run_worker) Ctrl-C is the trainer's to handle
    _say_what_this_process_is(settings.rank)
    _lower_io_priority(settings)
    _raise_open_file_limit()
    forks = _start_fork_server()  # first, while this process still has one thread
    use_fast_serialization()
    # Staging is on the trainer's critical path and keeps the trainer's CPU priority (only the
    # writers are niced, see Writers). Each copy runs on one torch thread; eager staging spreads
    # the pieces over a few threads of its own (StagingPool.copy_in), lazy staging uses one.
    torch.set_num_threads(1)
    loop = ServeLoop(conn, settings, forks)
    _start_parent_watchdog(settings.parent_pid, loop)
    gc.freeze()
    try:
        try:
            conn.send(Ready())
        except OSError:  # the trainer let go of this worker while it started (closed, or gone)
            log.info("trainer connection closed before this worker was ready; exiting")
            return
        loop.serve()
    finally:
        loop.close()
        log.debug("exiting; asyncckpt modules loaded here: %s", ", ".join(_asyncckpt_modules()))
        log.debug("torch.distributed.checkpoint loaded: %s", "torch.distributed.checkpoint" in sys.modules)


def _asyncckpt_modules() -> list[str]:
    """The library's modules in this process: the worker side only (see asyncckpt/__init__.py)."""
    return sorted(name for name in sys.modules if name.partition(".")[0] == "asyncckpt")


def _say_what_this_process_is(rank: int) -> None:
    """In ps and top: the name "asyncckpt-w<rank>" (15 bytes at most) and, where setproctitle is
    installed (not a dependency), the command line "asyncckpt worker rank <rank>", instead of
    multiprocessing's spawn line. The fork server and writers started next inherit the latter."""
    try:
        import setproctitle
    except ImportError:
        pass
    else:
        setproctitle.setproctitle(f"asyncckpt worker rank {rank}")
    name_process(f"asyncckpt-w{rank}".encode())


def _start_parent_watchdog(parent_pid: int, loop: ServeLoop) -> None:
    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_INTERVAL_S)
            if os.getppid() != parent_pid:
                if loop.tier is not None and not loop.tier.hold_for_exit():
                    log.error("trainer %d is gone and the save staging into the memory tier did not end within "
                              "%.0fs; its copy stays incomplete", parent_pid, loop.settings.memory.hold_s)
                log.warning("trainer %d is gone; worker exits", parent_pid)
                loop.writers.kill_children()
                os._exit(3)

    threading.Thread(target=watch, name="asyncckpt-parent-watchdog", daemon=True).start()


def _start_fork_server() -> Optional[ForkServer]:
    """The process that forks io="process" writers (forkserver.py). Without it, process-mode
    saves fail with the reason; thread mode works on."""
    try:
        return ForkServer.start(child_main)
    except (OSError, RuntimeError) as exc:
        log.error("could not start the writers' fork server: %s", exc)
        return None


def _raise_open_file_limit() -> None:
    """Every shared CPU storage the trainer hands over keeps a descriptor open here; a state of
    more tensors than the soft limit (often 1024) would kill the worker while it unpickles the
    request. The trainer checks its own limit before sharing; the worker takes its hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)


def _lower_io_priority(settings: WorkerSettings) -> None:
    """The I/O class applies to the whole worker (threads and forked writers inherit it);
    staging does no I/O, so it costs the trainer nothing."""
    if settings.ionice:
        try:
            import psutil

            io_class = psutil.IOPRIO_CLASS_IDLE if settings.ionice == "idle" else psutil.IOPRIO_CLASS_BE
            psutil.Process().ionice(io_class, value=7 if io_class == psutil.IOPRIO_CLASS_BE else None)
        except Exception as exc:  # not permitted in some containers
            log.warning("could not set I/O priority %s: %s", settings.ionice, exc)
