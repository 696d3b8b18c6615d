"""The torch DCP door in a training loop: `asyncckpt.async_save` against `dcp.async_save`.

A CPU training loop (a calibrated matmul step that also changes the state in place) saves every
--every steps the way torchtitan does: `.result()` on the previous save first, then async_save
into `step-N`, then (with a stager) `staging_completion.result()` before the next step. Each
method runs in a fresh process inside a one-rank gloo group (DCP's process mode needs one), so
its first call pays what a first call pays. Rows:

  asyncckpt.async_save           the drop-in (dcp.async_save replaced by it)
  dcp.async_save thread          torch's default
  dcp.async_save process         PROCESS mode with a reused CPU-safe DefaultStager (torchtitan's
                                 async_with_pinned_mem, less what needs a GPU)

Figures: first call blocked; median blocked per later save (the previous save's .result(), the
call, the staging wait) and the part of it that is the call itself (with the staging wait); median
seconds from a call to its future completing (durable); the step slowdown (mean step time while
saving over a loop without saves, measured first in the same process).

    python benchmarks/bench_doors.py --size-mb 256 --steps 60 --every 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
for _path in (REPO_ROOT, BENCH_DIR):
    if _path not in sys.path:
        sys.path.insert(0, _path)

METHODS = ("asyncckpt.async_save", "dcp.async_save thread", "dcp.async_save process")


def run_method(method: str, size_mb: int, steps: int, every: int, step_s: float, workdir: str) -> dict:
    """One method's loop, in this (fresh) process."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from savebench.measure import ComputeLoop
    from savebench.state import build_state, mutate

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(workdir, "store"), 1), rank=0, world_size=1)
    kwargs = {}
    if method == "asyncckpt.async_save":
        import asyncckpt

        dcp.async_save = asyncckpt.async_save  # the one-line switch
    elif method == "dcp.async_save process":
        kwargs = dict(
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=DefaultStager(StagingOptions(False, True, True, False)),
        )
    pg = dist.new_group(backend="gloo")  # as torchtitan's CheckpointManager does
    state = build_state(size_mb << 20)
    loop = ComputeLoop(target_step_s=step_s)
    with loop.own_threads():
        baseline = loop.run(max(10, steps // 3))
    future, blocked, waited, durable, step_times = None, [], [], [], []
    for step in range(1, steps + 1):
        with loop.own_threads():
            step_times.append(loop.step())
        mutate(state, step)
        if step % every:
            continue
        started = time.perf_counter()
        if future is not None:
            future.result()
        waited.append(time.perf_counter() - started)
        response = dcp.async_save(state, checkpoint_id=os.path.join(workdir, f"step-{step}"), process_group=pg, **kwargs)
        future = getattr(response, "upload_completion", response)
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            staging.result()  # torchtitan waits for it before optimizer.step()
        blocked.append(time.perf_counter() - started)
        called = started + 0.0
        future.add_done_callback(lambda _f, called=called: durable.append(time.perf_counter() - called))
    future.result()
    time.sleep(0.05)  # let the last done-callback record
    return {
        "method": method,
        "first_blocked_s": blocked[0],
        "blocked_s": statistics.median(blocked[1:]) if len(blocked) > 1 else blocked[0],
        "call_s": statistics.median(b - w for b, w in zip(blocked[1:], waited[1:])) if len(blocked) > 1 else blocked[0],
        "durable_s": statistics.median(durable[1:]) if len(durable) > 1 else durable[0],
        "step_slowdown": statistics.mean(step_times) / statistics.mean(baseline) - 1.0,
        "saves": len(blocked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--step-s", type=float, default=0.1, help="compute time of one training step")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one method here
    args = parser.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="bench_doors_")
    if args.one:
        workdir = os.path.join(base, args.one.replace(" ", "_"))
        os.makedirs(workdir, exist_ok=True)
        row = run_method(args.one, args.size_mb, args.steps, args.every, args.step_s, workdir)
        print(json.dumps(row), flush=True)
        os._exit(0)  # no atexit teardown in the figures' process (the saves are all durable)
    rows = []
    for method in args.methods.split(","):
        command = [sys.executable, __file__, "--one", method, "--dir", base, "--size-mb", str(args.size_mb),
                   "--steps", str(args.steps), "--every", str(args.every), "--step-s", str(args.step_s)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            print(f"{method}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        subprocess.run(["rm", "-rf", os.path.join(base, method.replace(" ", "_"))], check=False)
    print(f"\nstate {args.size_mb} MiB, save every {args.every} of {args.steps} steps ({args.step_s:.2f} s each)")
    print(f"{'method':<26}{'first call blocked':>20}{'blocked/save':>14}{'of it, the call':>17}{'durable':>10}"
          f"{'step slowdown':>15}")
    for r in rows:
        print(f"{r['method']:<26}{r['first_blocked_s']:>19.3f}s{r['blocked_s']:>13.3f}s{r['call_s']:>16.3f}s"
              f"{r['durable_s']:>9.3f}s{100 * r['step_slowdown']:>14.1f}%")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
