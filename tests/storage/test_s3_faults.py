"""Object stores under faults (docs/guarantees.md, "Object storage under faults"): saves and loads
through asyncckpt.testing.s3_faults.FaultyS3, a proxy in front of the session's moto server that
answers 503 SlowDown, resets connections mid-body, stalls, refuses expired credentials and drops
answers after the server acted.

Every save either commits a checkpoint that verifies and loads, or raises CheckpointError within
timeout_s; nothing partial is published, no earlier checkpoint is lost, no multipart upload stays
open. CI runs a small matrix; ASYNCCKPT_STRESS=1 runs more saves per case (a soak).
"""

from __future__ import annotations

import pickle
import threading
import time
import uuid
from dataclasses import dataclass

import pytest
import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, CheckpointError, load, verify_checkpoint
from asyncckpt.storage import storage_for
from asyncckpt.testing.s3_faults import Fault, FaultyS3
from asyncckpt.testing.s3_server import BUCKET, PROFILE, write_msc_config
from conftest import STRESS, assert_state_equal, clone_state, stress_size, zeros_like_state
from multirank import run_ranks

MiB = 1 << 20
RETRY_WINDOW_S = 3.0  # a fault outlasting this fails the save (ASYNCCKPT_RETRY_WINDOW_S)
TIMEOUT_S = 60.0


@dataclass
class Front:
    """The proxy, the msc profile that reaches the bucket through it, and the prefix of one test."""

    proxy: FaultyS3
    profile: str
    prefix: str

    @property
    def root(self) -> str:
        return f"msc://{self.profile}/{self.prefix}"


@pytest.fixture
def front(s3_server, tmp_path, monkeypatch, request):
    """A FaultyS3 in front of the session's server, reached through its own msc profile (set
    before the test's checkpointers start, so their workers inherit it)."""
    proxy = FaultyS3(s3_server.server.endpoint, seed=7)
    profile = f"faulty-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "msc.yaml"
    write_msc_config(str(config), {PROFILE: s3_server.server.endpoint, profile: proxy.endpoint})
    monkeypatch.setenv("MSC_CONFIG", str(config))
    monkeypatch.setenv("ASYNCCKPT_RETRY_WINDOW_S", str(RETRY_WINDOW_S))
    try:
        yield Front(proxy, profile, s3_server.unique_prefix(request.node.name))
    finally:
        proxy.close()


def _state(seed: int) -> dict:
    """~14 MiB: a 10 MiB tensor (a multipart upload in the test profile) and smaller ones (one PUT each)."""
    g = torch.Generator().manual_seed(seed)
    return {"model": {"big": torch.rand(10 * MiB // 4, generator=g), "small": torch.rand(3 * MiB // 4, generator=g),
                      "bias": torch.rand(1000, generator=g)}, "meta": {"seed": seed}}


def _change(state: dict, step: int) -> None:
    """One save's training: the small tensors change, the big one only every third step (an
    incremental save copies its file server-side in between)."""
    state["model"]["small"] += 1
    state["model"]["bias"] += step
    if step % 3 == 0:
        state["model"]["big"] += 1
    state["meta"]["seed"] = step


# what each save of the matrix meets: (label, faults); every one is retried and the save commits
TRANSIENT = [
    ("503 SlowDown on 5% of requests", [Fault("slowdown", rate=0.05)]),
    ("a reset mid-body", [Fault("reset", kinds=("put", "part", "copy"), times=1)]),
    ("answers dropped after the server acted", [Fault("drop", kinds=("put", "create", "complete", "copy"), rate=0.3, times=3)]),
    ("credentials expired for 1 s", [Fault("expired", window_s=1.0)]),
    ("a 2 s stall", [Fault("stall", kinds=("put", "part"), times=1, stall_s=2.0)]),
]
# CI: both I/O modes and both incremental settings; ASYNCCKPT_STRESS=1: every pairing, more rounds
CASES = [("thread", False), ("process", True)] + ([("process", False), ("thread", True)] if STRESS else [])


def _save(ckpt: AsyncCheckpointer, state: dict, step: int):
    started = time.monotonic()
    ckpt.schedule_save(state, step=step)
    reports = ckpt.finalize(blocking=True)
    return reports, time.monotonic() - started


def _since(before: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in now.items() if n > before.get(k, 0)}


def _keys(s3, prefix: str) -> list[str]:
    return s3.keys(prefix + "/")


def _check_committed(s3, front: Front, step: int, expected: dict) -> None:
    """The step verifies, loads whole, and holds exactly the files its .metadata names (a write
    applied twice published neither a second copy nor half of one)."""
    path = f"{front.root}/step_{step:08d}"
    assert verify_checkpoint(path) == []
    target = zeros_like_state(expected)
    load(target, path)
    assert_state_equal(target, expected)
    metadata = pickle.loads(s3.server.s3_client().get_object(
        Bucket=BUCKET, Key=f"{front.prefix}/step_{step:08d}/.metadata")["Body"].read())
    named = {info.relative_path for info in metadata.storage_data.values()}
    present = {k.rsplit("/", 1)[1] for k in _keys(s3, f"{front.prefix}/step_{step:08d}")}
    assert present - {".metadata"} - {n for n in present if n.startswith(".checksums")} == named, (step, present, named)


def _check_root(s3, front: Front, committed: dict[int, dict]) -> None:
    """After the checkpointer closed: every committed step still there and loadable, no step
    directory of a failed save left, `latest` the newest commit, no multipart upload open."""
    keys = _keys(s3, front.prefix)
    steps = sorted({int(k.split("/step_")[1][:8]) for k in keys if "/step_" in k})
    assert steps == sorted(committed), (steps, sorted(committed))
    for step, expected in committed.items():
        _check_committed(s3, front, step, expected)
    latest = s3.server.s3_client().get_object(Bucket=BUCKET, Key=f"{front.prefix}/latest")["Body"].read()
    assert latest == f"step_{max(committed):08d}\n".encode()
    assert s3.pending_multipart_uploads(front.prefix + "/") == []


@pytest.mark.parametrize("io,incremental", CASES)
def test_saves_under_transient_faults_commit_whole(s3_server, front, io, incremental):
    """Each save meets one transient fault, is retried and commits; its report counts the
    requests the store saw and the retries. At the end every checkpoint verifies, loads and
    holds only the files its .metadata names; no multipart upload is open."""
    config = CheckpointConfig(io=io, io_workers=2, incremental=incremental, timeout_s=TIMEOUT_S)
    state = _state(1)
    committed: dict[int, dict] = {}
    plan = TRANSIENT * stress_size("S3_FAULT_ROUNDS", 1, 10)
    with AsyncCheckpointer(front.root, config) as ckpt:
        _save(ckpt, state, 1)
        committed[1] = clone_state(state)
        for step, (label, faults) in enumerate(plan, start=2):
            _change(state, step)
            assert ckpt.wait_tidy()  # the last commit's background work is done: the proxy counts only this save
            requests, dealt = front.proxy.requests(), front.proxy.injected()
            for fault in faults:
                front.proxy.inject(fault)
            [report], took = _save(ckpt, state, step)
            front.proxy.clear()
            requests, dealt = _since(requests, front.proxy.requests()), _since(dealt, front.proxy.injected())
            print(f"{io}{' incremental' if incremental else ''}, {label}: committed in {took:.1f}s, "
                  f"{report.request_count} requests, {report.retries} retries; faults dealt {dealt}")
            assert dealt, f"{label}: no fault met the save (the test would prove nothing)"
            assert report.step == step and took < TIMEOUT_S
            counted = {k: report.requests.get(k, 0) + report.commit_requests.get(k, 0)
                       for k in {*report.requests, *report.commit_requests}}
            assert counted == requests  # what the store saw, each attempt counted
            assert report.retries >= (1 if "stall" not in dealt else 0)
            committed[step] = clone_state(state)
    _check_root(s3_server, front, committed)


def test_expired_credentials_fail_within_the_bound_and_say_so(s3_server, front):
    """Credentials refused for longer than the retries last: CheckpointError naming them, well
    within timeout_s; the earlier checkpoint stays `latest` and loads."""
    with AsyncCheckpointer(front.root, CheckpointConfig(io_workers=2, timeout_s=TIMEOUT_S)) as ckpt:
        state = _state(2)
        _save(ckpt, state, 1)
        expected = clone_state(state)
        _change(state, 2)
        front.proxy.inject(Fault("expired", window_s=60.0))
        started = time.monotonic()
        with pytest.raises(CheckpointError, match="credentials expired") as failure:
            _save(ckpt, state, 2)
        took = time.monotonic() - started
        front.proxy.clear()
    print(f"expired credentials: CheckpointError after {took:.1f}s: {failure.value}")
    assert took < RETRY_WINDOW_S + 15  # the retry window, a backoff, the answer; far below timeout_s
    _check_root(s3_server, front, {1: expected})


def test_a_conditional_put_whose_answer_was_lost_is_still_ours(s3_server, front):
    """The root's lease is written with If-None-Match / If-Match: when the store took the PUT but
    its answer was lost, the retry meets 412; reading back our own bytes, it is ours (before,
    the job took that for another job's lease and refused to start)."""
    storage = storage_for(front.root)
    lease = storage.join(front.root, ".asyncckpt.lock")
    front.proxy.inject(Fault("drop", kinds=("put",), times=1))
    assert storage.write_if_version(lease, b"ours", None)
    assert front.proxy.injected() == {"drop": 1}
    version = storage.read_versioned(lease).version
    front.proxy.inject(Fault("drop", kinds=("put",), times=1))
    assert storage.write_if_version(lease, b"ours, renewed", version)
    assert not storage.write_if_version(lease, b"another job's", None)  # a real conflict stays one
    assert storage.read_versioned(lease).data == b"ours, renewed"


def test_loads_retry_ranged_gets_and_never_pass_a_partial_read(s3_server, front):
    s3 = s3_server
    state = _state(4)
    expected = clone_state(state)
    with AsyncCheckpointer(front.root, CheckpointConfig(io_workers=2, timeout_s=TIMEOUT_S)) as ckpt:
        _save(ckpt, state, 1)
    path = f"{front.root}/step_00000001"
    for faults in ([Fault("slowdown", kinds=("get", "head", "list"), rate=0.2)], [Fault("reset", kinds=("get",), times=2)],
                   [Fault("expired", window_s=1.0)]):
        front.proxy.clear()
        seen = front.proxy.injected()
        for fault in faults:
            front.proxy.inject(fault)
        target = zeros_like_state(expected)
        load(target, path)
        assert_state_equal(target, expected)
        assert front.proxy.injected() != seen, faults
    # every GET cut: the load fails (not loaded, whatever it says of the state), within the bound
    front.proxy.clear()
    front.proxy.inject(Fault("reset", kinds=("get",)))
    target = zeros_like_state(expected)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="loading .* failed"):
        load(target, path)
    assert time.monotonic() - started < TIMEOUT_S
    front.proxy.clear()
    assert s3.pending_multipart_uploads(front.prefix + "/") == []


def _two_ranks(rank: int, world_size: int, root: str, control_address) -> None:
    """Each rank saves twice through the proxy; the test process sets the faults of each save
    for both ranks (over `control_address`): step 1 commits despite them, step 2 fails."""
    from multiprocessing.connection import Client

    state = {"w": torch.arange(6 * MiB // 4, dtype=torch.float32) + rank}
    with AsyncCheckpointer(root, CheckpointConfig(io="process", io_workers=2, timeout_s=TIMEOUT_S)) as ckpt, \
            Client(control_address) as control:
        for step in (1, 2):
            control.send(rank)
            assert control.recv() == "go"
            state["w"] += 1
            if step == 1:
                assert [r.step for r in _save(ckpt, state, step)[0]] == [1]
            else:
                with pytest.raises(CheckpointError, match="step 2 not .*credentials expired"):
                    _save(ckpt, state, step)
            control.send(rank)
            assert control.recv() == "ok"


def test_two_ranks_commit_or_fail_on_every_rank(s3_server, front):
    """Two ranks: 503s and a reset are retried and the save commits on both; credentials
    refused for longer than the retries fail the save on both, and it leaves nothing."""
    from multiprocessing.connection import Listener

    def conduct(listener) -> None:
        conns = [listener.accept() for _ in range(2)]
        for faults in ([Fault("slowdown", kinds=("put", "part"), times=2), Fault("reset", kinds=("put", "part"), times=1)],
                       [Fault("expired", window_s=60.0)]):
            assert sorted(conn.recv() for conn in conns) == [0, 1]  # both ranks wait for their save's faults
            for fault in faults:
                front.proxy.inject(fault)
            for conn in conns:
                conn.send("go")
            assert sorted(conn.recv() for conn in conns) == [0, 1]
            front.proxy.clear()
            for conn in conns:
                conn.send("ok")

    with Listener(("127.0.0.1", 0)) as listener:
        conductor = threading.Thread(target=conduct, args=(listener,), daemon=True)
        conductor.start()
        run_ranks(_two_ranks, 2, front.root, listener.address, timeout_s=240)
        conductor.join(10)
    assert front.proxy.injected() == {"slowdown": 2, "reset": 1, "expired": front.proxy.injected()["expired"]}
    keys = _keys(s3_server, front.prefix)
    assert not any("/step_00000002/" in k for k in keys), keys
    assert verify_checkpoint(f"{front.root}/step_00000001") == []
    assert s3_server.pending_multipart_uploads(front.prefix + "/") == []


def test_a_fault_that_ends_within_the_retry_window_is_outlasted():
    """A backoff drawn longer than what is left of the window is cut short at its end for one last
    try; before, the call gave up early (the matrix's 1 s of expired credentials then failed a
    save now and then, when the jitter drew a long wait)."""
    from asyncckpt.storage.retries import RetryPolicy, with_retries

    class LongWaits(RetryPolicy):
        def backoff_s(self, retry: int) -> float:
            return 30.0

    started = time.monotonic()

    def call() -> str:
        if time.monotonic() - started < 0.2:
            raise ConnectionResetError("reset by the store")
        return "done"

    assert with_retries(call, policy=LongWaits(window_s=0.5)) == "done"
    assert time.monotonic() - started < 5
    with pytest.raises(ConnectionResetError):  # a fault outlasting the window still fails, at its end
        with_retries(lambda: (_ for _ in ()).throw(ConnectionResetError("again")), policy=LongWaits(window_s=0.3))
