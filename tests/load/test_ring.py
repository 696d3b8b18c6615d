"""The pipeline that loads into CUDA tensors (ring.py), run on CPU: the same reading threads, ring
of slots, fences and copy step, with the device copy done on the host. Every tensor goes through
the ring here (reader.in_host_memory says no target may be read into directly), through
`CudaCopy` driven by a stand-in for torch.cuda, or through a slowed `HostCopy`: slots reused
only after their copy finished, pieces of items larger than the ring, a checksum failure or a
failed copy mid-stream (PartialLoadError, later reads cancelled), and a CPU-only load that never
touches CUDA."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import asyncckpt.loading.reader as reader
import asyncckpt.loading.ring as ring
from asyncckpt import PartialLoadError, load
from conftest import damaged_copy, saved_step_one

SMALL_RING = 16 << 10  # two 8 KiB slots: every tensor below is several pieces


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(300, 512, generator=g),  # 600 KiB: 75 pieces of a slot
        "wide": torch.randn(2, 6000, generator=g),  # a row of 24 KB: larger than a slot of the small ring
        "half": torch.randn(40, 33, generator=g).bfloat16(),
        "ints": torch.randint(0, 1 << 30, (17,), generator=g),
        "scalar": torch.tensor(2.5),
        "step": 7,
    }


def zeros(source: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in source.items()}


def assert_equal(target: dict, source: dict) -> None:
    for key, value in source.items():
        if isinstance(value, torch.Tensor):
            assert target[key].dtype == value.dtype and torch.equal(target[key], value), key
        else:
            assert target[key] == value, key


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    return saved_step_one(str(tmp_path_factory.mktemp("ring")), state())


class StandInCuda:
    """What CudaCopy uses of torch.cuda, on the host: copies run as they are queued; an event
    is done a few queries after it was recorded (so slots wait on real fences)."""

    def __init__(self) -> None:
        self.streams, self.events, self.waited_for = [], [], []
        self.lock = threading.Lock()
        outer = self

        class Stream:
            def __init__(self, device=None) -> None:
                outer.streams.append(self)

            def wait_stream(self, other) -> None:
                outer.waited_for.append(other)

        class Event:
            def __init__(self) -> None:
                self.recorded_on, self.queries = None, 0
                with outer.lock:
                    outer.events.append(self)

            def record(self, stream) -> None:
                self.recorded_on = stream

            def query(self) -> bool:
                self.queries += 1
                return self.recorded_on is not None and self.queries > 2

        self.Stream, self.Event = Stream, Event

    def current_stream(self, device=None):
        """As in CUDA, each thread has a current stream of its own."""
        return f"the current stream of {threading.current_thread().name}"

    def stream(self, stream):
        assert stream in self.streams
        return torch.autograd.profiler.record_function("stand-in stream")  # any context manager


@pytest.fixture
def through_the_ring(monkeypatch):
    """Every tensor goes through the ring."""
    monkeypatch.setattr(reader, "in_host_memory", lambda target: False)
    created = []
    real = ring.Ring.__init__

    def counting_init(self, step, ring_bytes):
        real(self, step, ring_bytes)
        created.append(self)

    monkeypatch.setattr(ring.Ring, "__init__", counting_init)
    return created


def test_the_device_pipeline_loads_bitwise_through_a_ring_smaller_than_one_item(saved, through_the_ring, monkeypatch):
    cuda = StandInCuda()
    monkeypatch.setattr(reader, "copy_step_for", lambda targets: ring.CudaCopy({t.device for t in targets}, cuda, pin=False))
    buffers = []
    real_buffer = ring.CudaCopy.buffer
    monkeypatch.setattr(ring.CudaCopy, "buffer", lambda self, n: buffers.append(n) or real_buffer(self, n))
    source, target = state(), zeros(state())
    target["wide"] = torch.zeros(2, 6000, dtype=torch.float64)  # converted: through the ring a row at a time
    load(target, saved, no_dist=True, ring_bytes=SMALL_RING)
    assert torch.equal(target.pop("wide"), source.pop("wide").double())
    assert_equal(target, source)
    used = through_the_ring[-1]  # (the first read only the objects)
    slots = [n for n in buffers if n == used.slot_bytes]
    assert used.slot_bytes == 8 << 10 and len(slots) <= used.slots  # the ring never grew past its slots
    assert sorted(set(buffers) - {used.slot_bytes}) == [24000]  # "wide": one row at a time, in a buffer of its own
    assert len(cuda.events) > 600 // 8  # an event per piece copied
    # one side stream, ordered after the caller's current stream, not a reading thread's (#41 item 5)
    assert cuda.waited_for == [f"the current stream of {threading.current_thread().name}"]
    assert len(cuda.streams) == 1


class SlowHostCopy(ring.HostCopy):
    """Copies that finish late: a slot reused before its copy ended would corrupt the target."""

    copies = 0

    def copy(self, copy_into, host, device, what):
        def late(host, non_blocking):
            time.sleep(0.002)
            SlowHostCopy.copies += 1
            copy_into(host, non_blocking)

        return super().copy(late, host, device, what)


def test_slots_are_reused_only_once_their_copy_finished(saved, through_the_ring, monkeypatch):
    monkeypatch.setattr(reader, "copy_step_for", lambda targets: SlowHostCopy())
    SlowHostCopy.copies = 0
    source, target = state(), zeros(state())
    load(target, saved, no_dist=True, ring_bytes=SMALL_RING)
    assert_equal(target, source)
    assert SlowHostCopy.copies > 600 // 8


def test_a_checksum_failure_mid_stream_raises_partial_load_error(saved, tmp_path, through_the_ring, monkeypatch):
    cuda = StandInCuda()
    monkeypatch.setattr(reader, "copy_step_for", lambda targets: ring.CudaCopy({t.device for t in targets}, cuda, pin=False))
    damaged = damaged_copy(saved, str(tmp_path / "damaged"), "big")  # one byte flipped mid-tensor
    with pytest.raises(PartialLoadError, match=r"big.*checksum mismatch.*PARTLY LOADED"):
        load(zeros(state()), damaged, no_dist=True, ring_bytes=SMALL_RING)


class FailingCopy(ring.HostCopy):
    """The fifth copy fails; counts the copies queued."""

    queued = 0

    def copy(self, copy_into, host, device, what):
        FailingCopy.queued += 1
        if FailingCopy.queued == 5:
            def fail(host, non_blocking):
                raise RuntimeError("device lost")

            return super().copy(fail, host, device, what)
        return super().copy(copy_into, host, device, what)


def test_a_failed_copy_stops_the_load_naming_the_item(saved, through_the_ring, monkeypatch):
    """The error names the item whose copy failed; the reads still waiting for a slot are
    cancelled rather than read through."""
    monkeypatch.setattr(reader, "copy_step_for", lambda targets: FailingCopy())
    FailingCopy.queued = 0
    with pytest.raises(PartialLoadError, match=r"copy into the target failed: RuntimeError: device lost.*PARTLY LOADED"):
        load(zeros(state()), saved, no_dist=True, ring_bytes=SMALL_RING)
    assert FailingCopy.queued < 600 // 8  # "big" alone is 75 pieces: most were never read


def test_ring_bytes_too_small_is_refused_before_anything_is_read(saved):
    target = zeros(state())
    with pytest.raises(ValueError, match="ring_bytes must be an int of at least 8192"):
        load(target, saved, no_dist=True, ring_bytes=4096)
    assert torch.equal(target["big"], torch.zeros(300, 512))


def test_a_cpu_load_through_the_ring_never_touches_cuda(saved, monkeypatch):
    """Targets that need the ring (another dtype, a transposed view) with CUDA "available":
    host copies only, no CUDA call."""

    def touched(*args, **kwargs):
        raise AssertionError("a CPU-only load touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("Stream", "Event", "current_stream", "stream", "init", "_lazy_init", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, touched)
    source = state()
    target = zeros(source)
    target["big"] = torch.zeros(512, 300).t()
    target["half"] = torch.zeros(40, 33, dtype=torch.float32)
    load(target, saved, no_dist=True, ring_bytes=SMALL_RING)
    assert torch.equal(target["big"], source["big"]) and torch.equal(target["half"], source["half"].float())
