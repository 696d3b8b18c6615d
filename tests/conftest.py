"""Shared fixtures and helpers: checkpoint roots (local and on the session's S3 server), small
realistic training states, step paths, free ports, crafted pickles, memory sampling."""

from __future__ import annotations

import os

# One compute thread in every test process and in every process it starts (OMP_NUM_THREADS is
# inherited; libgomp reads it when torch loads). torch's default is one thread per core in each
# process: with -n test processes, each starting trainers, workers or ranks, that is many times
# more OpenMP threads than cores, spin-waiting for each other. Measured on 2 cores (busy): a tiny
# GPT-2 training loop took 510 s in each of 6 processes at 2 threads, 20 s at 1 thread.
os.environ["OMP_NUM_THREADS"] = "1"

import importlib  # noqa: E402
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

import psutil
import pytest
import torch

from asyncckpt.testing.s3_server import BUCKET, MotoServer, S3Session, free_port, session_env, write_msc_config
from cuda_like import dtensor_as_on_cuda

dtensor_as_on_cuda()  # raw ops on a DTensor fail here as they do on a GPU machine
torch.set_num_threads(1)  # in case torch was loaded before this file set OMP_NUM_THREADS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout the suite tests
TESTS = os.path.join(REPO, "tests")  # the helpers beside conftest (hf_trainer.py, multirank.py)

__all__ = ["free_port", "stress_size", "STRESS"]  # re-exported for the tests: one helper for every loopback port

# msc:// and s3:// roots both go through multi-storage-client; the object-store tests cover each
# scheme, and every all_backends test runs on one remote root unless ASYNCCKPT_ALL_BACKENDS=1
BACKENDS = ("local", "msc", "s3") if os.environ.get("ASYNCCKPT_ALL_BACKENDS") == "1" else ("local", "s3")
STRESS = os.environ.get("ASYNCCKPT_STRESS") == "1"


def stress_size(name: str, ci: int, full: int) -> int:
    """A stress test's size: `ci` by default (CI runs the whole suite on 2 cores in ~15 minutes),
    `full` with ASYNCCKPT_STRESS=1, or the number in ASYNCCKPT_STRESS_<NAME>."""
    value = os.environ.get(f"ASYNCCKPT_STRESS_{name}")
    return int(value) if value else (full if STRESS else ci)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "all_backends: tests taking `ckpt_root` run on a local directory and an s3:// root (msc:// too with ASYNCCKPT_ALL_BACKENDS=1)"
    )
    config.addinivalue_line("markers", "local_only: inside an all_backends module, run on a local directory only")


def pytest_generate_tests(metafunc) -> None:
    """`ckpt_root` is a local directory; in modules marked all_backends it is also an msc://
    profile and an s3:// bucket prefix on the session's local S3 server (tests marked local_only
    stay local)."""
    node = metafunc.definition
    if "ckpt_backend" in metafunc.fixturenames and node.get_closest_marker("all_backends"):
        if not node.get_closest_marker("local_only"):
            metafunc.parametrize("ckpt_backend", BACKENDS)


@pytest.fixture
def ckpt_backend() -> str:
    """Where `ckpt_root` lives, unless parametrized: a local directory."""
    return "local"


@pytest.fixture
def ckpt_root(request, tmp_path, ckpt_backend) -> str:
    """A checkpoint root that does not exist yet (the checkpointer creates it); on an object
    store, a prefix no other test uses."""
    if ckpt_backend == "local":
        return os.path.join(str(tmp_path), "ckpt")
    s3 = request.getfixturevalue("s3_server")
    return s3.url(ckpt_backend, s3.unique_prefix(request.node.name) + "/ckpt")


def _skip_or_fail(reason: str) -> None:
    """Skip where the S3 server cannot run; fail under CI (.ci/run sets ASYNCCKPT_REQUIRE_S3=1),
    which installs it: there a skip would hide every object-store test."""
    if os.environ.get("ASYNCCKPT_REQUIRE_S3") == "1":
        pytest.fail(f"ASYNCCKPT_REQUIRE_S3=1: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def s3_server():
    """The session's moto_server, bucket and MSC_CONFIG, with MSC_CONFIG / AWS_* set for the
    session so worker processes spawned by the tests inherit them. Tests that need it are
    skipped, with the reason, when moto_server or the S3 clients are not installed."""
    try:
        importlib.import_module("boto3")
        importlib.import_module("multistorageclient")
    except ImportError as exc:
        _skip_or_fail(f"object-store tests need multi-storage-client[boto3] and boto3: {exc}")
    workdir = tempfile.mkdtemp(prefix="asyncckpt-s3-")
    try:
        server = MotoServer.start(workdir)
    except (RuntimeError, OSError) as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        _skip_or_fail(f"no local S3 server: {exc}")
    try:
        server.create_bucket(BUCKET)
        session = S3Session(server, os.path.join(workdir, "msc_config.yaml"))
        write_msc_config(session.config_path, {session.profile: server.endpoint})
        with pytest.MonkeyPatch.context() as mp:
            for name, value in session_env(session.config_path, server.endpoint).items():
                mp.setenv(name, value)
            mp.delenv("AWS_PROFILE", raising=False)
            yield session
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def step_path(root: str, step: int) -> str:
    """`ROOT/step_{step:08d}`, the checkpoint directory of a step (a local path or an object-store URL)."""
    return f"{root.rstrip('/')}/step_{step:08d}"


class Payload:
    """Unpickling this creates the directory `marker`: the stand-in for arbitrary code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def flip_byte(path: str, offset: int) -> None:
    """Damage one byte of a file in place (the stand-in for a bit flip on disk)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def damaged_copy(checkpoint: str, dest: str, fqn: str) -> str:
    """A copy of the local checkpoint directory `checkpoint` in `dest` whose item `fqn` has one
    byte flipped in the middle of its bytes."""
    from asyncckpt.loading.opened import open_checkpoint

    shutil.copytree(checkpoint, dest)
    info = next(i for index, i in open_checkpoint(dest).metadata.storage_data.items() if index.fqn == fqn)
    flip_byte(os.path.join(dest, info.relative_path), info.offset + info.length // 2)
    return dest


def rewrite_metadata(path: str, change) -> None:
    """Replace a checkpoint's `.metadata` with `change(metadata)` pickled (the test trusts its own files)."""
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        metadata = pickle.load(f)
    with open(file, "wb") as f:
        pickle.dump(change(metadata), f)


def make_model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_step(model, optimizer)
    return model, optimizer


def train_step(model, optimizer) -> None:
    loss = model(torch.randn(16, 32)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def make_state(model, optimizer, step: int = 0) -> dict:
    """A nested state dict: weights, Adam state, ints, strings, lists."""
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "meta": {"step": step, "name": "run-1", "milestones": [10, 20, 30]},
    }


def clone_state(obj):
    """Deep copy with tensors cloned (the expected values of a save)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    return obj


def zeros_like_state(obj):
    """Same structure, tensors zeroed and plain values replaced: a target to load into."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: zeros_like_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [zeros_like_state(v) for v in obj]
    if isinstance(obj, (int, float)):
        return type(obj)(0)
    if isinstance(obj, str):
        return ""
    return obj


def assert_state_equal(actual, expected, path: str = "") -> None:
    """Bitwise equality of tensors and equality of everything else, with the failing key named."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        as_bytes = lambda t: t.reshape(-1).view(torch.uint8)  # bitwise: NaNs and -0.0 count
        assert torch.equal(as_bytes(actual), as_bytes(expected)), f"tensor differs at {path}"
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"keys differ at {path}: {set(actual) ^ set(expected)}"
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_state_equal(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"value differs at {path}: {actual!r} != {expected!r}"


def saved_step_one(root: str, state: dict) -> str:
    """`state` saved as ROOT/step_1 in two data files (io_workers=2); returns that directory."""
    from asyncckpt import AsyncCheckpointer, CheckpointConfig

    with AsyncCheckpointer(root, CheckpointConfig(io_workers=2)) as ckpt:
        ckpt.schedule_save(state, step=1)
    return step_path(root, 1)


def assert_step_holds(root: str, step: int, expected: dict) -> None:
    """ROOT/step_N loads (asyncckpt.load) into exactly `expected`."""
    from asyncckpt import load

    target = zeros_like_state(expected)
    load(target, step_path(root, step))
    assert_state_equal(target, expected)


def assert_loads_on_s3(path: str, expected: dict) -> None:
    """A checkpoint on the object store loads into exactly `expected` through stock dcp.load (msc's
    reader) and through asyncckpt.load with verify=True."""
    import torch.distributed.checkpoint as dcp
    from multistorageclient.contrib.torch import MultiStorageFileSystemReader

    from asyncckpt import load

    target = zeros_like_state(expected)
    dcp.load(target, storage_reader=MultiStorageFileSystemReader(path, thread_count=2), no_dist=True)
    assert_state_equal(target, expected)
    target = zeros_like_state(expected)
    load(target, path, verify=True)
    assert_state_equal(target, expected)


def owned_memory_bytes(pid: int) -> int:
    """Memory a process owns: its private pages plus its own shared mappings (the worker's
    staging slab is a MAP_SHARED memfd so forked writers can map it; smaps names it
    /memfd:asyncckpt-staging). The trainer's tensors, which the worker maps from /dev/shm, are
    not counted."""
    total, owned_shared = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if " " in key or "-" in key:  # a mapping's header: address range, perms, ..., name
                owned_shared = line.rstrip().endswith(("/memfd:asyncckpt-staging (deleted)", "/dev/zero (deleted)"))
            elif key in ("Private_Clean", "Private_Dirty") or (owned_shared and key in ("Shared_Clean", "Shared_Dirty")):
                total += int(rest.split()[0]) * 1024
    return total


class MemorySampler:
    """Peak memory of a process while the block runs, sampled from a thread every few ms: `peak_rss`,
    and `peak_owned` = what it owns (`owned_memory_bytes`) plus the USS of its children (a forked
    writer shares the slab, which USS leaves out, so nothing counts twice). `sample()` gives
    (rss, owned) now, e.g. the baseline before the save."""

    def __init__(self, pid: int, interval_s: float = 0.005) -> None:
        self.process = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_rss = self.peak_owned = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[int, int]:
        owned = owned_memory_bytes(self.process.pid)
        for child in self.process.children():
            try:
                owned += child.memory_full_info().uss
            except (psutil.Error, OSError):  # a writer child that just exited
                pass
        return self.process.memory_info().rss, owned

    def _record(self) -> None:
        rss, owned = self.sample()
        self.peak_rss, self.peak_owned = max(self.peak_rss, rss), max(self.peak_owned, owned)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._record()
            except (psutil.Error, OSError):
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._record()


def call_when_waiting(thread_id: int, function: str, action, timeout_s: float = 120.0,
                      stop: threading.Event | None = None) -> threading.Thread:
    """From a helper thread, run `action()` once thread `thread_id` is inside a call of `function`
    (e.g. blocked in `wait_staged`): an event the test can wait for instead of a guessed delay.
    Returns the started helper thread (its `saw`: whether it found the call); join it. `stop`
    set: act at once (the caller is past the point where it could have waited)."""

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            frame = sys._current_frames().get(thread_id)
            while frame is not None:
                if frame.f_code.co_name == function:
                    helper.saw = True
                    action()
                    return
                frame = frame.f_back
            time.sleep(0.001)
        action()  # never seen waiting: act anyway so nothing hangs; the test's checks fail it

    helper = threading.Thread(target=watch, daemon=True)
    helper.saw = False
    helper.start()
    return helper


def pid_of_an_exited_process() -> int:
    """The pid of a process that has exited (and been reaped): what a stale file names."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def wait_gone(pid: int, timeout_s: float) -> float:
    """Seconds until `pid` is gone (a zombie counts as gone); fails past `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return time.monotonic() - started
        except psutil.NoSuchProcess:
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still running {timeout_s}s after it should have gone")


def run_cpu_script(command: list[str], timeout_s: float, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run a CPU training script (an example, a launcher such as torchrun) to its end within
    `timeout_s` and leave nothing it started behind.

    It sees no GPU: what these tests check is CPU behaviour (the `cuda` tests cover the GPU), and
    on a GPU machine Lightning, Transformers and DCP would probe or initialise CUDA in every
    process (seconds, GPU memory, warnings on stderr). It runs in a session of its own with its
    output in files, so a DDP rank or worker left running cannot hold a pipe open and stall the
    test; whatever of the session is still alive at the end (or past the bound, or when the
    test's own timeout interrupts) gets SIGTERM, which torchrun passes on to its ranks, then SIGKILL."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            _end_session(process)
        stdout.seek(0)
        stderr.seek(0)
        out, err = stdout.read(), stderr.read()
    if returncode is None:
        raise AssertionError(f"{' '.join(command)} did not finish within {timeout_s:.0f}s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, returncode, out, err)


def _end_session(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop what is left of the session `process` leads: SIGTERM (torchrun passes it on to its
    ranks), SIGKILL to what outlives `grace_s`. A zombie counts as gone."""
    process.poll()  # reaps the leader if it ended
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = _session_members(process.pid)
        for member in left:
            try:
                member.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.monotonic() + grace_s
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = _session_members(process.pid)
        if not left:
            break
    process.wait(10)


def _session_members(session_id: int) -> list[psutil.Process]:
    """The live (not zombie) processes of a session."""
    members = []
    for candidate in psutil.process_iter():
        try:
            if os.getsid(candidate.pid) == session_id and candidate.status() != psutil.STATUS_ZOMBIE:
                members.append(candidate)
        except (OSError, psutil.Error):  # gone meanwhile
            pass
    return members
