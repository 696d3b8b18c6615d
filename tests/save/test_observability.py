"""Per-save figures leave the library three ways: a JSON-lines file named in the config, an
`on_commit` callback, and one INFO line on the "asyncckpt" logger, each once per committed save
(a commit inside schedule_save or close included) and never for a save that failed. The worker
says in ps what it is and whose."""

from __future__ import annotations

import importlib.util
import json
import logging
import os

import psutil
import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, SaveReport

FIGURES = ("bytes", "blocked_s", "staging_s", "write_s", "commit_s", "throughput_gbps", "worker_pid", "cache_hit")


def state() -> dict:
    return {"w": torch.arange(10_000, dtype=torch.float32), "b": torch.ones(16), "meta": {"epoch": 1}}


def three_saves(root: str, config: CheckpointConfig) -> tuple[list[SaveReport], int]:
    """Step 1 commits inside schedule_save(2), step 2 in finalize, step 3 in close."""
    reports = []
    ckpt = AsyncCheckpointer(root, config)
    pid = ckpt.worker_pid
    ckpt.schedule_save(state(), step=1)
    ckpt.schedule_save(state(), step=2)
    reports += ckpt.finalize(blocking=True)
    ckpt.schedule_save(state(), step=3)
    reports += ckpt.close()
    assert [r.step for r in reports] == [1, 2, 3]
    return reports, pid


def read_records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines()]


def test_metrics_file_has_one_record_per_committed_save(ckpt_root, tmp_path):
    metrics = str(tmp_path / "metrics.jsonl")
    reports, pid = three_saves(ckpt_root, CheckpointConfig(metrics_path=metrics))
    records = read_records(metrics)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record, report in zip(records, reports):
        assert set(FIGURES) <= set(record)
        assert record == report.as_dict()  # the same figures finalize() returned
        assert record["bytes"] > 40_000 and record["throughput_gbps"] > 0
        assert all(record[k] >= 0 for k in ("blocked_s", "staging_s", "write_s", "commit_s"))
        assert record["worker_pid"] == pid
    assert [r["cache_hit"] for r in records] == [False, True, True]


def test_metrics_file_appends_and_skips_failed_saves(ckpt_root, tmp_path):
    metrics = str(tmp_path / "metrics.jsonl")
    with open(metrics, "w") as f:
        f.write(json.dumps({"step": 0, "earlier": "run"}) + "\n")
    os.makedirs(os.path.join(ckpt_root, "step_00000005", "__0_1.distcp"))  # opening this file fails
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(metrics_path=metrics, io_workers=2)) as ckpt:
        with pytest.raises(CheckpointError):
            ckpt.schedule_save(state(), step=5)
            ckpt.finalize(blocking=True)
        ckpt.schedule_save(state(), step=6)
    assert [r["step"] for r in read_records(metrics)] == [0, 6]


def test_on_commit_fires_exactly_once_per_commit(ckpt_root):
    seen: list[SaveReport] = []
    reports, _ = three_saves(ckpt_root, CheckpointConfig(on_commit=seen.append))
    assert seen == reports
    assert all(isinstance(r, SaveReport) for r in seen)


def test_on_commit_is_not_called_for_a_failed_save(ckpt_root):
    seen: list[SaveReport] = []
    os.makedirs(os.path.join(ckpt_root, "step_00000005", "__0_1.distcp"))
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(on_commit=seen.append, io_workers=2)) as ckpt:
        with pytest.raises(CheckpointError):
            ckpt.schedule_save(state(), step=5)
            ckpt.finalize(blocking=True)
        assert seen == []
    assert seen == []


def test_one_info_line_per_committed_save(ckpt_root, caplog):
    caplog.set_level(logging.INFO, logger="asyncckpt")
    reports, pid = three_saves(ckpt_root, CheckpointConfig())
    lines = [r for r in caplog.records if r.name.startswith("asyncckpt") and r.getMessage().startswith("committed step")]
    assert [r.levelno for r in lines] == [logging.INFO] * 3
    for record, report in zip(lines, reports):
        message = record.getMessage()
        assert message.startswith(f"committed step {report.step}:")
        for word in ("MB", "blocked", "staging", "write", "commit", "GB/s", f"worker {pid}"):
            assert word in message, f"{word!r} missing from {message!r}"
    assert [", cache hit" in r.getMessage() for r in lines] == [False, True, True]


def test_the_worker_says_in_ps_what_it_is_and_whose(tmp_path):
    """Named "asyncckpt-w<rank>" (what ps -e, top and pgrep show; 15 bytes at most), not
    "python"; with setproctitle installed, its command line is "asyncckpt worker rank <rank>"
    instead of multiprocessing's spawn line."""
    with AsyncCheckpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.schedule_save(state(), step=1)
        ckpt.finalize(blocking=True)  # written: the worker is past its start-up
        worker = psutil.Process(ckpt.worker_pid)
        assert worker.name() == "asyncckpt-w0"
        with open(f"/proc/{worker.pid}/comm") as f:
            assert f.read() == "asyncckpt-w0\n"
        if importlib.util.find_spec("setproctitle") is not None:
            assert " ".join(worker.cmdline()).startswith("asyncckpt worker rank 0")
