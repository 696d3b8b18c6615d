"""The "zygote" of the kill loops (tests/save/test_crash_loop.py, test_memory_kill_loop.py): a
script that imports torch once, then on command from its stdin forks a trainer (`spawn ARGS...`:
the child calls the script's own `train(*ARGS, go_fd)`), lets it start (`go PID`) and reaps it
(`reap PID`), saying `spawned PID` / `exited PID STATUS` on its stdout. A forked trainer starts in
milliseconds, so a loop can kill dozens of them within CI's time."""

from __future__ import annotations

import os
import select
import subprocess
import textwrap

SERVE = """
go = {}  # trainer pid -> write end of its go pipe
for line in sys.stdin:
    command, *args = line.split()
    if command == "spawn":
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                for fd in [write_fd, *go.values()]:
                    os.close(fd)
                train(*args, read_fd)
            except BaseException:
                traceback.print_exc()  # to the zygote's stderr: os._exit below would swallow it
            finally:
                sys.stderr.flush()
                os._exit(1)
        os.close(read_fd)
        go[pid] = write_fd
        print("spawned", pid, flush=True)
    elif command == "go":
        os.write(go[int(args[0])], b"g")
    elif command == "reap":
        pid = int(args[0])
        os.close(go.pop(pid))
        _, status = os.waitpid(pid, 0)
        print("exited", pid, status, flush=True)
"""


def zygote_script(trainer: str) -> str:
    """The zygote's source: `trainer` (imports os, sys, traceback and defines `train(..., go_fd)`)
    followed by the command loop."""
    return textwrap.dedent(trainer) + SERVE


def read_line(stream, timeout_s: float) -> list[str]:
    """The zygote's next line, split; fails the test past `timeout_s`."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    assert ready, f"no line from the zygote within {timeout_s}s"
    return stream.readline().split()


def stop_zygote(zygote: subprocess.Popen, trainers) -> None:
    """Kill the trainers still alive (only if a check failed) and end the zygote, never leaving it
    running past the test."""
    for pid in trainers:
        if pid is not None:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    zygote.stdin.close()
    try:
        zygote.wait(30)
    except subprocess.TimeoutExpired:
        zygote.kill()
        zygote.wait(5)
