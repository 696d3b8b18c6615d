"""A Hugging Face Trainer checkpointing through asyncckpt: `AsyncCheckpointTrainer` in place of `Trainer`.

Run it twice: the second run resumes from the newest committed `checkpoint-N` and trains on; each
run ends by exporting its last checkpoint as a `save_pretrained` folder and loading it back.

    python examples/transformers_trainer.py --dir checkpoints/transformers --fresh --steps 20
    python examples/transformers_trainer.py --dir checkpoints/transformers --steps 40

Self-checks (the script exits non-zero if one fails): on resume, the weights the Trainer restored
equal the checkpoint read independently with stock `torch.distributed.checkpoint.load`; at the
end, `from_pretrained` of the exported folder gives the logits of the checkpoint it came from.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch
import torch.distributed.checkpoint as dcp
import transformers

from asyncckpt.cli.export import export_hf
from asyncckpt.doors.transformers import AsyncCheckpointTrainer


class Tokens(torch.utils.data.Dataset):
    """Fixed synthetic token sequences (no downloads)."""

    def __init__(self) -> None:
        self.tokens = torch.randint(0, 256, (256, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def small_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=256, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class CheckResumedWeights(transformers.TrainerCallback):
    """At the start of a resumed run: the model must hold the checkpoint's weights exactly."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            return
        checkpoint = os.path.join(self.out_dir, f"checkpoint-{state.global_step}")
        saved = {"model": small_gpt2().state_dict()}
        dcp.load(saved, checkpoint_id=checkpoint, no_dist=True)
        wrong = [k for k, v in model.state_dict().items() if not torch.equal(v, saved["model"][k])]
        if wrong:
            sys.exit(f"SELF-CHECK FAILED: {len(wrong)} tensors differ from {checkpoint}, e.g. {wrong[:3]}")
        print(f"resumed from {checkpoint} (step {state.global_step}): weights equal the checkpoint")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="checkpoints/transformers")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--fresh", action="store_true", help="delete --dir first")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    if args.fresh:
        shutil.rmtree(args.dir, ignore_errors=True)
    out_dir = os.path.join(args.dir, "run")
    training = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=args.steps, save_steps=args.save_every, save_total_limit=2,
        per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=args.save_every, use_cpu=True,
        report_to="none", disable_tqdm=True, seed=0,
    )
    trainer = AsyncCheckpointTrainer(model=small_gpt2(), args=training, train_dataset=Tokens(),
                                     callbacks=[CheckResumedWeights(out_dir)])
    resume = any(name.startswith("checkpoint-") for name in os.listdir(out_dir)) if os.path.isdir(out_dir) else False
    trainer.train(resume_from_checkpoint=resume or None)  # True: the newest committed checkpoint

    kept = sorted((n for n in os.listdir(out_dir) if n.startswith("checkpoint-")), key=lambda n: int(n.split("-")[1]))
    last = os.path.join(out_dir, kept[-1])  # every save is committed once train() returns
    exported = os.path.join(args.dir, f"hf_model-{kept[-1].split('-')[1]}")
    shutil.rmtree(exported, ignore_errors=True)
    export_hf(last, exported)  # with the config.json the checkpoint folder holds
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(exported).eval()
    tokens = Tokens()[0]["input_ids"][None]
    with torch.no_grad():
        trained = small_gpt2().eval()
        saved = {"model": trained.state_dict()}
        dcp.load(saved, checkpoint_id=last, no_dist=True)
        if not torch.equal(reloaded(tokens).logits, trained(tokens).logits):
            sys.exit(f"SELF-CHECK FAILED: {exported} does not give {last}'s logits")
    print(f"trained to step {trainer.state.global_step}; committed checkpoints kept: {', '.join(kept)}; "
          f"exported {last} to {exported}; from_pretrained gives the same logits")


if __name__ == "__main__":
    main()
