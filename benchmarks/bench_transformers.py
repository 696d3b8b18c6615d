"""A Transformers Trainer saving every N steps: asyncckpt's AsyncCheckpointTrainer vs the stock
Trainer's synchronous checkpoints, against the same run without saves.

Every method trains the same GPT-2 built from a config (no downloads; default ~17 M parameters, so
model + AdamW moments are ~200 MB a checkpoint) on fixed synthetic tokens, on the CPU, in this
process, with `save_steps=N` (`save_strategy="no"` for the run without saves): 40 steps, a save
every 10 (a save every ~5 s of training here). Two configurations: the trainer's torch threads on
every core, and with one core left free (as on a GPU node, where the CPU is mostly idle while the
GPU trains). The methods run interleaved, twice each, and the figures are medians. Per method:
total train() time (for asyncckpt it includes waiting, at the end, for the last save's commit) and
its overhead over the run without saves, and the time the training loop was blocked per save
(`_save_checkpoint`, where Trainer saves): the first save apart (the worker may still be
starting), then mean and max of the rest. The stock Trainer does not fsync its files; asyncckpt
does (its default), so each asyncckpt checkpoint is durable when committed and the stock one may
still be in the page cache.

    python benchmarks/bench_transformers.py --out bench_out/bench_transformers.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from asyncckpt.doors.transformers import AsyncCheckpointTrainer  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, length: int, vocab: int) -> None:
        self.tokens = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def timed(trainer_class):
    """The class, with the time each `_save_checkpoint` call held the training loop recorded."""

    class Timed(trainer_class):
        def _save_checkpoint(self, model, trial):
            started = time.perf_counter()
            super()._save_checkpoint(model, trial)
            self.blocked.append(time.perf_counter() - started)

    Timed.blocked = None
    return Timed


def run(method: str, args, root: str) -> dict:
    out = os.path.join(root, method)
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_head=8, n_embd=args.width, vocab_size=args.vocab,
                                     n_positions=args.seq)
    model = transformers.GPT2LMHeadModel(config)
    training = transformers.TrainingArguments(
        output_dir=out, max_steps=args.steps, save_steps=args.every, per_device_train_batch_size=args.batch,
        save_strategy="no" if method == "no saves" else "steps", learning_rate=1e-4, logging_steps=10**6,
        use_cpu=True, report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    trainer_class = timed(AsyncCheckpointTrainer if method == "asyncckpt" else transformers.Trainer)
    trainer = trainer_class(model=model, args=training, train_dataset=Tokens(args.steps * args.batch, args.seq, args.vocab))
    trainer.blocked = []
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    state_mb = sum(p.numel() * p.element_size() for p in model.parameters()) * 3 / 1e6  # + 2 AdamW moments
    shutil.rmtree(out, ignore_errors=True)
    return {"method": method, "total_s": total, "blocked": trainer.blocked, "state_mb": state_mb}


def run_config(args, threads: int, root: str) -> dict:
    """Every method side by side, interleaved: no saves, stock, asyncckpt, ... --rounds times,
    then no saves once more; the figures are medians per method."""
    torch.set_num_threads(threads)
    order = ["no saves", "stock Trainer", "asyncckpt"] * args.rounds + ["no saves"]
    results = []
    for i, method in enumerate(order):
        print(f"[{threads} trainer threads] [{i + 1}/{len(order)}] {method} ...", file=sys.stderr, flush=True)
        results.append(run(method, args, root))
    baseline = statistics.median(r["total_s"] for r in results if r["method"] == "no saves")
    print(f"\nGPT-2 {args.layers}x{args.width}, vocab {args.vocab}: {results[1]['state_mb']:.0f} MB per checkpoint "
          f"(model + AdamW moments); {args.steps} steps, a save every {args.every} ({args.steps // args.every} saves); "
          f"the trainer on {threads} of {os.cpu_count()} cores; without saves: {baseline:.2f} s (median of "
          f"{args.rounds + 1})\n")
    print("| method | train() s (median) | overhead | first save blocked s | later saves blocked s (mean / max) |")
    print("|---|---|---|---|---|")
    rows = []
    for method in ("stock Trainer", "asyncckpt"):
        runs = [r for r in results if r["method"] == method]
        total = statistics.median(r["total_s"] for r in runs)
        first = statistics.median(r["blocked"][0] for r in runs)
        later = [b for r in runs for b in r["blocked"][1:]] or [float("nan")]
        rows.append({"method": method, "total_s": total, "overhead": total / baseline - 1, "first_blocked_s": first,
                     "later_blocked_mean_s": statistics.mean(later), "later_blocked_max_s": max(later)})
        print(f"| {method} | {total:.2f} | {(total / baseline - 1) * 100:+.1f} % | {first:.3f} | "
              f"{statistics.mean(later):.3f} / {max(later):.3f} |", flush=True)
    return {"threads": threads, "baseline_s": baseline, "rows": rows, "runs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="save every N steps")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each method (interleaved)")
    parser.add_argument("--threads", default=f"{torch.get_num_threads()},{max(1, torch.get_num_threads() - 1)}",
                        help="the trainer's torch threads, one configuration each (default: every core, and one core free)")
    parser.add_argument("--dir", help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    root = args.dir or tempfile.mkdtemp(prefix="bench_transformers_")
    threads = list(dict.fromkeys(int(t) for t in args.threads.split(",")))
    try:
        results = [run_config(args, n, root) for n in threads]
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"configs": results, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
