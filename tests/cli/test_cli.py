"""The command line: `python -m asyncckpt ls|inspect|verify|bench` run for real in a subprocess
on checkpoints the library wrote; damage, torn saves and wrong paths give distinct exit codes."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import AsyncCheckpointer
from asyncckpt.cli import commands as cli
from conftest import REPO, Payload, clone_state, make_model_and_optimizer, make_state, rewrite_metadata, step_path, train_step



def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncckpt", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )



def flat_keys(obj, prefix: str = "") -> set[str]:
    """The keys DCP stores: dicts are walked; lists only when they hold tensors or dicts."""
    if isinstance(obj, dict):
        return set().union(*(flat_keys(v, f"{prefix}{k}.") for k, v in obj.items()))
    if isinstance(obj, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in obj):
        return set().union(*(flat_keys(v, f"{prefix}{i}.") for i, v in enumerate(obj)))
    return {prefix[:-1]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A root with committed steps 1 and 2 (latest) and a torn step 3 (data files, no .metadata)."""
    root = str(tmp_path_factory.mktemp("cli") / "ckpt")
    model, optimizer = make_model_and_optimizer()
    state = make_state(model, optimizer, step=1)
    state["extra"] = {"big": torch.arange(50_000, dtype=torch.float64), "ints": torch.arange(7, dtype=torch.int16)}
    with AsyncCheckpointer(root) as ckpt:
        ckpt.schedule_save(state, step=1)
        train_step(model, optimizer)
        ckpt.schedule_save(state, step=2)
        ckpt.finalize(blocking=True)
    os.makedirs(step_path(root, 3))
    for name in os.listdir(step_path(root, 2)):
        if name.endswith(".distcp"):
            shutil.copy(os.path.join(step_path(root, 2), name), step_path(root, 3))
    return root, clone_state(state)


def copy_of_step_2(saved, tmp_path) -> str:
    target = str(tmp_path / "step_00000002")
    shutil.copytree(step_path(saved[0], 2), target)
    return target


def test_ls_marks_the_torn_checkpoint_and_the_latest(saved):
    root, _ = saved
    result = run_cli("ls", root)
    assert result.returncode == 0, result.stderr
    rows = {name: [line for line in result.stdout.splitlines() if name in line] for name in
            ("step_00000001", "step_00000002", "step_00000003")}
    assert all(len(lines) == 1 for lines in rows.values()), result.stdout
    rows = {name: lines[0] for name, lines in rows.items()}
    assert "committed" in rows["step_00000001"] and "latest" not in rows["step_00000001"]
    assert "committed" in rows["step_00000002"] and "<- latest" in rows["step_00000002"]
    assert "torn" in rows["step_00000003"] and "committed" not in rows["step_00000003"]
    assert "latest" not in rows["step_00000003"]
    assert "3 checkpoints (2 committed, 1 torn)" in result.stdout


def test_ls_reads_metadata_safely_and_marks_refused_and_unreadable_checkpoints(saved, tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], root)
    marker = str(tmp_path / "pwned")
    rewrite_metadata(step_path(root, 1), lambda md: Payload(marker))
    shutil.copytree(step_path(root, 2), step_path(root, 4))
    with open(os.path.join(step_path(root, 4), ".metadata"), "wb") as f:
        f.write(b"not a pickle")

    result = run_in_process(capsys, "ls", root)
    assert result.returncode == cli.EXIT_UNREADABLE
    rows = {line.split()[-1] if "latest" not in line else line.split()[-3]: line.split()[1]
            for line in result.stdout.splitlines() if "step_" in line}
    assert rows == {"step_00000001": "refused", "step_00000002": "committed", "step_00000003": "torn",
                    "step_00000004": "unreadable"}, result.stdout
    assert "4 checkpoints (1 committed, 1 refused, 1 unreadable, 1 torn)" in result.stdout
    errors = result.stderr.splitlines()
    assert len(errors) == 2, result.stderr
    assert "step_00000001" in errors[0] and "refusing to unpickle posix.mkdir" in errors[0] and "--trusted" in errors[0]
    assert "step_00000004" in errors[1] and "cannot read" in errors[1]
    assert not os.path.exists(marker)


def test_trusted_reads_metadata_with_a_class_outside_the_allow_list(saved, tmp_path, capsys):
    step_dir = copy_of_step_2(saved, tmp_path)
    rewrite_metadata(step_dir, lambda md: dataclasses.replace(md, planner_data={"made": datetime.date(2024, 1, 1)}))
    for command in ("inspect", "verify"):
        result = run_in_process(capsys, command, step_dir)
        assert result.returncode == cli.EXIT_UNREADABLE and result.stdout == ""
        assert "refusing to unpickle datetime.date" in result.stderr and "--trusted" in result.stderr
    result = run_in_process(capsys, "inspect", "--trusted", step_dir)
    assert result.returncode == 0, result.stderr
    assert "model.0.weight" in result.stdout
    result = run_in_process(capsys, "verify", "--trusted", "-q", step_dir)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


def test_installed_console_script_lists_a_root(saved):
    script = os.path.join(os.path.dirname(sys.executable), "asyncckpt")
    if not os.path.exists(script):
        pytest.skip(f"{script}: console script not installed (pip install -e .)")
    result = subprocess.run([script, "ls", saved[0]], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "3 checkpoints (2 committed, 1 torn)" in result.stdout
    assert "<- latest" in next(line for line in result.stdout.splitlines() if "step_00000002" in line)


def test_inspect_lists_every_key_with_dtype_and_shape(saved):
    root, state = saved
    result = run_cli("inspect", step_path(root, 2))
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:] if line.strip()}
    expected = flat_keys(state)
    assert "model.0.weight" in expected and "meta.milestones" in expected
    assert expected <= set(rows), f"missing from inspect: {expected - set(rows)}"
    assert rows["model.0.weight"][1:4] == ["tensor", "float32", "64x32"]
    assert rows["extra.ints"][1:4] == ["tensor", "int16", "7"]
    assert rows["meta.name"][1] == "object"
    assert all(row[-1].endswith(".distcp") for key, row in rows.items() if key in expected)


def test_inspect_of_a_root_uses_the_latest_checkpoint(saved):
    root, state = saved
    result = run_cli("inspect", root)
    assert result.returncode == 0, result.stderr
    assert "step_00000002 (latest)" in result.stderr
    assert "extra.big" in result.stdout


def test_verify_passes_an_intact_checkpoint_with_a_progress_bar(saved):
    result = run_cli("verify", step_path(saved[0], 2))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout and "DAMAGED" not in result.stdout
    assert "100%" in result.stderr


def test_verify_names_file_and_tensor_of_a_flipped_byte(saved, tmp_path):
    step_dir = copy_of_step_2(saved, tmp_path)
    with open(os.path.join(step_dir, ".checksums.json")) as f:
        [entry] = [e for e in json.load(f)["items"] if e["fqn"] == "extra.big"]
    data_file = os.path.join(step_dir, entry["file"])
    with open(data_file, "rb") as f:
        item = f.read()[entry["start"] : entry["start"] + entry["length"]]
    raw = saved[1]["extra"]["big"].numpy().tobytes()
    position = entry["start"] + item.index(raw) + len(raw) // 2  # inside the tensor's own bytes
    with open(data_file, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x01]))

    result = run_cli("verify", step_dir)
    assert result.returncode == cli.EXIT_DAMAGED, result.stdout + result.stderr
    damaged = [line for line in result.stdout.splitlines() if line.startswith("DAMAGED")]
    assert len(damaged) == 1, result.stdout + result.stderr
    assert entry["file"] in damaged[0] and "extra.big" in damaged[0] and "checksum mismatch" in damaged[0]


def test_verify_reports_a_truncated_data_file(saved, tmp_path):
    step_dir = copy_of_step_2(saved, tmp_path)
    data_file = os.path.join(step_dir, "__0_0.distcp")
    os.truncate(data_file, os.path.getsize(data_file) // 2)
    result = run_cli("verify", step_dir)
    assert result.returncode == cli.EXIT_DAMAGED, result.stdout + result.stderr
    assert "__0_0.distcp" in result.stdout and "truncated" in result.stdout


def run_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """The same command through cli.main in this process (cheaper than a fresh interpreter)."""
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_torn_checkpoint_is_refused_with_its_own_exit_code(saved, capsys):
    torn = step_path(saved[0], 3)
    for result in (run_cli("inspect", torn), run_in_process(capsys, "verify", torn)):
        assert result.returncode == cli.EXIT_TORN
        assert "torn" in result.stderr and "step_00000003" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""


def test_missing_path_is_one_line_and_exit_code(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    for command in ("ls", "inspect", "verify"):
        result = run_cli(command, missing) if command == "ls" else run_in_process(capsys, command, missing)
        assert result.returncode == cli.EXIT_MISSING
        assert result.stderr.strip() == f"asyncckpt {command}: error: {missing}: no such directory"


def test_non_checkpoint_directory_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    for command in ("ls", "inspect", "verify"):
        result = run_cli(command, str(tmp_path)) if command == "verify" else run_in_process(capsys, command, str(tmp_path))
        assert result.returncode == cli.EXIT_NOT_CHECKPOINT
        assert "not a checkpoint" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = run_in_process(capsys, "inspect", str(tmp_path / "notes.txt"))
    assert result.returncode == cli.EXIT_NOT_CHECKPOINT and "is a file" in result.stderr


def test_ls_of_a_checkpoint_directory_points_to_inspect(saved, capsys):
    result = run_in_process(capsys, "ls", step_path(saved[0], 2))
    assert result.returncode == cli.EXIT_NOT_CHECKPOINT
    assert "not a root" in result.stderr and "inspect" in result.stderr


def test_help_texts(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("ls", "inspect", "verify", "bench", "exit codes"))
    description = out.split("positional arguments")[0]
    assert all(command in description for command in ("list", "inspect", "verify", "export", "benchmark"))
    for command in ("ls", "inspect", "verify"):
        with pytest.raises(SystemExit) as exited:
            cli.main([command, "--help"])
        out = capsys.readouterr().out
        assert exited.value.code == 0 and f"usage: asyncckpt {command}" in out
        assert ("--trusted" in out) == (command != "ls")
    with pytest.raises(SystemExit) as exited:
        cli.main(["frobnicate"])
    assert exited.value.code == cli.EXIT_USAGE


HELP_AND_USAGE_ERRORS = """
import json, sys
from asyncckpt.cli import commands as cli
codes = []
for argv in (["--help"], ["export", "--help"], ["frobnicate"], ["export", "CKPT", "OUT"]):
    try:
        codes.append(cli.main(argv))
    except SystemExit as exc:
        codes.append(exc.code)
print(json.dumps({"codes": codes, "torch imported": "torch" in sys.modules}))
"""


def test_help_and_usage_errors_answer_without_importing_torch():
    """--help (the tool's and a command's) and argument errors are answered before torch is
    imported: 0.05 s of CPU instead of 2 s."""
    done = subprocess.run([sys.executable, "-c", HELP_AND_USAGE_ERRORS], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"codes": [0, 0, cli.EXIT_USAGE, cli.EXIT_USAGE], "torch imported": False}
    assert "--hf" in done.stderr  # export without --hf: the usage error names it


def test_bench_passes_every_argument_through_and_returns_its_exit_code(tmp_path, monkeypatch):
    script = tmp_path / "bench_save.py"
    script.write_text(
        "import json, sys\n"
        f"json.dump(sys.argv[1:], open({str(tmp_path / 'argv.json')!r}, 'w'))\n"
        "sys.exit(7)\n"
    )
    monkeypatch.setattr(cli, "BENCH_SCRIPT", script)
    args = ["--help", "--size-gib", "0.1", "--plot=out.png", "-x", "--"]
    assert cli.main(["bench", *args]) == 7
    assert json.loads((tmp_path / "argv.json").read_text()) == args

    monkeypatch.setattr(cli, "BENCH_LOAD_SCRIPT", script)  # `bench load ...` runs the load benchmark
    assert cli.main(["bench", "load", "--size-mb", "64"]) == 7
    assert json.loads((tmp_path / "argv.json").read_text()) == ["--size-mb", "64"]

    monkeypatch.setattr(cli, "BENCH_SCRIPT", tmp_path / "missing.py")
    assert cli.main(["bench"]) == cli.EXIT_MISSING


REPO_PATH = Path(REPO).resolve()


def test_bench_scripts_are_found_in_this_checkout_and_a_missing_one_says_where_to_run_it(tmp_path, monkeypatch, capsys):
    assert cli.BENCH_SCRIPT == REPO_PATH / "benchmarks" / "bench_save.py" and cli.BENCH_SCRIPT.is_file()
    assert cli.BENCH_LOAD_SCRIPT.is_file()
    monkeypatch.setattr(cli, "BENCH_SCRIPT", tmp_path / "bench_save.py")  # as in an installed wheel
    assert cli.main(["bench"]) == cli.EXIT_MISSING
    err = capsys.readouterr().err
    assert "not installed with the package" in err and "source checkout" in err and "make bench" in err


def test_verify_of_a_stock_dcp_save_reads_every_item_back_and_says_it_has_no_checksums(tmp_path, capsys):
    path = str(tmp_path / "stock")
    dcp.save({"w": torch.arange(1000.0), "n": {"x": torch.ones(3)}, "obj": [1, "a"]}, checkpoint_id=path, no_dist=True)
    result = run_in_process(capsys, "verify", "-q", path)
    assert result.returncode == 0, result.stderr
    assert "no .checksums.json" in result.stderr and "stock dcp.save" in result.stderr
    assert "OK, 3 items" in result.stdout and "read back whole" in result.stdout and "no checksums" in result.stdout
    data = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp"))
    with open(data, "r+b") as f:  # cut short: an item no longer reads back whole
        f.truncate(os.path.getsize(data) // 2)
    result = run_in_process(capsys, "verify", "-q", path)
    assert result.returncode == cli.EXIT_DAMAGED and "DAMAGED" in result.stdout, (result.stdout, result.stderr)
