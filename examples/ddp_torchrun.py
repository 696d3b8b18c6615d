"""Data-parallel training on CPU (gloo) with one async checkpoint per N steps, and resume.

    torchrun --nproc_per_node=2 examples/ddp_torchrun.py --root checkpoints/ddp --fresh
    torchrun --nproc_per_node=2 examples/ddp_torchrun.py --root checkpoints/ddp --steps 120

Every rank has its own checkpoint worker; replicated weights are written once (DCP's dedup);
rank 0 commits. All ranks call schedule_save and finalize at the same points.
"""

from __future__ import annotations

import argparse
import shutil

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from asyncckpt import AsyncCheckpointer, CheckpointConfig, TrainState


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="checkpoints/ddp")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.fresh and rank == 0:
        shutil.rmtree(args.root, ignore_errors=True)
    dist.barrier()

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = TrainState(model, optimizer, step=-1)  # model + optimizer + step as one DCP Stateful
    state = {"train": train}

    with AsyncCheckpointer(args.root, CheckpointConfig(keep_last=2)) as ckpt:
        resumed = ckpt.load_latest(state)
        start = 0 if resumed is None else train.extra["step"] + 1
        if rank == 0:
            print(f"[rank 0/{world}] " + ("fresh start" if resumed is None else f"resumed at step {resumed}"), flush=True)
        for step in range(start, args.steps):
            for report in ckpt.finalize():
                if rank == 0:
                    print(f"[rank 0] committed step {report.step}: {report.bytes / 1e6:.2f} MB, blocked "
                          f"{report.blocked_s * 1e3:.1f} ms, durable {report.durable_s * 1e3:.0f} ms, "
                          f"{report.collectives} collectives", flush=True)
            gen = torch.Generator().manual_seed(step * world + rank)
            x = torch.randn(32, 64, generator=gen)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.save_every == 0 or step == args.steps - 1:
                train.extra["step"] = step
                ckpt.schedule_save(state, step=step)
        final = ckpt.close()
    if rank == 0:
        for report in final:
            print(f"[rank 0] committed step {report.step} at close", flush=True)
        print(f"[rank 0] done: steps {start}..{args.steps - 1}, final loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
