"""A Lightning fit checkpointing every N steps: asyncckpt's plugin (as configured by default:
incremental, so last.ckpt links the files of the top-k save just before it; and `-full`, every
save written whole) vs Lightning's AsyncCheckpointIO vs Lightning's default IO
(TorchCheckpointIO), against the same fit without checkpoints.

Every method runs the same CPU fit (an MLP, Adam, deterministic data) in this process with
ModelCheckpoint(every_n_train_steps=N, save_top_k=2, save_last=True), so each checkpoint event is
two saves (a top-k one and last.ckpt). Figures per method: total fit time (trainer.fit, which
includes the wait for saves still in flight at its end) and its overhead over the fit without
checkpoints run beside it (the median over `--rounds` such pairs); the time the training loop
was blocked per save (`trainer.save_checkpoint` as ModelCheckpoint calls it: gathering the state
and handing it to the IO plugin): the first event's two saves apart, then mean and max; and the
CPU time the fit (trainer and workers) used beyond the fit without checkpoints, a figure this
box's drifting speed hardly touches. Beside the paired overhead, the in-fit overhead needs no
pair: each fit's time beyond its own steps at their median speed (StepClock), less that excess
in the fit without checkpoints; the box's speed drifts over minutes, and this compares a fit with
itself. It counts everything a save adds to the fit except a slowdown of every step alike.

Both still move by several percent when another tenant's burst lands anywhere in a fit. The
local figures look only near the checkpoints, each against the steps just before it: an event's
cost is the time of the `--window` steps from it on (its blocked saves, and the steps slowed
while its writes run: a few steps here) less that of the `--window` steps before it; the
start's cost is the fit's set-up before its first step plus its first `--window` steps (the
worker starts beside them), less the next `--window` steps; the end's cost is the time from the
last step's start to fit's return (its saves, and the wait for their writes in teardown). A
fit's local total adds all of them (the start, every event, the end); the local overhead is
that total less its pair's, over the time of the fit's steps without checkpoints (median and
range over rounds).

Before the fits, the plugin's start-up alone (`--start-ups` fresh plugins): the worker processes
it spawns and their CPU seconds from the spawn until the worker is ready (psutil: the worker and
the processes it started), the cost a fit pays when no core is free for it. The parts are shown apart: the start, the first event (it pays one-time
costs) and the end as medians over rounds, the later events as the mean over all of them, each
less the same figure of the fits without checkpoints (Lightning's own work at those steps, e.g.
logging every 50 steps).

Two configurations run, each with every method side by side: the short one (40 steps, an event
every 10: a save every ~0.7 s of training, more checkpoint than training: no IO fits in 5% of
that) and a representative one (400 steps, an event every 100: several seconds of training
between events, as real jobs checkpoint far less often than every second).

    python benchmarks/bench_lightning.py                       # ~100 MB of state, about 20 minutes
    python benchmarks/bench_lightning.py --threads 1           # the fit on one core, one left free
    python benchmarks/bench_lightning.py --steps 0 --rounds 5  # the representative fit only, more rounds
    python benchmarks/bench_lightning.py --width 2048 --steps 80 --out bench_out/bench_lightning.json
    python benchmarks/bench_lightning.py --steps 0 --long-steps 0     # the plugin's start-up only
    python benchmarks/bench_lightning.py --report bench_out/bench_lightning.json  # its tables again
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import lightning as L
import psutil
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO as LightningAsyncIO
from torch.utils.data import DataLoader, TensorDataset

from asyncckpt import CheckpointConfig
from asyncckpt.doors.lightning import AsyncCheckpointIO


class MLP(L.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers = [torch.nn.Linear(64, width), torch.nn.GELU()]
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def fit(method: str, args, steps: int, every: int, root: str) -> dict:
    torch.manual_seed(0)
    x = torch.randn(steps * args.batch, 64)
    loader = DataLoader(TensorDataset(x, x[:, :8].sin()), batch_size=args.batch, shuffle=False)
    plugins = {"lightning-async": [LightningAsyncIO], "asyncckpt": [AsyncCheckpointIO],
               "asyncckpt-full": [lambda: AsyncCheckpointIO(CheckpointConfig())]}.get(method, [])
    plugins = [make() for make in plugins]
    clock = StepClock()
    callbacks = [clock] + ([] if method == "none" else [ModelCheckpoint(
        dirpath=os.path.join(root, method), monitor="train_loss", save_top_k=2, every_n_train_steps=every, save_last=True)])
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=plugins, callbacks=callbacks,
        enable_checkpointing=method != "none", logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    blocked: list[float] = []
    save = trainer.save_checkpoint

    def timed_save(*a, **kw):
        started = time.perf_counter()
        try:
            return save(*a, **kw)
        finally:
            blocked.append(time.perf_counter() - started)

    trainer.save_checkpoint = timed_save
    model = MLP(args.width, args.depth)
    cpu_before = _cpu_s()
    started = time.perf_counter()
    trainer.fit(model, loader)
    total = time.perf_counter() - started
    for plugin in plugins:
        if isinstance(plugin, AsyncCheckpointIO):
            plugin.close()  # its workers exit and are reaped: their CPU time joins ours
    cpu = _cpu_s() - cpu_before
    state_mb = sum(p.numel() * p.element_size() for p in model.parameters()) * 3 / 1e6  # weights + Adam's 2 moments
    # the first event's two saves are reported apart (first use of the IO)
    step_s = statistics.median(b - a for a, b in zip(clock.starts, clock.starts[1:]))
    return {"method": method, "fit_s": total, "cpu_s": cpu, "saves": len(blocked), "state_mb": state_mb,
            "blocked_first_event_s": blocked[:2], "blocked_steady_s": blocked[2:],
            "median_step_s": step_s, "excess": total / (steps * step_s) - 1,
            **local_costs(started, clock.starts, started + total, every, args.window)}


def local_costs(fit_start: float, starts: list[float], fit_end: float, every: int, window: int) -> dict:
    """The fit's time near its checkpoints, each part against the steps just before it (see the
    module's docstring): the start, each event that has `window` steps after it, the end."""
    window = min(window, (every - 1) // 2)  # the start's steps and the first event's stay apart
    steps = [b - a for a, b in zip(starts, starts[1:])]  # steps[i]: step i, its checkpoint event included
    events = range(every - 1, len(steps) - window + 1, every)
    return {
        "start_cost_s": starts[0] - fit_start + sum(steps[:window]) - sum(steps[window:2 * window]),
        "event_costs_s": [sum(steps[i:i + window]) - sum(steps[i - window:i]) for i in events],
        "end_s": fit_end - starts[-1], "steps_s": steps,
    }


class StepClock(L.Callback):
    """When each training step starts. A fit's median step (start to start) is its speed with no
    checkpoint near, on this box at that minute; what the fit took beyond `steps` such steps is
    its excess (set-up, blocked saves, steps slowed by background work, the final wait)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())


METHODS = ("none", "default", "lightning-async", "asyncckpt", "asyncckpt-full")


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the plugin's workers once closed)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def plugin_start_up(rounds: int) -> dict:
    """The plugin's start-up, `rounds` fresh plugins one after another: the processes it spawns
    (its workers) and their CPU seconds, with the processes they start, until the worker is ready."""
    cpu_s, workers = [], []
    for _ in range(rounds):
        ours = psutil.Process()
        before = {child.pid for child in ours.children()}
        plugin = AsyncCheckpointIO()  # spawns its worker now (global rank 0)
        try:
            deadline = time.monotonic() + 120
            while True:
                with plugin._saves.lock:
                    if plugin._saves.ensure_saver().worker_ready:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("the plugin's worker did not start within 120 s")
                time.sleep(0.01)
            spawned = [child for child in ours.children() if child.pid not in before]
            processes = spawned + [child for process in spawned for child in process.children(recursive=True)]
            cpu_s.append(sum(sum(process.cpu_times()[:2]) for process in processes))  # user + system
            workers.append(sum("spawn_main" in " ".join(child.cmdline()) for child in spawned))  # (not
            # multiprocessing's resource tracker, which the first spawn of a process starts: its CPU counts)
        finally:
            plugin.close()
    result = {"rounds": rounds, "workers": workers, "cpu_s": cpu_s, "load_average": os.getloadavg()[0]}
    report_start_up(result)
    return result


def report_start_up(result: dict) -> None:
    cpu = result["cpu_s"]
    print(f"plugin start-up: {max(result['workers'])} worker process(es) spawned; CPU until ready "
          f"{statistics.median(cpu):.2f} s (median of {len(cpu)}: {', '.join(f'{c:.2f}' for c in cpu)}); "
          f"load average {result['load_average']:.1f}", flush=True)


def run_config(args, steps: int, every: int, root: str) -> dict:
    """Every method's fit in one configuration, each paired with a fit without checkpoints run
    right before or after it (alternating), `args.rounds` times. This shared box's speed drifts
    by 10-20 % over minutes, far more than the few percent measured: a method's overhead is the
    median over rounds of its fit time over its own pair's fit without checkpoints. The fits
    without checkpoints are kept in pair order (`_pairs`)."""
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for round_ in range(args.rounds):
        for method in METHODS[1:]:
            order = (method, "none") if (round_ + METHODS.index(method)) % 2 else ("none", method)
            for which in order:
                runs[which].append(fit(which, args, steps, every, root))
                shutil.rmtree(os.path.join(root, which), ignore_errors=True)
        print(f"  round {round_ + 1}/{args.rounds} done", flush=True)
    result = {"steps": steps, "every": every, "runs": runs, "threads": torch.get_num_threads(),
              "cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}
    result["rows"] = report(result)
    return result


def _pairs(runs: dict, method: str) -> list[tuple[dict, dict]]:
    """(the method's fit, the fit without checkpoints beside it) per round."""
    index = METHODS.index(method) - 1
    return [(fit_, runs["none"][round_ * (len(METHODS) - 1) + index]) for round_, fit_ in enumerate(runs[method])]


def _local_total_s(run: dict) -> float:
    """A fit's time near its checkpoints beyond the steps just before them: the start, every
    event and the end."""
    return run["start_cost_s"] + sum(run["event_costs_s"]) + run["end_s"]


def _median_or_nan(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def _mean_or_nan(values) -> float:
    values = list(values)
    return statistics.mean(values) if values else float("nan")


def report(result: dict) -> list[dict]:
    """Print one configuration's table (see the module's docstring) and return its rows."""
    runs, steps = result["runs"], result["steps"]
    none = runs["none"]
    baseline = statistics.median(r["fit_s"] for r in none)
    baseline_cpu = statistics.median(r["cpu_s"] for r in none)
    baseline_steps_s = statistics.median(r["median_step_s"] for r in none) * steps
    none_parts = _local_parts(none)
    table = []
    for method in METHODS[1:]:
        pairs = _pairs(runs, method)
        ratios = [ours["fit_s"] / theirs["fit_s"] for ours, theirs in pairs]
        in_fit = [ours["excess"] - theirs["excess"] for ours, theirs in pairs]
        local = [(_local_total_s(ours) - _local_total_s(theirs)) / baseline_steps_s for ours, theirs in pairs]
        parts = {part: cost - none_parts[part] for part, cost in _local_parts(runs[method]).items()}
        steady = [b for r in runs[method] for b in r["blocked_steady_s"]]
        table.append({
            "method": method, "fit_s": statistics.median(r["fit_s"] for r in runs[method]),
            "fits_s": [r["fit_s"] for r in runs[method]], "saves": runs[method][0]["saves"],
            "overhead": statistics.median(ratios) - 1, "overhead_range": (min(ratios) - 1, max(ratios) - 1),
            "in_fit_overhead": statistics.median(in_fit), "in_fit_range": (min(in_fit), max(in_fit)),
            "local_overhead": statistics.median(local), "local_range": (min(local), max(local)),
            "start_cost_s": parts["start"], "first_event_cost_s": parts["first_event"],
            "event_cost_s": parts["event"], "end_cost_s": parts["end"],
            "extra_cpu_s": statistics.median(r["cpu_s"] for r in runs[method]) - baseline_cpu,
            "blocked_first_event_s": [statistics.median(r["blocked_first_event_s"][i] for r in runs[method])
                                      for i in range(len(runs[method][0]["blocked_first_event_s"]))],
            "blocked_mean_s": statistics.mean(steady) if steady else 0.0, "blocked_max_s": max(steady, default=0.0),
        })
    step_s = baseline / steps
    every = result["every"]
    load = result.get("load_average")
    print(f"\nstate {none[0]['state_mb']:.0f} MB, {steps} steps ({step_s:.3f} s each), a checkpoint event every "
          f"{every} steps ({every * step_s:.1f} s of training; 2 saves each: top-k + last); fit without checkpoints "
          f"{baseline:.2f} s (median of {len(none)}); the fit on {result['threads']} of {result['cpus']} cores; "
          f"load average {'n/a' if load is None else f'{load:.1f}'}")
    print(f"in-fit: the fit's time beyond {steps} of its own median steps, less the same excess of its pair's fit "
          f"without checkpoints (median {statistics.median(r['excess'] for r in none):.1%})")
    print(f"local: the start, each event and the end, each against the steps just before it, less the same in its "
          f"pair's fit without checkpoints, over {baseline_steps_s:.1f} s of steps; its parts (s): medians over rounds, "
          f"the events after the first a mean over all of them, less the same of the fits without checkpoints")
    print(f"{'method':<16} {'fit s':>8} {'overhead':>9} {'(min..max)':>16} {'in-fit':>7} {'(min..max)':>16} "
          f"{'local':>6} {'(min..max)':>16} {'start s':>8} {'1st event s':>12} {'event s':>8} {'end s':>7} "
          f"{'extra CPU s':>12} {'saves':>6} {'blocked 1st event':>18} {'blocked/save after':>19} {'max':>8}")
    for r in table:
        first = " + ".join(f"{b:.3f}" for b in r["blocked_first_event_s"])
        ranges = {name: f"({low:.1%}..{high:.1%})" for name, (low, high) in
                  (("overhead", r["overhead_range"]), ("in_fit", r["in_fit_range"]), ("local", r["local_range"]))}
        print(f"{r['method']:<16} {r['fit_s']:>8.2f} {r['overhead']:>8.1%} {ranges['overhead']:>16} "
              f"{r['in_fit_overhead']:>6.1%} {ranges['in_fit']:>16} {r['local_overhead']:>6.1%} {ranges['local']:>16} "
              f"{r['start_cost_s']:>8.3f} {r['first_event_cost_s']:>12.3f} {r['event_cost_s']:>8.3f} {r['end_cost_s']:>7.3f} "
              f"{r['extra_cpu_s']:>12.2f} {r['saves']:>6} {first:>17}s {r['blocked_mean_s']:>18.3f}s "
              f"{r['blocked_max_s']:>7.3f}s", flush=True)
    return table


def _local_parts(runs: list[dict]) -> dict:
    """The start, the first event and the end: medians over fits; the later events: the mean
    over every one of every fit (an occasional slow one counts)."""
    return {"start": statistics.median(r["start_cost_s"] for r in runs),
            "first_event": _median_or_nan(r["event_costs_s"][0] for r in runs if r["event_costs_s"]),
            "event": _mean_or_nan(c for r in runs for c in r["event_costs_s"][1:]),
            "end": statistics.median(r["end_s"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="the short fit's steps (0: skip it)")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--long-steps", type=int, default=400, help="the representative fit's steps (0: skip it)")
    parser.add_argument("--long-every", type=int, default=100, help="the representative fit's checkpoint interval")
    parser.add_argument("--threads", type=int, help="torch threads for the fits (default: torch's, every core); "
                        "fewer leaves cores free, as on a GPU node whose CPU is mostly idle")
    parser.add_argument("--window", type=int, default=20, help="steps after (and before) a checkpoint event that "
                        "its local cost counts (at most half the interval)")
    parser.add_argument("--rounds", type=int, default=3, help="pairs (a method, a fit without checkpoints) per method and configuration; medians")
    parser.add_argument("--start-ups", type=int, default=3, help="fresh plugins whose start-up CPU is measured "
                        "before the fits (0: none)")
    parser.add_argument("--dir", help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--report", metavar="JSON", help="print the tables of a run saved with --out, and run nothing")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        if saved.get("start_up"):
            report_start_up(saved["start_up"])
        for result in saved["configs"]:
            result.setdefault("threads", saved["args"].get("threads") or "all")  # runs saved before these were kept
            result.setdefault("cpus", "?")
            report(result)
        return
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    root = args.dir or tempfile.mkdtemp(prefix="bench_lightning_")
    configs = [(steps, every) for steps, every in ((args.steps, args.every), (args.long_steps, args.long_every)) if steps]
    results = []
    start_up = plugin_start_up(args.start_ups) if args.start_ups else None
    try:
        for steps, every in configs:
            results.append(run_config(args, steps, every, root))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"start_up": start_up, "configs": results, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
