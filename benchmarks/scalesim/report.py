"""The simulator's table, its linear extrapolation to rank counts too large to run here, the
JSON and the log-log plot."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .measure import ScaleRow
from .write_cost import GiB, WriteCost

KiB, MiB = 1 << 10, 1 << 20
# (field, heading, scale, format): the table's columns after shape, ranks and method
COLUMNS = (
    ("chunks", "chunks", 1, "{:.0f}"),
    ("first_s", "first s", 1, "{:.2f}"),
    ("steady_s", "steady s", 1, "{:.2f}"),
    ("first_rank_sent", "rank sends 1st KiB", KiB, "{:.0f}"),
    ("steady_rank_sent", "rank sends KiB", KiB, "{:.0f}"),
    ("steady_rank_received", "rank gets KiB", KiB, "{:.1f}"),
    ("first_coordinator_received", "coord gets 1st MiB", MiB, "{:.1f}"),
    ("steady_coordinator_received", "coord gets MiB", MiB, "{:.1f}"),
    ("steady_beyond_results", "beyond results KiB", KiB, "{:.1f}"),
    ("metadata_bytes", ".metadata MiB", MiB, "{:.1f}"),
    ("metadata_write_s", "md write s", 1, "{:.2f}"),
    ("metadata_read_s", "md read s", 1, "{:.2f}"),
    ("metadata_our_read_s", "our read s", 1, "{:.2f}"),
    ("peak_mib", "peak MiB", 1, "{:.0f}"),
    ("files", "files", 1, "{:.0f}"),
    ("requests", "requests", 1, "{:.0f}"),
)
# not extrapolated: what one rank sends is its own plan or results (it does not grow with the
# ranks), requests change regime (multipart parts -> one PUT per file) as files shrink
FITTED = tuple(name for name, *_ in COLUMNS
               if name not in ("peak_mib", "first_rank_sent", "steady_rank_sent", "requests"))


@dataclass
class Fit:
    """y = intercept + per_rank * ranks (least squares on the measured rank counts): what a save
    costs grows with ranks through per-rank messages and per-chunk entries. `exponent` is the
    log-log slope over the measured counts (1.0: linear)."""

    intercept: float
    per_rank: float
    exponent: float

    def at(self, ranks: int) -> float:
        return self.intercept + self.per_rank * ranks


def fit(points: list[tuple[int, float]]) -> Optional[Fit]:
    points = [(n, y) for n, y in points if y is not None]
    if len(points) < 2:
        return None
    slope, intercept = _least_squares([n for n, _ in points], [y for _, y in points])
    positive = [(math.log(n), math.log(y)) for n, y in points if y > 0]
    exponent = _least_squares(*zip(*positive))[0] if len(positive) >= 2 else float("nan")
    return Fit(intercept, slope, exponent)


def _least_squares(xs, ys) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def fits(rows: list[ScaleRow]) -> dict[tuple[str, str], dict[str, Fit]]:
    """Per (shape, method): a fit of every figure over ranks."""
    out: dict[tuple[str, str], dict[str, Fit]] = {}
    for key in sorted({(r.shape, r.method) for r in rows}):
        mine = [r for r in rows if (r.shape, r.method) == key]
        out[key] = {name: f for name in FITTED if (f := fit([(r.ranks, getattr(r, name)) for r in mine]))}
        traced = [r for r in mine if r.peak_mib is not None]
        chunks = out[key].get("chunks")
        if traced and chunks:  # peak memory is traced at one rank count: it grows with the chunks
            ratio = traced[-1].peak_mib / traced[-1].chunks
            out[key]["peak_mib"] = Fit(chunks.intercept * ratio, chunks.per_rank * ratio, chunks.exponent)
    return out


def extrapolate(rows: list[ScaleRow], targets: list[int]) -> list[dict]:
    """Every figure at each target rank count beyond the measured ones, from the fits."""
    out = []
    for (shape, method), figures in fits(rows).items():
        largest = max(r.ranks for r in rows if (r.shape, r.method) == (shape, method))
        for n in targets:
            if n > largest:
                values = {name: f.at(n) for name, f in figures.items()}
                out.append({"shape": shape, "ranks": n, "method": method, "extrapolated": True,
                            **{name: v for name, v in values.items() if v >= 0}})  # below 0: noise around 0
    return out


def exponents(rows: list[ScaleRow]) -> dict[str, dict[str, float]]:
    """Growth exponents over the measured rank counts (1.0 = linear), for the JSON and the docs."""
    return {f"{shape} / {method}": {name: round(f.exponent, 2) for name, f in figures.items()}
            for (shape, method), figures in fits(rows).items()}


def table(rows: list, extrapolated: bool = False) -> str:
    head = ["shape", "ranks", "method"] + [h for _, h, _, _ in COLUMNS]
    body = []
    for r in rows:
        get = (lambda name: r.get(name)) if isinstance(r, dict) else (lambda name: getattr(r, name))
        ranks = f"~{get('ranks')}" if extrapolated else str(get("ranks"))
        cells = [get("shape"), ranks, get("method")]
        for name, _, scale, form in COLUMNS:
            value = get(name)
            cells.append("-" if value is None else form.format(value / scale))
        body.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    lines = ["  ".join(str(c).rjust(w) if i > 2 else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
             for cells in [head, ["-" * w for w in widths], *body]]
    return "\n".join(lines)


def steady_table(rows: list[ScaleRow]) -> str:
    """A steady save's coordinator seconds, run for real at many ranks."""
    lines = [f"{'ranks':>6}  {'method':9}  {'steady s CPU':>12}  {'steady s wall':>13}  {'coord gets KiB':>14}"]
    lines += [f"{r.ranks:6}  {r.method:9}  {r.steady_s:12.3f}  "
              f"{r.phases['steady_commit_wall_s'] + r.phases.get('steady_plan_wall_s', 0.0):13.3f}  "
              f"{r.steady_coordinator_received / KiB:14.1f}" for r in rows]
    return "\n".join(lines)


def coordination_at(ranks: int, steady: list[ScaleRow], beyond: list[dict], shape: str) -> tuple[float, str]:
    """A steady save's coordinator CPU at `ranks` without writing `.metadata`: measured there (the
    steady rows), else along their line, else the main fit's; and where the figure comes from."""
    ours = [r for r in steady if r.method == "asyncckpt"]
    exact = [r for r in ours if r.ranks == ranks]
    if exact:
        return exact[0].steady_s - exact[0].metadata_write_s, f"measured at {ranks} ranks"
    line = fit([(r.ranks, r.steady_s - r.metadata_write_s) for r in ours])
    if line is not None:
        return line.at(ranks), f"line through {', '.join(str(r.ranks) for r in ours)} ranks"
    for r in beyond:
        if (r["shape"], r["ranks"], r["method"]) == (shape, ranks, "asyncckpt"):
            return max(0.0, r.get("steady_s", 0.0) - r.get("metadata_write_s", 0.0)), "the main fit"
    return float("nan"), "no figure"


def write_table(costs: list[WriteCost], beyond: list[dict], steady: list[ScaleRow]) -> str:
    """The measured write costs per GiB; then, for asyncckpt at the largest extrapolated rank
    count, its `.metadata` written both ways, and the steady commit: the coordination (see
    `coordination_at`) plus the image's write at that size."""
    lines = [f"{'method':8}  {'CPU s/GiB':>9}  {'wall s/GiB':>10}"]
    lines += [f"{c.method:8}  {c.cpu_s_per_gib:9.3f}  {c.wall_s_per_gib:10.2f}" for c in costs]
    by_method = {c.method: c for c in costs}
    largest = max((r["ranks"] for r in beyond), default=None)
    for r in beyond:
        if r["ranks"] != largest or r["method"] != "asyncckpt" or "metadata_bytes" not in r:
            continue
        gib = r["metadata_bytes"] / GiB
        image, pieces = by_method["image"], by_method["pieces"]
        coordination, source = coordination_at(largest, steady, beyond, r["shape"])
        lines.append(f"{r['shape']} at ~{largest} ranks: .metadata {gib:.2f} GiB, written in "
                     f"{image.cpu_s_per_gib * gib:.2f} s CPU / {image.wall_s_per_gib * gib:.1f} s wall (image) vs "
                     f"{pieces.cpu_s_per_gib * gib:.2f} s CPU / {pieces.wall_s_per_gib * gib:.1f} s wall (pieces); "
                     f"steady commit ~{coordination + image.cpu_s_per_gib * gib:.2f} s CPU "
                     f"(coordination {coordination:.2f}, {source}, + write)")
    return "\n".join(lines)


PLOTTED = (("steady_s", "coordinator s, steady save", 1), ("first_s", "coordinator s, first save", 1),
           ("steady_coordinator_received", "coordinator receives, steady save (MiB)", MiB),
           ("metadata_bytes", ".metadata (MiB)", MiB))


def plot(rows: list[ScaleRow], targets: list[int], path: str) -> None:
    """Log-log: measured points (markers) and the fitted growth out to the largest target (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fitted = fits(rows)
    figure, axes = plt.subplots(2, 2, figsize=(12, 9))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    shapes = sorted({r.shape for r in rows})
    for ax, (name, title, scale) in zip(axes.flat, PLOTTED):
        for i, shape in enumerate(shapes):
            for method, style, marker in (("asyncckpt", "-", "o"), ("dcp", "--", "x")):
                mine = sorted((r for r in rows if (r.shape, r.method) == (shape, method)), key=lambda r: r.ranks)
                if not mine:
                    continue
                colour = colours[i % len(colours)]
                ax.plot([r.ranks for r in mine], [getattr(r, name) / scale for r in mine], style, marker=marker,
                        color=colour, label=f"{shape} {method}")
                f = fitted[(shape, method)].get(name)
                if f is not None and max(targets) > mine[-1].ranks:
                    xs = [mine[-1].ranks, max(targets)]
                    ax.plot(xs, [f.at(x) / scale for x in xs], ":", color=colour)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    figure.suptitle("asyncckpt (solid) vs DCP (dashed), measured; dotted: the linear fit out to the largest rank count")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
