"""`python -m asyncckpt ls|inspect|verify|export|bench`: look into checkpoints, export one, without writing code.

Exit codes: 0 ok, 1 damage found, 2 usage, 3 missing path, 4 not a checkpoint root/directory,
5 torn (never committed), 6 unreadable metadata or sidecar, 70 internal error; `bench` returns
the script's own. `verify` without a checksums sidecar (stock `dcp.save`) reads items back: 0 if whole."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

from ..command import cli_command
from ..errors import CheckpointError
from ..storage import Storage, storage_for

# The modules that read checkpoints import torch (1-2 s): each command imports them when it runs,
# so --help and argument errors answer at once (help texts spell .metadata and .checksums.json).

EXIT_DAMAGED, EXIT_USAGE, EXIT_MISSING, EXIT_NOT_CHECKPOINT, EXIT_TORN, EXIT_UNREADABLE = 1, 2, 3, 4, 5, 6
EXIT_INTERNAL = 70  # an unexpected exception (a bug): traceback on stderr
BENCH_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_save.py"  # in a source checkout
BENCH_LOAD_SCRIPT = BENCH_SCRIPT.with_name("bench_load.py")
CLI_TRUST_HINT = "pass --trusted (inspect, verify) to opt into full unpickling, only for checkpoints whose author you trust"


class CliError(Exception):
    """A one-line error for the user and the exit code that goes with it."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# paths -----------------------------------------------------------------------------------------
def _open_dir(path: str) -> tuple[Storage, str]:
    """The storage for `path` and the path normalized; raises if it is missing or not a directory."""
    path = path.rstrip("/") or "/"
    try:
        storage = storage_for(path)
    except CheckpointError as exc:
        raise CliError(str(exc), EXIT_UNREADABLE) from None
    if storage.is_symlink(path):
        path = storage.real_path(path)  # a symlinked root is fine; the library refuses links inside it
    if storage.is_dir(path):
        return storage, path
    if storage.exists(path):
        raise CliError(f"{path}: is a file, not a checkpoint root or directory", EXIT_NOT_CHECKPOINT)
    raise CliError(f"{path}: no such directory", EXIT_MISSING)


def _kind(storage: Storage, path: str) -> str:
    """"checkpoint" (committed), "torn" (a step directory without .metadata), "root" or "other"."""
    from ..layout import is_data_file, is_data_folder
    from ..layout import LATEST_FILE, METADATA_FILE, list_checkpoints, parse_step

    if storage.exists(storage.join(path, METADATA_FILE)):
        return "checkpoint"
    names = storage.list_dir(path)
    if parse_step(os.path.basename(path)) is not None or any(
        is_data_file(n) or (is_data_folder(n) and storage.is_dir(storage.join(path, n))) for n in names
    ):
        return "torn"
    if LATEST_FILE in names or list_checkpoints(path, storage):
        return "root"
    return "other"


def _checkpoint(path: str) -> tuple[Storage, str]:
    """A committed checkpoint directory; a root stands for the checkpoint `latest` names."""
    from ..layout import METADATA_FILE, latest_checkpoint

    storage, path = _open_dir(path)
    kind = _kind(storage, path)
    if kind == "torn":
        raise CliError(f"{path}: torn checkpoint (no {METADATA_FILE}: its save never committed)", EXIT_TORN)
    if kind == "other":
        raise CliError(f"{path}: not a checkpoint directory (no {METADATA_FILE}, no data files)", EXIT_NOT_CHECKPOINT)
    if kind == "root":
        info = latest_checkpoint(path)
        if info is None:
            raise CliError(f"{path}: checkpoint root without a committed checkpoint", EXIT_TORN)
        print(f"{path}: using {info.name} (latest)", file=sys.stderr)
        return storage, info.path
    return storage, path


def _open(path: str, trusted: bool = False):
    """The checkpoint, opened once through the library's safe path (restricted unpickling of
    `.metadata` unless `trusted`); a refused or unreadable `.metadata` is a CliError."""
    from ..loading.opened import open_checkpoint
    from ..layout import METADATA_FILE
    from ..loading.safety import TRUST_HINT

    try:
        return open_checkpoint(path, trusted=trusted)
    except Exception as exc:
        message = str(exc).replace(TRUST_HINT, CLI_TRUST_HINT)
        raise CliError(f"{path}: cannot read {METADATA_FILE}: {message}", EXIT_UNREADABLE) from None


# formatting ------------------------------------------------------------------------------------
def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    for limit, unit, scale in ((120, "s", 1), (7200, "m", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / scale:.0f}{unit}"
    return f"{seconds / 86400:.0f}d"


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> None:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]
    for row in [headers, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells).rstrip())


class _Progress:
    """A one-line text progress bar on stderr: redrawn at most ten times a second on a terminal,
    drawn once at the end otherwise (logs stay readable)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self._drawn = max(total, 1), 0, enabled, 0.0
        self.live = enabled and sys.stderr.isatty()

    def advance(self, n: int, label: str) -> None:
        self.done += n
        if self.live and time.monotonic() - self._drawn > 0.1:
            self._draw(label, end="")

    def _draw(self, label: str, end: str) -> None:
        width = shutil.get_terminal_size((80, 20)).columns - 1
        fraction = min(self.done / self.total, 1.0)
        line = f"[{'#' * int(fraction * 30):<30}] {fraction:4.0%} {_size(self.done)} / {_size(self.total)}  {label}"
        sys.stdout.flush()
        sys.stderr.write("\r" + line[:width].ljust(width) + end if self.live else line + end)
        sys.stderr.flush()
        self._drawn = time.monotonic()

    def clear(self) -> None:
        if self._drawn:
            sys.stderr.write("\r" + " " * (shutil.get_terminal_size((80, 20)).columns - 1) + "\r")
            self._drawn = 0.0

    def finish(self) -> None:
        if self.enabled:
            self._draw("done", end="\n")


# commands --------------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    from ..layout import LATEST_FILE, METADATA_FILE, list_checkpoints, read_latest_marker

    storage, root = _open_dir(args.root)
    kind = _kind(storage, root)
    if kind in ("checkpoint", "torn"):
        raise CliError(f"{root}: is a checkpoint directory, not a root (try: {cli_command()} inspect {root})", EXIT_NOT_CHECKPOINT)
    if kind == "other":
        raise CliError(f"{root}: not a checkpoint root (no step_NNNNNNNN directories, no {LATEST_FILE} file)", EXIT_NOT_CHECKPOINT)
    latest = read_latest_marker(root, storage)
    infos = list_checkpoints(root, storage)
    states = [_ls_state(storage, info) for info in infos]
    rows = [_ls_row(storage, info, state, latest) for info, (state, _) in zip(infos, states)]
    total = sum(row.pop() for row in rows)
    _table(["STEP", "STATE", "SIZE", "FILES", "AGE", "DIR", ""], rows, right={0, 2, 3, 4})
    counts = {state: sum(s == state for s, _ in states) for state in ("committed", "refused", "unreadable", "torn")}
    summary = ", ".join(f"{n} {state}" for state, n in counts.items() if n or state in ("committed", "torn"))
    print(f"{len(rows)} checkpoint{'s' * (len(rows) != 1)} ({summary}), {_size(total)}")
    if counts["torn"]:
        print(f"torn = no {METADATA_FILE}: the save never committed (or is still being written)")
    problems = [problem for _, problem in states if problem]
    for problem in problems:
        print(problem, file=sys.stderr)
    if latest is not None and latest not in {info.name for info in infos if info.committed}:
        print(f"warning: {LATEST_FILE} names {latest!r}, which is not a committed checkpoint here", file=sys.stderr)
    return EXIT_UNREADABLE if problems else 0


def _ls_state(storage: Storage, info) -> tuple[str, Optional[str]]:
    """"committed", "torn", or "refused"/"unreadable" with why: a committed checkpoint's
    `.metadata` is read the safe way (a crafted one is refused, never run)."""
    from ..layout import METADATA_FILE

    if not info.committed:
        return "torn", None
    try:
        _open(info.path)
    except CliError as exc:
        if not storage.exists(storage.join(info.path, METADATA_FILE)):
            return "torn", None  # retention removed it while we looked (it deletes .metadata first)
        return ("refused" if "refusing" in str(exc) else "unreadable"), str(exc)
    return "committed", None


def _ls_row(storage: Storage, info, state: str, latest: Optional[str]) -> list:
    """One table row (and, last, the size in bytes); a save in flight may change files meanwhile."""
    from ..layout import METADATA_FILE, list_files

    size, count, age = 0, 0, None
    try:
        for name in list_files(storage, info.path):
            file = storage.join(info.path, name)
            if storage.exists(file):
                size, count = size + storage.size(file), count + 1
        stamp = storage.join(info.path, METADATA_FILE) if info.committed else info.path
        modified = storage.modified_time(stamp)
        age = None if modified is None else time.time() - modified
    except OSError:
        pass  # vanished while we looked: a torn save being cleaned up
    mark = "<- latest" if info.name == latest else ""
    return [str(info.step), state, _size(size), str(count), _age(age), info.name, mark, size]


def cmd_inspect(args: argparse.Namespace) -> int:
    _, path = _checkpoint(args.path)
    metadata = _open(path, args.trusted).metadata
    places: dict[str, list] = {}
    for index, info in (metadata.storage_data or {}).items():
        places.setdefault(index.fqn, []).append(info)
    rows, tensor_bytes, object_bytes = [], 0, 0
    for fqn, item in metadata.state_dict_metadata.items():
        stored = places.get(fqn, [])
        files = ",".join(sorted({s.relative_path for s in stored})) or "-"
        on_disk = sum(s.length for s in stored)
        if hasattr(item, "chunks"):  # TensorStorageMetadata
            nbytes = item.size.numel() * item.properties.dtype.itemsize
            shape = "x".join(str(d) for d in item.size) or "scalar"
            dtype = str(item.properties.dtype).replace("torch.", "")
            rows.append([fqn, "tensor", dtype, shape, _size(nbytes), _size(on_disk), files])
            tensor_bytes += nbytes
        else:
            rows.append([fqn, "object", "-", "-", _size(on_disk), _size(on_disk), files])
            object_bytes += on_disk
    print(path)
    _table(["KEY", "KIND", "DTYPE", "SHAPE", "SIZE", "STORED", "FILE"], rows, right={4, 5})
    tensors = sum(r[1] == "tensor" for r in rows)
    print(f"{tensors} tensors ({_size(tensor_bytes)}), {len(rows) - tensors} objects ({_size(object_bytes)})")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """The library's verifier (verify.check_items), with a progress bar and one line per damaged item."""
    from ..formats import CHECKSUM_ALGORITHM, Sidecar
    from ..layout import CHECKSUMS_FILE
    from ..loading.verify import check_items, sidecar_belongs_to

    _, path = _checkpoint(args.path)
    opened = _open(path, args.trusted)
    storage, metadata, file = opened.storage, opened.metadata, opened.sidecar_file
    if file is None:  # stock dcp.save writes none: every item can still be read back whole
        print(f"{path}: no {CHECKSUMS_FILE} (no checksums were saved: stock dcp.save or checksums=False); "
              "reading every item back instead", file=sys.stderr)
        sidecar = Sidecar(CHECKSUM_ALGORITHM, None, [])
    else:
        try:
            sidecar = opened.sidecar()
        except CheckpointError as exc:
            raise CliError(str(exc), EXIT_UNREADABLE) from None
        if not sidecar_belongs_to(sidecar, metadata):
            raise CliError(f"{file} belongs to another save of this step (an interrupted re-save); cannot verify", EXIT_UNREADABLE)
    progress = _Progress(sum(info.length for info in (metadata.storage_data or {}).values()), enabled=not args.quiet)
    damaged, unchecked, total = 0, 0, 0
    for item in check_items(storage, path, metadata, sidecar, progress.advance):
        total, unchecked = total + 1, unchecked + (not item.checked)
        if item.problem:
            damaged += 1
            progress.clear()
            print(f"DAMAGED {item.relative_path}: {item.name}: {item.problem}", flush=True)
    progress.finish()
    note = f" ({unchecked} without a checksum: only read back)" if unchecked and file is not None else ""
    note = f" (it has no {CHECKSUMS_FILE}: no checksums to check, every item read back)" if file is None else note
    if damaged:
        print(f"{path}: {damaged} of {total} items damaged{note}")
        return EXIT_DAMAGED
    print(f"{path}: OK, {total} items, {_size(progress.done)} {'read back whole' if file is None else 'verified'}{note}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """The model of a checkpoint as a Hugging Face `save_pretrained` folder (export.py). Bad
    arguments (export's ValueError: a prefix without tensors, no model found, a non-empty OUT_DIR)
    exit 2; a checkpoint that cannot be read or exported, 6."""
    if not args.hf:
        raise CliError("name the output format: --hf (a Hugging Face save_pretrained folder)", EXIT_USAGE)
    from .export import DTYPES, export_hf, model_tensors

    _, path = _checkpoint(args.checkpoint)
    opened = _open(path, args.trusted)
    try:
        tensors = model_tensors(opened, args.prefix, DTYPES.get(args.dtype))
        if args.prefix is None:
            print(f"{path}: exporting the {len(tensors)} tensors under {tensors[0].prefix!r}", file=sys.stderr)
        total = sum(t.nbytes for t in tensors)
        progress = _Progress(total, enabled=not args.quiet)
        files = export_hf(opened, args.out_dir, max_shard_size=args.max_shard_size, dtype=args.dtype,
                          config_from=args.config_from, prefix=tensors[0].prefix, trusted=args.trusted,
                          progress=progress.advance)
    except (CheckpointError, ValueError, OSError) as exc:
        raise CliError(str(exc), EXIT_USAGE if isinstance(exc, ValueError) else EXIT_UNREADABLE) from None
    progress.finish()
    print(f"{args.out_dir}: {', '.join(files)} ({_size(total)} of tensors)")
    return 0


def cmd_bench(argv: list[str]) -> int:
    """Run the save benchmark (`bench load ...`: the load benchmark) with every argument passed
    through; its exit code is ours."""
    script = BENCH_LOAD_SCRIPT if argv[:1] == ["load"] else BENCH_SCRIPT
    argv = argv[1:] if argv[:1] == ["load"] else argv
    if not script.is_file():
        print(f"asyncckpt bench: error: the benchmarks are not installed with the package ({script} is not there); run it "
              "from a source checkout (`make bench`, or `python -m asyncckpt bench` with it on PYTHONPATH)", file=sys.stderr)
        return EXIT_MISSING
    try:
        code = subprocess.call([sys.executable, str(script), *argv])
    except KeyboardInterrupt:
        return 130
    return 128 - code if code < 0 else code


# entry point -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncckpt",
        description="Look into asyncckpt / PyTorch DCP checkpoints: list, inspect, verify, export; run the benchmarks.",
        epilog="exit codes: 0 ok, 1 damaged, 2 usage, 3 missing path, 4 not a checkpoint, 5 torn, 6 unreadable, 70 internal",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    where = "checkpoint directory, or a root (uses the checkpoint `latest` names)"
    _command(sub, cmd_ls, "ROOT", "checkpoint root (holds step_NNNNNNNN/ and latest)", "list the checkpoints of a root",
             "Table of the step directories in ROOT: step, state, size, files, age, which one `latest` names. "
             "State: committed, torn (no .metadata), or refused/unreadable (.metadata read safely "
             "names a class or a file it may not, or is damaged; exit 6).")
    inspect = _command(sub, cmd_inspect, "PATH", where, "list every tensor and object in a checkpoint",
                       "Every tensor and object of a committed checkpoint: dtype, shape, size, stored bytes, file.")
    verify = _command(sub, cmd_verify, "PATH", where, "re-read every item and check its checksum",
                      "Re-read every item of a committed checkpoint and check its checksum (CRC32C) from .checksums.json (none, e.g. stock dcp.save: read back); exit 1 on damage.")
    verify.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    export = sub.add_parser("export", help="write a checkpoint's model as a Hugging Face save_pretrained folder",
                            description="Write the model part of a checkpoint (asyncckpt's or any stock DCP one) as "
                            "safetensors files that transformers' from_pretrained loads, streaming one shard at a time.")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help=where)
    export.add_argument("out_dir", metavar="OUT_DIR", help="the folder to create (must not exist, or be empty)")
    export.add_argument("--hf", action="store_true", help="Hugging Face format (the one format so far; required)")
    export.add_argument("--max-shard-size", default="5GB", help="largest shard, as Hugging Face writes sizes "
                        "(5GB = 5*10^9 bytes, 100KB, 2GiB); one shard means model.safetensors and no index (default 5GB)")
    export.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="cast floating-point tensors to this dtype")
    export.add_argument("--config-from", metavar="DIR", help="copy config.json and tokenizer files from this folder "
                        "(default: the checkpoint's own folder when it holds config.json, as a Trainer checkpoint-N does)")
    export.add_argument("--prefix", help="the model's key prefix in the checkpoint (default: where asyncckpt's own "
                        "layouts keep it, model., train.model. or state_dict.; otherwise the candidates are listed)")
    export.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    export.set_defaults(func=cmd_export)
    for command in (inspect, verify, export):
        command.add_argument("--trusted", action="store_true", help="unpickle .metadata fully instead of refusing "
                             "classes outside DCP's: it can run code, so only for checkpoints whose author you trust")
    sub.add_parser("bench", add_help=False, help="run benchmarks/bench_save.py (bench load: bench_load.py), "
                   "every argument passed through (see bench --help, bench load --help)")
    return parser


def _command(sub, func, arg: str, arg_help: str, summary: str, description: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(func.__name__[4:], help=summary, description=description)
    parser.add_argument(arg.lower(), metavar=arg, help=arg_help)
    parser.set_defaults(func=func)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        print(f"asyncckpt {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `asyncckpt inspect ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception:  # a bug, not a verdict on the checkpoint: keep it apart from exit code 1
        traceback.print_exc()
        return EXIT_INTERNAL
