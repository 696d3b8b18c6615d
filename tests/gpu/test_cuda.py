"""The GPU path (docs/how_it_works.md, docs/guarantees.md "Limits"): CUDA tensors reach the worker as IPC handles, are copied into a
pinned slab on a side stream, and the trainer may mutate them once staged. Tests marked `cuda`
skip without a GPU; those that run here check that a CPU job never touches CUDA."""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import AsyncCheckpointer, CheckpointConfig, load
from conftest import assert_state_equal, clone_state, step_path, zeros_like_state

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
MiB = 1 << 20



def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    return obj


# CPU ---------------------------------------------------------------------------------------------
def test_a_cpu_job_on_a_machine_with_a_gpu_never_touches_cuda(ckpt_root, monkeypatch):
    """CUDA "available" here, but the state is on the CPU: building the checkpointer, saving,
    committing and closing initialise no CUDA context in the trainer (each costs GPU memory and
    seconds, and a context on device 0 from every rank of a node)."""

    def touched(*args, **kwargs):
        raise AssertionError("a CPU-only save touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("current_device", "synchronize", "ipc_collect", "init", "_lazy_init", "current_stream", "set_device"):
        monkeypatch.setattr(torch.cuda, name, touched)
    state = {"w": torch.randn(64), "step": 3}
    with AsyncCheckpointer(ckpt_root) as ckpt:
        for step in range(2):
            ckpt.schedule_save(state, step=step)
        ckpt.finalize(blocking=True)
    target = {"w": torch.zeros(64), "step": 0}
    load(target, step_path(ckpt_root, 1))
    assert torch.equal(target["w"], state["w"]) and target["step"] == 3


def test_rng_state_of_a_cpu_job_on_a_machine_with_a_gpu_leaves_cuda_alone(monkeypatch):
    """The Transformers door saves every generator's state: CUDA's only once the job has
    initialised CUDA (reading them creates a context), and CUDA's as a load template when the
    checkpoint holds them."""
    from asyncckpt.doors.rng import rng_state

    def touched(*args, **kwargs):
        raise AssertionError("a CPU-only job touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("init", "_lazy_init", "get_rng_state", "get_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, touched)
    assert set(rng_state()) == {"python", "python_gauss", "numpy", "numpy_gauss", "cpu"}

    device_states = [torch.full((16,), 1, dtype=torch.uint8), torch.full((16,), 2, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: device_states)
    assert torch.equal(rng_state(cuda=True)["cuda"], torch.stack(device_states))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a job on the GPU
    assert torch.equal(rng_state()["cuda"], torch.stack(device_states))


# GPU ---------------------------------------------------------------------------------------------
def cuda_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(32, 64, device="cuda")).pow(2).mean().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "big": torch.randn(3 * MiB, device="cuda"),  # 12 MiB
        "cpu": torch.arange(100.0),
        "meta": {"step": 1},
    }


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("io", ["thread", "process"])
def test_cuda_round_trip_and_repeated_saves_send_only_the_key(ckpt_root, io):
    state = cuda_state()
    reports = []
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(io=io, io_workers=3)) as ckpt:
        for step in range(3):
            with torch.no_grad():
                state["big"].add_(1.0)
            expected = to_cpu(clone_state(state))
            ckpt.schedule_save(state, step=step)
            reports += ckpt.finalize(blocking=True)
    assert reports[0].tensors_sent > 0
    assert all(r.tensors_sent == 0 and r.cache_hit for r in reports[1:]), reports
    target = zeros_like_state(expected)
    dcp.load(target, checkpoint_id=step_path(ckpt_root, 2), no_dist=True)
    assert_state_equal(target, expected)
    gpu_target = zeros_like_state(clone_state(state))  # tensors on the GPU: DCP copies into them
    load(gpu_target, step_path(ckpt_root, 2))
    assert_state_equal(to_cpu(gpu_target), expected)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("staging", ["eager", "lazy"])
def test_cuda_mutation_after_staging_does_not_reach_the_checkpoint(ckpt_root, staging):
    state = cuda_state()
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(staging=staging)) as ckpt:
        for step in range(3):
            with torch.no_grad():
                state["big"].fill_(float(step))  # queued on the current stream just before the save
            expected = to_cpu(clone_state(state))
            ckpt.schedule_save(state, step=step)
            ckpt.wait_staged()
            with torch.no_grad():  # right away, while the worker writes
                for tensor in (state["big"], *state["model"].values()):
                    tensor.add_(1000.0)
            ckpt.finalize(blocking=True)
            target = zeros_like_state(expected)
            load(target, step_path(ckpt_root, step))
            assert_state_equal(target, expected)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("io", ["thread", "process"])
def test_cuda_budget_streams_a_large_gpu_tensor_and_matches_unbudgeted_files(tmp_path, io):
    state = cuda_state()
    expected = to_cpu(clone_state(state))
    contents = {}
    for name, budget in (("whole", None), ("budget", 2 * MiB)):
        root = str(tmp_path / name)
        with AsyncCheckpointer(root, CheckpointConfig(io=io, staging_budget_bytes=budget)) as ckpt:
            ckpt.schedule_save(state, step=1)
            ckpt.finalize(blocking=True)
        contents[name] = {os.path.basename(p): open(p, "rb").read() for p in glob.glob(os.path.join(step_path(root, 1), "__0_*"))}
        target = zeros_like_state(expected)
        load(target, step_path(root, 1), verify=True)
        assert_state_equal(target, expected)
    assert contents["whole"] == contents["budget"]


@pytest.mark.cuda
@needs_cuda
def test_cuda_safetensors_round_trip(ckpt_root):
    state = cuda_state()
    expected = to_cpu(clone_state(state))
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(format="safetensors", io="process")) as ckpt:
        ckpt.schedule_save(state, step=1)
        ckpt.finalize(blocking=True)
    target = zeros_like_state(expected)
    load(target, step_path(ckpt_root, 1))
    assert_state_equal(target, expected)


@pytest.mark.cuda
@needs_cuda
def test_a_subclass_copy_on_the_gpu_is_freed_once_staged(ckpt_root):
    """A wrapper subclass's values are copied on the device for each save; that copy must go once
    the worker staged it, not live on (+1x those tensors' GPU memory) until the next save."""
    from save.test_subclasses import Wrapper

    state = {"w": Wrapper(torch.randn(16 * MiB, device="cuda")), "b": torch.ones(8, device="cuda")}
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.schedule_save(state, step=0)
        ckpt.finalize(blocking=True)
        baseline = torch.cuda.memory_allocated()
        ckpt.schedule_save(state, step=1)  # eager: returns once staged
        assert torch.cuda.memory_allocated() == baseline, "the save's device copy outlived its staging"
        ckpt.finalize(blocking=True)
    target = {"w": torch.zeros(16 * MiB), "b": torch.zeros(8)}
    load(target, step_path(ckpt_root, 1))
    assert torch.equal(target["w"], state["w"].inner.cpu())


# a trainer in its own process: what it prints at exit, and the allocator it starts with ------------
TRAINER = r"""
import sys, torch
from asyncckpt import AsyncCheckpointer, load
root, close = sys.argv[1], sys.argv[2] == "close"
state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(1000, device="cuda")}
ckpt = AsyncCheckpointer(root)
for step in range(3):
    if step == 1:
        state["w"] = torch.randn(1 << 20, device="cuda")  # reallocated: the old block was held by the worker
    expected = {k: v.cpu() for k, v in state.items()}
    ckpt.schedule_save(state, step=step)
    for v in state.values():
        v.add_(100.0)  # right after staging
    ckpt.finalize(blocking=True)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load(target, f"{root}/step_{step:08d}")
    assert all(torch.equal(target[k].cpu(), expected[k]) for k in state), step
# torch warns at exit about every CUDA tensor ever shared that is still alive at shutdown, even
# once the worker let go of it (measured on an H200, docs/guarantees.md "Limits"): a script that
# drops its state before it ends must get no warning, with or without close()
del state, expected, target
if close:
    ckpt.close()
print("trainer done")
"""


def run_trainer(tmp_path, *args: str, env: dict | None = None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", TRAINER, str(tmp_path / "ckpt"), *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("ending", ["close", "exit"])
def test_the_worker_lets_go_of_cuda_tensors_before_the_trainer_exits(tmp_path, ending):
    """No "Producer process has been terminated before all shared CUDA tensors released" at exit,
    whether the script closes the checkpointer or leaves it to the exit handler, after a tensor
    the worker held was reallocated: the worker released every handle, and the checkpointer keeps
    none of the trainer's tensors once closed."""
    done = run_trainer(tmp_path, ending)
    assert done.returncode == 0 and "trainer done" in done.stdout, done.stdout + done.stderr
    assert "Producer process has been terminated" not in done.stderr, done.stderr


@pytest.mark.cuda
@needs_cuda
def test_saves_are_consistent_with_expandable_segments(tmp_path):
    """torchtitan's allocator setting (expandable_segments) exports memory differently over IPC."""
    done = run_trainer(tmp_path, "close", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert done.returncode == 0 and "trainer done" in done.stdout, done.stdout + done.stderr


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")


@pytest.mark.cuda
@needs_two_gpus
def test_tensors_on_another_device_than_the_current_one_are_copied_on_their_own(tmp_path):
    """The checkpointer is built while device 0 is current (before set_device, as a door's commit
    thread does); the state lives on device 1, and on both. Each is copied on its device's
    stream and synchronized before "staged": values changed right after the call never leak in."""
    with AsyncCheckpointer(str(tmp_path / "ckpt")) as ckpt:
        torch.cuda.set_device(1)
        try:
            state = {"on1": torch.randn(4 * MiB, device="cuda:1"), "on0": torch.randn(MiB, device="cuda:0")}
            for step in range(2):
                with torch.no_grad():
                    state["on1"].fill_(float(step))  # queued on device 1's stream just before the save
                expected = to_cpu(clone_state(state))
                ckpt.schedule_save(state, step=step)
                for tensor in state.values():
                    tensor.add_(1000.0)
                ckpt.finalize(blocking=True)
                target = zeros_like_state(expected)
                load(target, step_path(str(tmp_path / "ckpt"), step))
                assert_state_equal(target, expected)
        finally:
            torch.cuda.set_device(0)
