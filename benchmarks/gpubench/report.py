"""The GPU benchmark's tables, ratios and the machine they came from."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from savebench.report import Ratio, fmt, machine_info

from .limits import LimitRow
from .loads import LoadRow
from .loop import LoopRow
from .saves import SaveRow

D2H_GOAL = 0.9  # steady blocked time at least 0.9x the pinned D2H copy's speed


def aligned(headers: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell: text left, numbers right; the last column (notes) free."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    widths[-1] = len(headers[-1])

    def line(cells: list[str]) -> str:
        out = [c.rjust(w) if looks_numeric(c) else c.ljust(w) for c, w in zip(cells, widths)]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def looks_numeric(cell: str) -> bool:
    return cell == "-" or cell.replace(".", "", 1).replace("-", "", 1).replace("+", "", 1).isdigit()


def limit_of(limits: list[LimitRow], name: str) -> Optional[float]:
    for row in limits:
        if row.name == name and row.status == "ok":
            return row.seconds
    return None


def render_limits(limits: list[LimitRow], nbytes: int) -> str:
    rows = [[r.name, r.status, fmt(r.seconds), fmt(r.gbps(nbytes), ".2f"), r.note] for r in limits]
    return aligned(["limit", "status", "s", "GB/s", "note"], rows)


def consistency(row: SaveRow) -> str:
    if row.consistent is None:
        return "-"
    return "yes" if row.consistent else f"FAILED at {row.difference}"


def render_saves(saves: list[SaveRow], limits: list[LimitRow]) -> str:
    d2h, write = limit_of(limits, "pinned D2H"), limit_of(limits, "raw write + fsync")
    rows = []
    for r in saves:
        blocked, durable = r.median("blocked_s"), r.median("durable_s")
        rows.append([
            r.label, r.status,
            fmt(r.fresh.blocked_s if r.fresh else None), fmt(r.fresh.durable_s if r.fresh else None),
            fmt(r.trained.blocked_s if r.trained else None), fmt(r.trained.durable_s if r.trained else None),
            fmt(blocked), fmt(r.median("call_s")), fmt(durable),
            fmt(blocked / d2h if blocked is not None and d2h else None, ".2f"),
            fmt(durable / write if durable is not None and write else None, ".2f"),
            consistency(r), r.note,
        ])
    headers = ["method", "status", "first blk s", "first dur s", "trained blk s", "trained dur s", "blocked s",
               "call s", "durable s", "blk/D2H", "dur/write", "consistent", "note"]
    return aligned(headers, rows)


def render_loop(loop: list[LoopRow]) -> str:
    baseline = loop[0]
    rows = []
    for r in loop:
        saves = len(r.save_call_s)
        rows.append([
            r.label, r.status, str(len(r.step_s)), str(saves), fmt(ms(r.median_s), ".1f"), fmt(ms(r.mean_s), ".1f"),
            fmt(r.slowdown(baseline, "median_s"), "+.1f") if r is not baseline else "-",
            fmt(r.slowdown(baseline, "mean_s"), "+.1f") if r is not baseline else "-",
            fmt(sum(r.save_call_s) / saves if saves else None), r.note,
        ])
    headers = ["loop", "status", "steps", "saves", "median ms", "mean ms", "median +%", "mean +%", "call/save s",
               "note"]
    return aligned(headers, rows)


def ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else 1000 * seconds


def render_loads(loads: list[LoadRow], limits: list[LimitRow], nbytes: int) -> str:
    read = limit_of(limits, "raw read (cold)")
    rows = []
    for r in loads:
        loaded = "-" if r.difference is None else ("yes" if not r.difference else f"WRONG at {r.difference}")
        rows.append([
            r.label, r.status, fmt(r.cold_s), fmt(gbps(nbytes, r.cold_s), ".2f"), fmt(r.warm_s),
            fmt(gbps(nbytes, r.warm_s), ".2f"), fmt(r.cold_s / read if r.cold_s and read else None, ".2f"),
            loaded, r.note,
        ])
    headers = ["load into the device", "status", "cold s", "cold GB/s", "warm s", "warm GB/s", "cold/raw read",
               "equal", "note"]
    return aligned(headers, rows)


def gbps(nbytes: int, seconds: Optional[float]) -> Optional[float]:
    return nbytes / seconds / 1e9 if seconds else None


def compute_ratios(saves: list[SaveRow], loads: list[LoadRow], limits: list[LimitRow]) -> list[Ratio]:
    """Blocked / pinned D2H time and durable / raw write time per save method, load / raw read per load."""
    d2h, write = limit_of(limits, "pinned D2H"), limit_of(limits, "raw write + fsync")
    read = limit_of(limits, "raw read (cold)")
    ratios = []
    for r in saves:
        blocked, durable = r.median("blocked_s"), r.median("durable_s")
        if blocked is None:
            continue
        ratios.append(Ratio(f"{r.label}: blocked / pinned D2H", blocked / d2h if d2h else None,
                            f"<= {1 / D2H_GOAL:.2f}", f"{fmt(blocked)}s / {fmt(d2h)}s"))
        ratios.append(Ratio(f"{r.label}: durable / raw write", durable / write if write else None, "~1",
                            f"{fmt(durable)}s / {fmt(write)}s"))
    for r in loads:
        for mode, seconds in (("cold", r.cold_s), ("warm", r.warm_s)):
            if seconds is not None:
                ratios.append(Ratio(f"{r.label} {mode} / raw read (cold)", seconds / read if read else None,
                                    "<= 1" if mode == "cold" else "info", f"{fmt(seconds)}s / {fmt(read)}s"))
    return ratios


def failures(saves: list[SaveRow], loads: list[LoadRow]) -> list[str]:
    """A line for every consistency check or load that did not hold the expected values."""
    lines = [f"!!! {r.label}: CONSISTENCY CHECK FAILED: {r.difference} did not hold its value at the call"
             for r in saves if r.consistent is False]
    lines += [f"!!! {r.label}: LOADED WRONG VALUES at {r.difference}" for r in loads if r.difference]
    return lines


def gpu_info(device: torch.device) -> dict[str, Any]:
    """The accelerator the numbers came from (empty on the CPU)."""
    if device.type != "cuda":
        return {}
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "total_memory_bytes": props.total_memory,
        "capability": f"{props.major}.{props.minor}",
        "count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def disk_info(directory: str) -> dict[str, str]:
    """The file system under `directory`: its mount point, type and device (from /proc/mounts)."""
    path = os.path.realpath(directory)
    best = {"mount": "", "type": "", "device": ""}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, kind = line.split()[:3]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best["mount"]):
                    best = {"mount": mount, "type": kind, "device": device}
    except OSError:
        pass
    return best


def machine(directory: str, device: torch.device) -> dict[str, Any]:
    """Where the numbers came from: host, torch, cores, memory, disk, GPU."""
    info = machine_info(directory)
    info["disk"] = disk_info(directory)
    info["gpu"] = gpu_info(device)
    info["device"] = str(device)
    return info
