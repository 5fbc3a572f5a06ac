#!/usr/bin/env python
"""Draw a pipeline schedule as a per-rank timeline PNG, with its bubble fraction.

From a run:   python tools/plot_pipeline_timeline.py --record DIR --output timeline.png
              (DIR is what pretrain_gpt.py --record-pipeline-timeline DIR wrote)
From a table: python tools/plot_pipeline_timeline.py --pp 4 --vp 2 --microbatches 8 --output ideal.png
              (the pure schedule on an ideal machine, backward = 2 x forward)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config.domain import domain_option, size  # noqa: E402
from megalite.launch.tool_errors import atomic_output, tool_main  # noqa: E402
from megalite.pipeline.schedule_table import ScheduleSpec, build_tables, simulate  # noqa: E402

Event = tuple[str, int, int, float, float]  # kind, chunk, micro-batch, start, end

MAX_PLOTTED = 4096  # stages, chunks or micro-batches past this make no readable picture (and a slow table)


def load_record(directory: str) -> tuple[dict[int, list[Event]], dict]:
    """Per pipeline rank events of the first TP/DP replica of a recorded run."""
    files = sorted(glob.glob(os.path.join(directory, "rank*.json")))
    if not files:
        raise SystemExit(f"--record: no rank*.json files in {directory}")
    per_stage: dict[int, list[Event]] = {}
    meta = {}
    for path in files:
        with open(path) as f:
            rec = json.load(f)
        if rec["tp_rank"] == 0 and rec["dp_rank"] == 0:
            per_stage[rec["pp_rank"]] = [tuple(e) for e in rec["timeline"]]
            meta = {k: rec[k] for k in ("pp", "vp", "microbatches", "schedule")}
    t0 = min(e[3] for events in per_stage.values() for e in events)
    return {r: [(k, c, m, s - t0, e - t0) for k, c, m, s, e in ev] for r, ev in per_stage.items()}, meta


def from_table(pp: int, vp: int, m: int, kind: str) -> dict[int, list[Event]]:
    trace = simulate(build_tables(ScheduleSpec(pp, vp, m, kind)), pp, vp)
    return {r: [(a.kind, a.chunk, a.microbatch, s, e) for a, s, e in t] for r, t in trace.items()}


def bubble(events: dict[int, list[Event]]) -> float:
    """Mean over ranks of idle time / busy time within the step's span (compare with (p-1)/(v*m))."""
    start = min(e[3] for ev in events.values() for e in ev)
    end = max(e[4] for ev in events.values() for e in ev)
    fracs = []
    for ev in events.values():
        busy = sum(e[4] - e[3] for e in ev)
        fracs.append((end - start - busy) / busy)
    return sum(fracs) / len(fracs)


def plot(events: dict[int, list[Event]], title: str, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = len(events)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.6 * pp))
    fwd = ["#1f77b4", "#6baed6", "#08519c", "#9ecae1"]
    bwd = ["#2ca02c", "#74c476", "#006d2c", "#a1d99b"]
    for rank, ev in events.items():
        for kind, chunk, mb, start, end in ev:
            color = (fwd if kind == "F" else bwd)[chunk % 4]
            ax.barh(pp - 1 - rank, end - start, left=start, height=0.8, color=color, edgecolor="black", linewidth=0.3)
            ax.text((start + end) / 2, pp - 1 - rank, f"{kind}{mb}", ha="center", va="center", fontsize=6,
                    color="white")
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"stage {pp - 1 - i}" for i in range(pp)])
    ax.set_xlabel("time (s)" if title.startswith("measured") else "time (forward = 1)")
    ax.set_title(title)
    fig.tight_layout()
    with atomic_output(output) as tmp:
        fig.savefig(tmp, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", help="directory written by --record-pipeline-timeline")
    domain_option(ap, "--pp", domain=size(MAX_PLOTTED), integer=True, help="pipeline size (table mode)")
    domain_option(ap, "--vp", domain=size(MAX_PLOTTED), integer=True, default=1,
                  help="model chunks per rank (table mode)")
    domain_option(ap, "--microbatches", domain=size(MAX_PLOTTED), integer=True,
                  help="micro-batches per step (table mode)")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--output", required=True, help="PNG file to write")
    a = ap.parse_args(argv)
    return tool_main("plot_pipeline_timeline.py", lambda: _main(ap, a))


def _main(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    if a.record:
        events, meta = load_record(a.record)
        p, v, m = meta["pp"], meta["vp"], meta["microbatches"]
        kind = f"measured {meta['schedule']}"
    elif a.pp and a.microbatches:
        events, p, v, m = from_table(a.pp, a.vp, a.microbatches, a.schedule), a.pp, a.vp, a.microbatches
        kind = f"ideal {a.schedule}"
    else:
        ap.error("give --record DIR, or --pp and --microbatches")
    b, formula = bubble(events), (p - 1) / (v * m)
    title = f"{kind}: p={p} v={v} m={m}  bubble {b:.3f} (formula (p-1)/(v*m) = {formula:.3f})"
    plot(events, title, a.output)
    print(f"{title}\nwrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
