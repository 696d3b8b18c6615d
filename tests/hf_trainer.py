"""A tiny Transformers training run for the Trainer tests: a 2-layer GPT-2 built from a config (no
downloads) on a fixed synthetic dataset. Run as a script, it trains in this process and can
SIGKILL itself at a chosen step: `python hf_trainer.py OUT_DIR --kill-at-save 10`; under
`torchrun --nproc-per-node 2 hf_trainer.py OUT_DIR --ddp` it trains with DDP (gloo, CPU)."""

from __future__ import annotations

import argparse
import os
import signal

import torch
import transformers

from asyncckpt.doors.transformers import AsyncCheckpointTrainer

STEPS, SAVE_STEPS = 20, 5


class TokenData(torch.utils.data.Dataset):
    """48 fixed sequences: 12 batches of 4 per epoch, so 20 steps cross an epoch boundary."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, 64, (48, 16), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def tiny_gpt2(layers: int = 2) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(n_layer=layers, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)  # dropout stays on: RNG matters
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def training_args(out_dir: str, **overrides) -> transformers.TrainingArguments:
    options = dict(
        output_dir=out_dir, max_steps=STEPS, save_steps=SAVE_STEPS, save_strategy="steps",
        per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=5, seed=0, use_cpu=True,
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, save_total_limit=None,
    )
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def make_trainer(out_dir: str, trainer_class=AsyncCheckpointTrainer, callbacks=None, eval_dataset=None, model=None,
                 **overrides):
    return trainer_class(model=model if model is not None else tiny_gpt2(), args=training_args(out_dir, **overrides), train_dataset=TokenData(),
                         eval_dataset=eval_dataset, callbacks=callbacks)


class KillAtSave(transformers.TrainerCallback):
    """SIGKILL this process right after the save at `step` was scheduled (before its commit)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--kill-at-save", type=int)
    parser.add_argument("--save-total-limit", type=int)
    parser.add_argument("--ddp", action="store_true", help="under torchrun: gloo, 2 sequences per rank and step")
    parser.add_argument("--resume", help="resume_from_checkpoint")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--final", help="torch.save the final model and optimizer state here (rank 0)")
    args = parser.parse_args()
    callbacks = [KillAtSave(args.kill_at_save)] if args.kill_at_save else None
    overrides = dict(ddp_backend="gloo", per_device_train_batch_size=2) if args.ddp else {}
    trainer = make_trainer(args.out_dir, callbacks=callbacks, save_total_limit=args.save_total_limit,
                           model=tiny_gpt2(args.layers), **overrides)
    if args.ddp:  # each rank's dropout draws differ, as with per-rank seeds: a resume must restore each rank's own
        torch.manual_seed(100 + trainer.args.process_index)
    trainer.train(resume_from_checkpoint=args.resume)
    if args.final and trainer.args.process_index == 0:
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        torch.save({"model": trainer.model.state_dict(), "optimizer": optimizer.state_dict()}, args.final)


if __name__ == "__main__":
    main()
