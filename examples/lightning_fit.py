"""A Lightning fit checkpointing through asyncckpt: `Trainer(plugins=[AsyncCheckpointIO()])`.

Run it twice: the second run resumes from `last.ckpt` (ckpt_path="last") and trains on.

    python examples/lightning_fit.py --dir checkpoints/lightning --fresh --steps 24
    python examples/lightning_fit.py --dir checkpoints/lightning --steps 48
    python examples/lightning_fit.py ... --devices 2      # DDP on CPU (gloo), 2 processes
    python examples/lightning_fit.py --dir other --resume checkpoints/lightning/epoch=1-step=12.ckpt

Self-check on resume: the checkpoint is read independently, with stock
`torch.distributed.checkpoint.format_utils.dcp_to_torch_save`, and the weights, optimizer state
and step Lightning restored must equal it exactly, or the script exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.data import DataLoader, TensorDataset

from asyncckpt import CheckpointConfig
from asyncckpt.doors.lightning import AsyncCheckpointIO
from asyncckpt.doors.nested import unflatten_exact


class Regressor(L.LightningModule):
    def __init__(self, width: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)]


def data(batches: int = 6, batch_size: int = 8) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batches * batch_size, 16, generator=gen)
    return DataLoader(TensorDataset(x, x[:, :4].sin()), batch_size=batch_size, shuffle=False)


class ResumeCheck(L.Callback):
    """On resume, compare what Lightning restored with the checkpoint as stock DCP reads it."""

    def __init__(self) -> None:
        self.problem, self.message = None, None

    def on_train_start(self, trainer, module) -> None:
        if trainer.ckpt_path is None:
            return
        with tempfile.TemporaryDirectory() as tmp:
            converted = os.path.join(tmp, "converted.pt")
            dcp_to_torch_save(trainer.ckpt_path, converted)
            saved = unflatten_exact(torch.load(converted, weights_only=True), trainer.ckpt_path)
        restored = {"state_dict": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()["state"]}
        expected = {"state_dict": saved["state_dict"], "optimizer": saved["optimizer_states"][0]["state"]}
        pairs = _tensor_pairs(expected, restored)
        differ = [name for name, a, b in pairs if b is None or a.dtype != b.dtype or not torch.equal(a, b)]
        if differ or saved["global_step"] != trainer.global_step:
            self.problem = (f"resume check failed at step {saved['global_step']}: {len(differ)} of {len(pairs)} "
                            f"tensors differ ({', '.join(differ[:4])}); restored step {trainer.global_step}")
            trainer.should_stop = True
        else:
            self.message = (f"resumed from {trainer.ckpt_path} at step {trainer.global_step}: weights and optimizer "
                            f"state match the checkpoint ({len(pairs)} tensors)")


def _tensor_pairs(expected, restored, prefix=""):
    pairs = []
    for key, value in expected.items():
        other = restored.get(key) if isinstance(restored, dict) else None
        if isinstance(value, dict):
            pairs += _tensor_pairs(value, other if isinstance(other, dict) else {}, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            pairs.append((f"{prefix}{key}", value, other if isinstance(other, torch.Tensor) else None))
    return pairs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="checkpoints/lightning", help="ModelCheckpoint's dirpath")
    parser.add_argument("--steps", type=int, default=24, help="train until this global step")
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1, help=">1: DDP on CPU (gloo)")
    parser.add_argument("--io", choices=("asyncckpt", "default"), default="asyncckpt")
    parser.add_argument("--fresh", action="store_true", help="delete --dir first; do not resume")
    parser.add_argument("--resume", default="last", help='the checkpoint to resume from (default: "last")')
    parser.add_argument("--final", help="torch.save the final weights and optimizer state here")
    args = parser.parse_args()

    if args.fresh and os.environ.get("LOCAL_RANK", "0") == "0" and os.path.isdir(args.dir):
        shutil.rmtree(args.dir)
    torch.manual_seed(0)
    config = CheckpointConfig(incremental=True, on_commit=lambda report: print(  # incremental: the plugin's default
        f"committed {os.path.basename(report.path)} ({report.bytes_written / 1e6:.2f} MB written)", flush=True))
    plugins = [AsyncCheckpointIO(config)] if args.io == "asyncckpt" else []
    check = ResumeCheck()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps, plugins=plugins, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
        callbacks=[check, ModelCheckpoint(dirpath=args.dir, monitor="train_loss", save_top_k=args.top_k,
                                          every_n_train_steps=args.save_every, save_last=True)],
    )
    model = Regressor()
    trainer.fit(model, data(), ckpt_path=None if args.fresh else args.resume)
    if check.problem:
        print(check.problem, file=sys.stderr)
        return 1
    if trainer.is_global_zero:
        if check.message:
            print(check.message)
        if args.final:
            torch.save({"state_dict": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}, args.final)
        print(f"done at step {trainer.global_step}; {args.dir}: {', '.join(sorted(os.listdir(args.dir)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
