"""Lazy staging: schedule_save returns at once; `guard(optimizer)` makes optimizer.step() wait for
the worker's copy, so a loop that mutates only through the optimizer always saves the values of
the scheduled step.

Without the guard, not mutating before `wait_staged()` is the caller's responsibility (documented
in CheckpointConfig.staging): the tests below pause the worker (SIGSTOP) to make the window
deterministic and show both the leak and the fix.
"""

from __future__ import annotations

import os
import signal
import threading

import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig, load
from conftest import assert_state_equal, call_when_waiting, clone_state, make_model_and_optimizer, make_state, step_path, train_step, zeros_like_state



class paused_worker:
    """Stop the worker process now. With `until_waited`, it goes on as soon as this thread is
    blocked in `wait_staged` (from a helper thread, so the blocked call is released): whatever
    ran before that wait ran while the worker provably had not copied anything. Otherwise it
    goes on at exit."""

    def __init__(self, pid: int, until_waited: bool = False) -> None:
        self.pid, self.until_waited, self.helper = pid, until_waited, None
        self.done = threading.Event()

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)
        if self.until_waited:
            resume = lambda: os.kill(self.pid, signal.SIGCONT)
            self.helper = call_when_waiting(threading.get_ident(), "wait_staged", resume, stop=self.done)
        return self

    @property
    def waited(self) -> bool:  # the block reached wait_staged while the worker was stopped
        return self.helper is not None and self.helper.saw

    def __exit__(self, *exc):
        self.done.set()  # (a block that never waited ends here, not at the helper's timeout)
        if self.helper is not None:
            self.helper.join()
        os.kill(self.pid, signal.SIGCONT)
        return False


def test_guarded_optimizer_saves_the_scheduled_step_on_every_save(ckpt_root):
    model, optimizer = make_model_and_optimizer()
    expected = {}
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(staging="lazy")) as ckpt:
        hook = ckpt.guard(optimizer)
        for step in range(20):
            if step % 2 == 0:
                state = make_state(model, optimizer, step)
                expected[step] = clone_state(state)
                if step >= 4:  # the worker is paused: the next optimizer.step() must wait for it
                    ckpt.finalize(blocking=True)
                    with paused_worker(ckpt.worker_pid, until_waited=True):
                        ckpt.schedule_save(state, step=step)
                        train_step(model, optimizer)
                    continue
                ckpt.schedule_save(state, step=step)
            train_step(model, optimizer)  # forward, backward and the guarded optimizer.step()
            ckpt.finalize()
        hook.remove()
    assert len(expected) == 10
    for step, values in expected.items():
        target = zeros_like_state(values)
        load(target, step_path(ckpt_root, step))
        assert_state_equal(target, values)


def test_unguarded_mutation_before_wait_staged_leaks_and_wait_staged_first_prevents_it(ckpt_root):
    state = {"w": torch.arange(4096.0), "b": torch.ones(16)}
    original = clone_state(state)
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(staging="lazy")) as ckpt:
        ckpt.schedule_save(state, step=0)
        ckpt.finalize(blocking=True)

        # caller's mistake: mutates while the worker has not copied yet -> the later value is saved
        with paused_worker(ckpt.worker_pid):
            ckpt.schedule_save(state, step=1)
            with torch.no_grad():
                state["w"].add_(1000.0)
        ckpt.finalize(blocking=True)
        leaked = clone_state(state)
        with torch.no_grad():
            state["w"].sub_(1000.0)

        # the documented contract: wait_staged() before the mutation
        with paused_worker(ckpt.worker_pid, until_waited=True):
            ckpt.schedule_save(state, step=2)
            ckpt.wait_staged()
            with torch.no_grad():
                state["w"].add_(1000.0)
        ckpt.finalize(blocking=True)

    for step, values in ((0, original), (1, leaked), (2, original)):
        target = zeros_like_state(values)
        load(target, step_path(ckpt_root, step))
        assert_state_equal(target, values)


def test_a_guarded_module_keeps_batchnorm_statistics_of_the_scheduled_step(ckpt_root):
    """BatchNorm's running statistics change in the next forward, before any optimizer.step():
    guarding the module makes that forward wait for the worker's copy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with AsyncCheckpointer(ckpt_root, CheckpointConfig(staging="lazy")) as ckpt:
        handles = ckpt.guard(model, optimizer)
        ckpt.schedule_save({"model": model.state_dict()}, step=0)  # the worker is up and holds the model:
        ckpt.finalize(blocking=True)  # the next save is staged lazily (a first save would be a private copy)
        model(torch.randn(4, 8))
        expected = clone_state(model.state_dict())
        with paused_worker(ckpt.worker_pid, until_waited=True) as paused:
            ckpt.schedule_save({"model": model.state_dict()}, step=1)
            model(torch.randn(4, 8))  # updates running_mean / running_var / num_batches_tracked
        assert paused.waited  # the forward waited for the worker's copy
        ckpt.finalize(blocking=True)
        handles.remove()
    assert not torch.equal(model.state_dict()["1.running_mean"], expected["1.running_mean"])
    target = {"model": zeros_like_state(expected)}
    load(target, step_path(ckpt_root, 1))
    assert_state_equal(target["model"], expected)
