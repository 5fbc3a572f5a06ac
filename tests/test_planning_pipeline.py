"""The planner on pipeline splits and zero-bubble schedules (docs/planning.md): --search proposes
Megatron-LM's first/last stage counts where they help, and zb-h1 / zbv are planned with their own bubble
and the bytes their tables keep under the holds training runs (docs/design.md §3.4)."""

from __future__ import annotations

import pytest

from megalite.config import validate
from megalite.config.arguments import parse_args
from megalite.config.validate import fill_derived_defaults
from megalite.parallel.placement import LayerSplit
from megalite.pipeline.schedule_table import ScheduleSpec, build_tables
from megalite.pipeline.timeline import peak_pending_w
from megalite.planning.cli import cluster_from_values, plan_config, split_argv, vocab_of
from megalite.planning.estimate import Plan, estimate
from megalite.planning.hardware import ClusterConfig
from megalite.planning.layout import Layout
from megalite.planning.memory import (
    _stage_layer_params,
    embedding_params,
    output_params,
    stage_dense_params,
    stage_memory,
    zero_bubble_holds,
)
from megalite.planning.search import first_last_splits, search
from megalite.planning.timing import busy_per_micro_batch_s

RAGGED = ["--num-layers", "126", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "4096",
          "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
          "--mock-data", "--swiglu", "--vocab-size", "128255", "--untie-embeddings-and-output-weights",
          "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
WIDE_VOCAB = ["--num-layers", "16", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "2048",
              "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16",
              "--mock-data", "--vocab-size", "256000", "--untie-embeddings-and-output-weights"]
SMALL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "2048",
         "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "16", "--bf16",
         "--mock-data", "--vocab-size", "32000", "--pipeline-model-parallel-size", "4"]


def _cluster(nodes: int, memory_gb: float | None = None) -> ClusterConfig:
    extra = ["--gpu-memory-gb", str(memory_gb)] if memory_gb else []
    values, _ = split_argv(["--num-nodes", str(nodes), "--gpus-per-node", "1", "--gpu", "h100-sxm", *extra])
    return cluster_from_values(values)


def test_first_last_counts_pass_the_split_rules():
    """Every proposed count is one LayerSplit accepts, none is the even split, and 126 layers over 16 stages
    (no even split) get Megatron-LM's counts: 14 stages of 8 and the ends of 14 layers between them."""
    assert LayerSplit(126, 16).errors()
    splits = first_last_splits(126, 16)
    assert splits
    for s in splits:
        cut = LayerSplit(126, 16, first=s.first, last=s.last)
        assert not cut.errors() and sum(cut.counts) == 126 and max(cut.counts) == 8
    assert (7, 7) in {(s.first, s.last) for s in splits}
    assert all(LayerSplit(32, 4, first=s.first, last=s.last).counts != (8,) * 4 for s in first_last_splits(32, 4))


def test_search_plans_a_layer_count_pp_does_not_divide():
    """126 layers: the fastest plan cuts them over a PP that does not divide them with first/last counts,
    its printed flags pass pretrain_gpt.py's validation and plan to the same numbers, and it beats every
    plan whose split is even or counts the loss (the only ones --search proposed before)."""
    cfg, cluster = parse_args(RAGGED), _cluster(16, 20)
    result = search(cfg, cluster, vocab_of(cfg))
    best = result.plans[0]
    lay = best.layout
    assert lay.first_layers is not None and lay.last_layers is not None and 126 % lay.pp
    assert f"--decoder-first-pipeline-num-layers {lay.first_layers}" in lay.flags()
    validate(lay.apply(cfg), cluster.world_size, cluster.gpus_per_node)
    cluster_flags = ["--num-nodes", "16", "--gpus-per-node", "1", "--gpu", "h100-sxm", "--gpu-memory-gb", "20"]
    run = [a for a in RAGGED if a not in ("--micro-batch-size", "1")] + lay.flags().split()
    plan, _ = plan_config(run, cluster_flags)
    assert plan.time.step_s == pytest.approx(best.time.step_s) and plan.memory.total == pytest.approx(best.memory.total)
    older = [p for p in result.plans if p.layout.first_layers is None and p.layout.last_layers is None]
    assert all(p.time.step_s > best.time.step_s for p in older)


def _peak(plan: Plan) -> tuple[int, float]:
    """(rank, bytes) of the planner's fullest pipeline rank."""
    per = [stage_memory(plan.shape, r).total for r in range(plan.shape.pp)]
    return per.index(max(per)), max(per)


def test_search_lightens_the_last_stage_where_the_even_split_does_not_fit():
    """A 256k vocabulary on 4 stages: the even split's last stage (output layer, fp32 logits) is the fullest
    and does not fit; --search proposes PP4 without recomputation only with first/last counts, whose
    fullest rank holds fewer bytes than the even split's (the planner's per-rank numbers)."""
    cfg = parse_args(WIDE_VOCAB)
    even = estimate(Layout(1, 4).apply(cfg), _cluster(4), vocab_of(cfg))
    rank, even_bytes = _peak(even)
    assert rank == 3
    cluster = _cluster(4, round(even.memory.total / 1e9 + 4 - 0.3, 2))  # 4 GB: the default headroom
    result = search(cfg, cluster, vocab_of(cfg))
    pp4 = [p for p in result.plans if p.layout.pp == 4 and p.layout.recompute is None and p.layout.vp_layers is None]
    assert pp4 and all(p.layout.last_layers is not None for p in pp4)
    best = pp4[0]
    assert best.layout.last_layers < 4 and _peak(best)[1] < even_bytes
    validate(best.layout.apply(cfg), cluster.world_size, cluster.gpus_per_node)


def _schedule_plan(schedule: str) -> Plan:
    cfg = parse_args([*SMALL, "--pipeline-schedule", schedule])
    fill_derived_defaults(cfg, 4)
    return estimate(cfg, _cluster(4), vocab_of(cfg))


@pytest.mark.parametrize("schedule,loss_rank", [("zb-h1", 3), ("zbv", 0)])
def test_zero_bubble_plan_holds_its_deferred_w_and_its_bubble(schedule, loss_rank):
    """Same config: the loss rank (ZB-V: rank 0) holds the output layer; each rank's activations and pending
    W's are its table played under the holds training runs (planning/zero_bubble_memory.py; the played bytes
    per chunk: tests/test_zero_bubble_memory.py), which keep ZB-H1's every rank within 1F1B's highest rank
    (here its last rank delays its W's by one B, not three: 2 pending at most, not 4); the bubble stays
    below 1F1B's, ZB-H1's the table's idle at F = B = W (the closed form (p - 1)(F + B - W) at its own
    holds, 3 steps; 5 with its last rank's hold)."""
    base, zb = _schedule_plan("1f1b"), _schedule_plan(schedule)
    holds = zero_bubble_holds(zb.shape)
    tables = build_tables(ScheduleSpec(4, 2 if schedule == "zbv" else 1, zb.shape.m, schedule, holds))
    for r in range(4):
        terms = stage_memory(zb.shape, r).terms
        assert terms["deferred W (zero bubble)"] <= sum(terms.values())
        owns_output = output_params(zb.shape) if r == loss_rank else 0
        assert stage_dense_params(zb.shape, r) - _stage_layer_params(zb.shape, r) - (
            embedding_params(zb.shape) if r == 0 else 0) == owns_output
    if schedule == "zb-h1":
        assert holds == (4, 4, 4, 2) and [peak_pending_w(t) for t in tables] == [1, 2, 3, 2]
        assert max(stage_memory(zb.shape, r).total for r in range(4)) <= base.memory.total
    bubble, base_bubble = zb.time.terms["pipeline bubble"], base.time.terms["pipeline bubble"]
    assert 0 < bubble < base_bubble
    if schedule == "zb-h1":
        third = busy_per_micro_batch_s(zb.shape, zb.cluster) / 3  # F = B = W
        assert bubble == pytest.approx(5 * third)


def test_schedule_flag_reaches_the_plan():
    """The config's schedule is the one planned (the zero-bubble term only where one is chosen)."""
    assert "deferred W (zero bubble)" not in _schedule_plan("1f1b").memory.terms
    assert "deferred W (zero bubble)" in _schedule_plan("zb-h1").memory.terms
