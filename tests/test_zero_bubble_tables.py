"""Promises of the zero-bubble tables (megalite/pipeline/zero_bubble.py), without processes:

- every (chunk, micro-batch) runs F, B and W exactly once, W after its B, B after its F;
- ZB-H1 keeps 1F1B's order of F and B (so its F-to-B count is 1F1B's, p - r) and holds at most p
  micro-batches between F and W (1F1B's peak); ZB-V holds at most 2p chunk-micro-batches (p stages' worth);
- with F = B = W the simulator gives ZB-H1 a bubble of (p - 1) steps, a third of 1F1B's 3(p - 1) (m >= p),
  and ZB-V p - 1 chunk steps (m >= p), the least a V allows; both complete for every m >= 1;
- a hold (ScheduleSpec.holds) bounds what a rank keeps between F and W, and every hold down to the least
  valid one still gives complete tables;
- the message rounds of both are planned (no deadlock) and a V turn is a hand-off on the rank (the batches
  the executor posts are replayed under the NCCL checker in tests/test_nccl_protocol.py, not here);
- the V placement: chunk 0 is stage r, chunk 1 stage 2p - 1 - r, the loss on rank 0.
"""

from __future__ import annotations

from collections import Counter

import pytest

from megalite.pipeline.p2p_plan import needed, produced, round_plan
from megalite.pipeline.partition import chunk_layers, loss_rank
from megalite.pipeline.schedule_table import ScheduleSpec, build_tables, forward_only_table, rank_table, simulate
from megalite.pipeline.stages import StageMap
from megalite.pipeline.timeline import peak_in_flight, peak_pending_w

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, p, 2 * p, 4 * p)]
KINDS = {"zb-h1": 1, "zbv": 2}


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_action_once_in_dependency_order(kind, p, m):
    v = KINDS[kind]
    for r, table in enumerate(build_tables(ScheduleSpec(p, v, m, kind))):
        assert set(Counter(table).values()) == {1}
        every = {(c, b) for c in range(v) for b in range(m)}
        for kind_ in "FBW":
            assert {(a.chunk, a.microbatch) for a in table if a.kind == kind_} == every, (r, kind_)
        order = {(a.kind, a.chunk, a.microbatch): i for i, a in enumerate(table)}
        for c, b in every:
            assert order[("F", c, b)] < order[("B", c, b)] < order[("W", c, b)], (r, c, b)


@pytest.mark.parametrize("p,m", GRID)
def test_zb_h1_keeps_1f1b_memory(p, m):
    for r, table in enumerate(build_tables(ScheduleSpec(p, 1, m, "zb-h1"))):
        plain = [a for a in table if a.kind != "W"]
        assert plain == rank_table(ScheduleSpec(p, 1, m), r)  # 1F1B's F and B order
        assert peak_in_flight(table, "B") == peak_in_flight(plain, "B") <= p - r
        assert peak_in_flight(table, "W") <= p


@pytest.mark.parametrize("p,m", GRID)
def test_zbv_holds_at_most_p_stages(p, m):
    for table in build_tables(ScheduleSpec(p, 2, m, "zbv")):
        assert peak_in_flight(table, "W") <= 2 * p


def _bubble_steps(kind: str, p: int, m: int) -> float:
    spec = ScheduleSpec(p, KINDS.get(kind, 1), m, kind)
    tables = build_tables(spec)
    if kind == "1f1b":
        trace = simulate(tables, p, 1, f_time=1, b_time=2)
    else:
        trace = simulate(tables, p, spec.vp, f_time=1, b_time=1, w_time=1, stages=spec.stages)
    span = max(end for t in trace.values() for _, _, end in t)
    return span - 3 * m * spec.vp


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_bubbles_with_equal_f_b_w(p, factor):
    m = factor * p
    assert _bubble_steps("1f1b", p, m) == 3 * (p - 1)
    assert _bubble_steps("zb-h1", p, m) == p - 1  # a third of 1F1B's
    assert _bubble_steps("zbv", p, m) == p - 1  # in chunk steps: a sixth of 1F1B's 6(p - 1) chunk steps


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if p > 1])
def test_holds_bound_what_each_rank_keeps(p, m):
    """ScheduleSpec.holds (planning/zero_bubble_memory.py chooses them): ZB-H1's rank r delays its W's by
    hold - min(p - r, m) B's (at most r), so it holds at most ``hold`` micro-batches between F and W, and a
    hold below 1F1B's own count is refused; ZB-V's rank 0 at every hold from 2 to 2p still completes (a
    smaller hold keeps a place for chunk 1's F, or the rank would fill up with chunk 0), holding at most that
    many chunk-micro-batches between F and W, every action once."""
    for r in range(p):
        for hold in range(min(p - r, m), p + 1):
            holds = tuple(hold if q == r else p for q in range(p))
            table = build_tables(ScheduleSpec(p, 1, m, "zb-h1", holds))[r]
            assert peak_in_flight(table, "W") <= hold and peak_pending_w(table) <= hold - min(p - r, m) + 1
        with pytest.raises(ValueError, match="below it"):
            build_tables(ScheduleSpec(p, 1, m, "zb-h1", tuple(min(p - q, m) - (q == r) for q in range(p))))
    for hold in range(2, 2 * p + 1):
        spec = ScheduleSpec(p, 2, m, "zbv", (hold,) + (2 * p,) * (p - 1))
        tables = build_tables(spec)
        assert peak_in_flight(tables[0], "W") <= hold
        for table in tables:
            assert len(table) == len(set(table)) == 3 * 2 * m
        simulate(tables, p, 2, f_time=1, b_time=1, w_time=1, stages=spec.stages)  # no deadlock


def test_w_fills_1f1b_idle_slots():
    """p = 4, m = 8: the last rank's W's run where its 1F1B twin would wait for a gradient."""
    spec = ScheduleSpec(4, 1, 8, "zb-h1")
    trace = simulate(build_tables(spec), 4, 1, f_time=1, b_time=1, w_time=1)
    ones = simulate(build_tables(ScheduleSpec(4, 1, 8)), 4, 1, f_time=1, b_time=2)
    span, idle_1f1b = 3 * 8 + 3, 3 * 3
    busy = sum(e - s for _, s, e in trace[0])
    assert span - busy == 3 and max(e for _, _, e in ones[0]) - sum(e - s for _, s, e in ones[0]) == idle_1f1b
    w_starts = [s for a, s, _ in trace[3] if a.kind == "W"]
    assert w_starts and all(s < span - 3 for s in w_starts[:-3])  # W's interleaved, not only at the end


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_message_rounds_complete(kind, p, m):
    spec = ScheduleSpec(p, KINDS[kind], m, kind)
    plan = round_plan(build_tables(spec), p, spec.vp, spec.stages)
    sent = Counter((r, msg) for r, steps in enumerate(plan) for s in steps for _, msg in s.sends)
    got = Counter((src, msg) for steps in plan for s in steps for src, msg in s.recvs)
    assert sum(sent.values()) == sum(got.values())
    per_mb = 2 * (p * spec.vp - 1) - (2 if kind == "zbv" else 0)  # the V's turn is a hand-off, no message
    assert sum(sent.values()) == m * per_mb


def test_v_placement_and_its_hand_offs():
    stages = StageMap(4, 2, v_shape=True)
    assert [stages.stage(r, 0) for r in range(4)] == [0, 1, 2, 3]
    assert [stages.stage(r, 1) for r in range(4)] == [7, 6, 5, 4]
    assert all(stages.holder(stages.stage(r, c)) == (r, c) for r in range(4) for c in range(2))
    assert loss_rank(4, "zbv") == 0 and loss_rank(4, "1f1b") == 3 and loss_rank(4, "zb-h1") == 3
    assert chunk_layers(16, 4, 2, 1, 1, stages) == [12, 13]  # stage 6 of 8, two layers each
    from megalite.pipeline.stages import Action
    turn_f, turn_b = Action("F", 0, 5), Action("B", 1, 5)
    assert produced(turn_f, 4, 3, 2, stages)[0] == 3 and needed(Action("F", 1, 5), 4, 3, 2, stages)[0] == 3
    assert produced(turn_b, 4, 3, 2, stages)[0] == 3
    assert needed(Action("W", 0, 1), 4, 2, 2, stages) is None and produced(Action("W", 0, 1), 4, 2, 2, stages) is None
    assert [(a.chunk, a.microbatch) for a in forward_only_table(ScheduleSpec(2, 2, 2, "zbv"))] == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_wrong_chunk_counts_are_named():
    with pytest.raises(ValueError, match="zb-h1 runs one model chunk per rank"):
        build_tables(ScheduleSpec(2, 2, 4, "zb-h1"))
    with pytest.raises(ValueError, match="zbv runs 2 model chunks per rank"):
        build_tables(ScheduleSpec(2, 1, 4, "zbv"))


@pytest.mark.parametrize("flags,rule", [
    ({"pipeline_schedule": "zbv", "num_layers": 6}, "divisible by 2 x --pipeline-model-parallel-size"),
    ({"pipeline_schedule": "zb-h1", "num_layers_per_virtual_pipeline_stage": 1}, "places its own model chunks"),
    ({"pipeline_schedule": "zbv", "num_virtual_stages_per_pipeline_rank": 2}, "drop --num-virtual-stages-per"),
])
def test_schedule_rules_are_named(flags, rule):
    from megalite.config import ConfigError, validate
    from megalite.config.arguments import MegaliteConfig
    from tests.tp_utils import LLAMA_GQA, layout_flat

    model = {**LLAMA_GQA, "num_layers": 4, **{k: v for k, v in flags.items() if k in ("num_layers",)}}
    if "untie_embeddings_and_output_weights" in flags:
        model["untie_embeddings_and_output_weights"] = False
    rest = {k: v for k, v in flags.items() if k not in ("num_layers", "untie_embeddings_and_output_weights")}
    cfg = MegaliteConfig.from_flat(layout_flat(model, vocab=64, iters=2, pp=2, **rest))
    with pytest.raises(ConfigError, match=rule):
        validate(cfg, 2)
