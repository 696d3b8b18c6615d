"""A loop whose step never ends after a preemption signal, driven by tests/save/test_preemption.py.

argv: root, grace_s, kind ("disk": step 2 is a disk save whose writes may still be under way;
"memory": step 2 is memory-only), memory_dir, [rank world_size store_path] (several ranks: gloo
through a FileStore). It saves step 1, then step 2, prints `STAGED 2`, changes the state, and
sleeps: it never calls finalize() or close() again. The checkpointer must close for it within
grace_s (preemption.py) and the process must end with 143.
"""

import signal
import sys
import time

import torch
import torch.distributed as dist

from asyncckpt import AsyncCheckpointer, CheckpointConfig

root, grace_s, kind, memory_dir = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
rank = 0
if len(sys.argv) > 5:
    rank, world_size, store_path = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
config = CheckpointConfig(preemption_signals=(signal.SIGTERM,), grace_s=grace_s, worker_nice=None, worker_ionice=None,
                          memory_tier=kind == "memory", memory_dir=memory_dir, timeout_s=60)
ckpt = AsyncCheckpointer(root, config)
state = {f"w{rank}": {f"t{i}": torch.full((512 * 1024,), 1.0) for i in range(8)}, "step": 1}  # 16 MiB a rank
ckpt.schedule_save(state, step=1)
ckpt.finalize(blocking=True)
for tensor in state[f"w{rank}"].values():
    tensor.fill_(2.0)
state["step"] = 2
ckpt.schedule_save(state, step=2, memory_only=kind == "memory")
for tensor in state[f"w{rank}"].values():  # what is saved is the copy staged at step 2
    tensor.fill_(3.0)
state["step"] = 3
print("STAGED 2", flush=True)
while True:  # a step that never ends (a hang in a training collective, say)
    time.sleep(1)
