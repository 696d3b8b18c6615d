"""Package boundaries: the worker process loads only the worker side of the library, under a
package name of its own; the data-file naming rule is one rule for the worker that writes the
files and the trainer side that commits, cleans up and inspects them."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig
from asyncckpt.layout import SAFETENSORS, TORCH_SAVE, data_file_name, is_data_file, new_file_tag


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



# the worker loads only the worker side -----------------------------------------------------------
WORKER_SIDE = {"asyncckpt", "asyncckpt.errors", "asyncckpt.formats", "asyncckpt.layout", "asyncckpt.memory_file", "asyncckpt.protocol",
               "asyncckpt.replica_wire", "asyncckpt.replica_server",
               "asyncckpt.storage", "asyncckpt.storage.base", "asyncckpt.storage.local", "asyncckpt.storage.msc",
               "asyncckpt.storage.page_buffer", "asyncckpt.storage.requests", "asyncckpt.storage.retries",
               "asyncckpt.storage.upload_memory"}

IMPORT_LIKE_THE_WORKER = """
import atexit, json, sys
registered = []
register = atexit.register

def recording(func, *args, **kwargs):
    registered.append(str(getattr(func, "__module__", None)))
    return register(func, *args, **kwargs)

atexit.register = recording
import asyncckpt_worker.main, asyncckpt.storage.msc  # its entry point; the object-store backend it may load
print(json.dumps({"modules": [m for m in sys.modules if m.partition(".")[0] == "asyncckpt"], "atexit": registered,
                  "dcp": "torch.distributed.checkpoint" in sys.modules}))
"""


def test_importing_the_worker_loads_no_trainer_module_and_no_exit_handler():
    """The worker imports asyncckpt.protocol/formats/storage; that must not run the trainer side
    (checkpointer, client, planning, commit, loading, safety...) nor register its exit handler,
    nor load torch.distributed.checkpoint (tests/architecture/test_imports.py checks the same statically) (it pulls DTensor and sympy: about a second more of
    every worker's start-up, which a first save may wait for)."""
    done = subprocess.run([sys.executable, "-c", IMPORT_LIKE_THE_WORKER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert set(found["modules"]) <= WORKER_SIDE, sorted(set(found["modules"]) - WORKER_SIDE)
    assert not [m for m in found["atexit"] if m.partition(".")[0] == "asyncckpt"], found["atexit"]
    assert not found["dcp"]


def test_the_spawned_worker_loads_no_trainer_module(tmp_path, capfd):
    """The real worker, after serving a full and an incremental save, lists the library modules
    it holds (a DEBUG line on its stderr as it exits): the worker side only, and no
    torch.distributed.checkpoint (the messages it unpickles do not name DCP's classes)."""
    logger = logging.getLogger("asyncckpt")
    level = logger.level
    logger.setLevel(logging.DEBUG)  # the worker takes the trainer's level when it is spawned
    try:
        with AsyncCheckpointer(str(tmp_path / "ckpt"), CheckpointConfig(io_workers=2, incremental=True)) as ckpt:
            for step in (1, 2):
                ckpt.schedule_save({"w": torch.arange(8.0), "meta": {"step": step}}, step=step)
                ckpt.finalize(blocking=True)
    finally:
        logger.setLevel(level)
    err = capfd.readouterr().err
    lines = re.findall(r"asyncckpt-worker\[0\] DEBUG exiting; asyncckpt modules loaded here: (.*)", err)
    assert len(lines) == 1, lines
    assert "asyncckpt-worker[0] DEBUG torch.distributed.checkpoint loaded: False" in err
    modules = set(lines[0].split(", "))
    assert {"asyncckpt.protocol", "asyncckpt.formats", "asyncckpt.layout", "asyncckpt.storage"} <= modules
    assert modules <= WORKER_SIDE, sorted(modules - WORKER_SIDE)


def test_public_names_resolve_and_are_listed():
    import asyncckpt

    for name in asyncckpt.__all__:
        assert getattr(asyncckpt, name) is not None
        assert name in dir(asyncckpt)
    assert asyncckpt.AsyncCheckpointer.__module__ == "asyncckpt.save.checkpointer"
    try:
        asyncckpt.no_such_name
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


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


# storage: callers ask the backend, not the type of it --------------------------------------------
def test_ls_of_an_object_store_root_shows_the_age_of_each_checkpoint(s3_server, request, capsys):
    """`asyncckpt ls` asks the storage when a checkpoint was committed, so an s3:// root shows
    ages as a local one does (before, any object-store path showed "-"); a torn prefix has none."""
    from asyncckpt.cli import commands as cli
    from asyncckpt.storage import storage_for

    root = s3_server.url("s3", s3_server.unique_prefix(request.node.name) + "/ckpt")
    with AsyncCheckpointer(root) as ckpt:
        ckpt.schedule_save({"w": torch.arange(8.0)}, step=1)
    storage = storage_for(root)
    storage.write_atomic(storage.join(root, "step_00000002", "__0_0.distcp"), b"torn")
    code = cli.main(["ls", root])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^ *1 +committed .* \d+[smhd] +step_00000001 +<- latest$", out, re.M), out
    assert re.search(r"^ *2 +torn .* - +step_00000002$", out, re.M), out
