"""asyncckpt.lightning.AsyncCheckpointIO with a real lightning.Trainer on CPU: what ModelCheckpoint
keeps, resuming, exact round trips, bad input, a process group, DDP and exit. Held saves and
files: test_lightning_held_saves.py, test_lightning_files.py."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
import torch

L = pytest.importorskip("lightning", reason="Lightning is not installed (pip install lightning; CI installs it)")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from asyncckpt import CheckpointConfig, CheckpointError, verify_checkpoint  # noqa: E402
from asyncckpt.layout import LOCK_FILE
from asyncckpt.doors.lightning import AsyncCheckpointIO  # noqa: E402
from asyncckpt.doors.nested import unflatten_exact  # noqa: E402
from conftest import REPO, run_cpu_script  # noqa: E402
from lightning_fits import _clone, _final, _fit, _is_committed_dir, assert_exactly_equal  # noqa: E402

EXAMPLE = os.path.join(REPO, "examples", "lightning_fit.py")


def test_fit_keeps_committed_dcp_dirs_and_resumes_exactly_as_default_io(tmp_path):
    """Uninterrupted 12 steps vs 6 + resume to 12, with Lightning's default IO and with the
    plugin (explicit ckpt_path, and ckpt_path="last"); one plugin serves several fits."""
    reference = _final(*_fit(str(tmp_path / "u"), 12)[:2])
    _fit(str(tmp_path / "d"), 6)
    default_io = _final(*_fit(str(tmp_path / "d"), 12, ckpt_path="last")[:2])

    plugin = AsyncCheckpointIO()
    try:
        first = str(tmp_path / "a")
        _, _, callback = _fit(first, 6, plugin)
        kept = {os.path.basename(p) for p in callback.best_k_models} | {"last.ckpt"}
        assert len(kept) == 3 and set(os.listdir(first)) == kept | {LOCK_FILE}  # removed top-k ones are gone; the plugin holds the folder
        assert all(_is_committed_dir(os.path.join(first, name)) for name in kept)
        assert all(verify_checkpoint(os.path.join(first, name)) == [] for name in kept)
        shutil.copytree(first, str(tmp_path / "b"))

        by_path = _final(*_fit(first, 12, plugin, ckpt_path=os.path.join(first, "last.ckpt"))[:2])
        by_last = _final(*_fit(str(tmp_path / "b"), 12, plugin, ckpt_path="last")[:2])
    finally:
        plugin.close()
    assert_exactly_equal(by_path, default_io, "resumed by path")
    assert_exactly_equal(by_last, default_io, "resumed from last")
    assert_exactly_equal(default_io, reference, "default IO resumed vs uninterrupted")


def _awkward_checkpoint() -> dict:
    return {
        "state_dict": collections.OrderedDict([("layer.weight", torch.randn(4, 3)), ("layer.bias", torch.zeros(4))]),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(4, 3)}, 1: {}},
                              "param_groups": [{"params": [0, 1], "betas": (0.9, 0.999), "lr": 0.1}]}],
        "layer": {"weight": torch.ones(2)},  # its flat name collides with state_dict's dotted keys' style
        "a.b": torch.full((3,), 7, dtype=torch.int64), "a": {"b": torch.full((3,), 8, dtype=torch.int64)},
        "empty": {}, "empty_list": [], "pair": (torch.arange(3, dtype=torch.int16), "label", None),
        "callbacks": {"ModelCheckpoint{'monitor': 'loss', 'every_n_train_steps': 2}": {"kth_value": torch.tensor(0.5)}},
        "odd_keys": {(1, "x"): 1.5, 2: "two", 3.5: True, None: b"bytes"},
        "bf16": torch.randn(5, dtype=torch.bfloat16), "scalar": torch.tensor(3), "none": None, "epoch": 3,
    }


def test_load_checkpoint_returns_exactly_the_saved_dict_as_of_the_save(tmp_path):
    checkpoint = _awkward_checkpoint()
    expected = _clone(checkpoint)
    path = str(tmp_path / "run" / "epoch=0-step=1.ckpt")
    plugin = AsyncCheckpointIO(max_in_flight=1)
    try:
        plugin.save_checkpoint(checkpoint, path)
        from asyncckpt.doors.nested import map_tensors
        map_tensors(checkpoint, lambda t: t.add_(1))  # every tensor changes right after the call returns
        loaded = plugin.load_checkpoint(path)  # waits for the save in flight
    finally:
        plugin.close()
    assert_exactly_equal(loaded, expected)
    assert isinstance(loaded["pair"], tuple) and isinstance(loaded["state_dict"], collections.OrderedDict)
    assert os.listdir(str(tmp_path / "run")) == ["epoch=0-step=1.ckpt"]
    converted = str(tmp_path / "converted.pt")
    dcp_to_torch_save(path, converted)  # stock DCP converts it
    assert_exactly_equal(unflatten_exact(torch.load(converted, weights_only=True)), expected)


def test_with_the_memory_tier_a_restarted_plugin_loads_the_newest_save_from_memory(tmp_path, caplog):
    """memory_tier=True (memory_keep: the file outlives the first plugin, as after a crash): a new
    plugin's load_checkpoint (what Lightning's resume calls) reads the newest save from the memory
    copy of that very save, exactly as saved; an older checkpoint of the folder from its files."""
    config = CheckpointConfig(memory_tier=True, memory_dir=str(tmp_path), memory_keep=True)
    older, newest = str(tmp_path / "run" / "epoch=0-step=1.ckpt"), str(tmp_path / "run" / "last.ckpt")
    checkpoint = _awkward_checkpoint()
    plugin = AsyncCheckpointIO(config, max_in_flight=1)
    try:
        plugin.save_checkpoint(checkpoint, older)
        plugin.save_checkpoint({**checkpoint, "epoch": 4}, newest)
    finally:
        plugin.close()
    restarted = AsyncCheckpointIO(config)
    try:
        with caplog.at_level("INFO", logger="asyncckpt"):
            loaded = restarted.load_checkpoint(newest)
        assert [r for r in caplog.records if r.getMessage().startswith(f"loaded {newest} from memory")]
        assert_exactly_equal(loaded, {**checkpoint, "epoch": 4})
        caplog.clear()
        with caplog.at_level("INFO", logger="asyncckpt"):
            assert_exactly_equal(restarted.load_checkpoint(older), checkpoint)
        assert not [r for r in caplog.records if "from memory" in r.getMessage()]
    finally:
        restarted.close()


class Custom:
    def __init__(self, value) -> None:
        self.value = value


def test_bad_input_is_refused_clearly(tmp_path):
    a_file = str(tmp_path / "old.ckpt")
    torch.save({"state_dict": {}}, a_file)
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep")
    stock = str(tmp_path / "stock")
    dcp.save({"w": torch.ones(2)}, checkpoint_id=stock, no_dist=True)
    with pytest.raises(ValueError, match="keep_last"):
        AsyncCheckpointIO(CheckpointConfig(keep_last=2))
    with pytest.raises(ValueError, match="staging='eager'"):  # a lazy copy would see the next step's values
        AsyncCheckpointIO(CheckpointConfig(staging="lazy"))
    with pytest.raises(ValueError, match="Lightning handles SIGTERM itself"):
        AsyncCheckpointIO(CheckpointConfig(preemption_signals=(signal.SIGTERM,)))
    plugin = AsyncCheckpointIO(max_in_flight=1)
    try:
        with pytest.raises(TypeError, match="storage_options"):
            plugin.save_checkpoint({"w": torch.ones(2)}, str(tmp_path / "x.ckpt"), storage_options={"a": 1})
        with pytest.raises(TypeError, match="must be a dict"):
            plugin.save_checkpoint([torch.ones(2)], str(tmp_path / "x.ckpt"))
        with pytest.raises(CheckpointError, match="old.ckpt.*a file"):
            plugin.save_checkpoint({"w": torch.ones(2)}, a_file)
        with pytest.raises(FileNotFoundError, match="missing.ckpt"):
            plugin.load_checkpoint(str(tmp_path / "missing.ckpt"))
        with pytest.raises(CheckpointError, match="a file, not a DCP checkpoint directory"):
            plugin.load_checkpoint(a_file)
        with pytest.raises(CheckpointError, match="asyncckpt.structure"):
            plugin.load_checkpoint(stock)
        with pytest.raises(CheckpointError, match="a file, not a checkpoint directory"):
            plugin.remove_checkpoint(a_file)
        with pytest.raises(CheckpointError, match="todo.txt"):
            plugin.remove_checkpoint(str(foreign))
        plugin.remove_checkpoint(str(tmp_path / "missing.ckpt"))  # like Lightning's: nothing to remove
        assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "notes", "old.ckpt", "stock"]
        assert os.listdir(foreign) == ["todo.txt"]

        path = str(tmp_path / "custom.ckpt")
        plugin.save_checkpoint({"hyper_parameters": {"obj": Custom(3)}, "w": torch.ones(2)}, path)
        with pytest.raises(CheckpointError, match="Custom.*trusted=True"):
            plugin.load_checkpoint(path)
        assert plugin.load_checkpoint(path, weights_only=False)["hyper_parameters"]["obj"].value == 3
        with pytest.raises(TypeError, match="map_location"):
            plugin.load_checkpoint(path, map_location=lambda storage, loc: storage, weights_only=False)
    finally:
        plugin.close()
    assert AsyncCheckpointIO(trusted=True, max_in_flight=1).load_checkpoint(path)["hyper_parameters"]["obj"].value == 3


def test_importing_asyncckpt_does_not_import_lightning():
    code = "import sys, asyncckpt; assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _rank0_alone(rank: int, world_size: int, root: str) -> None:
    """Lightning's DDP contract: the plugin is built on every rank, called on rank 0 only."""
    import torch.distributed as dist
    groups_before = dist.distributed_c10d._world.group_count
    os.environ["RANK"] = str(rank)  # as torchrun and Lightning's launcher say it
    plugin = AsyncCheckpointIO(max_in_flight=1)
    if rank == 0:  # any collective here would hang rank 0 (rank 1 is past this point)
        path = os.path.join(root, "last.ckpt")
        checkpoint = {"state_dict": {"w": torch.full((100,), 2.0)}, "optimizer_states": [{"state": {0: {}}}]}
        plugin.save_checkpoint(checkpoint, path)
        assert_exactly_equal(plugin.load_checkpoint(path), checkpoint)
        plugin.save_checkpoint(checkpoint, os.path.join(root, "epoch=0-step=1.ckpt"))
        plugin.remove_checkpoint(path)
    plugin.teardown()
    assert dist.distributed_c10d._world.group_count == groups_before, "the plugin created a process group"
    assert rank == 0 or plugin._saves.saver is None, "a rank that never saves started a worker"
    plugin.close()


def test_under_a_process_group_rank0_saves_loads_and_removes_alone(tmp_path):
    from multirank import run_ranks
    run_ranks(_rank0_alone, 2, str(tmp_path), timeout_s=240)
    assert os.listdir(tmp_path) == ["epoch=0-step=1.ckpt"]


def _run_example(*args: str) -> subprocess.CompletedProcess:
    done = run_cpu_script([sys.executable, EXAMPLE, *args], timeout_s=400, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.slow
def test_example_under_two_rank_ddp_resumes_like_an_uninterrupted_run(tmp_path):
    """The example (what `make example-lightning` runs) on 2 DDP ranks (gloo): the plugin is built
    on both ranks and saves from rank 0; resuming from the step-6 checkpoint of an uninterrupted
    run ends exactly where that run ended, and the restored state matches the checkpoint."""
    ddp = ("--devices", "2", "--save-every", "3", "--top-k", "-1", "--steps", "9")
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    whole = _run_example("--dir", first, "--fresh", "--final", str(tmp_path / "whole.pt"), *ddp)
    assert whole.stdout.count("committed last.ckpt") == 3
    names = ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "epoch=2-step=9.ckpt", "last.ckpt"]
    assert sorted(os.listdir(first)) == names and all(_is_committed_dir(os.path.join(first, n)) for n in names)
    resumed = _run_example("--dir", second, "--resume", os.path.join(first, names[1]),
                           "--final", str(tmp_path / "resumed.pt"), *ddp)
    assert "at step 6: weights and optimizer state match the checkpoint" in resumed.stdout, resumed.stdout
    assert_exactly_equal(torch.load(str(tmp_path / "resumed.pt")), torch.load(str(tmp_path / "whole.pt")))


EXIT_SCRIPT = """
import resource, sys, psutil, torch
from asyncckpt import CheckpointConfig
from asyncckpt.lightning import AsyncCheckpointIO
plugin = AsyncCheckpointIO(CheckpointConfig(timeout_s=5), max_in_flight=1)
plugin.save_checkpoint({"state_dict": {"w": torch.zeros(1 << 16)}, "epoch": 0}, sys.argv[1] + "/a.ckpt")
plugin.wait()  # its worker is up and one save committed
worker = psutil.Process(plugin._saves.saver.worker_pid)
for process in [worker, *worker.children(recursive=True)]:  # from now on its writes fail (EFBIG)
    process.rlimit(resource.RLIMIT_FSIZE, (1, 1))
plugin.save_checkpoint({"state_dict": {"w": torch.ones(1 << 16)}, "epoch": 1}, sys.argv[1] + "/b.ckpt")
print("worker", worker.pid, flush=True)
print("exiting without close", flush=True)
"""


def test_a_save_failing_at_exit_without_close_makes_the_exit_status_1(tmp_path):
    """A script that ends while its last save cannot commit (no teardown, no close; the worker's
    writes fail): the failure is on stderr and the process exits 1, as with AsyncCheckpointer.
    Output goes to files, not pipes: a leaked worker would hold a pipe open and hang the test."""
    root, out, err = tmp_path / "ckpts", tmp_path / "stdout", tmp_path / "stderr"
    root.mkdir()
    with open(out, "w") as stdout, open(err, "w") as stderr:
        done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(root)], stdout=stdout, stderr=stderr,
                              timeout=240, cwd=REPO)
    printed, said = out.read_text(), err.read_text()
    outlived = []  # the exit kills its workers; killing leftovers here keeps a bug from leaking them
    for pid in [int(line.split()[1]) for line in printed.splitlines() if line.startswith("worker ")]:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()
            outlived.append(pid)
    assert not outlived, f"workers {outlived} outlived their trainer"
    assert "exiting without close" in printed, printed + said
    assert done.returncode == 1, (done.returncode, said[-2000:])
    assert "NOT committed at interpreter exit" in said and "AsyncCheckpointIO" in said, said[-2000:]
    assert sorted(os.listdir(root)) == ["a.ckpt"]  # the failed save left nothing looking complete


def test_sigterm_mid_fit_commits_the_staged_save_and_a_resume_from_last_ends_exactly_as_default_io(tmp_path):
    """Lightning's own SIGTERM handling: the signal at step 5 ends fit at the end of that batch
    (SIGTERMException); its teardown commits the save of step 4 the plugin staged, and a fit
    resumed from last.ckpt ends exactly as with Lightning's default IO resumed from step 4 (mid
    epoch: its data loader starts the epoch again, as the reference's does)."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    class SignalAt(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    _fit(str(tmp_path / "d"), 4)
    reference = _final(*_fit(str(tmp_path / "d"), 12, ckpt_path="last")[:2])
    folder = str(tmp_path / "run")
    before = signal.getsignal(signal.SIGTERM)
    plugin = AsyncCheckpointIO()
    try:
        with pytest.raises(SIGTERMException):
            _fit(folder, 12, plugin, callbacks=[SignalAt()])
        assert signal.getsignal(signal.SIGTERM) == before
        assert _is_committed_dir(os.path.join(folder, "last.ckpt"))
        assert plugin.load_checkpoint(os.path.join(folder, "last.ckpt"))["global_step"] == 4
        resumed = _final(*_fit(folder, 12, plugin, ckpt_path="last")[:2])
    finally:
        plugin.close()
    assert_exactly_equal(resumed, reference, "resumed after SIGTERM vs default IO resumed from step 4")
