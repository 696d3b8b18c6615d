"""A real S3-compatible HTTP server for tests and benchmarks: `moto_server` as a separate process
on loopback.

`MotoServer.start()` runs it on a free port; `create_bucket`, `write_msc_config` (an MSC_CONFIG with
one S3 profile pointing at it) and `session_env` (MSC_CONFIG / AWS_* to set, so spawned worker
processes inherit them; `s3://BUCKET/...` URLs reach the same server through msc's implicit profile
via AWS_ENDPOINT_URL) make it usable. The tests' session fixture (tests/conftest.py) and the
benchmark's s3 row (benchmarks/bench_save.py) both use it. moto keeps objects in its own memory
(large ones spill to temp files): keep each test's objects to ~100 MiB.

Imports only the standard library at import time: boto3, psutil and moto_server (the test extras)
are needed only when a server is started or queried, so the package never depends on them.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Optional

BUCKET = "asyncckpt-test"
PROFILE = "asyncckpt-test"
REGION = "us-east-1"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
# The msc profile uses small multipart sizes, so uploads of a few MiB already go multipart there
# (the s3:// implicit profile keeps msc's defaults: 64 MiB threshold, 32 MiB parts).
MULTIPART_THRESHOLD = 8 << 20
MULTIPART_CHUNKSIZE = 5 << 20  # S3's smallest part


def moto_server_command() -> Optional[str]:
    """moto_server beside this interpreter (the venv's bin dir), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "moto_server")
    return beside if os.path.exists(beside) else shutil.which("moto_server")


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _PortTaken(Exception):
    """Another process bound the port first."""


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a listening socket on `port`."""
    import psutil

    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in psutil.Process(pid).net_connections("tcp"))
    except psutil.Error:
        return False


@dataclass
class MotoServer:
    """One moto_server process; `stop()` terminates it (its objects are gone with it)."""

    endpoint: str
    process: subprocess.Popen
    log_path: str

    @classmethod
    def start(cls, log_dir: str, timeout_s: float = 30.0, attempts: int = 3) -> "MotoServer":
        """Start on a free port and wait until it answers; RuntimeError (with its log) if not.
        A port taken by another process between `free_port` and the server's bind (two test
        processes) is retried on another port."""
        for attempt in range(attempts):
            try:
                return cls._start_once(log_dir, timeout_s)
            except _PortTaken:
                if attempt + 1 == attempts:
                    raise RuntimeError(f"moto_server found its port taken {attempts} times") from None
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(cls, log_dir: str, timeout_s: float) -> "MotoServer":
        command = moto_server_command()
        if command is None:
            raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
        port = free_port()
        log_path = os.path.join(log_dir, f"moto-{port}.log")
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [command, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
            )
        server = cls(f"http://127.0.0.1:{port}", process, log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            if not _listens(process.pid, port):  # an answer before our bind would be another server's
                time.sleep(0.1)
                continue
            try:
                with urllib.request.urlopen(server.endpoint + "/moto-api/", timeout=2):
                    return server
            except OSError:
                time.sleep(0.1)
        server.stop()
        if "Address already in use" in server.log_tail():
            raise _PortTaken()
        raise RuntimeError(f"moto_server did not start within {timeout_s:.0f}s: {server.log_tail()}")

    def s3_client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )

    def create_bucket(self, bucket: str) -> None:
        client = self.s3_client()
        try:
            client.create_bucket(Bucket=bucket)
        except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            pass

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key under `prefix`, listed with boto3 (not through the code under test)."""
        paginator = self.s3_client().get_paginator("list_objects_v2")
        return sorted(
            item["Key"] for page in paginator.paginate(Bucket=bucket, Prefix=prefix) for item in page.get("Contents", [])
        )

    def pending_multipart_uploads(self, bucket: str, prefix: str = "") -> list[str]:
        """Keys of multipart uploads started and neither completed nor aborted (listed with boto3)."""
        response = self.s3_client().list_multipart_uploads(Bucket=bucket, Prefix=prefix)
        return sorted(u["Key"] for u in response.get("Uploads", []))

    def rss_bytes(self) -> int:
        import psutil

        return psutil.Process(self.process.pid).memory_info().rss

    def log_tail(self, chars: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-chars:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def write_msc_config(path: str, profiles: dict[str, str], msc_parts: tuple[str, ...] = ()) -> None:
    """An MSC_CONFIG with one S3 profile per name -> endpoint, each on bucket BUCKET, with small
    multipart parts (tests) except the profiles named in `msc_parts`, which keep msc's defaults."""
    lines = ["profiles:"]
    for name, endpoint in profiles.items():
        parts = [] if name in msc_parts else [
            f"        multipart_threshold: {MULTIPART_THRESHOLD}",
            f"        multipart_chunksize: {MULTIPART_CHUNKSIZE}",
        ]
        lines += [
            f"  {name}:",
            "    storage_provider:",
            "      type: s3",
            "      options:",
            f"        base_path: {BUCKET}",
            f"        endpoint_url: {endpoint}",
            f"        region_name: {REGION}",
            *parts,
            "        max_concurrency: 4",
            "    credentials_provider:",
            "      type: S3Credentials",
            "      options:",
            f"        access_key: {ACCESS_KEY}",
            f"        secret_key: {SECRET_KEY}",
            "    retry:",  # a dead endpoint fails in a second, not after msc's default backoff
            "      attempts: 2",
            "      delay: 0.2",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


@dataclass
class S3Session:
    """The session's server and the URLs tests use."""

    server: MotoServer
    config_path: str
    bucket: str = BUCKET
    profile: str = PROFILE
    _serial: list = field(default_factory=lambda: [0])

    def unique_prefix(self, label: str) -> str:
        """A fresh key prefix (no two tests share one)."""
        self._serial[0] += 1
        clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-")[:60] or "t"
        return f"{clean}-{self._serial[0]}-{uuid.uuid4().hex[:6]}"

    def url(self, scheme: str, prefix: str) -> str:
        """`msc://PROFILE/prefix` or `s3://BUCKET/prefix` for the same keys."""
        if scheme == "msc":
            return f"msc://{self.profile}/{prefix}"
        if scheme == "s3":
            return f"s3://{self.bucket}/{prefix}"
        raise ValueError(f"scheme must be 'msc' or 's3', not {scheme!r}")

    def keys(self, prefix: str = "") -> list[str]:
        return self.server.keys(self.bucket, prefix)

    def pending_multipart_uploads(self, prefix: str = "") -> list[str]:
        return self.server.pending_multipart_uploads(self.bucket, prefix)


def session_env(config_path: str, endpoint: str) -> dict[str, str]:
    return {
        "MSC_CONFIG": config_path,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": REGION,
    }
