#!/usr/bin/env python
"""Draw a run's loss, learning rate, grad norm, loss scale and throughput curves into one PNG.

    python tools/plot_logs.py run.log --output run.png                 # a run's stdout (Megatron log lines)
    python tools/plot_logs.py a.log b.log --output compare.png         # several runs on the same axes
    python tools/plot_logs.py --tensorboard-dir tb/ --output run.png   # TensorBoard event files instead
    python tools/plot_logs.py run.log --output run.png --csv run.csv   # also the parsed values as CSV

Log lines are read wherever they appear (torchrun prefixes, other output in between). Every
"key: value" field of an iteration line is parsed, so fields added later are kept too. When a job was
restarted and logs an iteration again, the later value wins, and the restarts are counted. Skipped
(overflow) iterations are marked on the loss curve. matplotlib (Agg) is the only dependency; the
tensorboard package is needed only for --tensorboard-dir.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.launch.tool_errors import atomic_output, tool_main  # noqa: E402

ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|(.*)")
VALIDATION = re.compile(r"(validation|test) loss at iteration (\d+) \|(.*)")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)", re.IGNORECASE)


@dataclass
class Run:
    """Parsed series of one run: {field: {iteration: value}}."""

    label: str
    train: dict[str, dict[int, float]] = field(default_factory=dict)
    valid: dict[int, float] = field(default_factory=dict)
    restarts: int = 0

    def series(self, *names: str) -> tuple[str, list[int], list[float]] | None:
        """The first of ``names`` present (normalized: lower case, '-'/'_' as spaces), sorted by iteration."""
        for name in names:
            values = self.train.get(normalize(name))
            if values:
                its = sorted(values)
                return name, its, [values[i] for i in its]
        return None


def normalize(key: str) -> str:
    return re.sub(r"[-_\s]+", " ", key.strip().lower())


def _number(text: str) -> float | None:
    """The value of a field: its first number ("3.1E+00", "41.2%"), or the last one ("max_rss 320")."""
    found = NUMBER.findall(text)
    if not found:
        return None
    head = text.strip().split()[0].rstrip("%")
    return float(head) if NUMBER.fullmatch(head) else float(found[-1])


def parse_log(lines: Iterable[str], label: str = "run") -> Run:
    run = Run(label)
    last_it = 0
    for line in lines:
        m = ITERATION.search(line)
        if m:
            it = int(m[1])
            if it <= last_it:
                run.restarts += 1
            last_it = it
            for part in m[3].split(" | "):
                key, sep, value = part.partition(": ")
                number = _number(value) if sep else None
                if number is not None:
                    run.train.setdefault(normalize(key), {})[it] = number
            continue
        m = VALIDATION.search(line)
        if m and m[1] == "validation":
            for part in m[3].split(" | "):
                key, _, value = part.partition(": ")
                if normalize(key) == "lm loss value":
                    run.valid[int(m[2])] = float(value)
    return run


def read_tensorboard(directory: str, label: str | None = None) -> Run:
    """Scalars of every event file under ``directory`` (tags normalized like log fields)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("--tensorboard-dir needs the tensorboard package (pip install tensorboard)") from e
    files = glob.glob(os.path.join(directory, "**", "events.out.tfevents.*"), recursive=True)
    if not files:
        raise SystemExit(f"--tensorboard-dir: no events.out.tfevents.* files under {directory}")
    run = Run(label or os.path.basename(os.path.normpath(directory)))
    for folder in sorted({os.path.dirname(f) for f in files}):
        acc = EventAccumulator(folder, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            key = normalize(tag)
            points = {e.step: e.value for e in acc.Scalars(tag)}
            if "validation" in key and "loss" in key and "ppl" not in key:
                run.valid.update(points)
            else:
                run.train.setdefault(key, {}).update(points)
    return run


# Panels: title, candidate field names (log line names first, then Megatron's TensorBoard tags), y scale.
PANELS = [
    ("lm loss", ["lm loss"], "linear"),
    ("learning rate", ["learning rate"], "linear"),
    ("grad norm", ["grad norm"], "log"),
    ("loss scale", ["loss scale"], "log"),
    ("throughput (tokens/s)", ["tokens per second", "throughput tokens per sec", "tokens per sec"], "linear"),
    ("TFLOP/s per device", ["throughput per GPU (TFLOP/s/GPU)", "tflops per device", "throughput"], "linear"),
    ("time per iteration (ms)", ["elapsed time per iteration (ms)", "iteration time"], "linear"),
]


def _skipped(run: Run) -> list[int]:
    """Iterations whose log line reports a new skipped (overflow) step."""
    counts = run.train.get(normalize("number of skipped iterations"), {})
    out, before = [], 0.0
    for it in sorted(counts):
        if counts[it] > before:
            out.append(it)
        before = counts[it]
    return out


def plot(runs: list[Run], output: str, title: str | None = None) -> list[str]:
    """Write the PNG; returns the panels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, names, scale) for t, names, scale in PANELS if any(r.series(*names) for r in runs)]
    if not panels:
        raise SystemExit("no iteration lines or scalars found: is this a megalite/Megatron log?")
    cols = 2 if len(panels) > 1 else 1
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.2 * rows), squeeze=False)
    every = [i for r in runs for v in r.train.values() for i in v] + [i for r in runs for i in r.valid]
    span = (min(every) - 0.5, max(every) + 0.5)  # one iteration axis for all panels (a sparse grad norm too)
    for ax, (name, names, scale) in zip(axes.flat, panels):
        for run in runs:
            s = run.series(*names)
            if s is None:
                continue
            _, its, values = s
            style = dict(marker="." if len(its) < 60 else None, linewidth=1.2)
            ax.plot(its, values, label=run.label if len(runs) > 1 else "train", **style)
            if name == "lm loss":
                if run.valid:
                    vits = sorted(run.valid)
                    ax.plot(vits, [run.valid[i] for i in vits], "s--", markersize=4,
                            label=f"{run.label} validation" if len(runs) > 1 else "validation")
                skipped = [i for i in _skipped(run) if i in run.train.get("lm loss", {})]
                if skipped:
                    ax.plot(skipped, [run.train["lm loss"][i] for i in skipped], "rx",
                            label="skipped (overflow)")
        if scale == "log" and all(v > 0 for r in runs if (s := r.series(*names)) for v in s[2]):
            ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlim(*span)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if len(runs) > 1 or name == "lm loss":
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with atomic_output(output) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return [p[0] for p in panels]


def write_csv(runs: list[Run], path: str) -> None:
    keys = sorted({k for r in runs for k in r.train})
    with atomic_output(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "iteration", *keys, "validation lm loss"])
        for r in runs:
            for it in sorted({i for v in r.train.values() for i in v} | set(r.valid)):
                w.writerow([r.label, it, *(r.train.get(k, {}).get(it, "") for k in keys), r.valid.get(it, "")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("logs", nargs="*", help="stdout files of runs (pretrain_gpt.py / Megatron-LM log lines)")
    ap.add_argument("--tensorboard-dir", action="append", default=[], help="read TensorBoard event files")
    ap.add_argument("--output", "-o", required=True, help="PNG to write")
    ap.add_argument("--labels", nargs="+", help="legend names, one per log / TensorBoard dir")
    ap.add_argument("--title", help="figure title")
    ap.add_argument("--csv", help="also write the parsed values to this CSV file")
    args = ap.parse_args(argv)
    return tool_main("plot_logs.py", lambda: _main(ap, args))


def _main(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not args.logs and not args.tensorboard_dir:
        ap.error("give at least one log file or --tensorboard-dir")
    sources = [*args.logs, *args.tensorboard_dir]
    labels = args.labels or [os.path.basename(os.path.normpath(s)) for s in sources]
    if len(labels) != len(sources):
        ap.error(f"--labels: {len(labels)} names for {len(sources)} runs")
    runs = []
    for path, label in zip(args.logs, labels):
        if not os.path.isfile(path):
            ap.error(f"{path}: no such file")
        with open(path, errors="replace") as f:
            runs.append(parse_log(f, label))
    for directory, label in zip(args.tensorboard_dir, labels[len(args.logs):]):
        runs.append(read_tensorboard(directory, label))
    drawn = plot(runs, args.output, args.title)
    if args.csv:
        write_csv(runs, args.csv)
    for r in runs:
        loss = r.series("lm loss")
        span = f"lm loss {loss[2][0]:.4f} -> {loss[2][-1]:.4f} over iterations {loss[1][0]}-{loss[1][-1]}" if loss \
            else "no lm loss"
        extra = f", {r.restarts} restart(s)" if r.restarts else ""
        skipped = _skipped(r)
        extra += f", {len(skipped)} log line(s) with new skipped iterations" if skipped else ""
        print(f"{r.label}: {span}, {len(r.valid)} validation point(s){extra}")
    print(f"wrote {args.output} ({', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
