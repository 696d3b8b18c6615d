"""Loading into CUDA tensors through the pinned ring (loading/ring.py: CudaCopy): bitwise equal,
resharded, into a DTensor, the target's dtype kept, a checksum failure mid-stream, a ring
smaller than one item. All `cuda`-marked: they skip without a GPU (tests/load/test_ring.py runs
the same pipeline on CPU)."""

from __future__ import annotations


import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import PartialLoadError, load
from conftest import damaged_copy, saved_step_one
from multirank import run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
SMALL_RING = 64 << 10  # two 32 KiB slots


def state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(1024, 1024, generator=g),  # 4 MiB: 128 pieces of the small ring
        "half": torch.randn(300, 77, generator=g).bfloat16(),
        "ints": torch.randint(0, 1 << 40, (999,), generator=g),
        "scalar": torch.tensor(2.5),
        "step": 11,
    }


def on_cuda(source: dict) -> dict:
    return {k: torch.zeros_like(v, device="cuda") if isinstance(v, torch.Tensor) else None for k, v in source.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    return saved_step_one(str(tmp_path_factory.mktemp("cuda_load")), state())


@pytest.mark.parametrize("ring_bytes", [None, SMALL_RING], ids=["default-ring", "ring-smaller-than-an-item"])
def test_loads_into_cuda_tensors_bitwise_equal(saved, ring_bytes):
    source, target = state(), on_cuda(state())
    load(target, saved, no_dist=True, ring_bytes=ring_bytes)
    for key, value in source.items():
        if isinstance(value, torch.Tensor):
            assert target[key].is_cuda and target[key].dtype == value.dtype
            assert torch.equal(target[key].cpu().view(-1).view(torch.uint8), value.view(-1).view(torch.uint8)), key
        else:
            assert target[key] == value


def test_the_targets_dtype_is_kept(saved):
    target = on_cuda(state())
    target["big"] = torch.zeros(1024, 1024, dtype=torch.float64, device="cuda")
    target["half"] = torch.zeros(300, 77, dtype=torch.float32, device="cuda")
    load(target, saved, no_dist=True, ring_bytes=SMALL_RING)
    source = state()
    assert target["big"].dtype == torch.float64 and torch.equal(target["big"].cpu(), source["big"].double())
    assert target["half"].dtype == torch.float32 and torch.equal(target["half"].cpu(), source["half"].float())


def test_copies_land_after_the_callers_stream_even_from_reading_threads(saved):
    """The caller loads inside `torch.cuda.stream(s)` with a write to a target still queued on
    `s` (behind a long kernel). The load's copies, queued by reading threads whose own current
    stream is the default one, must come after it: the loaded values win (#41 item 5)."""
    source, target = state(), on_cuda(state())
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the write below
        target["big"].fill_(-1.0)
        load(target, saved, no_dist=True, ring_bytes=SMALL_RING)
    torch.cuda.synchronize()
    assert torch.equal(target["big"].cpu(), source["big"])


def test_a_checksum_failure_mid_stream_raises_partial_load_error(saved, tmp_path):
    damaged = damaged_copy(saved, str(tmp_path / "damaged"), "big")  # one byte flipped mid-tensor
    with pytest.raises(PartialLoadError, match=r"big.*checksum mismatch.*PARTLY LOADED"):
        load(on_cuda(state()), damaged, no_dist=True, ring_bytes=SMALL_RING)


def _save_row_shards(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dcp.save({"m": distribute_tensor(torch.arange(96.0 * 64).view(96, 64), mesh, [Shard(0)])}, checkpoint_id=path)


def test_a_checkpoint_of_two_row_shards_loads_resharded_into_one_cuda_tensor(tmp_path):
    path = str(tmp_path / "sharded")
    run_ranks(_save_row_shards, 2, path)
    target = {"m": torch.zeros(96, 64, device="cuda").t().contiguous().t()}  # column-major: through row slabs
    load(target, path, no_dist=True, ring_bytes=SMALL_RING)
    assert torch.equal(target["m"].cpu(), torch.arange(96.0 * 64).view(96, 64))


def _load_into_cuda_dtensor(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (world,))
    target = {"m": distribute_tensor(torch.zeros(96, 64, device="cuda"), mesh, [Shard(1)])}
    load(target, path, ring_bytes=SMALL_RING)
    assert target["m"].to_local().is_cuda
    assert torch.equal(target["m"].full_tensor().cpu(), torch.arange(96.0 * 64).view(96, 64))


def test_a_dtensor_on_cuda_loads_from_row_shards(tmp_path):
    path = str(tmp_path / "sharded")
    run_ranks(_save_row_shards, 2, path)
    run_ranks(_load_into_cuda_dtensor, 1, path, gpus=True)
