"""benchmarks/bench_gpu.py on the CPU: the harness the GPU run uses, end to end, on a tiny state."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

REPO_ROOT = REPO
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "bench_gpu.py")


def test_the_gpu_benchmark_runs_every_part_on_the_cpu_and_reports_a_consistent_save(tmp_path):
    """Limits, one asyncckpt method with its consistency check, one DCP peer, the training loop and
    the loads: each is a row of the JSON with its numbers, the checks passed, the data dir is gone."""
    out, data = tmp_path / "bench_gpu.json", tmp_path / "data"
    # --threads 1: on a shared 2-core box, DCP's staging copies with two OpenMP threads stall ~100x
    command = [sys.executable, SCRIPT, "--device", "cpu", "--size-gib", "0.01", "--saves", "2", "--train-s", "0.3",
               "--methods", "limits,eager,dcp,loop,load", "--save-every", "4", "--step-ms", "2",
               "--load-repeat", "1", "--limit-repeat", "1", "--threads", "1", "--dir", str(data), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["complete"] and not result["failures"] and not data.exists()

    limits = {row["name"]: row for row in result["limits"]}
    assert all(limits[name]["status"] == "ok" and limits[name]["gbps"] > 0
               for name in ("pinned D2H", "pageable D2H", "raw write + fsync", "raw read (cold)"))
    assert "memcpy" in limits["pinned D2H"]["note"] and limits["pinned H2D"]["status"] == "skipped"

    saves = {row["method"]: row for row in result["saves"]}
    assert set(saves) == {"eager", "dcp"}
    for row in saves.values():
        assert row["status"] == "ok" and row["consistent"] is True and row["difference"] == "", row
        assert len(row["steady"]) == 2 and row["blocked_s"] > 0 and row["durable_s"] >= row["blocked_s"]
    eager = saves["eager"]
    assert eager["fresh"]["durable_s"] > 0 and eager["trained"]["durable_s"] > 0 and eager["trained_steps"] > 0
    assert saves["dcp"]["fresh"]["durable_s"] > 0 and saves["dcp"]["trained"] is None

    loop = {row["label"]: row for row in result["loop"]}
    assert set(loop) == {"no saves", "dcp.async_save every 4", "asyncckpt eager every 4"}
    for label, row in loop.items():
        assert row["status"] == "ok" and len(row["step_s"]) == 8, row
        assert len(row["save_call_s"]) == (0 if label == "no saves" else 2)
        assert label == "no saves" or row["slowdown_mean_pct"] is not None

    loads = {row["label"]: row for row in result["loads"]}
    assert set(loads) == {"asyncckpt.load", "dcp.load"}
    for row in loads.values():
        assert row["status"] == "ok" and row["difference"] == "" and row["cold_s"] > 0 and row["warm_s"] > 0, row

    names = [ratio["name"] for ratio in result["ratios"]]
    assert "asyncckpt eager: blocked / pinned D2H" in names and "asyncckpt.load cold / raw read (cold)" in names
    assert "asyncckpt eager" in result["table"] and "consistent" in result["table"]
    assert result["machine"]["device"] == "cpu" and result["machine"]["disk"]["type"]
