"""Promises of the pure schedule tables: Megatron's warm-up counts, every (micro-batch, chunk) runs
forward then backward exactly once, no deadlock, and the ideal bubble equals (p - 1) / (v * m)."""

from __future__ import annotations

from collections import Counter

import pytest

from megalite.pipeline.schedule_table import (
    ScheduleSpec,
    bubble_fraction,
    build_tables,
    forward_only_table,
    simulate,
    warmup_count,
)

GRID = [(p, v, m) for p in (2, 4) for v in (1, 2, 4) for m in (p, 2 * p, 4 * p)] + [(4, 1, 2), (4, 1, 1), (2, 1, 3)]


@pytest.mark.parametrize("p,v,m", GRID)
@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_tables_run_each_action_once_in_order_without_deadlock(p, v, m, kind):
    spec = ScheduleSpec(p, v, m, kind)
    tables = build_tables(spec)
    for r, table in enumerate(tables):
        counts = Counter(table)
        assert set(counts.values()) == {1}
        assert {(a.chunk, a.microbatch) for a in table if a.kind == "F"} == {(c, b) for c in range(v) for b in range(m)}
        assert {(a.chunk, a.microbatch) for a in table if a.kind == "B"} == {(c, b) for c in range(v) for b in range(m)}
        seen = set()
        for a in table:
            if a.kind == "B":
                assert (a.chunk, a.microbatch) in seen, f"rank {r}: backward before forward {a}"
            seen.add((a.chunk, a.microbatch))
        leading = next((i for i, a in enumerate(table) if a.kind == "B"), len(table))
        assert leading >= warmup_count(spec, r)
    trace = simulate(tables, p, v)
    assert bubble_fraction(trace) == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("p,v,r,expected", [
    (4, 1, 0, 3), (4, 1, 3, 0), (4, 2, 0, 10), (4, 2, 3, 4), (2, 2, 0, 4), (2, 2, 1, 2), (4, 4, 1, 16),
])
def test_warmup_counts_follow_megatron(p, v, r, expected):
    m = 8
    assert warmup_count(ScheduleSpec(p, v, m), r) == min(expected, m * v)


def test_1f1b_warmup_caps_at_microbatches():
    assert warmup_count(ScheduleSpec(8, 1, 2), 0) == 2


def test_interleaved_forward_order_moves_groups_of_p_through_chunks():
    order = [(a.chunk, a.microbatch) for a in forward_only_table(ScheduleSpec(2, 2, 4))]
    assert order == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]


def test_simulator_reports_deadlock():
    spec = ScheduleSpec(2, 1, 2)
    tables = build_tables(spec)
    tables[1] = list(reversed(tables[1]))  # backward before its forward: can never run
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(tables, 2, 1)


def test_timeline_tool_draws_table_and_reports_bubble(tmp_path):
    from tests.cli_utils import load_tool

    tool = load_tool("plot_pipeline_timeline")
    events = tool.from_table(4, 2, 8, "1f1b")
    assert tool.bubble(events) == pytest.approx(3 / 16)
    out = tmp_path / "t.png"
    assert tool.main(["--pp", "4", "--vp", "2", "--microbatches", "8", "--output", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
