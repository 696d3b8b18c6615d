"""Probe and temp names are unique per host, process and call: ranks that share a pid (containers
on different nodes) or threads of one process preparing one directory or publishing one file
never trip over each other's probe or temp file."""

from __future__ import annotations

import multiprocessing
import os
import threading

from asyncckpt.loading.load import cleanup
from asyncckpt.storage import LocalStorage, unique_suffix

THREADS = 8
PROCESSES = 3
ROUNDS = 40


def _hammer(directory: str, target: str, tag: str) -> list[str]:
    """THREADS threads each prepare `directory` and publish `target` ROUNDS times; their errors."""
    storage = LocalStorage()
    errors: list[str] = []
    start = threading.Barrier(THREADS)

    def work(n: int) -> None:
        start.wait()
        for i in range(ROUNDS):
            try:
                storage.prepare_dir(directory)
                storage.write_atomic(target, f"{tag}-{n}-{i}".encode() * 100, fsync=False)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def _in_process(directory: str, target: str, tag: str, out) -> None:
    out.put(_hammer(directory, target, tag))


def test_threads_and_processes_prepare_one_directory_and_publish_one_file_concurrently(tmp_path):
    directory = str(tmp_path / "step_00000001")
    target = os.path.join(directory, "latest")
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_in_process, args=(directory, target, f"p{n}", results)) for n in range(PROCESSES)]
    for process in processes:
        process.start()
    try:
        errors = _hammer(directory, target, "main")
        for _ in processes:
            errors += results.get(timeout=120)
        for process in processes:
            process.join(30)
            assert process.exitcode == 0
    finally:  # a child left running would hang this pytest process's exit (multiprocessing joins it)
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    assert errors == [], errors[:5]
    content = open(target, "rb").read()
    assert len(content) % 100 == 0 and content == content[: len(content) // 100] * 100  # one writer's bytes, whole
    assert os.listdir(directory) == ["latest"]  # no probe or temp file left behind


def test_cleanup_recognises_leftover_probe_and_temp_names(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    names = [f".latest.tmp-{unique_suffix()}", f".asyncckpt-probe-{unique_suffix()}", ".latest.tmp-4242"]
    for name in names:
        (root / name).write_bytes(b"x")
    (root / "notes.tmp-1").write_bytes(b"mine")
    removed = cleanup(str(root))
    assert sorted(os.path.basename(p) for p in removed) == sorted(names)
    assert os.listdir(root) == ["notes.tmp-1"]
