"""The ranks of a job and the few collectives asyncckpt issues, counted.

Every agreement carries a per-checkpointer call counter, so ranks that called schedule_save or
finalize a different number of times get a CheckpointError instead of a silent mismatch.
Without a `process_group` the collectives run on a gloo group of their own whose timeout follows
`timeout_s` and `worker_start_timeout_s`, so a rank that died or stopped calling fails the others
within that bound instead of holding them for the default group's timeout (and an NCCL-only job
needs no extra group).
A collective that failed leaves the group unusable: later calls raise at once.
With one process (no process group) every collective is a local no-op.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..config import CheckpointConfig, hand_off_bound_s
from ..errors import CheckpointError


_CALL_KINDS = {"schedule_save": 1, "finalize": 2, "prepare": 3, "persist": 4}


def collective_timeout_s(config: CheckpointConfig) -> float:
    """How long a rank waits for the others in one collective. Longer than the longest wait a
    healthy rank does on its own worker between two collectives (a blocking finalize on a fresh
    worker: its start-up, then Staged and the writes, each up to `timeout_s`), plus a margin, so
    a rank whose own wait ran out reaches the collective and reports its cause."""
    return config.worker_start_timeout_s + 2 * config.timeout_s + 10.0


def finalize_bound_s(config: CheckpointConfig, to_starting_worker: bool) -> float:
    """How long a blocking finalize whose own rank is done waits for the others: a healthy rank
    needs at most `timeout_s` for Staged and `timeout_s` for its writes, after its worker's
    start-up when the save went to a worker still starting (the ranks start theirs together)."""
    return (hand_off_bound_s(config) if to_starting_worker else config.timeout_s) + config.timeout_s


class RankGroup:
    def __init__(
        self, process_group: Optional[Any] = None, config: Optional[CheckpointConfig] = None, no_dist: bool = False
    ) -> None:
        """`no_dist`: this process saves on its own (e.g. Lightning calls its CheckpointIO on rank 0
        only) even inside a distributed job: no collective, no group of its own."""
        if no_dist and process_group is not None:
            raise CheckpointError("no_dist=True saves without collectives; it cannot be combined with a process_group")
        self.distributed = not no_dist and dist.is_available() and dist.is_initialized()
        if process_group is not None and not self.distributed:
            raise CheckpointError("a process_group was given but torch.distributed is not initialized")
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.size = dist.get_world_size(process_group) if self.distributed else 1
        self.collectives = 0  # issued so far (a debug figure in every SaveReport)
        self._agreements = 0
        self._broken: Optional[str] = None
        self.signalled: Callable[[], bool] = lambda: False  # this rank got a preemption signal (preemption.py)
        self.on_preempted: Callable[[], None] = lambda: None  # an agreement said a rank got one: every rank learns it at the same call
        if self.size > 1 and process_group is not None:
            backend = str(dist.get_backend(process_group))
            if "gloo" not in backend:
                raise CheckpointError(
                    f"process group backend {backend!r} cannot carry asyncckpt's CPU collectives; "
                    "pass a gloo group, e.g. process_group=dist.new_group(backend='gloo')"
                )
        elif self.size > 1:  # every rank constructs its checkpointer, so every rank creates this
            timeout = timedelta(seconds=collective_timeout_s(config or CheckpointConfig()))
            process_group = dist.new_group(backend="gloo", timeout=timeout)
        self.pg = process_group
        self._coordinator = dist.get_global_rank(process_group, 0) if self.distributed and process_group else 0

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def agree(self, flags: Sequence[int], what: str, step: int) -> list[int]:
        """All-reduce MAX of small integers (one collective), checking every rank is at the same
        call (count), of the same kind, for the same step. Returns each flag's maximum."""
        self._agreements += 1
        if self.size == 1:
            return list(flags)
        kind = _CALL_KINDS[what]
        ident = (self._agreements, kind, step)
        values = torch.tensor([v for x in ident for v in (x, -x)] + list(flags) + [int(self.signalled())],
                              dtype=torch.int64)  # (the preemption flag rides along: no collective of its own)
        self._run(what, lambda: dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.pg))
        highs, lows = values[0:6:2].tolist(), [-v for v in values[1:6:2].tolist()]
        if highs != lows:
            raise CheckpointError(
                f"rank {self.rank}: ranks disagree at {what} of step {step} (calls {lows[0]}..{highs[0]}, "
                f"steps {lows[2]}..{highs[2]}); all ranks must call prepare, schedule_save and finalize at "
                "the same points with the same step"
            )
        if values[-1]:
            self.on_preempted()
        return [int(v) for v in values[6:-1]]

    def agree_finished(self, pending: bool, blocking: bool, step: int, bound_s: float) -> tuple[bool, bool]:
        """Whether any rank's save is still pending, and whether a rank gave up waiting for it.
        Blocking (this rank is done then), poll the others, one agreement per poll, until none
        is pending or `bound_s` passed: then this rank says it gives up, and every rank learns
        so from the same agreement (a rank still pending then fails its save)."""
        pending_any, gave_up = self.agree([int(pending), 0], "finalize", step)
        deadline = time.monotonic() + bound_s
        while pending_any and not gave_up and blocking:
            time.sleep(0.05)
            pending_any, gave_up = self.agree([0, int(time.monotonic() > deadline)], "finalize", step)
        return bool(pending_any), bool(gave_up)

    def gather(self, obj: Any) -> Optional[list[Any]]:
        """Objects of every rank on the coordinator (None elsewhere)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.is_coordinator else None
        self._run("gather", lambda: dist.gather_object(obj, out, dst=self._coordinator, group=self.pg))
        return out

    def scatter(self, objs: Optional[list[Any]]) -> Any:
        """The coordinator's objs[rank] on every rank."""
        if self.size == 1:
            return objs[0]
        out = [None]
        mine = objs if self.is_coordinator else None
        self._run("scatter", lambda: dist.scatter_object_list(out, mine, src=self._coordinator, group=self.pg))
        return out[0]

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's obj on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        self._run("broadcast", lambda: dist.broadcast_object_list(box, src=self._coordinator, group=self.pg))
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        self._run("all_gather", lambda: dist.all_gather_object(out, obj, group=self.pg))
        return out

    def _run(self, what: str, collective: Callable[[], Any]) -> None:
        """Issue one collective. A failure (a rank died, or did not call within the group's
        timeout) becomes a CheckpointError, and every later collective refuses at once: the
        ranks no longer agree on where they are."""
        if self._broken is not None:
            raise CheckpointError(f"rank {self.rank}: no collectives after an earlier failure ({self._broken})")
        self.collectives += 1
        try:
            collective()
        except RuntimeError as exc:  # gloo's DistBackendError and its timeouts are RuntimeErrors
            self._broken = f"{what} collective failed: {exc}"
            raise CheckpointError(
                f"rank {self.rank}: {self._broken}. Another rank died or did not reach {what} in time "
                "(all ranks must call schedule_save and finalize at the same points); this checkpointer "
                "cannot save any more: restart the job"
            ) from exc
