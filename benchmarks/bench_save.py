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
  asyncckpt s3         asyncckpt to a local S3 server (moto_server on loopback, started for the row and
                       stopped after it; skipped, with the reason, without one) through an msc profile
                       with msc's default part sizes; its note gives the requests per save and the
                       figure for 1,000 ranks, in one prefix and spread over the prefixes asyncckpt picks
  asyncckpt s3 proxy / s3 1% 503   the same through asyncckpt.testing.s3_faults.FaultyS3 (a proxy in
                       this process) with 5 MiB parts, without faults / answering 1% of requests 503 SlowDown

Per method: a first save right after the constructor, a fresh instance's first save after
--train-s of training (asyncckpt calls prepare(state) before that training), and --saves
steady-state saves. Each row, and each fresh instance, starts on a fresh copy of the state (new
tensors in ordinary memory, as in a new job: asyncckpt moves a state's tensors into shared memory
at its first save, which a later row would otherwise find done). Figures: caller-blocked
seconds, seconds to durable, throughput as a fraction of the raw-write ceiling measured in the same
run (pooled, plus a probe written just before the method), peak extra PSS (trainer + descendants)
over the state size, and the slowdown of a CPU compute loop while a save is in flight. A progress
line on stderr (redrawn in place on a terminal) counts the saves done and the time spent.

    python benchmarks/bench_save.py --quick --plot bench_out/quick.png
    python benchmarks/bench_save.py --size-mb 1024 --saves 5 --out bench_out/bench.json
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import asdict
from typing import Optional

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
for _path in (REPO_ROOT, BENCH_DIR):  # asyncckpt from this checkout; pss_sampler beside this file
    if _path not in sys.path:
        sys.path.insert(0, _path)

from savebench.common import ALL_METHODS, MiB, Progress, log  # noqa: E402
from savebench.measure import ComputeLoop  # noqa: E402
from savebench.report import annotate, compute_ratios, fmt, machine_info, plot, render_ratios, render_table, write_json  # noqa: E402
from savebench.runner import RunSettings, Runner  # noqa: E402
from savebench.state import build_state, describe_state  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024, help="tensor bytes of the state, MiB (default 1024)")
    p.add_argument("--saves", type=int, default=5, help="steady-state saves per method (default 5)")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 3 saves")
    p.add_argument("--dir", default="bench_out/data", help="directory on the disk under test")
    p.add_argument("--out", default="bench_out/bench.json", help="JSON with every raw number")
    p.add_argument("--plot", default=None, help="write a PNG of blocked / durable times here")
    methods = ", ".join(ALL_METHODS).replace("%", "%%")  # argparse %-formats help: "s3 1% 503" broke --help
    p.add_argument("--methods", default=None, help=f"comma list, subset of: {methods}")
    p.add_argument("--interference-saves", type=int, default=2, help="saves timed against the compute loop")
    p.add_argument("--idle-steps", type=int, default=20, help="idle compute steps around each of those")
    p.add_argument("--step-ms", type=float, default=25.0, help="uncontended compute-step time, ms")
    p.add_argument("--step-threads", type=int, default=1, help="torch threads of the compute loop (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads otherwise (default: torch's)")
    p.add_argument("--no-raw-probe", action="store_true", help="skip the raw write before each method")
    p.add_argument("--sample-ms", type=float, default=20.0, help="PSS sampling interval, ms")
    p.add_argument("--train-s", type=float, default=5.0,
                   help="training (the compute loop) before a fresh method's first save, s; 0 skips that column")
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
    progress = Progress(len(args.methods) * (1 + (args.train_s > 0) + args.saves + args.interference_saves))
    progress.update(label="building the state", force=True)
    progress.log(f"building a {args.size_mb} MiB state")
    state = build_state(args.size_mb * MiB, args.seed)
    info = describe_state(state)
    progress.log(f"state: {info.tensors} tensors ({info.float32} fp32, {info.bfloat16} bf16), "
                 f"{info.tensor_bytes / MiB:.0f} MiB, {info.smallest} B .. {info.largest / MiB:.1f} MiB, + {info.objects} objects")
    loop = ComputeLoop(target_step_s=args.step_ms / 1000, threads=args.step_threads)
    settings = RunSettings(args.saves, args.interference_saves, args.idle_steps, not args.no_raw_probe,
                           args.sample_ms / 1000, args.train_s)
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
    print(f"1st ctor: the first save right after the constructor; 1st train: a fresh one's first save after "
          f"{args.train_s:.0f}s of training (asyncckpt: prepare(state) first, its time under prep);\n"
          "x raw: throughput / pooled raw ceiling; x probe: / raw write just before the method; "
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
