"""The GPU path (docs/how_it_works.md, docs/guarantees.md "Limits"): CUDA tensors reach the worker as IPC handles, are copied into a
pinned slab on a side stream, and the trainer may mutate them once staged. Tests marked `cuda`
skip without a GPU; the dequantize rule is checked on CPU too."""

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


class Scaled(torch.Tensor):
    """An FP8-style wrapper: stored values times a scale; `dequantize` gives the real values."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: float):
        wrapped = data.as_subclass(cls)
        wrapped.scale = scale
        return wrapped

    def dequantize(self):
        return self.as_subclass(torch.Tensor) * self.scale


# CPU: which tensors count as wrappers ---------------------------------------------------------
def test_parameters_are_not_mistaken_for_quantized_wrappers(ckpt_root):
    """nn.Parameter has Tensor's own `dequantize`: it must be shared once, not copied per save."""
    state = {"w": torch.nn.Parameter(torch.randn(256)), "b": torch.nn.Parameter(torch.randn(8))}
    reports = []
    with AsyncCheckpointer(ckpt_root) as ckpt:
        for step in range(2):
            with torch.no_grad():
                state["w"].add_(1.0)
            expected = clone_state(state)
            ckpt.schedule_save(state, step=step)
            reports += ckpt.finalize(blocking=True)
    assert reports[1].tensors_sent == 0 and reports[1].cache_hit, reports[1]
    target = {"w": torch.zeros(256), "b": torch.zeros(8)}
    load(target, step_path(ckpt_root, 1))
    assert torch.equal(target["w"], expected["w"].detach()) and torch.equal(target["b"], expected["b"].detach())


def test_wrapper_with_its_own_dequantize_is_stored_dequantized(ckpt_root):
    raw = torch.arange(16, dtype=torch.float32)
    with AsyncCheckpointer(ckpt_root) as ckpt:
        ckpt.schedule_save({"q": Scaled(raw, 0.5)}, step=1)
        ckpt.finalize(blocking=True)
    target = {"q": torch.zeros(16)}
    load(target, step_path(ckpt_root, 1))
    assert torch.equal(target["q"], raw * 0.5)


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
