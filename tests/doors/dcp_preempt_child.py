"""A loop that saves through `dcp.async_save = asyncckpt.async_save` (as torchtitan is told to) with
`preemption_signals` configured, and never looks at any preemption flag: driven by
tests/doors/test_torch_dcp.py. argv: base folder, grace_s, saves_after_s. Saves step-1 (waits for
it), stages step-2, changes the state, prints `STAGED 2`, and loops on: from `saves_after_s` on
(0: never) it saves step-3, step-4, ... a second apart, each with its step's values."""

import signal
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

import asyncckpt
from asyncckpt import CheckpointConfig, torch_dcp

base, grace_s, saves_after_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
torch_dcp.configure(CheckpointConfig(preemption_signals=(signal.SIGTERM,), grace_s=grace_s, worker_nice=None,
                                     worker_ionice=None, timeout_s=60.0))
dcp.async_save = asyncckpt.async_save
state = {"w": torch.full((1 << 20,), 1.0)}
dcp.async_save(state, checkpoint_id=f"{base}/step-1").result()
state["w"].fill_(2.0)
dcp.async_save(state, checkpoint_id=f"{base}/step-2")
state["w"].fill_(3.0)
print("STAGED 2", flush=True)
started, step = time.monotonic(), 2
while True:  # the training loop goes on; it knows nothing of the signal
    time.sleep(0.1)
    if saves_after_s and time.monotonic() - started > saves_after_s + (step - 2):
        step += 1
        state["w"].fill_(float(step))
        dcp.async_save(state, checkpoint_id=f"{base}/step-{step}")
        print(f"STAGED {step}", flush=True)
