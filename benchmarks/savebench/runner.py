"""Running one method: first save, steady saves, memory and interference samples, into a MethodResult."""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .common import ALL_METHODS, MiB, Progress, Skip
from .measure import ComputeLoop, PeakMemory, PeakSampler, family_pss, remove, short_error
from .methods import DcpAsync, DcpSave, Memcpy, Method, RawWrite, TorchSave
from .ours import AsyncCkpt, AsyncCkptS3
from .state import describe_state, fresh_copy, mutate


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
    first: Optional[SaveSample] = None  # right after the constructor
    first_trained: Optional[SaveSample] = None  # a fresh one's first, after `train_s` of training
    warm_up_s: Optional[float] = None  # before that training: the method's one-time work (asyncckpt: prepare)
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
            "first_trained_blocked_s": self.first_trained.blocked_s if self.first_trained else None,
            "warm_up_s": self.warm_up_s,
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
    train_s: float = 5.0  # training before a fresh checkpointer's first save (0: not measured)


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
        """First saves + steady saves + interference saves: what the progress line counts."""
        return 1 + (self.settings.train_s > 0) + self.settings.saves + self.settings.interference_saves

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
        self.state = fresh_copy(self.state)  # each row's first save on a fresh state (the last row's goes)
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
        if result.status == "ok" and self.settings.train_s > 0:
            self._first_after_training(name, result)
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
        method.discard(result.first.step)
        self.progress.saved()
        for i in range(self.settings.saves):
            self.progress.update(label=f"{method.name} save {i + 1}/{self.settings.saves}")
            sample = self._timed_save(method, self.next_step())
            self.log(f"{method.name}: save {i + 1}/{self.settings.saves} blocked {sample.blocked_s:.3f}s "
                     f"durable {sample.durable_s:.3f}s")
            result.steady.append(sample)
            method.discard(sample.step)
            self.progress.saved()
        result.memory = sampler.stop()
        for i in range(self.settings.interference_saves):
            label = f"step-time interference {i + 1}/{self.settings.interference_saves}"
            self.log(f"{method.name}: {label}")
            self.progress.update(label=f"{method.name} {label}")
            result.interference.append(self._interference(method))
            self.progress.saved()

    def _first_after_training(self, name: str, result: MethodResult) -> None:
        """A fresh instance of the method: set up, its one-time work (asyncckpt: prepare), then
        `train_s` of the compute loop (a training loop before its first checkpoint), then its
        first save."""
        self.state = fresh_copy(self.state)  # a fresh instance on a fresh state, as in a new job
        method = make_method(name, self.state, self.root, self.state_bytes)
        self.progress.update(label=f"{name} first save after {self.settings.train_s:.0f}s of training")
        try:
            method.prepare()
            method.setup()
            start = time.perf_counter()
            method.warm_up()
            result.warm_up_s = time.perf_counter() - start
            with self.loop.own_threads():
                self.loop.run_for(self.settings.train_s)
            result.first_trained = self._timed_save(method, self.next_step())
            self.log(f"{name}: first save after {self.settings.train_s:.0f}s of training blocked "
                     f"{result.first_trained.blocked_s:.3f}s (warm-up {result.warm_up_s:.3f}s)")
            method.discard(result.first_trained.step)
        except Exception as exc:
            result.add_note(f"first after training: {short_error(exc)}")
        finally:
            try:
                method.teardown()
            except Exception as exc:
                result.add_note(f"teardown: {short_error(exc)}")
            remove(method.workdir)
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
        method.discard(step)
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
    if name == "asyncckpt s3 proxy":  # through the fault proxy, no fault: the baseline of the next row
        return AsyncCkptS3(state, workdir, name, slowdown_rate=0.0)
    if name == "asyncckpt s3 1% 503":
        return AsyncCkptS3(state, workdir, name, slowdown_rate=0.01)
    raise ValueError(f"unknown method {name!r}; known: {', '.join(ALL_METHODS)}")
