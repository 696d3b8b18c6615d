"""asyncckpt.lightning.AsyncCheckpointIO with a real lightning.Trainer on CPU: what ModelCheckpoint
keeps, resuming, exact round trips, removal and replacement racing saves, bad input, and DDP."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import subprocess
import sys
import threading

import psutil
import pytest
import torch

L = pytest.importorskip("lightning", reason="Lightning is not installed (pip install lightning; CI installs it)")

import torch.distributed.checkpoint as dcp  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from asyncckpt import CheckpointConfig, CheckpointError, verify_checkpoint  # noqa: E402
from asyncckpt.save.job_lock import LOCK_FILE, FolderLocks  # noqa: E402
from asyncckpt.doors.lightning import AsyncCheckpointIO  # noqa: E402
from asyncckpt.doors.nested import unflatten_exact  # noqa: E402
from conftest import REPO, run_cpu_script  # noqa: E402

EXAMPLE = os.path.join(REPO, "examples", "lightning_fit.py")
MiB = 1 << 20


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)]


def _loader() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 8, generator=gen)  # 3 batches an epoch: step 6 ends an epoch
    return DataLoader(TensorDataset(x, x[:, :2].cos()), batch_size=8, shuffle=False)


def _fit(dirpath: str, steps: int, plugin=None, ckpt_path=None, save_last=True, callbacks=()):
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=dirpath, monitor="train_loss", save_top_k=2, every_n_train_steps=2, save_last=save_last)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin] if plugin else [], callbacks=[checkpoint, *callbacks],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = Tiny()
    trainer.fit(model, _loader(), ckpt_path=ckpt_path)
    return model, trainer, checkpoint


def _final(model, trainer) -> dict:
    return {"model": model.state_dict(), "optim": trainer.optimizers[0].state_dict(), "step": trainer.global_step}


def assert_exactly_equal(a, b, where="") -> None:
    """Same keys (and key types), same container kinds (tuple ~ list), tensors equal in dtype,
    shape and values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), f"{where}: {list(a)} != {list(b)}"
        assert [type(k) for k in a] == [type(k) for k in b], where
        for key in a:
            assert_exactly_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_exactly_equal(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def _is_committed_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


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


def _clone(obj):
    from asyncckpt.doors.nested import map_tensors
    return map_tensors(obj, lambda t: t.clone())


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


def _workers(plugin) -> list[psutil.Process]:
    return [psutil.Process(plugin._saves.saver.worker_pid)] if plugin._saves.saver is not None else []


def test_one_worker_serves_both_saves_of_an_event_and_a_steady_event_sends_no_tensors(tmp_path):
    """ModelCheckpoint's event is a top-k save then last.ckpt. One worker serves both: the second
    save returns while the first is still being written (the worker is stopped here) and keeps
    the values of its call; from the second event on, neither save hands the worker a tensor (the
    trainer's tensors and the held copy each keep their cache slot), and no second worker starts."""
    reports = []
    plugin = AsyncCheckpointIO(CheckpointConfig(io_workers=1, on_commit=reports.append))
    # 16 MiB, one file: its write and fsync outlast the instant between staging and the suspend below
    model = {"w": torch.arange(4 << 20, dtype=torch.float32), "v": torch.ones(1024), "layers": [torch.zeros(256), torch.zeros(512)]}
    expected = {}
    try:
        [worker] = _workers(plugin)
        for _ in range(2400):  # the worker is up (a first save would otherwise be held too: tested below)
            with plugin._saves.lock:
                if plugin._saves.saver.worker_ready:
                    break
            threading.Event().wait(0.05)
        else:
            pytest.fail("the worker did not start within 120 s")
        for event in range(3):
            state = {"state_dict": model, "epoch": event, "callbacks": {"best": {f"e{event}.ckpt": torch.tensor(float(event))}}}
            plugin.save_checkpoint(state, str(tmp_path / f"epoch={event}.ckpt"))  # staged: written from here on
            worker.suspend()  # the first save stays in flight
            try:
                returned = threading.Event()
                threading.Thread(target=lambda: (plugin.save_checkpoint(state, str(tmp_path / "last.ckpt")), returned.set()),
                                 daemon=True).start()
                assert returned.wait(60), "the second save of an event waited for the first one's writes"
            finally:
                worker.resume()
            expected[event] = _clone(model)
            for tensor in [model["w"], model["v"], *model["layers"]]:
                tensor.add_(1.0)  # the next step changes every tensor
            plugin.wait()
            assert _workers(plugin) == [worker], "a second worker served the plugin"
        for event in range(3):
            assert_exactly_equal(plugin.load_checkpoint(str(tmp_path / f"epoch={event}.ckpt"))["state_dict"], expected[event])
        assert_exactly_equal(plugin.load_checkpoint(str(tmp_path / "last.ckpt"))["state_dict"], expected[2])
        sent = [r.tensors_sent for r in reports]
        assert sent[:2] == [5, 5], sent  # the trainer's tensors, then the held copy's
        assert sent[2:] == [1, 1, 1, 1], f"tensors sent per save after the first event: {sent[2:]}"  # each event's new score
    finally:
        plugin.close()


def test_without_shared_memory_for_a_held_copy_the_second_save_waits_and_both_commit(tmp_path, monkeypatch, caplog):
    """/dev/shm (a container's is often 64 MiB) has room for the trainer's tensors but not for a
    held copy too: the second save of an event is not held (it would fail at hand-over) but waits
    for the first one's writes, once warned, without copying the state first; both checkpoints
    commit with their call's values."""
    import asyncckpt.doors.held_saves as held_saves

    plugin = AsyncCheckpointIO(CheckpointConfig(io_workers=1))
    model = {"w": torch.arange(1 << 20, dtype=torch.float32)}  # 4 MiB
    try:
        with plugin._saves.lock:
            plugin._saves.ensure_saver().ensure_worker()
        for _ in range(2400):
            with plugin._saves.lock:
                if plugin._saves.saver.worker_ready:
                    break
            threading.Event().wait(0.05)
        monkeypatch.setattr(held_saves, "shm_free_bytes", lambda: 2 << 20)  # no room for 4 more MiB
        copies = []
        take = held_saves.HeldCopy.take
        monkeypatch.setattr(held_saves.HeldCopy, "take", lambda self, state: copies.append(1) or take(self, state))
        for event in range(2):
            checkpoint = {"state_dict": model, "epoch": event}
            plugin.save_checkpoint(checkpoint, str(tmp_path / f"epoch={event}.ckpt"))
            with caplog.at_level("WARNING", "asyncckpt"):
                plugin.save_checkpoint(checkpoint, str(tmp_path / "last.ckpt"))
            assert os.path.exists(tmp_path / f"epoch={event}.ckpt" / ".metadata"), "the second save did not wait for the first"
            expected = _clone(model)
            model["w"].add_(1.0)
        plugin.teardown()
        assert_exactly_equal(plugin.load_checkpoint(str(tmp_path / "last.ckpt"))["state_dict"], expected)
        assert_exactly_equal(plugin.load_checkpoint(str(tmp_path / "epoch=1.ckpt"))["state_dict"], expected)
    finally:
        plugin.close()
    assert caplog.text.count("cannot take a held copy") == 1, caplog.text
    assert copies == [], "a copy was taken only to be thrown away"


def _held_copy_counts_a_dtensors_shard(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from asyncckpt.save.private_copy import HeldCopy
    from asyncckpt.save.snapshot import shm_bytes

    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.ones(300, 100), mesh, [Shard(0)]), "b": torch.ones(10)}
    held = HeldCopy()
    assert held.bytes_to_share(state) == shm_bytes(300 * 100 * 4 // world) + shm_bytes(40)
    held.take(state)["b"].share_memory_()  # as a save does; the DTensor is cloned afresh by every take
    assert held.bytes_to_share(state) == shm_bytes(300 * 100 * 4 // world)


def test_a_held_copy_says_how_much_shared_memory_its_save_needs():
    """What the plugin checks against /dev/shm's free space before holding a copy: nothing for a
    tensor that lands in memory the previous copy already shared, its page-rounded bytes for a
    fresh one (a new shape, a DTensor's local shard)."""
    from asyncckpt.save.private_copy import HeldCopy
    from asyncckpt.save.snapshot import shm_bytes
    from multirank import run_ranks

    held = HeldCopy()
    state = {"w": torch.ones(1000), "meta": {"n": 3, "bias": torch.ones(5)}}
    assert held.bytes_to_share(state) == shm_bytes(4000) + shm_bytes(20)
    taken = held.take(state)
    assert held.bytes_to_share(state) == shm_bytes(4000) + shm_bytes(20)  # taken, not yet shared
    taken["w"].share_memory_()
    taken["meta"]["bias"].share_memory_()
    assert held.bytes_to_share(state) == 0
    assert held.bytes_to_share({"w": torch.ones(2000), "meta": state["meta"]}) == shm_bytes(8000)
    run_ranks(_held_copy_counts_a_dtensors_shard, 2)  # a shard, not the whole tensor


def test_the_first_saves_do_not_wait_for_the_workers_to_start(tmp_path):
    """ModelCheckpoint's first event (a top-k save and last.ckpt) comes while the worker the
    plugin spawned is still starting: both saves return once copied, even though it cannot run
    yet (stopped here), and keep the values of the call; a removal of one waits for it."""
    state = {"state_dict": {"w": torch.arange(4096.0)}, "epoch": 0}
    plugin = AsyncCheckpointIO()  # spawns its worker now
    workers = _workers(plugin)
    for worker in workers:
        worker.suspend()
    returned = threading.Event()
    try:
        if plugin._saves.saver.worker_ready:
            pytest.skip("the worker finished starting before it could be stopped")

        def first_event() -> None:
            plugin.save_checkpoint(state, str(tmp_path / "epoch=0-step=2.ckpt"))
            plugin.save_checkpoint(state, str(tmp_path / "last.ckpt"))
            returned.set()

        caller = threading.Thread(target=first_event, daemon=True)
        caller.start()
        returned.wait(120)  # a bound against a hang only: on failure the saves wait for the workers
        assert returned.is_set(), "save_checkpoint waited for a worker that had not started"
        state["state_dict"]["w"].add_(1.0)
        state["epoch"] = 1
    finally:
        for worker in workers:
            worker.resume()
    try:
        plugin.remove_checkpoint(str(tmp_path / "epoch=0-step=2.ckpt"))
        loaded = plugin.load_checkpoint(str(tmp_path / "last.ckpt"))
        assert torch.equal(loaded["state_dict"]["w"], torch.arange(4096.0)) and loaded["epoch"] == 0
        plugin.teardown()
        assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "last.ckpt"]
    finally:
        plugin.close()


class LoadThroughLastAfterFirstEvent(L.Callback):
    """At the step after the first checkpoint event: what last.ckpt is, then the workers resumed
    and the checkpoint loaded through it."""

    def __init__(self, plugin, workers, last: str) -> None:
        self.plugin, self.workers, self.last = plugin, workers, last
        self.seen, self.loaded = None, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step != 2:
            return
        target = os.path.join(os.path.dirname(self.last), os.readlink(self.last))
        self.seen = (os.path.basename(target), _is_committed_dir(target))
        for worker in self.workers:
            worker.resume()
        self.loaded = self.plugin.load_checkpoint(self.last)


def test_save_last_link_names_the_newest_checkpoint_and_loads_it_once_committed(tmp_path):
    """ModelCheckpoint(save_last="link") in a real fit whose first save comes while the worker is
    still starting (stopped here): the save returns with the folder made, so Lightning links
    last.ckpt to a checkpoint not written yet; a load through the link waits for that save and
    gets it committed. After the fit last.ckpt links the newest checkpoint, a fit resumed with
    ckpt_path="last" restores it, and removing the link leaves the checkpoint it names."""
    dirpath = str(tmp_path / "run")
    last = os.path.join(dirpath, "last.ckpt")
    plugin = AsyncCheckpointIO()  # spawns its worker now
    workers = _workers(plugin)
    for worker in workers:
        worker.suspend()
    try:
        if plugin._saves.saver.worker_ready:
            pytest.skip("the worker finished starting before it could be stopped")
        probe = LoadThroughLastAfterFirstEvent(plugin, workers, last)
        model, trainer, _ = _fit(dirpath, 6, plugin, save_last="link", callbacks=[probe])
    finally:
        for worker in workers:
            worker.resume()
    try:
        assert probe.seen == ("epoch=0-step=2.ckpt", False)  # linked while its save was held
        assert probe.loaded["global_step"] == 2
        assert os.readlink(last) == "epoch=1-step=6.ckpt" and _is_committed_dir(os.path.join(dirpath, "epoch=1-step=6.ckpt"))
        saved = plugin.load_checkpoint(last)
        assert saved["global_step"] == 6
        assert_exactly_equal(saved["state_dict"], model.state_dict())

        resumed, trainer, _ = _fit(dirpath, 6, plugin, ckpt_path="last", save_last="link")  # restores, trains no step
        assert trainer.ckpt_path == last and trainer.global_step == 6
        assert_exactly_equal(resumed.state_dict(), model.state_dict())

        plugin.remove_checkpoint(last)
        assert not os.path.lexists(last) and _is_committed_dir(os.path.join(dirpath, "epoch=1-step=6.ckpt"))
    finally:
        plugin.close()


def test_a_folder_another_job_saves_into_is_refused_at_the_call(tmp_path):
    """Two jobs' plugins saving into one dirpath: the second one's first save_checkpoint (held
    while its worker starts) raises at once, naming the holder, and writes nothing."""
    other_job = FolderLocks("other-job")
    other_job.take(str(tmp_path))
    plugin = AsyncCheckpointIO()
    try:
        with pytest.raises(CheckpointError, match=r"last.ckpt'? is in use by another job: job other-job \(host .*, pid "):
            plugin.save_checkpoint({"state_dict": {"w": torch.ones(8)}}, str(tmp_path / "last.ckpt"))
        plugin.teardown()  # nothing was held
        assert os.listdir(tmp_path) == [LOCK_FILE]
    finally:
        plugin.close()
        other_job.release()


def test_a_worker_killed_with_a_save_held_fails_that_save_and_the_held_one_commits(tmp_path):
    """The worker dies (OOM killer, kill -9) while writing an event's top-k save, with last.ckpt
    held: the top-k save fails and says so at the plugin's next call (never a hang), nothing of
    it is left looking committed, and the held last.ckpt is written by a fresh worker the plugin's
    commit thread starts (no call from Lightning needed), with its call's values; the plugin goes
    on saving."""
    plugin = AsyncCheckpointIO(CheckpointConfig(io_workers=1, timeout_s=60.0))
    model = {"w": torch.arange(4 << 20, dtype=torch.float32)}  # 16 MiB
    try:
        [worker] = _workers(plugin)
        for _ in range(2400):
            with plugin._saves.lock:
                if plugin._saves.saver.worker_ready:
                    break
            threading.Event().wait(0.05)
        best = str(tmp_path / "epoch=0-step=1.ckpt")
        plugin.save_checkpoint({"state_dict": model, "step": 1}, best)
        worker.suspend()  # the top-k save stays in flight, so last.ckpt is held
        plugin.save_checkpoint({"state_dict": model, "step": 1}, str(tmp_path / "last.ckpt"))
        with plugin._saves.lock:
            held = bool(plugin._saves.held)
        if not held:
            worker.resume()
            pytest.skip("the top-k save was written before the worker could be stopped")
        expected = _clone(model)
        model["w"].add_(1.0)
        worker.kill()
        last_committed = tmp_path / "last.ckpt" / ".metadata"
        for _ in range(2400):  # the plugin's commit thread starts the next worker, without a call from Lightning
            if last_committed.exists():
                break
            threading.Event().wait(0.05)
        assert last_committed.exists(), "the held save was not written without a call from Lightning"
        with pytest.raises(CheckpointError, match=r"epoch=0-step=1\.ckpt' not committed: rank 0: checkpoint worker pid \d+ died"):
            plugin.teardown()  # then says what failed
        assert not os.path.exists(os.path.join(best, ".metadata"))
        assert_exactly_equal(plugin.load_checkpoint(str(tmp_path / "last.ckpt"))["state_dict"], expected)
        assert _workers(plugin) != [worker]
        plugin.save_checkpoint({"state_dict": model, "step": 2}, str(tmp_path / "epoch=0-step=2.ckpt"))
        plugin.teardown()
        assert_exactly_equal(plugin.load_checkpoint(str(tmp_path / "epoch=0-step=2.ckpt"))["state_dict"], model)
    finally:
        plugin.close()


def test_remove_during_an_in_flight_save_waits_and_it_never_reappears(tmp_path):
    state = {"w": torch.randn(MiB // 4)}
    path = str(tmp_path / "epoch=0-step=2.ckpt")
    plugin = AsyncCheckpointIO(max_in_flight=1)
    try:
        plugin.save_checkpoint(state, str(tmp_path / "warm.ckpt"))
        plugin.teardown()
        plugin.save_checkpoint(state, path)  # staged; its writes are still to come
        assert plugin._saves.saver.in_flight_dir == path
        [worker] = _workers(plugin)
        worker.suspend()  # the save stays in flight until the worker goes on
        resume = threading.Timer(0.5, worker.resume)
        resume.start()
        try:
            plugin.remove_checkpoint(path)
        finally:
            resume.join()
            worker.resume()
        assert not os.path.exists(os.path.join(path, ".metadata"))  # un-committed on return
        plugin.teardown()  # nothing left in flight, nothing failed, the removal ended
        assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "warm.ckpt"]
    finally:
        plugin.close()


def test_remove_returns_uncommitted_and_the_files_go_before_the_path_is_used_again(tmp_path, monkeypatch):
    """Deleting a checkpoint's files (0.1 s for 86 MB here, longer on a store) is not the
    trainer's wait: remove_checkpoint returns once `.metadata` is gone, while the deletion is
    held up here. A save to that path waits for the deletion (its new files are never deleted
    with the old ones); teardown waits for every deletion; one that fails reaches the next call,
    before a save into that path writes anything."""
    from asyncckpt.storage import LocalStorage
    remove_tree, gate = LocalStorage.remove_tree, threading.Event()
    monkeypatch.setattr(LocalStorage, "remove_tree", lambda self, path: gate.wait(60) and remove_tree(self, path))
    old, new = {"w": torch.zeros(MiB // 4)}, {"w": torch.ones(MiB // 4)}
    path = str(tmp_path / "epoch=0-step=2.ckpt")
    plugin = AsyncCheckpointIO()
    try:
        plugin.save_checkpoint(old, path)
        plugin.teardown()
        plugin.remove_checkpoint(path)  # returns with the deletion held up
        assert os.path.isdir(path) and not os.path.exists(os.path.join(path, ".metadata"))
        saved = threading.Event()
        threading.Thread(target=lambda: (plugin.save_checkpoint(new, path), saved.set()), daemon=True).start()
        assert not saved.wait(0.5), "a save to a path being deleted did not wait for the deletion"
        gate.set()
        assert saved.wait(60)
        plugin.teardown()
        assert_exactly_equal(plugin.load_checkpoint(path), new)

        gate.clear()
        plugin.remove_checkpoint(path)
        assert os.path.isdir(path)
        gate.set()
        plugin.teardown()
        assert os.listdir(tmp_path) == [LOCK_FILE]

        monkeypatch.setattr(LocalStorage, "remove_tree", lambda self, path: (_ for _ in ()).throw(PermissionError(13, "denied")))
        plugin.save_checkpoint(old, path)
        plugin.remove_checkpoint(path)
        with pytest.raises(CheckpointError, match="removing .*epoch=0-step=2.ckpt failed.*denied"):
            plugin.save_checkpoint(new, path)  # said before anything is written into the half-deleted path
        plugin.teardown()  # said once
        assert not os.path.exists(os.path.join(path, ".metadata"))
    finally:
        gate.set()
        plugin.close()


def test_a_failed_replace_of_last_ckpt_keeps_the_old_one(tmp_path):
    state = {"state_dict": {"w": torch.randn(2 * MiB // 4), "v": torch.randn(2 * MiB // 4)}}
    path = str(tmp_path / "last.ckpt")
    plugin = AsyncCheckpointIO(CheckpointConfig(io_workers=1, timeout_s=60.0), max_in_flight=1)
    try:
        plugin.save_checkpoint(state, path)
        plugin.teardown()
        expected = _clone(state)
        state["state_dict"]["w"].add_(1.0)
        [worker] = _workers(plugin)
        limits = worker.rlimit(psutil.RLIMIT_FSIZE)
        worker.rlimit(psutil.RLIMIT_FSIZE, (MiB, limits[1]))  # the re-save's data file fails with EFBIG
        try:
            with pytest.raises(CheckpointError, match="EFBIG|File too large"):
                plugin.save_checkpoint(state, path)
                plugin.teardown()
        finally:
            worker.rlimit(psutil.RLIMIT_FSIZE, limits)
        assert_exactly_equal(plugin.load_checkpoint(path), expected)
        assert verify_checkpoint(path) == []
        plugin.save_checkpoint(state, path)  # a successful replace
        assert_exactly_equal(plugin.load_checkpoint(path), _clone(state))
        assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "last.ckpt"]
    finally:
        plugin.close()


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


def test_incremental_saves_in_lightnings_pattern_reuse_the_frozen_weights(tmp_path):
    """ModelCheckpoint's event (save the new top-k, save last.ckpt, remove the previous best) with
    incremental=True and a mostly frozen model: only the first save is full, every other save
    writes at most the trained tensors (last.ckpt is re-saved in place, continuing from itself),
    and every kept checkpoint loads as saved."""
    reports = []
    plugin = AsyncCheckpointIO(CheckpointConfig(incremental=True, on_commit=reports.append))
    frozen = {f"encoder.{i}": torch.randn(1 << 18) for i in range(4)}  # 4 MiB never trained
    head = torch.zeros(1 << 16)  # 256 KiB trained
    try:
        previous = None
        for step in range(1, 4):
            head.add_(1.0)
            checkpoint = {"state_dict": {**frozen, "head": head}, "global_step": step}
            best = str(tmp_path / f"epoch=0-step={step}.ckpt")
            plugin.save_checkpoint(checkpoint, best)
            plugin.save_checkpoint(checkpoint, str(tmp_path / "last.ckpt"))
            if previous is not None:
                plugin.remove_checkpoint(previous)
            previous = best
        plugin.teardown()
        for path in (best, str(tmp_path / "last.ckpt")):
            assert_exactly_equal(plugin.load_checkpoint(path), checkpoint)
            assert verify_checkpoint(path) == []
    finally:
        plugin.close()
    written = [r.bytes_written for r in reports]
    assert len(written) == 6 and written[0] >= 4 << 20, written  # the first save: everything
    assert all(n < (1 << 18) + (64 << 10) for n in written[1:]), written  # then the trained 256 KiB at most
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=3.ckpt", "last.ckpt"]


def test_incremental_last_ckpt_links_the_top_k_save_of_its_event(tmp_path):
    """Every tensor trained between events: last.ckpt, saved right after the event's top-k
    checkpoint with the same values, writes none of them again (its files are the top-k save's,
    hard-linked) while it replaces its own previous save; removing the previous best returns while
    the event's saves are still in flight (the worker is stopped here); removing the top-k
    checkpoint last.ckpt links leaves last.ckpt whole."""
    reports = []
    plugin = AsyncCheckpointIO(CheckpointConfig(incremental=True, io_workers=1, on_commit=reports.append))
    weights = {f"layer{i}": torch.randn(1 << 18) for i in range(4)}  # 4 MiB, all trained
    try:
        [worker] = _workers(plugin)
        previous = None
        for step in range(1, 4):
            for tensor in weights.values():
                tensor.add_(1.0)
            checkpoint = {"state_dict": dict(weights), "global_step": step}
            best = str(tmp_path / f"epoch=0-step={step}.ckpt")
            plugin.save_checkpoint(checkpoint, best)
            plugin.save_checkpoint(checkpoint, str(tmp_path / "last.ckpt"))
            if previous is not None:
                worker.suspend()  # the event's saves stay in flight
                try:
                    removed = threading.Event()
                    threading.Thread(target=lambda: (plugin.remove_checkpoint(previous), removed.set()), daemon=True).start()
                    assert removed.wait(60), "removing the previous best waited for the event's saves"
                finally:
                    worker.resume()
            previous = best
        plugin.teardown()
        last = str(tmp_path / "last.ckpt")
        best_inodes = {os.stat(os.path.join(best, n)).st_ino for n in os.listdir(best)}
        assert {os.stat(os.path.join(last, n)).st_ino for n in os.listdir(last) if n.endswith(".distcp")} & best_inodes
        plugin.remove_checkpoint(best)
        assert_exactly_equal(plugin.load_checkpoint(last), checkpoint)
        assert verify_checkpoint(last) == []
    finally:
        plugin.close()
    written = [r.bytes_written for r in reports]
    assert len(written) == 6 and all(n >= 4 << 20 for n in written[0::2]), written  # top-k: every tensor
    assert all(n < 64 << 10 for n in written[1::2]), written  # last.ckpt: its objects only
    assert os.listdir(tmp_path) == ["last.ckpt"]


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
