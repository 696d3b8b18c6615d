"""Package boundaries: the worker package has a name of its own; the data-file naming rule is one rule for the worker that writes the files and the trainer side that
commits, cleans up and inspects them."""

from __future__ import annotations

import subprocess
import sys

from asyncckpt.formats import SAFETENSORS, TORCH_SAVE, data_file_name, is_data_file, new_file_tag


def test_every_data_file_name_is_recognised_with_its_tag():
    tag = new_file_tag()
    assert tag != new_file_tag()  # a fresh tag per re-save
    for fmt in (TORCH_SAVE, SAFETENSORS):
        for file_tag in ("", tag):
            name = data_file_name(3, 12, fmt, file_tag)
            assert is_data_file(name)
            assert is_data_file(name, tag=file_tag)
            assert not is_data_file(name, tag=new_file_tag())
    assert not is_data_file(data_file_name(0, 0), tag=tag)  # an untagged file is not the re-save's
    for foreign in ("model.safetensors", "__0_0.distcp.bak", "__0_0.tmp.distcp", ".metadata", "__0.metadata"):
        assert not is_data_file(foreign), foreign



# the worker package's name is ours ----------------------------------------------------------------
USERS_WORKER = 'WHO = "the user\'s own worker module"\n'

USERS_TRAINING_SCRIPT = """
import sys
import torch
import worker  # the user's own module, next to this script
from asyncckpt import AsyncCheckpointer, latest_checkpoint, load

assert worker.WHO == "the user's own worker module", worker
root = sys.argv[1]
state = {"w": torch.arange(6.0), "meta": {"step": 3}}
with AsyncCheckpointer(root) as ckpt:
    ckpt.schedule_save(state, step=3)
restored = {"w": torch.zeros(6), "meta": {"step": 0}}
load(restored, latest_checkpoint(root).path)
print("restored", restored["w"].tolist(), restored["meta"]["step"], worker.WHO)
"""


def test_a_script_with_its_own_worker_module_checkpoints(tmp_path):
    """A training script whose directory holds its own `worker.py` imports that module and still
    checkpoints: the library's worker package has a name of its own (and the spawned worker
    process, which starts with the script's directory on its path, finds its entry point)."""
    (tmp_path / "worker.py").write_text(USERS_WORKER)
    (tmp_path / "train.py").write_text(USERS_TRAINING_SCRIPT)
    done = subprocess.run(
        [sys.executable, "train.py", str(tmp_path / "ckpt")], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restored [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] 3 the user's own worker module" in done.stdout
