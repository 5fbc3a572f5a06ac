"""The accuracy the planner prints with every estimate (megalite/planning/accuracy.py) is the first runs of
every held-out round pooled, recomputed here from the rows (tests/planning_rows/first_runs.csv), which are
in turn the round tables docs/planning.md recorded at each first run; docs/planning.md and the README lead
with the same figures."""

from __future__ import annotations

import csv
import re
import statistics
from pathlib import Path

import pytest

from megalite.planning import accuracy
from megalite.planning.accuracy import BOUND, Accuracy, accuracy_lines
from tests.planning_rows.heldout import HELD_OUT, HELD_OUT_V2, HELD_OUT_V3, HELD_OUT_V4
from tests.planning_rows.heldout_v5 import HELD_OUT_V5

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "tests" / "planning_rows" / "first_runs.csv"
ROUNDS = [HELD_OUT, HELD_OUT_V2, HELD_OUT_V3, HELD_OUT_V4, HELD_OUT_V5]


def first_runs() -> list[dict]:
    with open(ROWS, newline="") as f:
        return [{**r, "round": int(r["round"]), "error": float(r["error_percent"]),
                 "fit": r["estimated_to_fit"] == "yes"} for r in csv.DictReader(f)]


def figures(rows: list[dict]) -> Accuracy:
    errors = [r["error"] for r in rows]
    return Accuracy(runs=len(rows), within=sum(abs(e) <= BOUND for e in errors),
                    median=round(statistics.median(abs(e) for e in errors), 4), low=min(errors), high=max(errors),
                    fit=sum(r["fit"] for r in rows))


def docs_round_tables() -> dict[int, dict[str, tuple[float, bool]]]:
    """Each round's first-run table in docs/planning.md: id -> (signed error %, estimated to fit), bound rows."""
    text = (ROOT / "docs" / "planning.md").read_text()
    out: dict[int, dict[str, tuple[float, bool]]] = {}
    pattern = r"^### Held-out results, round (\d) \(first and only run[^\n]*\n(.*?)(?=^#)"
    for m in re.finditer(pattern, text, re.S | re.M):
        lines = [line for line in m.group(2).splitlines() if line.startswith("| ")]
        head = [c.strip() for c in lines[0].strip("|").split("|")]
        table = out.setdefault(int(m.group(1)), {})
        for line in lines[1:]:
            row = dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True))
            if set(row["id"]) <= {"-"} or "reported" in line:
                continue
            error = float(row["error"].replace("\u2212", "-").rstrip("%"))
            table[row["id"]] = (error, row["memory GB per rank (fits)"].endswith("(yes)"))
    return out


def test_rows_are_every_held_out_rounds_first_run_as_recorded():
    """Every bound row of rounds 1-5, each once, with the error and memory verdict of its round's table,
    on the GPU preset its row is planned on."""
    rows, tables = first_runs(), docs_round_tables()
    assert sorted(tables) == [1, 2, 3, 4, 5]
    for n, held_out in enumerate(ROUNDS, 1):
        mine = {r["id"]: r for r in rows if r["round"] == n}
        assert set(mine) == {r.id for r in held_out if r.bound} == set(tables[n]), n
        for run in held_out:
            gpu = run.cluster[run.cluster.index("--gpu") + 1]
            assert (mine[run.id]["error"], mine[run.id]["fit"], mine[run.id]["gpu"]) == (*tables[n][run.id], gpu)
    assert len(rows) == sum(len(t) for t in tables.values())


def test_printed_figures_are_the_rows():
    rows = first_runs()
    assert accuracy.POOLED == figures(rows)
    assert accuracy.BY_GPU == {g: figures([r for r in rows if r["gpu"] == g]) for g in sorted({r["gpu"] for r in rows})}
    assert accuracy.BY_ROUND == tuple(figures([r for r in rows if r["round"] == n]) for n in range(1, 6))


def _lead(pooled: Accuracy) -> str:
    return f"{pooled.within} of {pooled.runs}"


def test_report_prints_the_pooled_first_runs_and_the_spread_per_gpu():
    from megalite.planning.cli import plan_config
    from megalite.planning.estimate import format_report

    plan, _ = plan_config(["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length",
                           "64", "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size",
                           "8"], ["--num-nodes", "1", "--gpus-per-node", "8"])
    report = format_report(plan)
    rows = first_runs()
    pooled = figures(rows)
    assert f"{_lead(pooled)} published runs within 25%" in report
    assert f"median error {pooled.median:.0f}%" in report
    for gpu, name in (("a100-80g", "A100"), ("h100-sxm", "H100")):
        a = figures([r for r in rows if r["gpu"] == gpu])
        assert f"{name} {a.within} of {a.runs} within 25%, median {a.median:.0f}%, errors {a.low:+.0f}% to " \
               f"{a.high:+.0f}%" in report
    assert "\n".join(f"  {line}" for line in accuracy_lines()) in report


@pytest.mark.parametrize("doc", ["docs/planning.md", "README.md"])
def test_docs_lead_with_the_pooled_figure(doc):
    """docs/planning.md states the pooled first-run figure before its first section; the README's planning
    row states it too."""
    text = (ROOT / doc).read_text()
    if doc == "README.md":
        text = next(line for line in text.splitlines() if line.startswith("| planning |"))
    else:
        text = text.split("\n## ")[0]
    pooled = figures(first_runs())
    assert f"{_lead(pooled)} " in text and f"median error {pooled.median:.0f}%" in text, doc
