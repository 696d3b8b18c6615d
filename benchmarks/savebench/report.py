"""The table, the ratios, the JSON and the plot."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Optional

import psutil
import torch

from .common import MiB, REPO_ROOT
from .runner import MethodResult


def fmt(value: Optional[float], spec: str = ".3f", suffix: str = "") -> str:
    """A number for the table, or "-" when there is none."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def annotate(results: list[MethodResult], state_bytes: int) -> None:
    """Notes that need more than one row (e.g. whether the staging budget lowered memory)."""
    by_name = {r.name: r for r in results}
    budget, thread = by_name.get("asyncckpt budget"), by_name.get("asyncckpt thread")
    if budget and thread and budget.status == "ok" and thread.status == "ok":
        b, t = budget.extra_memory(state_bytes), thread.extra_memory(state_bytes)
        if b is not None and t is not None and b > 0.8 * t:
            budget.add_note(f"peak extra {b:.2f}x vs {t:.2f}x without a budget: budget not honoured?")
    lazy = by_name.get("asyncckpt lazy")
    if lazy and lazy.wait_staged is not None:
        lazy.add_note(f"wait_staged {lazy.wait_staged:.3f}s")


def render_table(results: list[MethodResult], state_bytes: int, raw_gbps: Optional[float]) -> str:
    """The aligned results table."""
    headers = ["method", "status", "1st ctor s", "1st train s", "prep s", "blocked s", "durable s", "GB/s", "x raw",
               "x probe", "mem +x", "slowdown", "load", "note"]
    rows = []
    for r in results:
        s = r.summary(state_bytes, raw_gbps)
        prep = s["warm_up_s"] if r.name.startswith("asyncckpt") else None
        rows.append([
            r.name, r.status, fmt(s["first_blocked_s"]), fmt(s["first_trained_blocked_s"]), fmt(prep),
            fmt(s["blocked_s"]), fmt(s["durable_s"]),
            fmt(s["throughput_gbps"], ".2f"), fmt(s["fraction_of_raw"], ".2f"), fmt(s["fraction_of_raw_probe"], ".2f"),
            fmt(s["peak_extra_over_state"], ".2f"), fmt(s["slowdown"], ".2f", "*" if r.helper_thread else " "),
            f"{r.loadavg[0]:.1f}", r.note,
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if i < len(headers) - 1 else len(h)
              for i, h in enumerate(headers)]
    numeric = set(range(2, len(headers) - 1))

    def line(cells: list[str]) -> str:
        out = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(row) for row in rows)])


@dataclass
class Ratio:
    """A headline ratio, its target and the figures it was computed from."""

    name: str
    value: Optional[float]
    target: str
    detail: str


def compute_ratios(results: list[MethodResult], state_bytes: int) -> list[Ratio]:
    """The headline ratios the README's "Benchmark" section reports."""
    by = {r.name: r for r in results if r.status == "ok"}

    def get(name: str, attr: str) -> Optional[float]:
        r = by.get(name)
        return getattr(r, attr) if r is not None else None

    def div(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a is not None and b else None

    ack_blk, ack_dur = get("asyncckpt thread", "blocked"), get("asyncckpt thread", "durable")
    first = by.get("asyncckpt thread")
    first_blk = first.first.blocked_s if first and first.first else None
    trained_blk = first.first_trained.blocked_s if first and first.first_trained else None
    proc_dur, nock_dur = get("asyncckpt process", "durable"), get("asyncckpt no-checksums", "durable")
    s3_dur = get("asyncckpt s3", "durable")
    proxy_dur, faulty_dur = get("asyncckpt s3 proxy", "durable"), get("asyncckpt s3 1% 503", "durable")
    return [
        Ratio("asyncckpt blocked / memcpy", div(ack_blk, get("memcpy", "blocked")), "<= 1.5",
              f"{fmt(ack_blk)}s / {fmt(get('memcpy', 'blocked'))}s"),
        Ratio("torch.save+fsync / asyncckpt blocked", div(get("torch.save+fsync", "durable"), ack_blk), ">= 10",
              f"{fmt(get('torch.save+fsync', 'durable'))}s / {fmt(ack_blk)}s"),
        Ratio("dcp.async_save thread blocked / asyncckpt blocked", div(get("dcp.async_save thread", "blocked"), ack_blk),
              "> 1", f"{fmt(get('dcp.async_save thread', 'blocked'))}s / {fmt(ack_blk)}s"),
        Ratio("dcp.async_save process+gloo blocked / asyncckpt blocked",
              div(get("dcp.async_save process+gloo", "blocked"), ack_blk), "> 1",
              f"{fmt(get('dcp.async_save process+gloo', 'blocked'))}s / {fmt(ack_blk)}s"),
        Ratio("lazy blocked / eager blocked", div(get("asyncckpt lazy", "blocked"), ack_blk), "<< 1",
              f"{fmt(get('asyncckpt lazy', 'blocked'))}s / {fmt(ack_blk)}s"),
        Ratio("first right after the constructor / steady blocked (asyncckpt thread)", div(first_blk, ack_blk),
              "<= 6", f"{fmt(first_blk)}s / {fmt(ack_blk)}s"),
        Ratio("first after training, prepared / steady blocked (asyncckpt thread)", div(trained_blk, ack_blk),
              "<= 2", f"{fmt(trained_blk)}s / {fmt(ack_blk)}s"),
        Ratio("process / thread throughput", div(ack_dur, proc_dur), "~1",
              f"durable thread {fmt(ack_dur)}s, process {fmt(proc_dur)}s"),
        Ratio("checksum cost: durable with / without", div(ack_dur, nock_dur), "~1",
              f"{fmt(ack_dur)}s vs {fmt(nock_dur)}s"),
        Ratio("s3 / local disk throughput", div(ack_dur, s3_dur), "info",
              f"durable to local S3 server {fmt(s3_dur)}s, to local disk {fmt(ack_dur)}s (asyncckpt thread)"),
        Ratio("s3 throughput with 1% 503 SlowDown / without", div(proxy_dur, faulty_dur), ">= 0.8",
              f"durable {fmt(faulty_dur)}s with, {fmt(proxy_dur)}s without (both through the fault proxy)"),
        Ratio("slowdown nice0 / nice10", div(get("asyncckpt nice0", "slowdown"), get("asyncckpt thread", "slowdown")),
              ">= 1", f"{fmt(get('asyncckpt nice0', 'slowdown'), '.2f')} vs "
                      f"{fmt(get('asyncckpt thread', 'slowdown'), '.2f')}"),
        Ratio("slowdown process io / thread io", div(get("asyncckpt process", "slowdown"),
                                                      get("asyncckpt thread", "slowdown")), "<= 1",
              f"{fmt(get('asyncckpt process', 'slowdown'), '.2f')} vs "
              f"{fmt(get('asyncckpt thread', 'slowdown'), '.2f')}"),
    ]


def render_ratios(ratios: list[Ratio]) -> str:
    """The ratios, one aligned line each, with their targets and the figures behind them."""
    width = max(len(r.name) for r in ratios)
    lines = ["Ratios:"]
    for r in ratios:
        lines.append(f"  {r.name.ljust(width)}  {fmt(r.value, '.2f'):>7}   target {r.target:<7}  ({r.detail})")
    return "\n".join(lines)


def machine_info(directory: str) -> dict[str, Any]:
    """Where the numbers came from."""
    usage = shutil.disk_usage(directory)
    try:
        commit = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "disk_dir": os.path.abspath(directory),
        "disk_total_bytes": usage.total,
        "disk_free_bytes": usage.free,
        "loadavg": os.getloadavg(),
        "git_commit": commit,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write the raw results (numbers, machine, settings) as indented JSON."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def plot(results: list[MethodResult], state_bytes: int, path: str) -> None:
    """Bars of caller-blocked and time-to-durable seconds per method (log scale), first save as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok" and r.steady]
    names = [r.name for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(ok) + 2), sharey=True)
    panels = [("caller-blocked s", "blocked", "blocked_s"), ("time to durable s", "durable", "durable_s")]
    for ax, (title, attr, first_attr) in zip(axes, panels):
        values = [max(getattr(r, attr), 1e-4) for r in ok]
        firsts = [max(getattr(r.first, first_attr), 1e-4) for r in ok]
        ys = range(len(ok))
        ax.barh(ys, values, color=["tab:blue" if n.startswith("asyncckpt") else "tab:gray" for n in names])
        ax.scatter(firsts, ys, color="tab:red", marker="o", zorder=3, label="first save")
        for y, v in zip(ys, values):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
        ax.set_xscale("log")
        ax.set_title(f"{title} (median of steady saves)")
        ax.grid(axis="x", which="both", alpha=0.3)
    axes[0].set_yticks(range(len(ok)), names)
    axes[0].invert_yaxis()
    axes[1].legend(loc="lower right")
    fig.suptitle(f"bench_save: {state_bytes / MiB:.0f} MiB state")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
