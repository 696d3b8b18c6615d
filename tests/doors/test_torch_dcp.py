"""asyncckpt.async_save, the drop-in for torch.distributed.checkpoint.async_save: the types callers
check, completion in call order without polling, failures on every rank, torchtitan's call
sequence (step-N directories, .result() before the next save, a purge thread), bad input."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import threading
import time
from concurrent.futures import Future
from multiprocessing.pool import ThreadPool

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import asyncckpt
from asyncckpt import CheckpointConfig, CheckpointError, torch_dcp
from asyncckpt.save.job_lock import FolderLocks
from asyncckpt.layout import LOCK_FILE
from multirank import run_ranks

ROWS, COLS = 8, 12


@pytest.fixture(autouse=True)
def fresh_doors():
    torch_dcp.shutdown()
    torch_dcp.configure(CheckpointConfig(io_workers=2, timeout_s=60.0))
    yield
    torch_dcp.shutdown()
    torch_dcp.configure(CheckpointConfig())


class Counter(Stateful):
    """A Stateful entry: DCP calls state_dict() at save time (like a model, it hands out the
    same tensor every time)."""

    def __init__(self) -> None:
        self.value = torch.tensor(0)

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value.copy_(state["value"])


def _load(path: str, template: dict) -> dict:
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in template.items()}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    return target


def test_futures_complete_in_call_order_with_metadata_and_steady_state_sends_no_tensors(tmp_path, monkeypatch):
    """Installed in torch's place: a real Future per call, completed by the door's own thread in
    call order with the committed Metadata; Stateful resolved at call time; values as of the call;
    a steady-state call sends the structure key only; nothing written beside the directories."""
    monkeypatch.setattr(dcp, "async_save", asyncckpt.async_save)
    state = {"w": torch.nn.Parameter(torch.randn(256, 64)), "b": torch.zeros(64), "counter": Counter()}
    futures, expected, done_order = [], [], []
    for step in range(1, 4):
        with torch.no_grad():
            state["w"].add_(1.0)
            state["b"].fill_(step)
        state["counter"].value.fill_(step)
        future = dcp.async_save(state, checkpoint_id=str(tmp_path / f"step-{step}"))
        assert type(future) is Future and isinstance(future, Future)
        future.add_done_callback(lambda f, step=step: done_order.append(step))
        expected.append((state["w"].detach().clone(), float(step)))
        with torch.no_grad():
            state["w"].add_(100.0)  # after the call returns: must not reach the checkpoint
        futures.append(future)
    metadata = [f.result(timeout=60) for f in futures]
    assert done_order == [1, 2, 3]
    assert all(isinstance(m, Metadata) and "w" in m.state_dict_metadata for m in metadata)
    assert metadata[0].state_dict_metadata == metadata[2].state_dict_metadata  # the first call's too
    assert metadata[0].state_dict_metadata["w"].properties.requires_grad
    report = torch_dcp.last_report()
    assert report.tensors_sent == 0 and report.cache_hit and report.path == str(tmp_path / "step-3")
    assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "step-1", "step-2", "step-3"]  # held while the door is open
    for step, (w, b) in enumerate(expected, start=1):
        got = _load(str(tmp_path / f"step-{step}"), {"w": w, "b": torch.zeros(64), "counter": {"value": torch.tensor(0)}})
        assert torch.equal(got["w"], w) and torch.equal(got["b"], torch.full((64,), b))
        assert int(got["counter"]["value"]) == step


def test_the_first_call_does_not_wait_for_the_worker_to_start_and_the_second_sends_nothing(tmp_path):
    """The first call has nothing before it to hide the worker's start-up: it returns once its
    copy is taken, even while the worker cannot run at all (stopped here), and the values saved
    are those of the call. The copy is the core's hand-off (save/first_save.py), which gives the
    worker the caller's own tensors too: the second call sends none."""
    door = torch_dcp._door_for(None, False, True)  # the door the call will use, worker spawned
    os.kill(door.ckpt.worker_pid, signal.SIGSTOP)
    try:
        state = {"w": torch.arange(4096.0), "nested": [torch.ones(3), {"step": 1}]}
        future = asyncckpt.async_save(state, checkpoint_id=str(tmp_path / "first"))
        state["w"].add_(1.0)
        state["nested"][0].add_(1.0)
        assert not future.done()
    finally:
        os.kill(door.ckpt.worker_pid, signal.SIGCONT)
    future.result(timeout=60)
    target = {"w": torch.zeros(4096), "nested": [torch.zeros(3), {"step": 0}]}
    dcp.load(target, checkpoint_id=str(tmp_path / "first"), no_dist=True)
    assert torch.equal(target["w"], torch.arange(4096.0)) and torch.equal(target["nested"][0], torch.ones(3))
    assert target["nested"][1]["step"] == 1
    asyncckpt.async_save(state, checkpoint_id=str(tmp_path / "second")).result(timeout=60)
    assert torch_dcp.last_report().tensors_sent == 0, torch_dcp.last_report()
    dcp.load(target, checkpoint_id=str(tmp_path / "second"), no_dist=True)
    assert torch.equal(target["w"], torch.arange(4096.0) + 1)


def test_a_folder_another_job_saves_into_fails_the_first_save_and_refuses_the_next(tmp_path):
    """Two jobs' doors saving into one folder: the second job's first call raises naming the
    holder, and so does its next, nothing is written."""
    other_job = FolderLocks("other-job")
    other_job.take(str(tmp_path))
    try:
        state = {"w": torch.ones(8)}
        with pytest.raises(CheckpointError, match=r"step-1'? is in use by another job: job other-job \(host .*, pid "):
            asyncckpt.async_save(state, checkpoint_id=str(tmp_path / "step-1"))
        with pytest.raises(CheckpointError, match="step-2'? is in use by another job: job other-job"):
            asyncckpt.async_save(state, checkpoint_id=str(tmp_path / "step-2"))
        assert os.listdir(tmp_path) == [LOCK_FILE]
    finally:
        other_job.release()


def test_stagers_and_writers_give_the_types_torch_gives(tmp_path):
    """torchtitan's pinned-memory mode (a DefaultStager with async staging) gets a real
    AsyncSaveResponse, staged on return; a FileSystemWriter (or msc's) means its path."""
    state = {"w": torch.arange(1000.0)}
    stager = DefaultStager(StagingOptions(False, True, True, False))  # torchtitan's, less what needs a GPU
    response = asyncckpt.async_save(
        state, checkpoint_id=str(tmp_path / "a"), async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        async_stager=stager,
    )
    assert type(response) is AsyncSaveResponse
    assert response.staging_completion.done() and response.staging_completion.result() is None
    assert isinstance(response.upload_completion.result(timeout=60), Metadata)
    stager.close()
    blocking = DefaultStager(StagingOptions(False, False, False, False))
    future = asyncckpt.async_save(state, checkpoint_id=str(tmp_path / "b"), async_stager=blocking)
    assert type(future) is Future
    writer = dcp.FileSystemWriter(str(tmp_path / "c"), thread_count=4, sync_files=False)
    assert isinstance(asyncckpt.async_save(state, storage_writer=writer).result(timeout=60), Metadata)
    future.result(timeout=60)
    for name in "abc":
        assert torch.equal(_load(str(tmp_path / name), state)["w"], state["w"])


def test_an_msc_filesystem_writer_means_its_path(tmp_path):
    """multi-storage-client's DCP writer (a local path here) is taken like FileSystemWriter."""
    msc_torch = pytest.importorskip("multistorageclient.contrib.torch.filesystem",
                                    reason="needs multi-storage-client (the msc extra)")
    state = {"w": torch.arange(1000.0)}
    msc_writer = msc_torch.MultiStorageFileSystemWriter(str(tmp_path / "d"))
    assert isinstance(asyncckpt.async_save(state, storage_writer=msc_writer).result(timeout=60), Metadata)
    assert torch.equal(_load(str(tmp_path / "d"), state)["w"], state["w"])


def test_bad_input_is_refused_naming_the_problem_and_writes_nothing(tmp_path):
    state = {"w": torch.ones(16)}
    a_file = tmp_path / "model.ckpt"
    a_file.write_text("not a directory")
    with pytest.raises(CheckpointError, match="model.ckpt.*not writable.*a file"):
        asyncckpt.async_save(state, checkpoint_id=str(a_file))
    with pytest.raises(CheckpointError, match="model.ckpt/sub.*not usable|not writable"):
        asyncckpt.async_save(state, checkpoint_id=str(a_file / "sub"))  # unwritable: under a file
    with pytest.raises(CheckpointError, match="needs a checkpoint_id"):
        asyncckpt.async_save(state)

    class MyWriter(dcp.FileSystemWriter):
        pass

    with pytest.raises(CheckpointError, match="storage_writer MyWriter is not supported"):
        asyncckpt.async_save(state, storage_writer=MyWriter(str(tmp_path / "x")))
    safetensors = dcp.FileSystemWriter(str(tmp_path / "x"), serialization_format=SerializationFormat.SAFETENSORS)
    with pytest.raises(CheckpointError, match="serialization_format"):
        asyncckpt.async_save(state, storage_writer=safetensors)
    with pytest.raises(CheckpointError, match="planner DefaultSavePlanner is not supported"):
        asyncckpt.async_save(state, checkpoint_id=str(tmp_path / "x"), planner=DefaultSavePlanner(flatten_state_dict=False))
    with pytest.raises(CheckpointError, match="async_stager object is not supported"):
        asyncckpt.async_save(state, checkpoint_id=str(tmp_path / "x"), async_stager=object())
    with pytest.raises(CheckpointError, match="no_dist=True .* process_group"):
        asyncckpt.async_save(state, checkpoint_id=str(tmp_path / "x"), no_dist=True, process_group=object())
    with pytest.raises(CheckpointError, match="staging='lazy' does not apply"):
        torch_dcp.configure(CheckpointConfig(staging="lazy"))
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt"]  # nothing created, nothing half-written
    asyncckpt.async_save(state, checkpoint_id=str(tmp_path / "y")).result(timeout=60)
    with pytest.raises(CheckpointError, match="already exists .* overwrite=False"):
        asyncckpt.async_save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "y"), overwrite=False))


def test_a_killed_worker_fails_the_future_within_timeout_and_the_next_save_works(tmp_path):
    """The write is held (its data file is a FIFO that nobody drains: the write blocks once the
    pipe is full, after staging), the worker is SIGKILLed: the future fails with the cause well
    within timeout_s, no .metadata appears, and the next save gets a fresh worker."""
    timeout_s = 20.0
    torch_dcp.shutdown()
    torch_dcp.configure(CheckpointConfig(io_workers=1, timeout_s=timeout_s))
    state = {"w": torch.randn(1 << 18)}  # 1 MiB: far more than a pipe holds
    asyncckpt.async_save(state, checkpoint_id=str(tmp_path / "warm")).result(timeout=60)
    pid = torch_dcp.last_report().worker_pid
    held = tmp_path / "held"
    held.mkdir()
    os.mkfifo(held / "__0_0.distcp")
    reader = os.open(held / "__0_0.distcp", os.O_RDONLY | os.O_NONBLOCK)  # lets the worker open it; never reads
    try:
        future = asyncckpt.async_save(state, checkpoint_id=str(held))
        assert not future.done()
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match="died|killed"):
            future.result(timeout=timeout_s)
        assert time.monotonic() - started < timeout_s
    finally:
        os.close(reader)
    assert not (held / ".metadata").exists()
    asyncckpt.async_save(state, checkpoint_id=str(tmp_path / "after")).result(timeout=60)
    assert torch_dcp.last_report().worker_pid != pid


# several ranks ----------------------------------------------------------------------------------
def full_matrix(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS) + 1000 * step


def _rank_state(rank: int, step: int, mesh) -> dict:
    return {
        "replicated": torch.linspace(0, 1, 64) + step,
        f"rank{rank}": torch.full((5,), float(rank * 100 + step)),
        "sharded": distribute_tensor(full_matrix(step), mesh, [Shard(0)]),
        "meta": {"step": step},
    }


def _update(state: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, DTensor):
            state[key].to_local().copy_(value.to_local())
        elif isinstance(value, torch.Tensor):
            state[key].copy_(value)
        else:
            state[key] = value


def _torchtitan_sequence(rank: int, world: int, root: str, out: str) -> None:
    """What torchtitan's CheckpointManager does, call for call: its own gloo group, `step-N`
    directories, `.result()` on the previous save before the next one, in pinned-memory mode a
    reused DefaultStager and `staging_completion.result()` before optimizer.step(), and rank 0
    purging older `step-*` directories from a thread while the newer save is in flight."""
    torch_dcp.configure(CheckpointConfig(io_workers=2, timeout_s=60.0))
    mesh = init_device_mesh("cpu", (world,))
    pg = dist.new_group(backend="gloo")
    stager = DefaultStager(StagingOptions(False, True, True, False))  # torchtitan's (True x4) needs a GPU
    purge: queue.Queue = queue.Queue()
    purger = threading.Thread(target=lambda: [shutil.rmtree(p) for p in iter(purge.get, None)], daemon=True)
    purger.start()
    state = _rank_state(rank, 0, mesh)
    save_future, sent = None, []
    for step in range(1, 5):
        _update(state, _rank_state(rank, step, mesh))  # training changes the state in place
        if save_future is not None:
            save_future.result(timeout=60)
            sent.append(torch_dcp.last_report(pg).tensors_sent)
        path = os.path.join(root, f"step-{step}")
        if step % 2:  # async_with_pinned_mem
            response = dcp.async_save(state, checkpoint_id=path, process_group=pg,
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
            assert isinstance(response, AsyncSaveResponse)
            response.staging_completion.result()
            save_future = response.upload_completion
        else:  # async
            save_future = dcp.async_save(state, checkpoint_id=path, process_group=pg)
        assert isinstance(save_future, Future)
        if rank == 0:
            for name in os.listdir(root):
                if name.startswith("step-") and int(name[5:]) < step - 1:
                    purge.put(os.path.join(root, name))
    save_future.result(timeout=60)
    sent.append(torch_dcp.last_report(pg).tensors_sent)
    purge.put(None)
    purger.join(30)
    stager.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"sent": sent}, f)
    torch_dcp.shutdown()


@pytest.mark.parametrize("world", [4])  # one rank: the tests above; two: test_torchtitan.py, the real CheckpointManager
def test_torchtitan_call_sequence_on_several_ranks_with_dtensors(world, tmp_path):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "out.json")
    os.makedirs(root)
    run_ranks(_torchtitan_sequence_installed, world, root, out, timeout_s=150)
    assert sorted(os.listdir(root)) == ["step-3", "step-4"]  # the purge ran; nothing else written
    with open(out) as f:
        sent = json.load(f)["sent"]
    assert sent[0] > 0 and sent[2:] == [0, 0], sent  # the 2nd sends the real tensors, once  # steady state: the key only
    for step in (3, 4):
        target = {"replicated": torch.zeros(64), "sharded": torch.zeros(ROWS, COLS), "meta": {"step": -1},
                  **{f"rank{r}": torch.zeros(5) for r in range(world)}}
        dcp.load(target, checkpoint_id=os.path.join(root, f"step-{step}"), no_dist=True)
        assert torch.equal(target["sharded"], full_matrix(step)) and target["meta"]["step"] == step
        assert torch.equal(target["replicated"], torch.linspace(0, 1, 64) + step)
        for r in range(world):
            assert torch.equal(target[f"rank{r}"], torch.full((5,), float(r * 100 + step)))


def _torchtitan_sequence_installed(rank: int, world: int, root: str, out: str) -> None:
    dcp.async_save = asyncckpt.async_save  # the one-line switch, in each rank's process
    _torchtitan_sequence(rank, world, root, out)


def _failure_on_rank1(rank: int, world: int, root: str) -> None:
    torch_dcp.configure(CheckpointConfig(io_workers=1, timeout_s=60.0))
    mesh = init_device_mesh("cpu", (world,))
    asyncckpt.async_save(_rank_state(rank, 1, mesh), checkpoint_id=os.path.join(root, "step-1")).result(timeout=60)
    if rank == 0:  # rank 1's data file cannot be opened: a directory in its place
        os.makedirs(os.path.join(root, "step-2", "__1_0.distcp"))
    dist.barrier()
    future = asyncckpt.async_save(_rank_state(rank, 2, mesh), checkpoint_id=os.path.join(root, "step-2"))
    with pytest.raises(CheckpointError) as failure:
        future.result(timeout=60)
    assert "rank 1" in str(failure.value) and "__1_0.distcp" in str(failure.value), str(failure.value)
    assert not os.path.exists(os.path.join(root, "step-2", ".metadata"))
    with pytest.raises(CheckpointError, match="use_collectives=False is not supported"):
        asyncckpt.async_save(_rank_state(rank, 3, mesh), checkpoint_id=os.path.join(root, "x"), use_collectives=False)
    future = asyncckpt.async_save(_rank_state(rank, 3, mesh), checkpoint_id=os.path.join(root, "step-3"))
    assert isinstance(future.result(timeout=60), Metadata)
    torch_dcp.shutdown()


def test_a_writer_failure_on_one_rank_raises_from_result_on_every_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks(_failure_on_rank1, 2, root, timeout_s=120)
    assert os.path.exists(os.path.join(root, "step-3", ".metadata"))
    assert not os.path.exists(os.path.join(root, "x"))


def test_with_the_memory_tier_the_resume_loads_the_newest_save_from_memory(tmp_path, caplog):
    """configure(memory_tier=True, memory_keep: the file outlives the shutdown, as after a crash):
    torch_dcp.load (the resume's dcp.load) reads the newest save from the memory copy of that very
    save, an older checkpoint of the folder from its files; both as saved."""
    torch_dcp.shutdown()
    torch_dcp.configure(CheckpointConfig(io_workers=2, timeout_s=60.0, memory_tier=True, memory_dir=str(tmp_path),
                                         memory_keep=True))
    state = {"w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS), "c": Counter(), "note": "x"}
    older, newest = str(tmp_path / "ckpt" / "step-1"), str(tmp_path / "ckpt" / "step-2")
    torch_dcp.async_save(state, checkpoint_id=older, no_dist=True).result(timeout=60)
    state["w"].add_(1)
    state["c"].value.fill_(2)
    torch_dcp.async_save(state, checkpoint_id=newest, no_dist=True).result(timeout=60)
    torch_dcp.shutdown()
    for path, offset in ((newest, 1), (older, 0)):
        target = {"w": torch.zeros(ROWS, COLS), "c": Counter(), "note": None}
        caplog.clear()
        with caplog.at_level("INFO", logger="asyncckpt"):
            torch_dcp.load(target, checkpoint_id=path, no_dist=True)
        assert torch.equal(target["w"], torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + offset)
        assert target["c"].value.item() == 2 * offset and target["note"] == "x"
        from_memory = [r for r in caplog.records if r.getMessage().startswith(f"loaded {path} from memory")]
        assert bool(from_memory) == (path == newest), path


def _preempted_dcp_loop(base, grace_s: float, saves_after_s: float) -> tuple[int, str, str]:
    """dcp_preempt_child in a session of its own, SIGTERM once it staged step-2: its exit status and output."""
    import subprocess
    import sys

    from conftest import REPO

    child = os.path.join(os.path.dirname(__file__), "dcp_preempt_child.py")
    process = subprocess.Popen([sys.executable, "-u", child, str(base), str(grace_s), str(saves_after_s)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = process.stdout.readline()
        assert line.strip() == "STAGED 2", (line, process.stderr.read() if process.poll() is not None else "")
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return process.returncode, out, err


def test_a_preemption_signal_commits_the_staged_save_of_a_loop_that_never_looks(tmp_path):
    """torchtitan through async_save, `preemption_signals` in `configure()`: its loop knows nothing
    of the signal; the save staged before it is committed (stock dcp.load reads it, with the values
    staged), and the process ends with 143 when grace_s runs out, saying what was saved. A loop
    that saves on after the signal: the first save asked once the checkpointer was closed for it
    ends the process (143, not an exception's 1), and every save committed before loads equal."""
    from asyncckpt.save.preemption import PREEMPTED_EXIT_CODE

    with ThreadPool(2) as pool:
        (rc, _, err), (rc_on, out_on, err_on) = pool.starmap(
            _preempted_dcp_loop, [(tmp_path / "idle", 4, 0), (tmp_path / "saving", 8, 1)])
    assert rc == PREEMPTED_EXIT_CODE, err
    assert "closed for it" in err and f"committed ({tmp_path}/idle/step-2" in err, err
    assert bool((_load(str(tmp_path / "idle" / "step-2"), {"w": torch.zeros(1 << 20)})["w"] == 2.0).all())
    assert rc_on == PREEMPTED_EXIT_CODE, err_on
    assert "a save was asked after the checkpointer was closed for the loop" in err_on, err_on
    staged = [2] + [int(line.split()[1]) for line in out_on.splitlines() if line.startswith("STAGED")]
    assert len(staged) > 2, out_on  # (it saved on after the signal until the close for it)
    for step in staged:  # each staged before the close: committed by the door or by the close
        assert bool((_load(str(tmp_path / "saving" / f"step-{step}"), {"w": torch.zeros(1 << 20)})["w"] == step).all())
