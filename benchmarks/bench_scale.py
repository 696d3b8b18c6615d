"""Scale on paper: what a save costs the coordinator and every rank at thousands of ranks.

Drives asyncckpt's real planning, plan cache and commit (`asyncckpt.save.planning.Planning`,
`asyncckpt.save.commit.finish_save`) and DCP's own (`DefaultSavePlanner.create_global_plan`,
`FileSystemWriter.finish`) for N ranks in one process: rank 0 runs the code, the other ranks'
messages are fabricated from the job shape (their local plans, their write results) and handed
over as the bytes they would send (benchmarks/scalesim/). No tensor memory is allocated. Figures
per shape and rank count: coordinator seconds (first save, steady save), bytes a rank sends and
receives and the coordinator receives, `.metadata` size and time to write and read it, peak
coordinator memory (tracemalloc; at the smallest rank count only, it triples the run time), files
per checkpoint directory and S3 requests per save. Rank counts too large to run in pure Python
here are extrapolated along a least-squares line (marked ~ in the table; docs/benchmark.md, "Scale").
The restart rows (scalesim/restart.py): opening that checkpoint again at the same rank counts,
asyncckpt's load (one read of `.metadata`, shared reads planned) against stock dcp.load's.

    python benchmarks/bench_scale.py --out bench_out/bench_scale.json --plot bench_out/bench_scale.png
    python benchmarks/bench_scale.py --shapes "7B FSDP,7B DDP" --ranks 8,16 --no-memory
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from asyncckpt.layout import step_dir_name  # noqa: E402
from scalesim.measure import measure  # noqa: E402
from scalesim.report import exponents, extrapolate, plot, steady_table, table, write_table  # noqa: E402
from scalesim.restart import RANKS_PER_NODE, restart_fits, restart_rows, restart_table  # noqa: E402
from scalesim.shapes import LLAMA_7B, LLAMA_70B, LLAMA_70B_ONE_LAYER, TINY, JobShape  # noqa: E402
from scalesim.write_cost import write_cost  # noqa: E402

SHAPES = {s.name: s for s in (JobShape(LLAMA_7B, "fsdp"), JobShape(LLAMA_70B, "fsdp"),
                              JobShape(LLAMA_70B, "fsdp_tp", tp=8), JobShape(LLAMA_7B, "ddp"))}
DEFAULT_SHAPES = list(SHAPES)
SHAPES["tiny FSDP"] = JobShape(TINY, "fsdp")  # a smoke run (tests)
# what runs in a few minutes on 2 cores: ~0.7 ms of work per chunk (both methods)
DEFAULT_RANKS = {"7B FSDP": (8, 16, 32), "70B FSDP": (8, 16, 32, 64), "70B FSDPxTP8": (8, 16, 32),
                 "7B DDP": (8, 16, 32, 64)}
TARGETS = (64, 1024, 16384)
STEADY_SHAPE = JobShape(LLAMA_70B_ONE_LAYER, "fsdp")
STEADY_RANKS = (1024, 4096, 16384)  # ~9 min of the run: 16,384 ranks plan twice (asyncckpt and DCP)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--ranks", default="", help="comma-separated rank counts for every shape (default: per shape)")
    parser.add_argument("--targets", default=",".join(map(str, TARGETS)), help="rank counts to extrapolate to")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    parser.add_argument("--out", default=None, help="write the rows, the extrapolation and the fits as JSON here")
    parser.add_argument("--plot", default=None, help="write the log-log plot here (needs matplotlib)")
    parser.add_argument("--workdir", default=None, help="where the simulated commits write (default: a temp dir)")
    parser.add_argument("--steady-ranks", default=",".join(map(str, STEADY_RANKS)),
                        help=f"rank counts at which a steady commit runs for real ({STEADY_SHAPE.name}; empty: skip)")
    parser.add_argument("--write-gib", type=float, default=2.0,
                        help="also time writing a .metadata this large, as a steady commit does and through the "
                             "page cache (0: skip)")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; known: {list(SHAPES)}")
    targets = [int(n) for n in args.targets.split(",") if n]
    rows, restarts, started = [], [], time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        for name in names:
            counts = [int(n) for n in args.ranks.split(",") if n] or DEFAULT_RANKS.get(name, (2, 4))
            for n in counts:
                print(f"[{time.perf_counter() - started:6.0f}s] {name} x {n} ranks", file=sys.stderr, flush=True)
                measured = measure(SHAPES[name], n, workdir)
                if not args.no_memory and n == min(counts):
                    traced = measure(SHAPES[name], n, workdir, trace_memory=True)
                    for row, with_peak in zip(measured, traced):
                        row.peak_mib = with_peak.peak_mib
                rows += measured
                restarts += restart_rows(SHAPES[name], n, os.path.join(workdir, "asyncckpt", step_dir_name(3)))
        steady = []
        for n in [int(n) for n in args.steady_ranks.split(",") if n]:
            print(f"[{time.perf_counter() - started:6.0f}s] {STEADY_SHAPE.name} x {n} ranks (steady commit)",
                  file=sys.stderr, flush=True)
            steady += measure(STEADY_SHAPE, n, workdir)
        costs = []
        if args.write_gib > 0:
            print(f"[{time.perf_counter() - started:6.0f}s] writing a {args.write_gib:g} GiB .metadata", file=sys.stderr,
                  flush=True)
            costs = write_cost(workdir, args.write_gib)
    beyond = extrapolate(rows, targets)
    print(table(rows))
    if beyond:
        print("\nExtrapolated (least-squares line over the measured rank counts):")
        print(table(beyond, extrapolated=True))
    if restarts:
        print("\nThe restart: opening the checkpoint just written (its step 3), asyncckpt's load against stock "
              f"dcp.load ({RANKS_PER_NODE} ranks per node); the growth exponent of what the coordinator does and sends:")
        print(restart_table(restarts))
        for (shape, method), (plan_fit, sent_fit) in restart_fits(restarts).items():
            print(f"  {shape}, {method}: coordinator plans ~ ranks^{plan_fit.exponent:.2f}, "
                  f"sends ~ ranks^{sent_fit.exponent:.2f}" if plan_fit and sent_fit else f"  {shape}, {method}: one count")
    if steady:
        print(f"\nA steady save at many ranks, run for real ({STEADY_SHAPE.name}: the per-rank part of it does not "
              "depend on the tensors; CPU and wall seconds):")
        print(steady_table(steady))
    if costs:
        print(f"\n.metadata written durably at {costs[0].gib:.1f} GiB (median of 3, this disk), and what that makes "
              "a steady commit at the largest target:")
        print(write_table(costs, beyond, steady))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "restart": [asdict(r) for r in restarts],
                       "extrapolated": beyond, "growth_exponents": exponents(rows),
                       "steady_at_scale": [asdict(r) for r in steady],
                       "metadata_write_cost": [dict(asdict(c), cpu_s_per_gib=c.cpu_s_per_gib,
                                                    wall_s_per_gib=c.wall_s_per_gib) for c in costs],
                       "seconds": time.perf_counter() - started}, f, indent=1)
    if args.plot:
        plot(rows, targets, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
