"""Promises of the zero-bubble figures (docs/parallelism.md, "Zero-bubble schedules"; docs/design.md §3.4),
from the pure tables (megalite/pipeline/timeline.py) and one single-process stage:

- with F = B = W, ZB-H1's bubble is at most a third of 1F1B's for m >= p (below m = p the start-up
  dominates and it is more), and matches the paper's (p - 1)(F + B - W) for any F, B, W tried;
- ZB-H1 holds 1F1B's micro-batches between F and B (min(p - r, m) on rank r), at most r + 1 W's pending;
- ZB-V holds at most 2p chunk-activations (p stages' worth, 1F1B's rank-0 peak) on every rank, exactly 2p
  once m >= 2p;
- ZB-V sends twice 1F1B's pipeline messages: 4(p - 1) activations and gradients per micro-batch against
  2(p - 1) (2p - 1 stage boundaries, of which rank p - 1's turn of the V is a hand-off on one rank).
"""

from __future__ import annotations

import pytest

from megalite.pipeline.p2p_plan import produced
from megalite.pipeline.schedule_table import bubble_fraction, build_tables
from megalite.pipeline.timeline import SCHEDULES, idle_per_rank, peak_in_flight, peak_pending_w, play, spec_for
from tests.zero_bubble_formulas import paper_bubble

GRID = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p,m", GRID)
def test_zb_h1_bubble_a_third_of_1f1b(p, m):
    one = bubble_fraction(play("1f1b", p, m, 1, 1, 1))
    zb = bubble_fraction(play("zb-h1", p, m, 1, 1, 1))
    if m >= p:
        assert zb <= one / 3 + 1e-9
    assert zb < one


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1.0, 1.2, 0.9), (1.0, 1.05, 0.83), (2, 3, 1)])
def test_zb_h1_idle_is_the_papers(p, f, b, w):
    """Every rank of ZB-H1 idles (p - 1)(F + B - W), 1F1B's (p - 1)(F + B + W) (m = 2p, W <= F + B)."""
    zb, one = play("zb-h1", p, 2 * p, f, b, w), play("1f1b", p, 2 * p, f, b, w)
    assert idle_per_rank(zb) == pytest.approx([paper_bubble("zb-h1", p, f, b, w)] * p)
    assert idle_per_rank(one) == pytest.approx([paper_bubble("1f1b", p, f, b, w)] * p)


@pytest.mark.parametrize("p,m", GRID)
def test_zb_h1_in_flight_is_1f1b(p, m):
    zb, one = build_tables(spec_for("zb-h1", p, m)), build_tables(spec_for("1f1b", p, m))
    for r in range(p):
        assert peak_in_flight(zb[r], "B") == peak_in_flight(one[r], "B") == min(p - r, m)
        assert peak_pending_w(zb[r]) == min(r + 1, m)
    assert all(peak_pending_w(t) == 0 for t in one)


@pytest.mark.parametrize("p,m", GRID)
def test_zbv_peak_chunk_activations(p, m):
    for table in build_tables(spec_for("zbv", p, m)):
        peak = peak_in_flight(table, "B")
        assert peak <= 2 * p and peak_in_flight(table, "W") <= 2 * p
        if m >= 2 * p:
            assert peak == 2 * p


def test_unit_bubbles_of_the_four_schedules():
    """p = 4, m = 8, a stage's F = B = W = 1 (a chunk's 1/2): (p-1)/m, /2, /3, /6."""
    got = {}
    for name in SCHEDULES:
        v = SCHEDULES[name][1]
        got[name] = bubble_fraction(play(name, 4, 8, 1 / v, 1 / v, 1 / v))
    assert got == pytest.approx({"1f1b": 3 / 8, "interleaved": 3 / 16, "zb-h1": 3 / 24, "zbv": 3 / 48})


def _messages(name: str, p: int, m: int) -> int:
    """Activations and gradients the named schedule's tables send between ranks in one step."""
    spec = spec_for(name, p, m)
    sent = 0
    for r, table in enumerate(build_tables(spec)):
        for a in table:
            out = produced(a, p, r, spec.vp, spec.stages)
            sent += out is not None and out[0] != r
    return sent


@pytest.mark.parametrize("p,m", GRID)
def test_zbv_sends_twice_1f1b_messages(p, m):
    assert _messages("1f1b", p, m) == _messages("zb-h1", p, m) == 2 * (p - 1) * m
    assert _messages("zbv", p, m) == 4 * (p - 1) * m
