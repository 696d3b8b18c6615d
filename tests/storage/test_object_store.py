"""Object stores (docs/usage.md, "Object storage"): msc:// and s3:// roots against a real S3 server process (moto).

What the foundation tests do not cover: the backend's own semantics (nothing visible before an
upload completes, aborted files publish nothing, listing and deleting dot-files), a connection cut
in the middle of an upload, retention leaving no key behind, loading with multi-storage-client's
own DCP reader, forked writers, and the worker's memory while it uploads a 512 MiB state.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError
from asyncckpt.storage.msc import MscStorage
from asyncckpt.storage import storage_for
from asyncckpt.testing.s3_server import BUCKET, PROFILE, write_msc_config
from conftest import (
    MemorySampler, assert_loads_on_s3, assert_state_equal, clone_state, free_port, make_model_and_optimizer, make_state, step_path,
    zeros_like_state,
)

MiB = 1 << 20



@pytest.fixture
def s3(s3_server):
    return s3_server


def _prefix_of(s3, url: str) -> str:
    """The bucket key prefix a msc:// or s3:// URL of the session's server names."""
    for head in (f"msc://{s3.profile}/", f"s3://{s3.bucket}/"):
        if url.startswith(head):
            return url[len(head) :]
    raise ValueError(url)


# the backend on its own ----------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["msc", "s3"])
def test_backend_publishes_only_complete_objects_and_deletes_dot_files(s3, scheme):
    prefix = s3.unique_prefix("backend")
    root = s3.url(scheme, prefix)
    storage = storage_for(root)
    assert isinstance(storage, MscStorage) and storage_for(root) is storage  # one per process
    step = storage.join(root, "step_00000001")
    storage.prepare_dir(step)  # proves the bucket is writable; creates nothing
    assert s3.keys(prefix) == [] and not storage.is_dir(root)

    handle = storage.create(storage.join(step, "__0_0.distcp"))
    payload = os.urandom(12 * MiB)  # above the msc profile's multipart threshold
    handle.write(payload[: 5 * MiB])
    handle.write(memoryview(payload)[5 * MiB :])
    assert s3.keys(prefix) == []  # nothing visible before the upload
    handle.commit()
    aborted = storage.create(storage.join(step, "__0_1.distcp"))
    aborted.write(b"x" * MiB)
    aborted.abort()
    storage.write_atomic(storage.join(step, ".metadata"), b"commit")
    storage.write_atomic(storage.join(root, "latest"), b"step_00000001\n")

    assert s3.keys(prefix) == [f"{prefix}/latest", f"{prefix}/step_00000001/.metadata", f"{prefix}/step_00000001/__0_0.distcp"]
    assert storage.list_dir(root) == ["latest", "step_00000001"]
    assert storage.list_dir(step) == [".metadata", "__0_0.distcp"]
    assert storage.list_dir(storage.join(root, "nothing")) == []
    assert storage.is_dir(root) and storage.is_dir(step) and not storage.is_dir(storage.join(root, "latest"))
    assert storage.exists(storage.join(step, ".metadata")) and not storage.exists(step)
    assert storage.size(storage.join(step, "__0_0.distcp")) == len(payload)
    assert storage.read_bytes(storage.join(step, "__0_0.distcp")) == payload
    assert storage.read_bytes(storage.join(step, "__0_0.distcp"), 7 * MiB + 3, 100) == payload[7 * MiB + 3 : 7 * MiB + 103]
    assert storage.read_bytes(storage.join(step, "__0_0.distcp"), len(payload) - 10) == payload[-10:]
    with pytest.raises(FileNotFoundError, match="step_00000001/missing"):
        storage.read_bytes(storage.join(step, "missing"))

    storage.remove_tree(step)  # dot-files too (msc's recursive delete would leave .metadata)
    assert s3.keys(prefix) == [f"{prefix}/latest"]
    storage.remove_file(storage.join(root, "latest"))
    storage.remove_file(storage.join(root, "latest"))  # already gone: fine
    assert s3.keys(prefix) == []


def test_unreachable_or_unknown_store_fails_before_handoff(s3, tmp_path, monkeypatch):
    closed_port = free_port()  # nothing listens there
    config = tmp_path / "msc.yaml"
    dead = f"dead-{uuid.uuid4().hex[:8]}"
    write_msc_config(str(config), {PROFILE: s3.server.endpoint, dead: f"http://127.0.0.1:{closed_port}"})
    monkeypatch.setenv("MSC_CONFIG", str(config))
    for root in (f"msc://{dead}/run", f"msc://no-such-profile-{uuid.uuid4().hex[:8]}/run"):
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=f"{root}.*not writable"):
            storage_for(root).prepare_dir(root)
        assert time.monotonic() - started < 30
    with pytest.raises(CheckpointError, match=f"msc://{dead}/run.*not writable"):
        AsyncCheckpointer(f"msc://{dead}/run")  # a root: at construction
    with AsyncCheckpointer() as ckpt:
        pid = ckpt.worker_pid
        with pytest.raises(CheckpointError, match="not writable"):
            ckpt.schedule_save({"w": torch.ones(4)}, checkpoint_dir=f"msc://{dead}/run/step-1")
        assert ckpt.worker_pid == pid and psutil.pid_exists(pid)
        assert ckpt.finalize() == []


# a writer failure mid-upload -----------------------------------------------------------------------
class CuttableProxy:
    """A TCP proxy in front of the S3 server that drops every connection (and refuses new ones)
    once `cut_after(n)` bytes of requests have passed: a network failure in mid-upload."""

    def __init__(self, target_port: int) -> None:
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._budget = None
        self.sent = 0
        self.cut = False
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def cut_after(self, nbytes: int) -> None:
        with self._lock:
            self.sent, self._budget = 0, nbytes

    def restore(self) -> None:
        with self._lock:
            self.cut, self._budget = False, None

    def close(self) -> None:
        self._closed = True
        self._drop_all()
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.cut:
                client.close()
                continue
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, request_side: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if request_side:
                    with self._lock:
                        self.sent += len(data)
                        over = self._budget is not None and self.sent > self._budget
                    if over:
                        self.cut = True
                        self._drop_all()
                        return
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            _shut(s)

    def _drop_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            _shut(s)


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def _upload_state(seed: int) -> dict:
    """~40 MiB in four files: two above the msc profile's multipart threshold, two single PUTs."""
    g = torch.Generator().manual_seed(seed)
    sizes = {"a": 16 * MiB, "b": 16 * MiB, "c": 4 * MiB, "d": 4 * MiB}
    return {"model": {k: torch.rand(n // 4, generator=g) for k, n in sizes.items()}, "meta": {"seed": seed}}


def test_connection_cut_mid_upload_commits_nothing_and_keeps_latest(s3, tmp_path, monkeypatch, caplog):
    proxy = CuttableProxy(int(s3.server.endpoint.rsplit(":", 1)[1]))
    try:
        flaky = f"flaky-{uuid.uuid4().hex[:8]}"  # same bucket, reached through the proxy
        config = tmp_path / "msc.yaml"
        write_msc_config(str(config), {PROFILE: s3.server.endpoint, flaky: f"http://127.0.0.1:{proxy.port}"})
        monkeypatch.setenv("MSC_CONFIG", str(config))  # before the worker is spawned: it inherits it
        monkeypatch.setenv("ASYNCCKPT_RETRY_WINDOW_S", "2")  # a cut lasting longer than the retries fails the save
        prefix = s3.unique_prefix("cut")
        root, direct_root = f"msc://{flaky}/{prefix}", s3.url("msc", prefix)
        config_ = CheckpointConfig(io_workers=4, timeout_s=120)
        state = _upload_state(1)
        expected_1 = clone_state(state)
        with AsyncCheckpointer(root, config_) as ckpt:
            ckpt.schedule_save(state, step=1)
            ckpt.finalize(blocking=True)

            state = _upload_state(2)
            proxy.cut_after(10 * MiB)  # the four uploads run at once: every one is cut short
            started = time.monotonic()
            with pytest.raises(CheckpointError, match="step 2 not committed.*__0_"):
                ckpt.schedule_save(state, step=2)
                ckpt.finalize(blocking=True)
            failed_after = time.monotonic() - started
            assert proxy.cut

            keys = s3.keys(f"{prefix}/step_00000002/")
            assert f"{prefix}/step_00000002/.metadata" not in keys
            assert f"{prefix}/step_00000002/.checksums.json" not in keys
            # an object that is visible at all is a complete file (here, none is)
            reference = _local_reference_files(tmp_path / "reference", state, config_)
            for key in keys:
                body = s3.server.s3_client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
                assert body == reference[key.rsplit("/", 1)[1]], f"{key} is a partial object"
            cut_short = [name for name, data in reference.items() if len(data) > 10 * MiB]  # multipart
            assert cut_short and not any(key.endswith("/" + name) for key in keys for name in cut_short)
            assert _get(s3, f"{prefix}/latest") == b"step_00000001\n"
            target = zeros_like_state(expected_1)
            with AsyncCheckpointer(direct_root) as reader:
                assert reader.load_latest(target) == 1
            assert_state_equal(target, expected_1)
            # the cut uploads could not be aborted while the network was down: they are open now
            assert s3.pending_multipart_uploads(f"{prefix}/step_00000002/")

            _start_uploads(s3, _foreign_uploads(prefix))  # another job's: the sweep leaves them alone
            proxy.restore()  # the network is back: the same checkpointer saves again
            ckpt.schedule_save(state, step=3)
            assert [r.step for r in ckpt.finalize(blocking=True)] == [3]
        assert _get(s3, f"{prefix}/latest") == b"step_00000003\n"
        print(f"cut mid-upload: CheckpointError after {failed_after:.1f}s; step_00000002 keys left: {keys}")
    finally:
        proxy.close()
    # the next commit (its retention thread, which close() waits for) aborted them: an open upload
    # keeps its parts stored, and billed, on a real store, and no listing of objects shows it
    assert s3.pending_multipart_uploads(prefix) == _foreign_uploads(prefix)


def _start_uploads(s3, keys: list[str]) -> None:
    """Open multipart uploads, as writers that died mid-file leave them (boto3, not the code under test)."""
    api = s3.server.s3_client()
    for key in keys:
        api.create_multipart_upload(Bucket=BUCKET, Key=key)


def _foreign_uploads(prefix: str) -> list[str]:
    """Uploads in the same bucket that are not a save's of the root `prefix`: another job's root
    beside it with the same leading name, a root nested in it, a file name a save never writes."""
    return sorted([f"{prefix}-b/step_00000007/__0_0.distcp", f"{prefix}/nested/step_00000007/__0_0.distcp",
                   f"{prefix}/step_00000007/notes.bin"])


def test_cleanup_aborts_uploads_left_open_in_step_directories(s3):
    prefix = s3.unique_prefix("cleanup-uploads")
    ours = [f"{prefix}/step_00000003/__0_0.distcp", f"{prefix}/step_00000009/__1_2.distcp"]
    _start_uploads(s3, ours + _foreign_uploads(prefix))
    root = s3.url("s3", prefix)
    expected = sorted(f"s3://{s3.bucket}/{key}" for key in ours)
    assert sorted(asyncckpt.cleanup(root, dry_run=True)) == expected
    assert s3.pending_multipart_uploads(prefix) == sorted(ours + _foreign_uploads(prefix))
    assert sorted(asyncckpt.cleanup(root)) == expected
    assert s3.pending_multipart_uploads(prefix) == _foreign_uploads(prefix)


def _local_reference_files(root, state, config: CheckpointConfig) -> dict[str, bytes]:
    """The files the same save writes to a local directory (the format is deterministic)."""
    with AsyncCheckpointer(str(root), config) as ckpt:
        ckpt.schedule_save(state, step=2)
    step = root / "step_00000002"
    return {name: (step / name).read_bytes() for name in os.listdir(step)}


def _get(s3, key: str) -> bytes:
    return s3.server.s3_client().get_object(Bucket=BUCKET, Key=key)["Body"].read()


# retention, loading, forked writers ------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["msc", "s3"])
def test_retention_leaves_no_key_of_a_deleted_checkpoint(s3, scheme):
    prefix = s3.unique_prefix("retention")
    root = s3.url(scheme, prefix)
    with AsyncCheckpointer(root, CheckpointConfig(keep_last=2, io_workers=2)) as ckpt:
        for step in range(1, 6):
            ckpt.schedule_save({"w": torch.arange(1000.0) + step, "meta": {"step": step}}, step=step)
            ckpt.finalize(blocking=True)
    keys = s3.keys(prefix + "/")
    steps = sorted({k[len(prefix) + 1 :].split("/")[0] for k in keys})
    assert steps == ["latest", "step_00000004", "step_00000005"], keys
    for step in (4, 5):
        names = {k.rsplit("/", 1)[1] for k in keys if f"/step_{step:08d}/" in k}
        assert {".checksums.json", ".metadata"} < names, names
        assert all(n.endswith(".distcp") for n in names - {".checksums.json", ".metadata"}), names


def test_checkpoints_load_with_msc_reader_stock_dcp_and_load_latest(s3):
    prefix = s3.unique_prefix("load")
    model, optimizer = make_model_and_optimizer()
    state = make_state(model, optimizer, step=4)
    expected = clone_state(state)
    with AsyncCheckpointer(s3.url("s3", prefix), CheckpointConfig(io="process", io_workers=3)) as ckpt:
        ckpt.schedule_save(state, step=4)  # forked writers fill the spool files; the worker uploads
        [report] = ckpt.finalize(blocking=True)
    assert report.bytes > 0
    for scheme in ("msc", "s3"):
        path = step_path(s3.url(scheme, prefix), 4)
        assert_loads_on_s3(path, expected)
        target = zeros_like_state(expected)
        with AsyncCheckpointer(s3.url(scheme, prefix)) as reader:
            assert reader.load_latest(target) == 4
        assert_state_equal(target, expected)
    target = zeros_like_state(expected)  # msc:// also resolves through fsspec for checkpoint_id
    dcp.load(target, checkpoint_id=step_path(s3.url("msc", prefix), 4), no_dist=True)
    assert_state_equal(target, expected)


# memory while uploading --------------------------------------------------------------------------------
def _measure_save(root: str, state: dict, config: CheckpointConfig):
    """Save `state` once with a warmed-up worker (imports, clients and threads already made);
    returns the report and the worker's peak extra private and RSS bytes during the save."""
    with AsyncCheckpointer(root, config) as ckpt:
        ckpt.schedule_save({"warm-up": torch.ones(4)}, step=0)
        ckpt.finalize(blocking=True)
        with MemorySampler(ckpt.worker_pid, interval_s=0.01) as sampler:
            base_rss, base_owned = sampler.sample()
            ckpt.schedule_save(state, step=1)
            [report] = ckpt.finalize(blocking=True)
    storage_for(root).remove_tree(step_path(root, 1))  # frees the server's copy
    return report, sampler.peak_owned - base_owned, sampler.peak_rss - base_rss


@pytest.mark.slow
def test_worker_memory_while_uploading_stays_near_the_staging_pool(s3, tmp_path):
    """The staging pool holds the state once; uploads add bounded buffers on top: multipart
    chunks for large files, and at most SINGLE_PUT_MEMORY_BYTES for files msc sends in one PUT."""
    from asyncckpt.storage.msc import SINGLE_PUT_MEMORY_BYTES

    config = CheckpointConfig(io_workers=4, checksums=False, timeout_s=300)
    cases = [  # (label, tensor bytes, count, roots)
        ("512 MiB in 128 MiB files (multipart)", 64 * MiB, 8, ["local", "s3"]),
        ("240 MiB in 60 MiB files (one PUT each)", 60 * MiB, 4, ["s3"]),
    ]
    for label, tensor_bytes, count, where in cases:
        state = {f"layer{i}": torch.rand(tensor_bytes // 4) for i in range(count)}
        state_bytes = tensor_bytes * count
        reports, extras = {}, {}
        for kind in where:
            root = str(tmp_path / f"ckpt-{count}") if kind == "local" else s3.url("s3", s3.unique_prefix("mem"))
            report, extra_private, extra_rss = _measure_save(root, state, config)
            reports[kind], extras[kind] = report, extra_private
            print(
                f"{label} to {kind}: durable in {report.durable_s:.1f}s, writes {report.bytes / MiB / report.write_s:.0f} MiB/s; "
                f"worker peak extra: private {extra_private / MiB:.0f} MiB, rss {extra_rss / MiB:.0f} MiB"
            )
            assert extra_private < state_bytes + SINGLE_PUT_MEMORY_BYTES + 64 * MiB, (label, kind, extra_private / MiB)
            if kind == "s3" and tensor_bytes * count // config.io_workers > 64 * MiB:  # multipart only
                assert extra_private < state_bytes + 64 * MiB, (label, kind, extra_private / MiB)
        if "local" in reports:
            # the same save uploaded costs the local write's memory plus bounded upload buffers
            ratio = extras["s3"] / extras["local"]
            rate = reports["local"].write_s / reports["s3"].write_s
            print(f"{label}: s3 (moto) peak extra memory {ratio:.2f}x the local write's; writes at {rate:.2f}x its rate")
            assert extras["local"] > 0.9 * state_bytes  # the measurement sees the whole-state slab
            assert ratio < 1 + 64 * MiB / extras["local"], (label, ratio)


def test_upload_memory_wait_is_bounded_and_names_the_upload():
    """An upload that hangs while holding the shared upload memory must not hold the next
    upload forever: its wait ends at its bound with a TimeoutError naming it."""
    from asyncckpt.storage.upload_memory import MemoryBudget

    budget = MemoryBudget(100)
    held, release = threading.Event(), threading.Event()

    def hanging_upload() -> None:
        with budget.hold(100, 60.0, "upload first"):
            held.set()
            release.wait(60)

    thread = threading.Thread(target=hanging_upload)
    thread.start()
    try:
        assert held.wait(60)
        with pytest.raises(TimeoutError, match="upload s3://b/k: 50 bytes of upload memory not free within 0.2s"):
            with budget.hold(50, 0.2, "upload s3://b/k"):
                pass
    finally:
        release.set()
        thread.join(60)
    with budget.hold(100, 0.2, "upload after"):  # nothing leaked from the failed wait
        pass
