"""GPU benchmark: asyncckpt against the copy and disk limits and against DCP's async_save, one run.

The state (default 4 GiB, --size-gib) lives on the device and is shaped like a transformer trained
with Adam: bf16 weights, fp32 master weights and both moments (14 bytes per parameter), matrices
of three hidden sizes, norms, an embedding, Adam's step counter. Everything below runs on it side by
side, on the same disk (--dir, removed at the end):

  limits       pinned and pageable device-to-host copies of the state, pinned host-to-device, a raw
               write + fsync of as many bytes and a cold read of them (pages dropped). On the CPU
               (--device cpu) the copies are a memcpy and there is no host-to-device copy.
  eager, lazy, process, async_save
               asyncckpt's checkpointer (default config; staging="lazy" then wait_staged; io="process")
               and its async_save door. Each: the first save right after the constructor; the first
               save of a fresh checkpointer after --train-s of training on the device; --saves steady
               saves, the last one checked: every tensor is changed in place as soon as the call lets
               the caller go, and the committed checkpoint must hold the values at the call.
  dcp, dcp_pinned
               torch.distributed.checkpoint.async_save with its default stager (thread mode), and in
               process mode (one-rank gloo group) with DefaultStager(StagingOptions(pinned, shared,
               async staging, non-blocking copy)): first save, steady saves, the same check. A peer
               that fails is a row with its error.
  loop         a training loop on the device (bf16 matmuls, ~25 ms steps on a GPU) without saves and
               with a save every K steps (asyncckpt eager, dcp.async_save): median and mean step time.
  load         asyncckpt.load and stock dcp.load into tensors on the device, cold and warm.

Prints the tables and the ratios (blocked / pinned D2H: the goal is <= 1/0.9; durable / raw
write; load / raw read) and writes every raw number, the machine and the tables to --out (also
after each part, so a run stopped midway keeps what it measured). Progress goes to stderr.

    python benchmarks/bench_gpu.py --size-gib 4 --out bench_out/bench_gpu_4gib.json
    python benchmarks/bench_gpu.py --device cpu --size-gib 0.01 --saves 2 --train-s 0.3   # smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from typing import Any, Optional

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
for _path in (REPO_ROOT, BENCH_DIR):  # asyncckpt from this checkout; savebench beside this file
    if _path not in sys.path:
        sys.path.insert(0, _path)

from gpubench.limits import LimitRow, copy_limits, disk_limits  # noqa: E402
from gpubench.loads import LoadRow, run_loads  # noqa: E402
from gpubench.loop import LOOP_METHODS, LoopRow, run_loops, save_interval  # noqa: E402
from gpubench.report import (  # noqa: E402
    compute_ratios, failures, limit_of, machine, render_limits, render_loads, render_loop, render_saves,
)
from gpubench.saves import SaveRow, SaveRunner, SaveSettings, release_memory  # noqa: E402
from gpubench.savers import LABELS, OURS, make_saver  # noqa: E402
from gpubench.state import build_adam_state, describe_state  # noqa: E402
from savebench.common import Progress, log  # noqa: E402
from savebench.measure import ComputeLoop, short_error  # noqa: E402
from savebench.report import fmt, render_ratios, write_json  # noqa: E402

GiB = 1 << 30
PARTS = ("limits", *LABELS, "loop", "load")
LARGE_GIB = 8  # above this, fewer repeats by default, so 16 GiB fits a 10-minute slot (docs/benchmark.md)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=4.0, help="tensor bytes of the state, GiB (default 4)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available, else cpu)")
    p.add_argument("--saves", type=int, default=None,
                   help=f"steady saves per method, the checked one included (default 5; 3 above {LARGE_GIB} GiB)")
    p.add_argument("--train-s", type=float, default=5.0, help="training before the second first save (default 5)")
    p.add_argument("--methods", default=",".join(PARTS), help=f"comma list, subset of: {', '.join(PARTS)}")
    p.add_argument("--dir", default="bench_out/gpu_data", help="directory on the disk under test (removed at the end)")
    p.add_argument("--out", default="bench_out/bench_gpu.json", help="JSON with every raw number")
    p.add_argument("--step-ms", type=float, default=None, help="training step, ms (default 25 on a GPU, 10 on the CPU)")
    p.add_argument("--save-every", type=int, default=None,
                   help="loop: steps between saves (default: a quarter more than the slowest steady durable)")
    p.add_argument("--loop-saves", type=int, default=None, help=f"loop: saves per method (default 2; 1 above {LARGE_GIB} GiB)")
    p.add_argument("--load-repeat", type=int, default=None,
                   help=f"loads per method and mode, median shown (default 2; 1 above {LARGE_GIB} GiB)")
    p.add_argument("--limit-repeat", type=int, default=3, help="copies per copy limit, median shown (default 3)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="bound on every wait for a save (default 300)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip the parts not expected to end within this many seconds (e.g. 540 in a 10-minute slot)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in PARTS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; known: {', '.join(PARTS)}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.split(":")[0] not in ("cuda", "cpu"):
        p.error(f"--device {args.device!r}: cuda or cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    large = args.size_gib > LARGE_GIB
    for name, small, big in (("saves", 5, 3), ("loop_saves", 2, 1), ("load_repeat", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, big if large else small)
    if args.step_ms is None:
        args.step_ms = 25.0 if args.device.startswith("cuda") else 10.0
    for name in ("size_gib", "timeout_s", "step_ms"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    for name in ("saves", "loop_saves", "load_repeat", "limit_repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.train_s < 0 or (args.save_every is not None and args.save_every < 1):
        p.error("--train-s must be >= 0 and --save-every >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", message=".*pin_memory.*")  # DCP's stager on the CPU says it ignores pinning
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    size = int(args.size_gib * GiB)
    os.makedirs(args.dir, exist_ok=True)
    # on disk at once: the raw file, a save, or a loop's saves; and some room
    need = max(1, args.loop_saves if "loop" in args.methods else 1) * size + GiB
    free = shutil.disk_usage(args.dir).free
    if free < need:
        print(f"bench_gpu: {os.path.abspath(args.dir)} has {free / GiB:.1f} GiB free; a {args.size_gib:g} GiB "
              f"state needs {need / GiB:.1f} GiB there (--dir, or a smaller --size-gib)", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="run-", dir=args.dir)
    try:
        return measure(args, device, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if not os.listdir(args.dir):
            os.rmdir(args.dir)


class Run:
    """One benchmark run: the state, the parts measured so far, and the JSON written after each."""

    def __init__(self, args: argparse.Namespace, device: torch.device, workdir: str) -> None:
        self.args = args
        self.device = device
        self.workdir = workdir
        self.start = time.monotonic()
        self.limits: list[LimitRow] = []
        self.saves: list[SaveRow] = []
        self.loop: list[LoopRow] = []
        self.loads: list[LoadRow] = []
        self.skipped: list[str] = []  # parts left out by --budget-s
        self.kept: Optional[str] = None  # the loop's last asyncckpt checkpoint, for the loads
        self.payload: dict[str, Any] = {"args": vars(args), "complete": False}
        save_methods = [m for m in LABELS if m in args.methods]
        loop_saves = 2 * len(LOOP_METHODS) if "loop" in args.methods else 0  # a warm-up, then the loop
        self.progress = Progress(sum((2 if m in OURS else 1) + args.saves for m in save_methods) + loop_saves)
        self.progress.update(label="building the state", force=True)
        self.state = build_adam_state(int(args.size_gib * GiB), device, args.seed)
        self.info = describe_state(self.state)
        self.nbytes = self.info.tensor_bytes
        self.progress.log(
            f"state on {device}: {self.info.parameters / 1e6:.1f} M parameters in {self.info.blocks} blocks of "
            f"hidden sizes {self.info.hidden_sizes}, {self.info.tensors} tensors, {self.nbytes / GiB:.2f} GiB, "
            f"{self.info.smallest} B .. {self.info.largest / 2**20:.1f} MiB")
        self.training = ComputeLoop(dim=8192 if device.type == "cuda" else 256, target_step_s=args.step_ms / 1000,
                                    device=device, dtype=torch.bfloat16)
        self.progress.log(f"training step: {self.training.iters} x {self.training.dim}^2 bf16 matmuls on {device}")
        self.payload.update(machine=machine(args.dir, device), state=asdict(self.info),
                            compute_loop={"matmul_dim": self.training.dim, "iters_per_step": self.training.iters,
                                          "device": str(device), "target_step_s": args.step_ms / 1000})

    def wanted(self, part: str, estimate_s: float = 0.0) -> bool:
        """Whether to run `part`: selected, and (with --budget-s) expected to end within the budget,
        by `estimate_s`; a part left out for the budget is noted."""
        if part not in self.args.methods:
            return False
        elapsed = time.monotonic() - self.start
        if self.args.budget_s is not None and elapsed + estimate_s > self.args.budget_s:
            self.skipped.append(part)
            log(f"{part}: skipped, {elapsed:.0f} s elapsed + about {estimate_s:.0f} s for it is over --budget-s "
                f"{self.args.budget_s:g}")
            return False
        return True

    def save_s(self) -> float:
        """About how long a save takes to durable: the slowest steady median so far, else the raw write."""
        durables = [r.median("durable_s") for r in self.saves if r.median("durable_s")]
        return max(durables) if durables else (limit_of(self.limits, "raw write + fsync") or 0.0)

    def first_save_s(self) -> float:
        """About how long a fresh saver's first save takes (its start-up included)."""
        return max([r.fresh.durable_s for r in self.saves if r.fresh], default=self.save_s())

    def measure_limits(self) -> None:
        self.progress.update(label="limits: copies", force=True)
        self.limits = guarded_limits(lambda: copy_limits(self.state, self.device, self.args.limit_repeat),
                                     ("pinned D2H", "pageable D2H", "pinned H2D"))
        self.progress.update(label="limits: raw write + fsync, cold read", force=True)
        self.limits += guarded_limits(lambda: disk_limits(self.state, os.path.join(self.workdir, "raw_write.bin")),
                                      ("raw write + fsync", "raw read (cold)"))
        for r in self.limits:
            self.progress.log(f"limit {r.name}: {fmt(r.seconds)} s, {fmt(r.gbps(self.nbytes), '.2f')} GB/s {r.note}")
        release_memory(self.device)
        write_s = limit_of(self.limits, "raw write + fsync")
        if write_s:
            count = self.progress.total - self.progress.done
            self.progress.log(f"ahead: {count} saves at about {write_s:.1f} s each to durable (raw write): "
                              f"about {count * write_s / 60:.1f} min of writing")

    def measure_saves(self) -> None:
        settings = SaveSettings(self.args.saves, self.args.train_s, self.args.timeout_s)
        runner = SaveRunner(self.state, self.device, os.path.join(self.workdir, "saves"), settings, self.training,
                            self.progress)
        row_s: list[float] = []  # how long each row took, start-ups included: the next one's estimate
        for name in LABELS:
            estimate = runner.saves_of(name) * self.save_s() + (self.args.train_s if name in OURS else 0.0)
            if self.wanted(name, max([estimate, *row_s])):
                start = time.monotonic()
                self.saves.append(runner.run(name))
                row_s.append(time.monotonic() - start)
            elif name in self.skipped:
                self.saves.append(SaveRow(name, LABELS[name], status="skipped", note="over --budget-s"))
            self.save_json()

    def measure_loop(self) -> None:
        durables = [r.median("durable_s") for r in self.saves if r.method in LOOP_METHODS and r.median("durable_s")]
        durable = max(durables) if durables else (limit_of(self.limits, "raw write + fsync") or 1.0)
        every = self.args.save_every or save_interval(durable, self.args.step_ms / 1000)
        self.loop, self.kept = run_loops(self.state, self.device, os.path.join(self.workdir, "loop"), self.training,
                                         every, self.args.loop_saves, self.args.timeout_s, self.progress)

    def measure_loads(self) -> None:
        try:
            path = self.kept or checkpoint_for_loads(self.state, self.device, os.path.join(self.workdir, "load"),
                                                     self.args.timeout_s)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            self.loads = [LoadRow("asyncckpt.load", status="error", note=f"no checkpoint to load: {short_error(exc)}")]
            return
        self.loads = run_loads(self.state, self.device, path, self.args.load_repeat, self.progress)

    def save_json(self, table: str = "") -> None:
        self.payload.update({
            "elapsed_s": time.monotonic() - self.start,
            "limits": [{**asdict(r), "gbps": r.gbps(self.nbytes)} for r in self.limits],
            "saves": [{**asdict(r), "blocked_s": r.median("blocked_s"), "call_s": r.median("call_s"),
                       "durable_s": r.median("durable_s")} for r in self.saves],
            "loop": [{**asdict(r), "median_s": r.median_s, "mean_s": r.mean_s,
                      "slowdown_median_pct": r.slowdown(self.loop[0], "median_s"),
                      "slowdown_mean_pct": r.slowdown(self.loop[0], "mean_s")} for r in self.loop],
            "loads": [{**asdict(r), "cold_s": r.cold_s, "warm_s": r.warm_s} for r in self.loads],
            "skipped_parts": self.skipped,
            "table": table,
        })
        write_json(self.args.out, self.payload)


def measure(args: argparse.Namespace, device: torch.device, workdir: str) -> int:
    """Every selected part in order, the JSON after each; the tables at the end. Exits 1 when one of
    asyncckpt's saves or loads did not hold the values it should."""
    run = Run(args, device, workdir)
    if run.wanted("limits"):
        run.measure_limits()
        run.save_json()
    run.measure_saves()
    # the loop: three runs of about 1.25 durable times per save, and two fresh savers' warm-up saves
    if run.wanted("loop", 3 * 1.25 * args.loop_saves * run.save_s() + 2 * run.first_save_s()):
        run.measure_loop()
        run.save_json()
    # the loads: two loaders, each `load_repeat` loads cold and warm and one to warm the cache
    if run.wanted("load", 2 * (2 * args.load_repeat + 1) * (limit_of(run.limits, "raw read (cold)") or 0.0)):
        run.measure_loads()
        run.save_json()
    run.progress.update(label="done")
    run.progress.close()
    table = render(run)
    print(table)
    run.payload["ratios"] = [asdict(r) for r in compute_ratios(run.saves, run.loads, run.limits)]
    run.payload["failures"] = failures(run.saves, run.loads)
    run.payload["complete"] = True
    run.save_json(table)
    log(f"wrote {args.out}")
    ours_wrong = [r for r in run.saves if r.method in OURS and r.consistent is False]
    ours_wrong += [r for r in run.loads if r.label == "asyncckpt.load" and r.difference]
    return 1 if ours_wrong else 0


def guarded_limits(measure_rows, names: tuple[str, ...]) -> list[LimitRow]:
    """The rows `measure_rows` returns, or an error row for each of `names` if it fails."""
    try:
        return measure_rows()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        log(f"limits {', '.join(names)}: ERROR {short_error(exc)}")
        return [LimitRow(name, status="error", note=short_error(exc)) for name in names]


def checkpoint_for_loads(state: dict[str, Any], device: torch.device, workdir: str, timeout_s: float) -> str:
    """A checkpoint of the state as it is now (asyncckpt eager), when the loop left none."""
    saver = make_saver("eager", state, workdir, timeout_s, device)
    saver.open()
    try:
        saver.save(1)
        saver.wait_durable()
    finally:
        saver.close()
    return saver.path(1)


def render(run: Run) -> str:
    """Everything printed at the end: the settings, the tables, failures and ratios."""
    args, nbytes, loop = run.args, run.nbytes, run.training
    gpu = run.payload["machine"]["gpu"]
    where = f"{gpu['name']} ({gpu['total_memory_bytes'] / GiB:.0f} GiB)" if gpu else "CPU (no GPU)"
    parts = [
        f"\nGPU benchmark: {nbytes / GiB:.2f} GiB state on {run.device} [{where}], torch {torch.__version__}, "
        f"{os.cpu_count()} cores; disk {os.path.abspath(args.dir)} ({run.payload['machine']['disk']['type'] or '?'}); "
        f"{args.saves} steady saves per method (medians), first saves apart; {time.monotonic() - run.start:.0f} s",
    ]
    if run.skipped:
        parts.append(f"skipped (over --budget-s): {', '.join(run.skipped)}")
    if run.limits:
        parts += ["", render_limits(run.limits, nbytes)]
    if run.saves:
        parts += [
            "",
            "first: the first save right after the constructor (a door: its first call); trained: the first save of "
            f"a fresh saver after {args.train_s:g} s of training;\nblocked: until the state may change (lazy: + "
            "wait_staged; a staging future: + its wait); call: the call itself; durable: call to committed;\n"
            "blk/D2H: blocked / pinned D2H time (goal <= 1.11); dur/write: durable / raw write + fsync time; "
            "consistent: the last save, its tensors changed right after, holds the values at the call",
            render_saves(run.saves, run.limits),
        ]
    if run.loop:
        parts += ["", f"training loop: steps of {loop.iters} x {loop.dim}^2 bf16 matmuls (+ a synchronize) on "
                      f"{run.device}; +%: over the loop without saves", render_loop(run.loop)]
    if run.loads:
        parts += ["", render_loads(run.loads, run.limits, nbytes)]
    wrong = failures(run.saves, run.loads)
    if wrong:
        parts += ["", *wrong]
    ratios = compute_ratios(run.saves, run.loads, run.limits)
    if ratios:
        parts += ["", render_ratios(ratios)]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
