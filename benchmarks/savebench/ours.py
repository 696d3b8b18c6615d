"""asyncckpt as a benchmark method: thread, process, lazy, safetensors, budget and s3 variants."""

from __future__ import annotations

import importlib
import os
import time
import uuid
from typing import Any, Optional

from .common import Skip
from .methods import Method


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

    def warm_up(self) -> None:
        self.ckpt.prepare(self.state)

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
        from asyncckpt.layout import step_dir_name

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

    def __init__(self, state, workdir, name: str, slowdown_rate: Optional[float] = None) -> None:
        """`slowdown_rate`: reach the server through asyncckpt.testing.s3_faults.FaultyS3 (in this
        process), which answers that fraction of requests with 503 SlowDown (0: none, the proxy's
        own cost only); None: straight to the server."""
        super().__init__(state, workdir, name, {})
        self.server = None
        self.front = None
        self.slowdown_rate = slowdown_rate
        self.profile = ""  # this instance's msc profile: to the server, or through the proxy
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
        endpoint, profiles = self.server.endpoint, {s3_server.PROFILE: self.server.endpoint}
        # a profile of its own for every instance: msc keeps the s3:// client of an earlier server
        # (the row's first instance, or another row), at that server's address
        self.profile = f"bench-{uuid.uuid4().hex[:8]}"
        profiles[self.profile] = endpoint
        if self.slowdown_rate is not None:
            from asyncckpt.testing.s3_faults import Fault, FaultyS3

            self.front = FaultyS3(endpoint, seed=0)
            if self.slowdown_rate > 0:
                self.front.inject(Fault("slowdown", rate=self.slowdown_rate))
            profiles[self.profile] = self.front.endpoint
        config_path = os.path.join(self.workdir, "msc_config.yaml")
        # the plain row uploads with msc's own part sizes (as an s3:// root would), the proxy rows with small parts
        s3_server.write_msc_config(config_path, profiles, msc_parts=() if self.front else (self.profile,))
        env = s3_server.session_env(config_path, endpoint)
        # Set before the checkpointer starts, so its worker process inherits them; restored in teardown.
        self._saved_env = {name: os.environ.get(name) for name in (*env, "AWS_PROFILE")}
        os.environ.update(env)
        os.environ.pop("AWS_PROFILE", None)
        self.note = "local moto_server (its memory not counted)" + (
            f", through a fault proxy in this process, {self.slowdown_rate:.0%} 503 SlowDown, msc profile with "
            f"{s3_server.MULTIPART_CHUNKSIZE >> 20} MiB parts" if self.front else "")
        self._server_note = self.note

    def end(self) -> dict[str, Any]:
        report = super().end()
        self.note = f"{self._server_note}; {requests_note(report)}"
        return report

    def outside_pids(self) -> frozenset[int]:
        return frozenset([self.server.process.pid]) if self.server is not None else frozenset()

    @property
    def root(self) -> str:
        return f"msc://{self.profile}/{self.PREFIX}" if self.profile else f"s3://{self.bucket}/{self.PREFIX}"

    def output_of(self, step: int) -> str:
        return ""  # nothing on the local disk; see output_size / discard

    def _step_keys(self, step: int) -> list[tuple[str, int]]:
        from asyncckpt.layout import step_dir_name

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
            if self.front is not None:
                self.front.close()
                self.front = None
            if self.server is not None:
                self.server.stop()
                self.server = None
            for name, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            self._saved_env = {}


WRITES = ("put", "part", "create", "complete", "copy", "delete", "abort")  # what S3 limits to ~3,500/s per prefix
PREFIX_WRITES_PER_S = 3500


def requests_note(report: dict[str, Any], ranks: int = 1000) -> str:
    """One save's requests by kind (this rank's data files + its commit) and what a `ranks`-rank
    job of the same shape issues: every rank's data-file writes plus the coordinator's commit,
    and the least time those take at S3's per-prefix write limit, all in one prefix
    (ROOT/step_N/) and spread over the data folders `prefixes=None` picks for that job
    (layout.prefix_count of the writes counted here): the busiest folder's writes."""
    from asyncckpt.layout import prefix_count

    data, commit = report.get("requests", {}), report.get("commit_requests", {})
    kinds = sorted({*data, *commit})
    per_save = ", ".join(f"{k} {data.get(k, 0) + commit.get(k, 0)}" for k in kinds)
    per_rank = sum(data.get(k, 0) for k in WRITES)
    writes = ranks * per_rank + sum(commit.get(k, 0) for k in WRITES)
    folders = prefix_count(ranks, per_rank)
    busiest = -(-ranks // folders) * per_rank
    return (f"requests/save: {per_save}, retries {report.get('retries', 0)}; {ranks:,} ranks: {writes:,} writes/save, "
            f">= {writes / PREFIX_WRITES_PER_S:.1f}s at {PREFIX_WRITES_PER_S:,} writes/s per prefix; spread over "
            f"{folders} prefixes: busiest {busiest:,} writes/save, >= {busiest / PREFIX_WRITES_PER_S:.1f}s")


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
