"""The main job: train a small model on synthetic data, checkpointing asynchronously.

Run it twice: the second run resumes from `latest` with the saved weights, optimizer state and
step, and continues. Prints one line per committed save and a summary.

    python examples/train_loop.py --root checkpoints/example --fresh     # steps 0..199
    python examples/train_loop.py --root checkpoints/example --steps 300 # resumes at 200
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time

import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig


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
    progress = {"step": 0, "weights_sum": 0.0}
    state = {"model": model, "optim": optimizer, "progress": progress}

    config = CheckpointConfig(io=args.io, keep_last=args.keep_last)
    with AsyncCheckpointer(args.root, config) as ckpt:
        resumed = ckpt.load_latest(state)
        if resumed is None:
            print(f"fresh start in {args.root}")
            start = 0
        else:
            start = progress["step"] + 1
            restored = weights_sum(model)
            if restored != progress["weights_sum"]:
                raise SystemExit(f"resume check failed: weights sum {restored} != saved {progress['weights_sum']}")
            print(f"resumed from step {resumed}: weights match the save (sum {restored:.6f}); continuing at step {start}")
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
                progress["weights_sum"] = weights_sum(model)
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


def weights_sum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def print_report(report) -> None:
    print(
        f"  committed step {report.step:4d}: {report.bytes / 1e6:6.1f} MB  blocked {report.blocked_s * 1e3:7.1f} ms  "
        f"staging {report.staging_s * 1e3:6.1f} ms  write {report.write_s * 1e3:6.1f} ms  "
        f"durable {report.durable_s * 1e3:7.1f} ms  ({report.throughput_gbps:.2f} GB/s)"
    )


if __name__ == "__main__":
    main()
