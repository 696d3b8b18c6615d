"""A bounded ring of reused host buffers between the reading threads and a copy step.

Bytes that cannot be read straight into their target (a CUDA tensor, a resharded or converted
CPU tensor) are read into a slot of the ring, checksummed there, and handed to the copy step,
which copies them into the target and returns a fence; the slot is reused once its fence is
done. The reading threads go on filling the other slots meanwhile, so reads overlap copies and
the host memory stays bounded by the ring (plus, for a piece larger than a slot, one buffer of
its own at a time: see `Ring.acquire`).

Two copy steps, one pipeline: `CudaCopy` (pinned slots, copies on a side stream per device, a
CUDA event per slot) for loads with CUDA targets, `HostCopy` (plain slots, copies in order on one
thread) for everything else. A CPU-only load never touches CUDA. `CudaCopy` takes its CUDA API as
an argument, so CPU tests run its code with a stand-in.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional

import torch

from ..errors import PartialLoadError

SLOT_BYTES = 16 << 20  # fastsafetensors reads in 16 MiB slices too
DEVICE_RING_BYTES = 256 << 20  # default ring for CUDA targets (pinned): 16 slots
MIN_RING_BYTES = 8 << 10
COPY_TIMEOUT_S = 300.0  # a copy that has not finished by then is reported, not waited for
CopyInto = Callable[[torch.Tensor, bool], None]  # (host bytes, non_blocking): copy them into the target


class LoadCancelled(Exception):
    """The load failed elsewhere: a reading thread waiting for a slot stops."""


class Fence(ABC):
    """When a queued copy has finished reading its slot."""

    @abstractmethod
    def wait(self, deadline: float) -> None:
        """Return once the copy finished; PartialLoadError if it failed or is not done by `deadline`."""


class CopyStep(ABC):
    """Copies a slot's bytes into a target; pluggable so that CPU tests run the device pipeline."""

    @abstractmethod
    def buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of `nbytes` (uint8) for a slot."""

    @abstractmethod
    def copy(self, copy_into: CopyInto, host: torch.Tensor, device: torch.device, what: str) -> Fence:
        """Queue `copy_into(host, ...)`; the fence says when `host` may be reused."""

    def close(self) -> None:
        """Every queued copy has been waited for: release what the step holds."""


class _FutureFence(Fence):
    def __init__(self, future: Future, what: str) -> None:
        self.future, self.what = future, what

    def wait(self, deadline: float) -> None:
        try:
            self.future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise PartialLoadError(f"{self.what}: copy into the target not done after {COPY_TIMEOUT_S:.0f} s") from None
        except Exception as exc:
            raise PartialLoadError(f"{self.what}: copy into the target failed: {type(exc).__name__}: {exc}") from exc


class HostCopy(CopyStep):
    """Plain host buffers; copies run in order on one thread of their own (the host's "stream")."""

    def __init__(self) -> None:
        self._stream = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncckpt-load-copy")

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, copy_into: CopyInto, host: torch.Tensor, device: torch.device, what: str) -> Fence:
        return _FutureFence(self._stream.submit(copy_into, host, False), what)

    def close(self) -> None:
        self._stream.shutdown(wait=True)


class _EventFence(Fence):
    def __init__(self, event: Any, what: str) -> None:
        self.event, self.what = event, what

    def wait(self, deadline: float) -> None:
        while not self.event.query():  # polled, not event.synchronize(): the wait stays bounded
            if time.monotonic() > deadline:
                raise PartialLoadError(f"{self.what}: copy to the device not done after {COPY_TIMEOUT_S:.0f} s")
            time.sleep(0.0002)


class CudaCopy(CopyStep):
    """Pinned slots; host-to-device copies on one side stream per device, each followed by an
    event that frees its slot. The side streams are made by the caller's thread when the step is
    built, each first waiting for the caller's current stream on its device, so copies land after
    whatever the caller queued on its targets. The reading threads that later queue the copies
    have streams of their own (CUDA's current stream is per thread): they only ever use these.
    `cuda` is `torch.cuda` (a stand-in in CPU tests); `pin=False` allocates plain buffers (CPU tests)."""

    def __init__(self, devices: Iterable[torch.device], cuda: Any = torch.cuda, pin: bool = True) -> None:
        self.cuda, self.pin = cuda, pin
        self._streams: dict[Optional[torch.device], Any] = {}
        for device in map(_stream_key, devices):
            if device not in self._streams:
                stream = cuda.Stream(device=device)
                stream.wait_stream(cuda.current_stream(device))
                self._streams[device] = stream

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)  # torch's host allocator caches pinned blocks

    def copy(self, copy_into: CopyInto, host: torch.Tensor, device: torch.device, what: str) -> Fence:
        stream = self._streams.get(_stream_key(device))
        if stream is None:
            raise PartialLoadError(f"{what}: its target is on {device}, not on a device the load was set up for")
        with self.cuda.stream(stream):  # also makes the stream's device current in this thread
            copy_into(host, True)
            event = self.cuda.Event()
            event.record(stream)
        return _EventFence(event, what)


def _stream_key(device: torch.device) -> Optional[torch.device]:
    """A CUDA device has its own side stream; host targets of a load with CUDA ones share the
    current device's (their copies are synchronous: the stream only orders the event)."""
    return device if device.type == "cuda" else None


class Ring:
    """At most `slots` buffers of `slot_bytes`, created as needed and reused. `acquire` hands a
    free slot, or waits for the oldest copy in flight (copies finish in order) to free one."""

    def __init__(self, step: CopyStep, ring_bytes: int) -> None:
        self.step = step
        self.slot_bytes = min(SLOT_BYTES, ring_bytes // 2)
        self.slots = max(2, ring_bytes // self.slot_bytes)
        self._free: list[torch.Tensor] = []
        self._in_flight: deque[tuple[torch.Tensor, Fence]] = deque()
        self._created = 0
        self._cond = threading.Condition()
        self._cancelled = False
        self._oversize = threading.Lock()  # one buffer beyond the ring at a time

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes`: a slot, or (a piece larger than a slot) a buffer of its
        own, one at a time. LoadCancelled once `cancel` was called."""
        if nbytes > self.slot_bytes:
            while not self._oversize.acquire(timeout=0.05):
                self._check_cancelled()
            return self.step.buffer(nbytes)
        while True:
            with self._cond:
                self._check_cancelled()
                if self._free:
                    return self._free.pop()
                if self._created < self.slots:
                    self._created += 1
                    return self.step.buffer(self.slot_bytes)
                if not self._in_flight:  # every slot is being read into: one will come back
                    self._cond.wait(0.05)
                    continue
                buffer, fence = self._in_flight.popleft()
            try:
                fence.wait(time.monotonic() + COPY_TIMEOUT_S)
            except BaseException:
                self.release(buffer)
                raise
            return buffer

    def submit(self, buffer: torch.Tensor, copy_into: CopyInto, device: torch.device, what: str) -> None:
        """Queue the copy of `buffer`'s bytes; the buffer comes back once it finished."""
        try:
            fence = self.step.copy(copy_into, buffer, device, what)
        except Exception as exc:
            self.release(buffer)
            raise PartialLoadError(f"{what}: copy into the target failed: {type(exc).__name__}: {exc}") from exc
        if buffer.numel() > self.slot_bytes:
            fence.wait(time.monotonic() + COPY_TIMEOUT_S)  # a buffer of its own: freed once copied
            self.release(buffer)
            return
        with self._cond:
            self._in_flight.append((buffer, fence))
            self._cond.notify()

    def release(self, buffer: torch.Tensor) -> None:
        """Give back a buffer nothing was queued from (read only for its checksum, or a failed read)."""
        if buffer.numel() > self.slot_bytes:
            self._oversize.release()
            return
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()

    def cancel(self) -> None:
        """Make every waiting and later `acquire` raise LoadCancelled."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def drain(self) -> Optional[PartialLoadError]:
        """Wait for every copy in flight (none may still read a slot, nor write a target, once
        the load returns or raises) and close the step; the first copy error, if any."""
        error = None
        with self._cond:
            in_flight, self._in_flight = list(self._in_flight), deque()
        deadline = time.monotonic() + COPY_TIMEOUT_S
        for buffer, fence in in_flight:
            try:
                fence.wait(deadline)
            except PartialLoadError as exc:
                error = error or exc
            self._free.append(buffer)
        self.step.close()
        return error

    def _check_cancelled(self) -> None:
        if self._cancelled:
            raise LoadCancelled()


def check_ring_bytes(ring_bytes: Optional[int]) -> int:
    """`ring_bytes` as `load` takes it (None: the default), refused unless it holds two slots of 4 KiB."""
    if ring_bytes is None:
        return DEVICE_RING_BYTES
    if not isinstance(ring_bytes, int) or isinstance(ring_bytes, bool) or ring_bytes < MIN_RING_BYTES:
        raise ValueError(f"ring_bytes must be an int of at least {MIN_RING_BYTES} (two 4 KiB slots), not {ring_bytes!r}")
    return ring_bytes


def copy_step_for(targets: list[torch.Tensor]) -> CopyStep:
    """CudaCopy when a target is a CUDA tensor (known from its device: no CUDA call), else
    HostCopy. Called in the caller's thread: CudaCopy takes that thread's current streams."""
    devices = {t.device for t in targets}
    return CudaCopy(devices) if any(d.type == "cuda" for d in devices) else HostCopy()
