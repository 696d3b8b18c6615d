"""asyncckpt.transformers: a real `transformers.Trainer` on CPU (a 2-layer GPT-2 built from a
config) saving every 5 steps in the background, killed and resumed, rotated, stopped early."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

transformers = pytest.importorskip("transformers")  # the test extra installs it
pytest.importorskip("accelerate")

import hf_trainer  # noqa: E402  (tests/ is on sys.path)
from asyncckpt import CheckpointConfig, CheckpointError  # noqa: E402
from asyncckpt.doors.transformers import AsyncCheckpointMixin, AsyncCheckpointTrainer  # noqa: E402
from conftest import TESTS, run_cpu_script  # noqa: E402

HERE = TESTS  # hf_trainer.py lies there
METADATA = ".metadata"


def checkpoint_dirs(out: str) -> list[str]:
    return sorted((d for d in os.listdir(out) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))


def final_state(trainer) -> dict[str, torch.Tensor]:
    """Model weights and every optimizer moment, by name."""
    state = {f"model.{k}": v.clone() for k, v in trainer.model.state_dict().items()}
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for param, moments in optimizer.state.items():
        for key, value in moments.items():
            state[f"optim.{names[id(param)]}.{key}"] = torch.as_tensor(value).clone()
    return state


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def run_killed(out: str, kill_at_save: int) -> None:
    """Train in a child process that SIGKILLs itself right after scheduling the save at that step."""
    done = run_cpu_script([sys.executable, os.path.join(HERE, "hf_trainer.py"), out, "--kill-at-save", str(kill_at_save)],
                          timeout_s=240, cwd=HERE)
    assert done.returncode == -9, done.stderr[-2000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 20 steps without interruption, saving every 5 steps."""
    out = str(tmp_path_factory.mktemp("reference"))
    trainer = hf_trainer.make_trainer(out)
    trainer.train()
    return out, final_state(trainer), trainer.state.log_history


def test_saves_every_5_steps_are_committed_stock_dcp_checkpoints(uninterrupted):
    out, final, _ = uninterrupted
    assert checkpoint_dirs(out) == [f"checkpoint-{s}" for s in (5, 10, 15, 20)]
    last = os.path.join(out, "checkpoint-20")
    names = set(os.listdir(last))
    assert {METADATA, "trainer_state.json", "config.json"} <= names
    assert json.load(open(os.path.join(last, "trainer_state.json")))["global_step"] == 20
    model = hf_trainer.tiny_gpt2()
    template = {"model": model.state_dict()}
    dcp.load(template, checkpoint_id=last, no_dist=True)  # stock DCP reads it
    for key, value in model.state_dict().items():
        assert torch.equal(value, final[f"model.{key}"]), key
    # every parameter once, in its own dtype (GPT-2's tied lm_head may appear under both names)
    saved = dcp.FileSystemReader(last).read_metadata().state_dict_metadata
    assert {k[len("model."):] for k in saved if k.startswith("model.")} == set(model.state_dict())


def test_a_run_killed_mid_save_resumes_from_the_newest_committed_checkpoint_and_ends_bitwise_equal(tmp_path, uninterrupted, caplog):
    """Killed right after scheduling the save of step 10: checkpoint-10 never committed. The
    usual idiom hands Trainer `get_last_checkpoint(out)`, which names that torn folder: the run
    resumes from checkpoint-5 instead, re-saves checkpoint-10 over the torn one, and ends with
    the same weights and optimizer moments as the uninterrupted run."""
    out = str(tmp_path / "run")
    run_killed(out, kill_at_save=10)
    assert METADATA not in os.listdir(os.path.join(out, "checkpoint-10"))
    assert METADATA in os.listdir(os.path.join(out, "checkpoint-5"))

    seen = []

    class ResumedAt(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.append(state.global_step)

    trainer = hf_trainer.make_trainer(out, callbacks=[ResumedAt()])
    with caplog.at_level("WARNING", logger="asyncckpt"):
        trainer.train(resume_from_checkpoint=transformers.trainer_utils.get_last_checkpoint(out))
    assert "checkpoint-10 is a save that never committed" in caplog.text
    assert seen == [5]
    assert_same(final_state(trainer), uninterrupted[1])
    assert all(METADATA in os.listdir(os.path.join(out, d)) for d in checkpoint_dirs(out))
    ref_losses = [e["loss"] for e in uninterrupted[2] if "loss" in e and e["step"] > 5]
    assert [e["loss"] for e in trainer.state.log_history if "loss" in e and e["step"] > 5] == ref_losses


def test_a_run_resumed_from_an_earlier_checkpoint_replaces_the_committed_later_ones_at_their_commit(tmp_path, uninterrupted):
    """Resuming from checkpoint-10 of a finished run re-saves checkpoint-15 and -20 over the
    committed ones: each stays loadable until its replacement commits, and the old files go."""
    out = str(tmp_path / "run")
    shutil.copytree(uninterrupted[0], out)
    trainer = hf_trainer.make_trainer(out)
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-10"))
    assert_same(final_state(trainer), uninterrupted[1])
    last = os.path.join(out, "checkpoint-20")
    used = {i.relative_path for i in dcp.FileSystemReader(last).read_metadata().storage_data.values()}
    assert {n for n in os.listdir(last) if n.endswith(".distcp")} == used  # the replaced save's files are gone
    model = {"model": hf_trainer.tiny_gpt2().state_dict()}
    dcp.load(model, checkpoint_id=last, no_dist=True)
    for key, value in model["model"].items():
        assert torch.equal(value, uninterrupted[1][f"model.{key}"]), key


def test_a_run_started_with_the_stock_trainer_continues_from_its_checkpoint(tmp_path, uninterrupted):
    """Switching mid-run: resume_from_checkpoint=True picks the stock Trainer's newest folder,
    Trainer's own loaders read it, and the run ends as the uninterrupted one."""
    class StopAt10(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 10

    out = str(tmp_path / "run")
    hf_trainer.make_trainer(out, trainer_class=transformers.Trainer, callbacks=[StopAt10()]).train()
    assert checkpoint_dirs(out) == ["checkpoint-5", "checkpoint-10"]
    trainer = hf_trainer.make_trainer(out)
    trainer.train(resume_from_checkpoint=True)
    assert_same(final_state(trainer), uninterrupted[1])
    assert METADATA in os.listdir(os.path.join(out, "checkpoint-20"))


def test_a_parameter_that_never_had_a_gradient_does_not_stop_a_resume(tmp_path):
    """An unused head has no optimizer state in the checkpoint; the resumed run loads the others
    and leaves it stateless, as the uninterrupted run does, and ends equal to it."""
    def model_with_unused_head():
        model = hf_trainer.tiny_gpt2()
        model.unused_head = torch.nn.Linear(4, 4)
        return model

    full = hf_trainer.make_trainer(str(tmp_path / "full"), model=model_with_unused_head(), max_steps=10)
    full.train()
    resumed = hf_trainer.make_trainer(str(tmp_path / "full"), model=model_with_unused_head(), max_steps=10)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-5"))
    assert_same(final_state(resumed), final_state(full))
    assert not any(p in resumed.optimizer.optimizer.state for p in resumed.model.unused_head.parameters())


def test_rotation_keeps_save_total_limit_committed_folders_and_removes_a_torn_one(tmp_path):
    """A torn checkpoint-10 from a killed run; the resumed run (resume_from_checkpoint=True) with
    save_total_limit=2 ends with exactly the two newest committed checkpoints."""
    out = str(tmp_path / "run")
    run_killed(out, kill_at_save=10)
    os.makedirs(os.path.join(out, "checkpoint-7"))  # an older torn folder, e.g. from another crash
    trainer = hf_trainer.make_trainer(out, save_total_limit=2)
    kept_while_training = []

    class Watch(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            dirs = checkpoint_dirs(out)
            committed = [d for d in dirs if METADATA in os.listdir(os.path.join(out, d))]
            kept_while_training.append(len(committed))

    trainer.add_callback(Watch())
    trainer.train(resume_from_checkpoint=True)
    assert checkpoint_dirs(out) == ["checkpoint-15", "checkpoint-20"]
    assert max(kept_while_training) <= 2


def test_training_stopped_early_commits_the_save_in_flight_before_train_returns(tmp_path):
    class StopAfterSave(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 10:
                control.should_training_stop = True

    out = str(tmp_path / "run")
    trainer = hf_trainer.make_trainer(out, callbacks=[StopAfterSave()])
    trainer.train()
    assert trainer.state.global_step == 10
    assert checkpoint_dirs(out) == ["checkpoint-5", "checkpoint-10"]
    assert all(METADATA in os.listdir(os.path.join(out, d)) for d in checkpoint_dirs(out))
    assert trainer._checkpointer is None  # the worker is gone with train()


def test_the_mixin_on_a_trainer_subclass_and_save_strategy_best_with_the_best_model_loaded_at_end(tmp_path):
    """A Trainer subclass with its own compute_loss gets async saves from the mixin; with
    save_strategy="best" only improving evaluations save, and load_best_model_at_end loads the
    best committed checkpoint's weights (even when the best save is the one still in flight)."""
    calls = []

    class CountingTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            calls.append(1)
            return super().compute_loss(model, inputs, *args, **kwargs)

    class AsyncCountingTrainer(AsyncCheckpointMixin, CountingTrainer):
        pass

    out = str(tmp_path / "run")
    trainer = hf_trainer.make_trainer(
        out, trainer_class=AsyncCountingTrainer, eval_strategy="steps", eval_steps=5, save_strategy="best",
        metric_for_best_model="loss", greater_is_better=False, load_best_model_at_end=True, save_total_limit=1,
        eval_dataset=hf_trainer.TokenData(),
    )
    trainer.train()
    assert calls
    best = trainer.state.best_model_checkpoint
    assert best is not None and METADATA in os.listdir(best)
    assert checkpoint_dirs(out) == [os.path.basename(best)]  # save_total_limit=1 keeps the best one at the end
    saved = {"model": hf_trainer.tiny_gpt2().state_dict()}
    dcp.load(saved, checkpoint_id=best, no_dist=True)
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, saved["model"][key]), key


def test_incremental_saves_of_a_partly_frozen_model_write_only_what_changed(tmp_path):
    """checkpoint_config=CheckpointConfig(incremental=True) on a subclass: with all but the
    last block frozen, the frozen weights are not written again, and each checkpoint is still
    complete (stock DCP loads the final weights from the last)."""
    reports = []

    class Incremental(AsyncCheckpointTrainer):
        checkpoint_config = CheckpointConfig(incremental=True, on_commit=reports.append)

    out = str(tmp_path / "run")
    trainer = hf_trainer.make_trainer(out, trainer_class=Incremental)
    for name, param in trainer.model.named_parameters():
        param.requires_grad_(name.startswith(("transformer.h.1.", "transformer.ln_f.")))
    frozen = {p.data_ptr(): p.numel() * p.element_size() for p in trainer.model.parameters() if not p.requires_grad}
    trainer.train()
    assert [r.step for r in reports] == [5, 10, 15, 20]
    assert reports[0].bytes_written == reports[0].bytes
    # from the third save on (the second still rewrites files it split), no frozen byte is written again
    assert all(r.bytes_written <= r.bytes - sum(frozen.values()) for r in reports[2:]), [(r.bytes_written, r.bytes) for r in reports]
    saved = {"model": hf_trainer.tiny_gpt2().state_dict()}
    dcp.load(saved, checkpoint_id=os.path.join(out, "checkpoint-20"), no_dist=True)
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, saved["model"][key]), key


def torchrun_training(out: str, *extra: str) -> None:
    """2-rank DDP (gloo, CPU) with the same global batch as the 1-process runs."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "localhost:0", os.path.join(HERE, "hf_trainer.py"), out, "--ddp", *extra]
    done = run_cpu_script(command, timeout_s=300, cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]


def test_under_2_rank_ddp_each_rank_keeps_its_rng_and_a_resumed_run_ends_equal(tmp_path):
    """torchrun, 2 ranks: checkpoints hold one RNG state per rank (model and optimizer once) and
    rank 0's trainer state (a 1-layer model, where DCP's de-duplication would keep rank 1's copy
    of an item both ranks stage), and a run resumed from checkpoint-10 ends with the
    uninterrupted run's weights and moments."""
    out = str(tmp_path / "run")
    torchrun_training(out, "--layers", "1", "--final", str(tmp_path / "full.pt"))
    last = os.path.join(out, "checkpoint-20")
    saved = dcp.FileSystemReader(last).read_metadata().state_dict_metadata
    assert {k.split(".")[0] for k in saved} == {"model", "optimizer", "scheduler", "rng_0", "rng_1", "trainer_state"}
    trainer_state = {"trainer_state": ""}
    dcp.load(trainer_state, checkpoint_id=last, no_dist=True)
    assert json.loads(trainer_state["trainer_state"])["is_world_process_zero"] is True
    resumed = str(tmp_path / "resumed")
    shutil.copytree(out, resumed)
    torchrun_training(resumed, "--layers", "1", "--resume", os.path.join(resumed, "checkpoint-10"),
                      "--final", str(tmp_path / "resumed.pt"))
    full, again = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert_same(full["model"], again["model"])
    for param, moments in full["optimizer"]["state"].items():
        assert_same(moments, again["optimizer"]["state"][param])


def test_the_example_trains_resumes_and_exports(tmp_path):
    """examples/transformers_trainer.py as `make example-transformers` runs it, smaller: a fresh
    run, then one that resumes (its self-checks exit non-zero when they fail)."""
    example = os.path.join(os.path.dirname(HERE), "examples", "transformers_trainer.py")
    for extra in (["--fresh", "--steps", "12"], ["--steps", "22"]):
        done = run_cpu_script([sys.executable, example, "--dir", str(tmp_path), *extra], timeout_s=300)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "checkpoint-12 (step 12): weights equal the checkpoint" in done.stdout
    assert "trained to step 22; committed checkpoints kept: checkpoint-20, checkpoint-22" in done.stdout  # Trainer saves at the end too
    assert sorted(os.listdir(tmp_path / "hf_model-22")) == ["config.json", "model.safetensors"]  # config.json: the checkpoint's


def test_a_configuration_it_cannot_honour_fails_at_construction(tmp_path):
    class KeepLast(AsyncCheckpointTrainer):
        checkpoint_config = CheckpointConfig(keep_last=2)

    class Lazy(AsyncCheckpointTrainer):
        checkpoint_config = CheckpointConfig(staging="lazy")

    with pytest.raises(ValueError, match="save_total_limit"):
        hf_trainer.make_trainer(str(tmp_path), trainer_class=KeepLast)
    with pytest.raises(ValueError, match="lazy"):  # the next step would change the state before the copy ends
        hf_trainer.make_trainer(str(tmp_path), trainer_class=Lazy)
    assert not os.listdir(tmp_path)


def test_an_optimizer_holding_a_parameter_outside_the_model_fails_the_save_clearly(tmp_path):
    extra = torch.nn.Parameter(torch.zeros(3))

    class ExtraParameter(AsyncCheckpointTrainer):
        def create_optimizer(self, model=None):
            self.optimizer = torch.optim.AdamW(list(self.model.parameters()) + [extra], lr=1e-3)
            return self.optimizer

    trainer = hf_trainer.make_trainer(str(tmp_path / "run"), trainer_class=ExtraParameter, max_steps=5)
    with pytest.raises(CheckpointError, match="every parameter it holds must be one of the model's"):
        trainer.train()
    assert not os.path.exists(tmp_path / "run" / "checkpoint-5" / METADATA)


def test_resume_from_a_folder_no_save_committed_names_the_problem(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-5").mkdir(parents=True)
    trainer = hf_trainer.make_trainer(str(out))
    with pytest.raises(Exception, match="never committed"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-5"))
    assert isinstance(trainer, AsyncCheckpointTrainer)


def test_with_the_memory_tier_a_resume_loads_the_checkpoint_from_memory_as_from_its_files(tmp_path, caplog):
    """memory_tier=True (memory_keep: the file outlives the first run, as after a crash): the
    resumed run loads checkpoint-10 from the memory copy of that very save, not from its files,
    and ends bitwise as a run resumed from the files. A copy of another save is not used."""
    out, shm = str(tmp_path / "run"), tmp_path / "shm"
    shm.mkdir()
    config = CheckpointConfig(memory_tier=True, memory_dir=str(shm), memory_keep=True)
    first = hf_trainer.make_trainer(out, max_steps=10)
    first.checkpoint_config = config
    first.train()
    assert os.listdir(shm), "the memory copy outlives the run"
    shutil.copytree(out, str(tmp_path / "disk"))  # another folder: no memory copy of its own
    from_disk = hf_trainer.make_trainer(str(tmp_path / "disk"), max_steps=15)
    from_disk.train(resume_from_checkpoint=str(tmp_path / "disk" / "checkpoint-10"))
    resumed = hf_trainer.make_trainer(out, max_steps=15)
    resumed.checkpoint_config = config
    with caplog.at_level("INFO", logger="asyncckpt"):
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-10"))
    loaded = [r.getMessage() for r in caplog.records if "from memory" in r.getMessage()]
    assert any(os.path.join(out, "checkpoint-10") in m for m in loaded), loaded
    assert_same(final_state(resumed), final_state(from_disk))
    caplog.clear()
    again = hf_trainer.make_trainer(out, max_steps=6)
    again.checkpoint_config = config
    with caplog.at_level("INFO", logger="asyncckpt"):
        again.train(resume_from_checkpoint=os.path.join(out, "checkpoint-5"))  # memory holds checkpoint-15's save
    assert not [r for r in caplog.records if "from memory" in r.getMessage()]


def test_a_preemption_signal_stops_training_at_that_step_and_the_staged_save_commits(tmp_path, uninterrupted):
    """SIGTERM at step 12 (the save of step 10 staged): training stops at the end of that step,
    train() returns with checkpoint-10 committed (no new save), and a resume from it ends equal
    to the run that was never stopped."""
    import signal

    class SignalAt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 12:
                os.kill(os.getpid(), signal.SIGTERM)

    out = str(tmp_path / "run")
    before = signal.getsignal(signal.SIGTERM)
    trainer = hf_trainer.make_trainer(out, callbacks=[SignalAt()])
    trainer.checkpoint_config = CheckpointConfig(preemption_signals=(signal.SIGTERM,), grace_s=120)
    trainer.train()
    assert trainer.state.global_step == 12
    assert checkpoint_dirs(out) == ["checkpoint-5", "checkpoint-10"]
    assert all(METADATA in os.listdir(os.path.join(out, d)) for d in checkpoint_dirs(out))
    assert signal.getsignal(signal.SIGTERM) == before  # given back with the checkpointer
    resumed = hf_trainer.make_trainer(out)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == hf_trainer.STEPS
    assert_same(final_state(resumed), uninterrupted[1])
