"""Full against incremental saves of a mostly frozen state, side by side in one run.

The state (default 1 GiB of float32) is 90 % frozen by bytes (a "base" the loop never changes)
and 10 % trained (changed before every save). Each mode saves it with its own AsyncCheckpointer
(keep_last=2, into a fresh root on the same disk): one warm-up save (the worker's start, and for
incremental the full first save), then --saves measured saves. Figures per mode, medians: bytes
the save wrote, time blocked in schedule_save, time to durable (schedule_save to commit).
Alongside: XXH3-128 hashing throughput on one core and a raw sequential write + fsync of the
same disk, the two speeds an incremental save trades.

    python benchmarks/bench_incremental.py --size-mib 1024 --out bench_out/bench_incremental.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from asyncckpt import AsyncCheckpointer, CheckpointConfig  # noqa: E402
from asyncckpt.formats import tensor_digest  # noqa: E402

MiB = 1 << 20
TENSOR_MIB = 32  # a layer-sized tensor


@dataclass
class ModeResult:
    mode: str
    saves: int
    bytes_written_mib: float
    blocked_s: float
    durable_s: float


def build_state(size_mib: int, trained_share: float) -> tuple[dict, list[torch.Tensor]]:
    """{"base": frozen tensors, "trained": changed every step, "progress": {...}}: size_mib in all."""
    trained_mib = max(TENSOR_MIB, int(size_mib * trained_share))
    generator = torch.Generator().manual_seed(0)

    def tensors(total_mib: int) -> dict:
        count = max(1, total_mib // TENSOR_MIB)
        return {f"layer{i}": torch.randn(total_mib * MiB // 4 // count, generator=generator) for i in range(count)}

    state = {"base": tensors(size_mib - trained_mib), "trained": tensors(trained_mib), "progress": {"step": 0}}
    return state, list(state["trained"].values())


def run_mode(mode: str, directory: str, size_mib: int, saves: int) -> ModeResult:
    state, trained = build_state(size_mib, 0.1)
    reports = []
    root = os.path.join(directory, mode)
    with AsyncCheckpointer(root, CheckpointConfig(incremental=mode == "incremental", keep_last=2)) as ckpt:
        for step in range(saves + 1):
            for tensor in trained:
                tensor.add_(1.0)
            state["progress"] = {"step": step}
            ckpt.schedule_save(state, step=step)
            [report] = ckpt.finalize(blocking=True)
            if step:  # step 0 is the warm-up
                reports.append(report)
            print(f"[bench] {mode} save {step}/{saves}: wrote {report.bytes_written / MiB:.0f} MiB, "
                  f"blocked {report.blocked_s:.3f}s, durable {report.durable_s:.3f}s", file=sys.stderr, flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return ModeResult(
        mode, len(reports),
        statistics.median(r.bytes_written for r in reports) / MiB,
        statistics.median(r.blocked_s for r in reports),
        statistics.median(r.durable_s for r in reports),
    )


def hash_gbps(size_mib: int = 256, repeat: int = 3) -> float:
    tensor = torch.randn(size_mib * MiB // 4)
    best = min(_timed(lambda: tensor_digest(tensor)) for _ in range(repeat))
    return size_mib * MiB / best / 1e9


def raw_write_gbps(directory: str, size_mib: int = 512) -> float:
    data = torch.randn(size_mib * MiB // 4).numpy().tobytes()
    path = os.path.join(directory, "raw")

    def write() -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    seconds = _timed(write)
    os.remove(path)
    return size_mib * MiB / seconds / 1e9


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir under bench_out/)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    os.makedirs("bench_out", exist_ok=True)
    directory = tempfile.mkdtemp(prefix="incremental-", dir=args.dir or "bench_out")
    try:
        results = [run_mode(mode, directory, args.size_mib, args.saves) for mode in ("full", "incremental")]
        hashing, disk = hash_gbps(), raw_write_gbps(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    full, incremental = results
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"state {args.size_mib} MiB, 90 % frozen by bytes; {args.saves} measured saves per mode (medians); "
          f"load average {load}")
    print(f"{'mode':<12} {'written MiB':>12} {'blocked s':>10} {'durable s':>10}")
    for r in results:
        print(f"{r.mode:<12} {r.bytes_written_mib:>12.0f} {r.blocked_s:>10.3f} {r.durable_s:>10.3f}")
    print(f"incremental / full: written {incremental.bytes_written_mib / full.bytes_written_mib:.2f}x, "
          f"durable {incremental.durable_s / full.durable_s:.2f}x (goal <= 0.25x), "
          f"blocked {incremental.blocked_s / full.blocked_s:.2f}x (goal <= 1.05x)")
    print(f"XXH3-128 hashing {hashing:.1f} GB/s on one core; raw write + fsync {disk:.2f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": [asdict(r) for r in results], "hash_gbps": hashing, "raw_write_gbps": disk,
                       "size_mib": args.size_mib, "load_average": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
