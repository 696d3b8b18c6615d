"""A newcomer's path, for real: a wheel built from this checkout, installed with pip into a fresh
venv that already has torch (the one this suite runs on, seen through a .pth file: nothing is
downloaded and torch is not touched), the README's loop run there as written, killed with SIGKILL
mid-run, run again: it resumes, and its last checkpoint is bit for bit that of a run never
interrupted (weights and optimizer state)."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO, assert_state_equal, run_cpu_script, wait_gone
from readme_blocks import python_blocks

# what `pip wheel .` needs of the checkout
SOURCES = ("pyproject.toml", "README.md", "asyncckpt", "worker")
# the library's dependencies (pyproject.toml), taken from this interpreter's environment
DEPENDENCIES = ("torch", "psutil", "safetensors", "numpy", "google_crc32c", "xxhash")


def pip(*args: str, cwd: str) -> subprocess.CompletedProcess:
    """pip as a user's: a machine-wide constraint file (this box caps torch at 2.14.1 in
    /etc/xdg/pip) would make pip replace a newer torch the environment has, which no user sees."""
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=240, env={**clean_env(), "PIP_CONSTRAINT": os.devnull})
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def clean_env(venv: str = "") -> dict[str, str]:
    """This environment without what points Python at the checkout (`make test-here` sets
    PYTHONPATH) or at another venv; the fresh venv's bin first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if venv:
        env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
    return env


def build_wheel(tmp_path) -> str:
    """`pip wheel --no-deps .` of a copy of the checkout's sources (the build writes into the tree)."""
    src, dist = tmp_path / "src", tmp_path / "dist"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if os.path.isdir(os.path.join(REPO, name)) else shutil.copy
        kwargs = {"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}
        copy(os.path.join(REPO, name), src / name, **kwargs)
    pip("wheel", "--no-deps", "--no-index", "--no-build-isolation", "-w", str(dist), str(src), cwd=str(tmp_path))
    wheels = os.listdir(dist)
    assert len(wheels) == 1 and wheels[0].startswith("asyncckpt-"), wheels
    return str(dist / wheels[0])


def fresh_venv(path: str) -> tuple[str, str]:
    """A new venv of this Python (no pip: pip --python installs into it) that sees this
    environment's torch and the other dependencies through a .pth file; (python, site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True, timeout=120, env=clean_env())
    python = os.path.join(path, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=clean_env()).stdout.strip()
    where = []
    for name in DEPENDENCIES:
        folder = os.path.dirname(os.path.dirname(os.path.abspath(importlib.import_module(name).__file__)))
        if folder not in where:
            where.append(folder)
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write("".join(f"{folder}\n" for folder in where))
    return python, site


def start(python: str, cwd: str, venv: str) -> tuple[subprocess.Popen, str]:
    log = os.path.join(cwd, "out.log")
    with open(log, "w") as out:
        process = subprocess.Popen([python, "train.py"], cwd=cwd, env=clean_env(venv), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return process, log


def checkpoint_items(path: str) -> dict:
    """Every item of a checkpoint, as stock DCP reads it (weights, optimizer state, values)."""
    out = path + ".pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


@pytest.mark.skipif(not hasattr(sys, "_base_executable"), reason="needs a venv-capable CPython")
def test_a_newcomer_installs_the_wheel_runs_the_readme_loop_kills_it_and_resumes_exactly(tmp_path):
    wheel = build_wheel(tmp_path)
    venv = str(tmp_path / "venv")
    python, site = fresh_venv(venv)
    before = set(os.listdir(site))
    installed = pip("--python", python, "install", "--no-index", wheel, cwd=str(tmp_path))
    assert "Successfully installed asyncckpt-0.1.0" in installed.stdout, installed.stdout
    assert "Requirement already satisfied: torch" in installed.stdout, installed.stdout  # found, not touched
    added = sorted(set(os.listdir(site)) - before)
    assert [name for name in added if not name.startswith("asyncckpt")] == [], added
    where = subprocess.run([python, "-c", "import asyncckpt, asyncckpt_worker; from asyncckpt.command import "
                            "cli_command; print(asyncckpt.__file__, asyncckpt_worker.__file__, cli_command())"],
                           cwd=str(tmp_path), env=clean_env(venv), capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    library, worker, hint = where.stdout.split()
    assert library.startswith(site) and worker.startswith(site), where.stdout
    assert hint == "asyncckpt", where.stdout  # the venv's script is on PATH: hints name it

    loop = python_blocks(os.path.join(REPO, "README.md"))[0].code
    runs = {name: tmp_path / name for name in ("interrupted", "uninterrupted")}
    for folder in runs.values():
        folder.mkdir()
        (folder / "train.py").write_text(loop)

    # the loop, killed once a checkpoint is committed; its worker goes on its own
    process, log = start(python, str(runs["interrupted"]), venv)
    latest = runs["interrupted"] / "checkpoints" / "latest"
    deadline = time.monotonic() + 180
    while not latest.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process.poll() is None, f"the loop ended before it could be killed:\n{open(log).read()}"
    children = [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
    os.kill(process.pid, signal.SIGKILL)
    process.wait(30)
    for pid in children:
        wait_gone(pid, 60)
    killed_at = int(re.search(r"step_(\d+)", latest.read_text()).group(1))

    resumed = run_cpu_script([python, "train.py"], timeout_s=300, cwd=str(runs["interrupted"]))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from step {killed_at}" in resumed.stdout, resumed.stdout
    whole = run_cpu_script([python, "train.py"], timeout_s=300, cwd=str(runs["uninterrupted"]))
    assert whole.returncode == 0 and "fresh start" in whole.stdout, whole.stdout + whole.stderr

    # the tool the hints name works in this venv
    listed = subprocess.run([os.path.join(venv, "bin", "asyncckpt"), "ls", "checkpoints"],
                            cwd=str(runs["interrupted"]), env=clean_env(venv), capture_output=True, text=True,
                            timeout=120)
    last = (runs["uninterrupted"] / "checkpoints" / "latest").read_text().strip()
    assert (runs["interrupted"] / "checkpoints" / "latest").read_text().strip() == last
    assert int(last.rpartition("_")[2]) > killed_at, (last, killed_at)  # saved again after the resume
    assert listed.returncode == 0 and last in listed.stdout, listed.stdout + listed.stderr

    final = {name: checkpoint_items(str(folder / "checkpoints" / last)) for name, folder in runs.items()}
    assert any(".exp_avg_sq" in key for key in _flat(final["interrupted"])), sorted(_flat(final["interrupted"]))
    assert_state_equal(final["interrupted"], final["uninterrupted"])


def _flat(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        keys += _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys
