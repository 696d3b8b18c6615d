"""Checkpoints in an object store: train, save asynchronously to S3, resume from it.

Starts a local S3-compatible server (moto_server from `pip install "moto[server]"`) on a free
loopback port, creates a bucket, and writes an MSC_CONFIG with one profile for it. Then:
  1. trains a small model, saving every few steps to `msc://PROFILE/run1` (or `s3://BUCKET/run1`)
     while training goes on; retention keeps the newest two checkpoints;
  2. starts over with a fresh model and optimizer, resumes from the newest checkpoint in the
     bucket (checking the weights are the saved ones), and trains on;
  3. lists the bucket, to show what a checkpoint is made of and that retention left nothing.

    python examples/object_store.py                 # msc:// root
    python examples/object_store.py --scheme s3     # the same bucket through s3:// (AWS_ENDPOINT_URL)
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

from asyncckpt import AsyncCheckpointer, CheckpointConfig

BUCKET = "checkpoints"
PROFILE = "local-s3"


def start_moto(workdir: str) -> tuple[subprocess.Popen, str]:
    """moto_server on a free port; returns the process and its endpoint once it answers."""
    command = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(command):
        command = shutil.which("moto_server")
    if command is None:
        raise SystemExit('moto_server not found: pip install "moto[server]"')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(workdir, "moto.log"), "wb")
    process = subprocess.Popen([command, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=2).close()
            return process, endpoint
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit(f"moto_server did not start; see {workdir}/moto.log")


def configure(workdir: str, endpoint: str) -> None:
    """Bucket, MSC_CONFIG and credentials. Set in os.environ before the checkpointer starts, so
    its worker process inherits them."""
    config_path = os.path.join(workdir, "msc_config.yaml")
    with open(config_path, "w") as f:
        f.write(
            f"""profiles:
  {PROFILE}:
    storage_provider:
      type: s3
      options:
        base_path: {BUCKET}
        endpoint_url: {endpoint}
        region_name: us-east-1
"""
        )
    os.environ.update(
        MSC_CONFIG=config_path,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_ENDPOINT_URL=endpoint,  # what s3:// URLs (msc's implicit profile) connect to
        AWS_DEFAULT_REGION="us-east-1",
    )
    s3().create_bucket(Bucket=BUCKET)


def s3():
    import boto3

    return boto3.client("s3")


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 8))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, 128, generator=gen)
    return x, x[:, :8].cos()


def train(root: str, first_step: int, last_step: int, save_every: int, seed: int) -> None:
    """Train steps first_step..last_step, resuming from the bucket if it holds a checkpoint."""
    torch.manual_seed(seed)  # a resumed run must not depend on its own initialization
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    progress = {"step": -1, "weights_sum": 0.0}
    state = {"model": model, "optim": optimizer, "progress": progress}
    with AsyncCheckpointer(root, CheckpointConfig(keep_last=2, io_workers=2)) as ckpt:
        resumed = ckpt.load_latest(state)
        if resumed is None:
            print(f"fresh start in {root}")
        else:
            restored = weights_sum(model)
            if abs(restored - progress["weights_sum"]) > 0:
                raise SystemExit(f"resume check failed: weights sum {restored} != saved {progress['weights_sum']}")
            print(f"resumed from {root} at step {resumed}: weights match the save (sum {restored:.6f})")
            first_step = progress["step"] + 1
        for step in range(first_step, last_step + 1):
            for report in ckpt.finalize():  # non-blocking: commits saves whose uploads ended
                print_report(report)
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % save_every == 0 or step == last_step:
                progress.update(step=step, weights_sum=weights_sum(model))
                ckpt.schedule_save(state, step=step)  # returns once staged; the upload goes on
        for report in ckpt.close():
            print_report(report)
    print(f"trained steps {first_step}..{last_step}, final loss {loss.item():.4f}")


def weights_sum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def print_report(report) -> None:
    print(
        f"  committed step {report.step:3d}: {report.bytes / 1e6:5.2f} MB, training blocked "
        f"{report.blocked_s * 1e3:6.1f} ms, durable after {report.durable_s * 1e3:6.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheme", choices=["msc", "s3"], default="msc")
    parser.add_argument("--steps", type=int, default=60, help="steps per phase")
    parser.add_argument("--save-every", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    workdir = tempfile.mkdtemp(prefix="asyncckpt-object-store-")
    server, endpoint = start_moto(workdir)
    try:
        configure(workdir, endpoint)
        root = f"msc://{PROFILE}/run1" if args.scheme == "msc" else f"s3://{BUCKET}/run1"
        print(f"local S3 server at {endpoint}, bucket {BUCKET!r}, root {root}")
        print("phase 1: train and save asynchronously")
        train(root, 0, args.steps - 1, args.save_every, seed=0)
        print("phase 2: a new process would do this: fresh model, resume from the bucket, go on")
        train(root, 0, 2 * args.steps - 1, args.save_every, seed=1)
        keys = [o["Key"] for o in s3().list_objects_v2(Bucket=BUCKET, Prefix="run1/").get("Contents", [])]
        print(f"bucket {BUCKET!r} now holds {len(keys)} keys (keep_last=2):")
        for key in keys:
            print(f"  {key}")
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
