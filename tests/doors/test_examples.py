"""examples/train_loop.py run for real, the way `make example` runs it: a fresh run, then a run
that resumes from the last committed save and checks that the weights and the optimizer state it
restored are exactly the ones saved (and exits non-zero otherwise)."""

from __future__ import annotations

import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from asyncckpt.cli import commands as cli

from conftest import REPO, run_cpu_script

EXAMPLE = os.path.join(REPO, "examples", "train_loop.py")

# small versions of `make example`: saves at 0, 10, 20 and the last step, 29; then resume to 45
FRESH = ("--fresh", "--steps", "30", "--save-every", "10", "--keep-last", "2")
RESUME = ("--steps", "45", "--save-every", "10", "--keep-last", "2")

# The bug the self-check exists for, put back: the model and the optimizer handed to DCP as they
# are. A fresh optimizer's state_dict() is empty until its first step(), so on resume DCP finds no
# exp_avg / exp_avg_sq / step to load into and the optimizer silently starts over.
WITH_BARE_OPTIMIZER = """
import runpy, sys
sys.argv = sys.argv[1:]
example = runpy.run_path(sys.argv[0])  # defines the example's functions, runs nothing

def load_state_dict(self, sd):
    self.model.load_state_dict(sd["model"])
    self.optimizer.load_state_dict(sd["optim"])

example["TrainState"].state_dict = lambda self: {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
example["TrainState"].load_state_dict = load_state_dict
example["main"]()
"""


def run(*args: str, patch: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", patch, EXAMPLE, *args] if patch else [sys.executable, EXAMPLE, *args]
    return run_cpu_script(cmd, timeout_s=180, cwd=REPO)


def committed_steps(stdout: str) -> list[int]:
    return [int(s) for s in re.findall(r"committed step +(\d+):", stdout)]


@pytest.fixture(scope="module")
def fresh_root(tmp_path_factory) -> str:
    """One fresh run (steps 0..29), shared; tests resume from a copy of its root."""
    root = str(tmp_path_factory.mktemp("example") / "ckpt")
    fresh = run("--root", root, *FRESH)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert f"fresh start in {root}" in fresh.stdout
    assert committed_steps(fresh.stdout) == [0, 10, 20, 29]
    return root


@pytest.fixture
def root(fresh_root, tmp_path) -> str:
    copy = str(tmp_path / "ckpt")
    shutil.copytree(fresh_root, copy)
    return copy


def test_example_resumes_from_the_last_committed_save_with_its_optimizer_state(root) -> None:
    resumed = run("--root", root, *RESUME)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from step 29: weights and optimizer state match the save (24 tensors); continuing at step 30" in (
        resumed.stdout
    )  # 6 parameters: weight + exp_avg + exp_avg_sq + step each
    assert committed_steps(resumed.stdout) == [30, 40, 44]
    assert "summary: steps 30..44" in resumed.stdout
    assert "WARNING" not in resumed.stderr, resumed.stderr  # e.g. tensors copied on every save
    # where they are and how to look, with a command that works here (this Python, or the script)
    hint = re.search(r"list them with `([^`]+)`", resumed.stdout).group(1)
    assert hint.endswith(f" ls {root}") and ("-m asyncckpt" in hint or hint.startswith("asyncckpt ")), hint
    listed = subprocess.run(shlex.split(hint), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "step_00000044" in listed.stdout, listed.stdout + listed.stderr

    again = run("--root", root, *RESUME)  # nothing left to train: resumes, checks, stops
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step 44: weights and optimizer state match the save" in again.stdout
    assert "summary: nothing to do (already at step 45)" in again.stdout


def test_example_with_a_bare_optimizer_still_resumes_its_optimizer_state(tmp_path) -> None:
    """A bare `optimizer.state_dict()` (no TrainState) used to come back without Adam's moments;
    loading now fills a fresh optimizer's state from the checkpoint (#42 item 4): the example's
    own resume check passes."""
    root = str(tmp_path / "ckpt")
    fresh = run("--root", root, *FRESH, patch=WITH_BARE_OPTIMIZER)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    resumed = run("--root", root, *RESUME, patch=WITH_BARE_OPTIMIZER)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "weights and optimizer state match the save" in resumed.stdout, resumed.stdout


def test_the_example_checkpoint_exports_its_model_without_naming_a_prefix(fresh_root, tmp_path, capsys) -> None:
    """`python -m asyncckpt export ROOT OUT --hf` on the example's checkpoints finds the model
    under TrainState's "train.model." and names its tensors as model.state_dict() does."""
    out = str(tmp_path / "hf")
    assert cli.main(["export", fresh_root, out, "--hf", "-q"]) == 0
    assert "exporting the 6 tensors under 'train.model.'" in capsys.readouterr().err
    model = runpy.run_path(EXAMPLE)["make_model"]()  # defines the example's functions, runs nothing
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert {name: t.shape for name, t in exported.items()} == {name: t.shape for name, t in model.state_dict().items()}
