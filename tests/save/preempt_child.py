"""A training loop with preemption_signals=(SIGTERM,), driven by tests/save/test_preemption.py.

argv: root, steps, grace_s, [rank world_size store_path] (several ranks: gloo through a FileStore,
and an all-reduce each step as a training step's). It resumes (load_latest), then each step mutates
the state to the step's values and saves every other step. It prints `STAGED n` when it sees `ckpt.preempted`:
the newest step whose schedule_save had returned (the resumed one when none had), then closes and
leaves through requeue_exit(). Without a signal it ends after `steps` steps with status 0.
"""

import sys
import time

import torch
import torch.distributed as dist

import asyncckpt
from asyncckpt import AsyncCheckpointer, CheckpointConfig
import signal

root, steps, grace_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ranks = 1
if len(sys.argv) > 4:
    rank, ranks, store_path = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=ranks)
state = {"w": {f"t{i}": torch.zeros(512 * 1024) for i in range(8)}, "step": -1}  # 16 MiB
config = CheckpointConfig(preemption_signals=(signal.SIGTERM,), grace_s=grace_s, worker_nice=None,
                          worker_ionice=None, io_workers=2, timeout_s=60)
ckpt = AsyncCheckpointer(root, config)
print("STARTED", flush=True)  # the handler is installed
resumed = ckpt.load_latest(state)
staged = resumed if resumed is not None else -1
start = 0 if resumed is None else resumed + 1
for step in range(start, start + steps):
    if ckpt.preempted:
        print(f"STAGED {staged}", flush=True)
        try:
            ckpt.close()
        finally:
            asyncckpt.requeue_exit()
    ckpt.finalize()
    for tensor in state["w"].values():
        tensor.fill_(float(step))
    state["step"] = step
    time.sleep(0.01)  # the step's compute
    if ranks > 1:
        dist.all_reduce(torch.ones(1))  # (its collective: the ranks stay a step apart at most)
    if step % 2 == 0:
        ckpt.schedule_save(state, step=step)
        staged = step
ckpt.close()
print(f"DONE {staged}", flush=True)
