"""Shared fixtures: checkpoint roots and small realistic training states."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

pytest_plugins = ["s3_server"]

BACKENDS = ("local", "msc", "s3")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "all_backends: tests taking `ckpt_root` run on a local directory, msc:// and s3:// roots"
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
