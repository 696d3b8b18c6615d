"""`python -m asyncckpt export CKPT OUT --hf`: a checkpoint's model as a Hugging Face
`save_pretrained` folder that `from_pretrained` loads, sharded like Hugging Face, streamed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from asyncckpt import AsyncCheckpointer
from asyncckpt.cli import commands as cli
from asyncckpt.cli.export import export_hf, parse_size
from asyncckpt.doors.nested import flatten_exact
from conftest import REPO, MemorySampler, step_path

transformers = pytest.importorskip("transformers")  # the test extra installs it



def tiny_gpt2():
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncckpt", "export", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_an_exported_checkpoint_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    """Our checkpoint of {"model": ..., "optimizer": ...}: one shard is model.safetensors with no
    index, names are model.state_dict() names (no optimizer state), config.json is copied."""
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    optimizer.step()
    root, config_dir, out = str(tmp_path / "ckpt"), tmp_path / "config", tmp_path / "hf"
    model.config.save_pretrained(config_dir)
    (config_dir / "tokenizer_config.json").write_text("{}")
    with AsyncCheckpointer(root) as ckpt:
        ckpt.schedule_save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step=3)
    done = export_cli(step_path(root, 3), str(out), "--hf", "--config-from", str(config_dir))
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    assert set(load_file(out / "model.safetensors")) == set(model.state_dict())
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    tokens = torch.arange(16)[None]
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)


def test_a_sharded_bf16_export_of_a_stock_dcp_checkpoint_has_an_index(tmp_path):
    """dcp.save's own checkpoint, --max-shard-size 20KB (Hugging Face's 10^3 units) and --dtype
    bf16: shards named model-0000i-of-0000n with an index naming each tensor's shard; every
    floating tensor cast; from_pretrained loads it."""
    model = tiny_gpt2()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "stock"), no_dist=True)
    model.config.save_pretrained(tmp_path / "config")
    out = tmp_path / "hf"
    done = export_cli(str(tmp_path / "stock"), str(out), "--hf", "--max-shard-size", "20KB", "--dtype", "bf16",
                      "--config-from", str(tmp_path / "config"), "-q")
    assert done.returncode == 0, done.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(model.state_dict()) and set(index["weight_map"].values()) == set(shards)
    tensors = {}
    for shard in shards:
        part = load_file(out / shard)
        assert sum(t.nbytes for t in part.values()) <= 20_000 or len(part) == 1
        tensors.update(part)
    for name, expected in model.state_dict().items():
        assert index["weight_map"][name] in shards
        assert torch.equal(tensors[name], expected.to(torch.bfloat16) if expected.is_floating_point() else expected)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    transformers.GPT2LMHeadModel.from_pretrained(out)


def test_export_streams_one_shard_at_a_time_and_refuses_bad_input(tmp_path):
    """Peak memory stays near one shard (16 MB of a 96 MiB model); a missing prefix, an unknown
    size and an existing non-empty folder are clear errors that write nothing."""
    model = {f"layer{i}.weight": torch.randn(2 << 20) for i in range(12)}  # 12 x 8 MiB
    dcp.save({"model": model}, checkpoint_id=str(tmp_path / "big"), no_dist=True)
    out = str(tmp_path / "hf")
    baseline, _ = MemorySampler(os.getpid()).sample()
    with MemorySampler(os.getpid()) as sampler:
        files = export_hf(str(tmp_path / "big"), out, max_shard_size="16MB")
    extra_mib = (sampler.peak_rss - baseline) / (1 << 20)
    print(f"peak extra RSS {extra_mib:.0f} MiB exporting 96 MiB in {len(files) - 1} shards")
    assert len(files) == 13 and extra_mib < 48, extra_mib  # a shard is one 8 MiB tensor here; half the model is the bound
    assert torch.equal(load_file(os.path.join(out, "model-00003-of-00012.safetensors"))["layer2.weight"], model["layer2.weight"])

    with pytest.raises(Exception, match="exists and is not an empty directory"):
        export_hf(str(tmp_path / "big"), out)
    done = export_cli(str(tmp_path / "big"), str(tmp_path / "other"), "--hf", "--prefix", "optimizer.")
    assert done.returncode != 0 and "no tensors under 'optimizer.'" in done.stderr, done.stderr
    done = export_cli(str(tmp_path / "big"), str(tmp_path / "other"), "--hf", "--max-shard-size", "lots")
    assert done.returncode == 2 and "not a size" in done.stderr, done.stderr
    done = export_cli(str(tmp_path / "big"), str(tmp_path / "other"))
    assert done.returncode == 2 and "--hf" in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["big", "hf"]  # no "other", no temporary folder left


def small_model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def export_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """`python -m asyncckpt export ...` through cli.main in this process (no fresh interpreter)."""
    code = cli.main(["export", *args, "-q"])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_export_finds_the_model_where_the_lightning_plugin_and_the_trainer_keep_it(tmp_path, capsys):
    """Without --prefix: the Lightning plugin's checkpoint dict (flattened, under "state_dict.")
    and the Transformers door's checkpoint-N ("model.", with its config.json beside, which is
    copied without --config-from) export the model's state_dict under its own names."""
    model, optimizer = small_model_and_optimizer()
    lightning = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": 3}
    dcp.save(flatten_exact(lightning), checkpoint_id=str(tmp_path / "epoch=0-step=3.ckpt"), no_dist=True)
    trainer_dir = tmp_path / "out" / "checkpoint-3"
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "trainer_state": "{}"},
             checkpoint_id=str(trainer_dir), no_dist=True)
    (trainer_dir / "config.json").write_text('{"model_type": "tiny"}')  # as AsyncCheckpointTrainer writes it

    for checkpoint, prefix, copied in ((tmp_path / "epoch=0-step=3.ckpt", "state_dict.", []),
                                       (trainer_dir, "model.", ["config.json"])):
        out = tmp_path / f"hf-{prefix}"
        done = export_in_process(capsys, str(checkpoint), str(out), "--hf")
        assert done.returncode == 0, done.stderr
        assert f"exporting the 4 tensors under {prefix!r}" in done.stderr
        assert sorted(os.listdir(out)) == sorted(["model.safetensors", *copied])
        exported = load_file(out / "model.safetensors")
        assert set(exported) == set(model.state_dict())
        assert all(torch.equal(exported[name], tensor) for name, tensor in model.state_dict().items())
    assert (tmp_path / "hf-model." / "config.json").read_text() == '{"model_type": "tiny"}'


def test_export_usage_errors_exit_2_and_name_where_the_tensors_are(tmp_path, capsys):
    """A layout asyncckpt does not write lists where its tensors are; two models, a --prefix with
    no tensors, a non-empty OUT_DIR, one under a file and a --config-from without config.json are
    usage errors (exit 2, not 6: the metadata was read fine); nothing is written."""
    model, optimizer = small_model_and_optimizer()
    dcp.save({"net": model.state_dict(), "opt": optimizer.state_dict()}, checkpoint_id=str(tmp_path / "own"), no_dist=True)
    dcp.save({"model": model.state_dict(), "state_dict": model.state_dict()}, checkpoint_id=str(tmp_path / "two"),
             no_dist=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep")
    out = str(tmp_path / "hf")

    done = export_in_process(capsys, str(tmp_path / "own"), out, "--hf")
    assert done.returncode == cli.EXIT_USAGE, done.stderr
    assert "--prefix" in done.stderr and "net. (4 tensors)" in done.stderr and "opt.state. (12 tensors)" in done.stderr
    done = export_in_process(capsys, str(tmp_path / "two"), out, "--hf")
    assert done.returncode == cli.EXIT_USAGE and "model. (4 tensors), state_dict. (4 tensors)" in done.stderr, done.stderr
    for args, message in (((str(tmp_path / "own"), out, "--prefix", "model."), "no tensors under 'model.'"),
                          ((str(tmp_path / "own"), str(tmp_path / "full"), "--prefix", "net."), "not an empty directory"),
                          ((str(tmp_path / "own"), out, "--prefix", "net.", "--config-from", str(tmp_path)), "no config.json"),
                          ((str(tmp_path / "own"), str(tmp_path / "full" / "notes.txt" / "hf"), "--prefix", "net."),
                           "cannot create the folder")):
        done = export_in_process(capsys, *args, "--hf")
        assert done.returncode == cli.EXIT_USAGE and message in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["full", "own", "two"] and os.listdir(tmp_path / "full") == ["notes.txt"]


def test_the_exported_folder_gets_the_users_umask(tmp_path):
    """As save_pretrained's folder would: not the 0700 of a temporary directory."""
    model, _ = small_model_and_optimizer()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    for umask, folder_mode, file_mode in ((0o022, 0o755, 0o644), (0o027, 0o750, 0o640)):
        previous = os.umask(umask)
        try:
            out = tmp_path / f"hf-{umask:o}"
            export_hf(str(tmp_path / "ckpt"), str(out))
        finally:
            os.umask(previous)
        assert os.stat(out).st_mode & 0o777 == folder_mode
        assert os.stat(out / "model.safetensors").st_mode & 0o777 == file_mode


def test_hugging_face_sizes():
    assert parse_size("100KB") == 100_000 and parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30
    with pytest.raises(ValueError):
        parse_size("5 apples")
