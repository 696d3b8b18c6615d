"""Small real Lightning fits for the Lightning plugin's tests (tests/doors/test_lightning*.py): a
tiny model, its data, a fit with ModelCheckpoint, exact comparisons, the plugin's worker."""

from __future__ import annotations

import contextlib
import os

import psutil
import pytest
import torch

L = pytest.importorskip("lightning", reason="Lightning is not installed (pip install lightning; CI installs it)")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

MiB = 1 << 20


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)]


def _loader() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 8, generator=gen)  # 3 batches an epoch: step 6 ends an epoch
    return DataLoader(TensorDataset(x, x[:, :2].cos()), batch_size=8, shuffle=False)


def _fit(dirpath: str, steps: int, plugin=None, ckpt_path=None, save_last=True, callbacks=()):
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=dirpath, monitor="train_loss", save_top_k=2, every_n_train_steps=2, save_last=save_last)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin] if plugin else [], callbacks=[checkpoint, *callbacks],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = Tiny()
    trainer.fit(model, _loader(), ckpt_path=ckpt_path)
    return model, trainer, checkpoint


def _final(model, trainer) -> dict:
    return {"model": model.state_dict(), "optim": trainer.optimizers[0].state_dict(), "step": trainer.global_step}


def assert_exactly_equal(a, b, where="") -> None:
    """Same keys (and key types), same container kinds (tuple ~ list), tensors equal in dtype,
    shape and values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), f"{where}: {list(a)} != {list(b)}"
        assert [type(k) for k in a] == [type(k) for k in b], where
        for key in a:
            assert_exactly_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_exactly_equal(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def _is_committed_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def _workers(plugin) -> list[psutil.Process]:
    return [psutil.Process(plugin._saves.saver.worker_pid)] if plugin._saves.saver is not None else []


@contextlib.contextmanager
def starting_workers_stopped(plugin):
    """The plugin's workers, stopped while still starting (the test is skipped if one finished
    first), resumed on the way out."""
    workers = _workers(plugin)
    for worker in workers:
        worker.suspend()
    try:
        if plugin._saves.saver.worker_ready:
            pytest.skip("the worker finished starting before it could be stopped")
        yield workers
    finally:
        for worker in workers:
            worker.resume()


def _clone(obj):
    from asyncckpt.doors.nested import map_tensors
    return map_tensors(obj, lambda t: t.clone())
