"""How a message names the command-line tool: a command that works where this process runs.

`python -m asyncckpt` fails with a Python that does not have the library (the system's, when it
is installed in a venv); the `asyncckpt` script is on PATH only where that venv is active."""

from __future__ import annotations

import os
import shlex
import shutil
import sys


def cli_command() -> str:
    """`asyncckpt` when that script on PATH belongs to this interpreter's environment, else this
    interpreter with `-m asyncckpt` (relative to the working directory when below it)."""
    python = sys.executable
    if not python:
        return "python -m asyncckpt"
    bin_dir = os.path.dirname(os.path.abspath(python))
    script = shutil.which("asyncckpt")
    if script and os.path.dirname(os.path.abspath(script)) == bin_dir:
        return "asyncckpt"
    relative = os.path.relpath(os.path.abspath(python))
    shown = relative if not relative.startswith(os.pardir) else os.path.abspath(python)
    if os.sep not in shown:
        shown = os.path.join(os.curdir, shown)
    return f"{shlex.quote(shown)} -m asyncckpt"
