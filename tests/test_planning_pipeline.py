"""The planner on pipeline splits and zero-bubble schedules (docs/planning.md): --search proposes
Megatron-LM's first/last stage counts where they help, and zb-h1 / zbv are planned with their own bubble
and the bytes their deferred W's keep (docs/design.md §3.4)."""

from __future__ import annotations

import pytest

from megalite.config import validate
from megalite.config.arguments import parse_args
from megalite.config.validate import fill_derived_defaults
from megalite.parallel.placement import LayerSplit
from megalite.planning.cli import cluster_from_values, plan_config, split_argv, vocab_of
from megalite.planning.estimate import Plan, estimate
from megalite.planning.hardware import ClusterConfig
from megalite.planning.layout import Layout
from megalite.planning.memory import stage_memory
from megalite.planning.search import first_last_splits, search
from megalite.planning.timing import busy_per_micro_batch_s
from megalite.planning.zero_bubble import deferred_w_bytes, output_bytes, pending_w

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


def _formula(plan: Plan, rank: int, chunks: int, loss_rank: int) -> float:
    """One pending W of the rank's chunk (the output layer's W is not one: it runs right after its B)."""
    sh = plan.shape
    layers = -(-sh.layers_in(rank) // chunks)
    return deferred_w_bytes(sh.cfg.model, layers, sh.local_tokens, sh.padded_vocab, sh.tp, sh.sp,
                            output=False, element=sh.act_bytes)


def _output(plan: Plan) -> float:
    sh = plan.shape
    return output_bytes(sh.cfg.model, sh.local_tokens, sh.padded_vocab, sh.tp, sh.sp, sh.act_bytes)


@pytest.mark.parametrize("schedule,chunks,loss_rank", [("zb-h1", 1, 3), ("zbv", 2, 0)])
def test_zero_bubble_plan_holds_its_deferred_w_and_its_bubble(schedule, chunks, loss_rank):
    """Same config: every rank's bytes are 1F1B's plus exactly the pending W's times the formula (ZB-H1:
    r + 1 of them), the loss rank's plus one output layer's W bytes (run right after its B, never pending;
    ZB-V: where the table's peak falls at a loss-chunk B), and the bubble is below 1F1B's (ZB-H1: the
    closed form (p - 1)(F + B - W))."""
    base, zb = _schedule_plan("1f1b"), _schedule_plan(schedule)
    for r in range(4):
        n = pending_w(schedule, 4, zb.shape.m, r)
        if schedule == "zb-h1":
            assert n == r + 1
        extra = stage_memory(zb.shape, r).total - stage_memory(base.shape, r).total
        out = _output(zb) if r == loss_rank else 0
        if schedule == "zb-h1":
            assert n > 0 and extra == n * _formula(zb, r, chunks, loss_rank) + out
        else:
            assert n > 0 and n * _formula(zb, r, chunks, loss_rank) <= extra <= n * _formula(zb, r, chunks,
                                                                                              loss_rank) + out
    bubble, base_bubble = zb.time.terms["pipeline bubble"], base.time.terms["pipeline bubble"]
    assert 0 < bubble < base_bubble
    if schedule == "zb-h1":
        third = busy_per_micro_batch_s(zb.shape, zb.cluster) / 3  # F = B = W
        assert bubble == pytest.approx(3 * (third + third - third))
    assert zb.memory.total > base.memory.total


def test_schedule_flag_reaches_the_plan():
    """The config's schedule is the one planned (the zero-bubble term only where one is chosen)."""
    assert "deferred W (zero bubble)" not in _schedule_plan("1f1b").memory.terms
    assert "deferred W (zero bubble)" in _schedule_plan("zb-h1").memory.terms
