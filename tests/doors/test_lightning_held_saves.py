"""The Lightning plugin's held saves: one worker serves both saves of a checkpoint event; a save
that comes while the worker is busy or starting is copied and held (room in /dev/shm checked
first), `save_last="link"` links a held save, a folder another job writes is refused, and a worker
killed with a save held fails that save only."""

from __future__ import annotations

import os
import threading

import pytest
import torch

L = pytest.importorskip("lightning", reason="Lightning is not installed (pip install lightning; CI installs it)")


from asyncckpt import CheckpointConfig, CheckpointError  # noqa: E402
from asyncckpt.save.job_lock import FolderLocks
from asyncckpt.layout import LOCK_FILE
from asyncckpt.doors.lightning import AsyncCheckpointIO  # noqa: E402
from lightning_fits import (  # noqa: E402
    _clone, _fit, _is_committed_dir, _workers, assert_exactly_equal, starting_workers_stopped,
)


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
    from asyncckpt.save.sharing import shm_bytes

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
    from asyncckpt.save.sharing import shm_bytes
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
    returned = threading.Event()
    with starting_workers_stopped(plugin):

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
    try:
        plugin.remove_checkpoint(str(tmp_path / "epoch=0-step=2.ckpt"))
        loaded = plugin.load_checkpoint(str(tmp_path / "last.ckpt"))
        assert torch.equal(loaded["state_dict"]["w"], torch.arange(4096.0)) and loaded["epoch"] == 0
        plugin.teardown()
        assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "last.ckpt"]
    finally:
        plugin.close()


def test_the_first_event_hands_the_trainers_tensors_over_so_the_next_event_sends_only_what_is_new(tmp_path):
    """The first event's top-k save, while the worker is still starting (stopped here), is the
    core's hand-off (save/first_save.py), as for every entry point: it returns once copied and
    gives the worker the trainer's own tensors too, so the next event's top-k save sends only its
    new score, not the model (it sent every tensor when the plugin held the first save's copy)."""
    reports = []
    plugin = AsyncCheckpointIO(CheckpointConfig(io_workers=1, on_commit=reports.append))
    model = {"w": torch.arange(4096.0), "layers": [torch.zeros(256), torch.ones(512)]}
    with starting_workers_stopped(plugin):
        expected = _clone(model)
        event = {"state_dict": model, "callbacks": {"best": {"e0.ckpt": torch.tensor(0.0)}}}
        plugin.save_checkpoint(event, str(tmp_path / "epoch=0.ckpt"))
        plugin.save_checkpoint(event, str(tmp_path / "last.ckpt"))
        for tensor in [model["w"], *model["layers"]]:
            tensor.add_(1.0)
    try:
        plugin.wait()
        event = {"state_dict": model, "callbacks": {"best": {"e1.ckpt": torch.tensor(1.0)}}}
        plugin.save_checkpoint(event, str(tmp_path / "epoch=1.ckpt"))
        plugin.wait()
        assert_exactly_equal(plugin.load_checkpoint(str(tmp_path / "epoch=0.ckpt"))["state_dict"], expected)
        assert_exactly_equal(plugin.load_checkpoint(str(tmp_path / "last.ckpt"))["state_dict"], expected)
        assert_exactly_equal(plugin.load_checkpoint(str(tmp_path / "epoch=1.ckpt"))["state_dict"], model)
    finally:
        plugin.close()
    assert [r.tensors_sent for r in reports] == [4, 4, 1], reports


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
    with starting_workers_stopped(plugin) as workers:
        probe = LoadThroughLastAfterFirstEvent(plugin, workers, last)
        model, trainer, _ = _fit(dirpath, 6, plugin, save_last="link", callbacks=[probe])
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
        plugin.save_checkpoint({"state_dict": model, "step": 0}, str(tmp_path / "warm.ckpt"))  # the first save
        plugin._saves.settle()  # (handed over from a copy) is done: the next one is written by the worker alone
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
        with pytest.raises(CheckpointError, match=r"epoch=0-step=1\.ckpt' not committed: rank 0: .*checkpoint worker pid \d+ died"):
            plugin.teardown()  # then says what failed
        assert not os.path.exists(os.path.join(best, ".metadata"))
        assert_exactly_equal(plugin.load_checkpoint(str(tmp_path / "last.ckpt"))["state_dict"], expected)
        assert _workers(plugin) != [worker]
        plugin.save_checkpoint({"state_dict": model, "step": 2}, str(tmp_path / "epoch=0-step=2.ckpt"))
        plugin.teardown()
        assert_exactly_equal(plugin.load_checkpoint(str(tmp_path / "epoch=0-step=2.ckpt"))["state_dict"], model)
    finally:
        plugin.close()


