"""The main job: train a small model on synthetic data, checkpointing asynchronously.

Run it twice: the second run resumes from `latest` with the saved weights, optimizer state and
step, and continues. Prints one line per committed save and a summary.

    python examples/train_loop.py --root checkpoints/example --fresh     # steps 0..199
    python examples/train_loop.py --root checkpoints/example --steps 300 # resumes at 200

Self-check: every save also records a digest of each tensor of the model and optimizer state; on
resume the restored tensors must match those digests exactly, or the script exits non-zero.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shlex
import shutil
import time

import torch
# TrainState: model + optimizer as one DCP Stateful. Don't put a bare optimizer in the state dict:
# DCP loads into the structure `state_dict()` returns, and a fresh optimizer's is empty until its
# first step(), so a resume would skip exp_avg, exp_avg_sq and step.
from asyncckpt import AsyncCheckpointer, CheckpointConfig, TrainState
from asyncckpt.command import cli_command


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 16)
    )


def synthetic_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch per step, so a resumed run sees the same data it would have."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(64, 256, generator=gen)
    return x, x[:, :16].sin()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="checkpoints/example")
    parser.add_argument("--steps", type=int, default=200, help="train until this step")
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--io", choices=["thread", "process"], default="thread")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--fresh", action="store_true", help="delete the root first")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.fresh:
        shutil.rmtree(args.root, ignore_errors=True)

    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = TrainState(model, optimizer)
    # "digests" is one JSON string, not a dict: DCP only loads the keys the target already has
    progress = {"step": -1, "digests": ""}
    state = {"train": train, "progress": progress}

    config = CheckpointConfig(io=args.io, keep_last=args.keep_last)
    with AsyncCheckpointer(args.root, config) as ckpt:
        resumed = ckpt.load_latest(state)
        if resumed is None:
            print(f"fresh start in {args.root}")
            start = 0
        else:
            start = progress["step"] + 1
            checked = check_resume(train, progress, resumed)
            print(f"resumed from step {resumed}: weights and optimizer state match the save "
                  f"({checked} tensors); continuing at step {start}")
        reports, losses, t0 = [], [], time.perf_counter()
        for step in range(start, args.steps):
            for report in ckpt.finalize():  # non-blocking: commits saves whose writes ended
                reports.append(report)
                print_report(report)
            x, y = synthetic_batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if step % args.save_every == 0 or step == args.steps - 1:
                progress["step"] = step
                progress["digests"] = json.dumps(tensor_digests(train))
                ckpt.schedule_save(state, step=step)
        for report in ckpt.close():
            reports.append(report)
            print_report(report)

    elapsed = time.perf_counter() - t0
    if reports:
        blocked = sorted(r.blocked_s for r in reports)
        print(
            f"summary: steps {start}..{args.steps - 1} in {elapsed:.1f}s, final loss {losses[-1]:.4f}, "
            f"{len(reports)} saves, median blocked {blocked[len(blocked) // 2] * 1e3:.1f} ms, "
            f"max blocked {blocked[-1] * 1e3:.1f} ms, {reports[-1].bytes / 1e6:.1f} MB each"
        )
    else:
        print(f"summary: nothing to do (already at step {args.steps})")
    root, tool = shlex.quote(args.root), cli_command()  # `asyncckpt`, or this Python with -m asyncckpt
    print(f"checkpoints in {args.root}: list them with `{tool} ls {root}`, "
          f"see the latest one's tensors with `{tool} inspect {root}`")


# Self-check ------------------------------------------------------------------------------------
def tensor_digests(train: TrainState) -> dict[str, str]:
    """A digest of the exact bytes of every weight and every optimizer state tensor (exp_avg,
    exp_avg_sq, step of each parameter), by name."""
    sd = train.state_dict()
    tensors = {f"model.{name}": t for name, t in sd["model"].items()}
    for param, per_param in sd["optim"]["state"].items():
        tensors.update({f"optim.{param}.{key}": value for key, value in per_param.items()})
    # hash a copy: exporting the live tensors to NumPy would pin their storage, which the
    # checkpointer would then have to copy into shared memory on every save
    return {
        name: hashlib.blake2b(torch.as_tensor(t).detach().cpu().clone().numpy(), digest_size=16).hexdigest()
        for name, t in sorted(tensors.items())
    }


def check_resume(train: TrainState, progress: dict, resumed: int) -> int:
    """Exit non-zero unless the state just loaded is exactly what was saved at step `resumed`."""
    saved = json.loads(progress["digests"] or "{}")
    restored = tensor_digests(train)
    wrong = sorted(name for name in saved.keys() | restored.keys() if saved.get(name) != restored.get(name))
    if progress["step"] != resumed or not saved:
        raise SystemExit(f"resume check failed: the checkpoint of step {resumed} loaded no digests of its state")
    if wrong:
        more = " ..." if len(wrong) > 6 else ""
        raise SystemExit(
            f"resume check failed at step {resumed}: {len(wrong)} of {len(saved)} saved tensors differ after "
            f"loading: {', '.join(wrong[:6])}{more}"
        )
    return len(saved)


def print_report(report) -> None:
    print(
        f"  committed step {report.step:4d}: {report.bytes / 1e6:6.1f} MB  blocked {report.blocked_s * 1e3:7.1f} ms  "
        f"staging {report.staging_s * 1e3:6.1f} ms  write {report.write_s * 1e3:6.1f} ms  "
        f"durable {report.durable_s * 1e3:7.1f} ms  ({report.throughput_gbps:.2f} GB/s)"
    )


if __name__ == "__main__":
    main()
