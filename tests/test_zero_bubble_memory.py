"""Zero-bubble memory (docs/design.md §3.4): the loss rank never holds more than one micro-batch's output-layer
weight-gradient inputs (the logits' gradient, or the fused path's fp32 partial gradient), as 1F1B, and the
planner's deferred-W bytes follow the tables and the actual per-chunk layer counts (uneven ZB-V included).
The allocator figures: bench/zero_bubble_memory.py."""

from __future__ import annotations

import pytest
import torch

from megalite.config.model import ModelConfig
from megalite.parallel.groups import ProcessGroups
from megalite.pipeline.schedule_table import ScheduleSpec, build_tables
from megalite.pipeline.timeline import peak_loss_buffers
from megalite.tensor_parallel.param_meta import param_meta
from megalite.tensor_parallel.weight_grad import WeightGradStore
from tests.harness import run_ranks
from tests.tp_utils import LLAMA_GQA

CFG = {**LLAMA_GQA, "hidden_size": 32, "num_layers": 4}
VOCAB, SEQ, M = 64, 16, 4


def _chunks(pg: ProcessGroups, cfg: ModelConfig, schedule: str) -> list[torch.nn.Module]:
    from megalite.model.gpt import GPTModel
    from megalite.pipeline.partition import chunk_layers
    from megalite.pipeline.stages import StageMap
    from megalite.tensor_parallel.context import BuildContext
    from megalite.tensor_parallel.init import initialize_parameters
    from megalite.tensor_parallel.random import model_parallel_seed

    stages = StageMap(2, 2, v_shape=True) if schedule == "zbv" else StageMap(2)
    chunks = []
    for c in range(stages.vp):
        stage = stages.stage(pg.pp_rank, c)
        model = GPTModel(cfg, BuildContext(pg, model_parallel_seed(1234, 0, stage)), VOCAB,
                         layer_numbers=chunk_layers(cfg.num_layers, 2, stages.vp, pg.pp_rank, c, stages),
                         pre_process=stage == 0, post_process=stage == stages.last)
        initialize_parameters(model, pg, 1234, cfg.init_method_std, cfg.num_layers)
        chunks.append(model)
    return chunks


def _held_output_ws(rank: int, world: int, schedule: str, fused: bool) -> tuple[int, bool]:
    """(most output-layer weight gradients queued and not yet run at once, whether this rank holds the loss)
    over one ZB pass on 2 ranks: counted where the split backward queues them and where each one runs."""
    from megalite.parallel.layout import RankLayout
    from megalite.training.train_step import run_microbatches

    pg = ProcessGroups.build(RankLayout(world, 1, 2), rank)
    chunks = _chunks(pg, ModelConfig(**CFG, cross_entropy_loss_fusion=fused), schedule)
    held, peak = [0], [0]
    defer = WeightGradStore.defer

    def counting(self, key, param, fn, kept):
        if not param_meta(param).embedding_or_output:
            return defer(self, key, param, fn, kept)
        held[0] += 1
        peak[0] = max(peak[0], held[0])

        def run():
            held[0] -= 1
            return fn()
        return defer(self, key, param, run, kept)

    WeightGradStore.defer = counting
    g = torch.Generator().manual_seed(3)
    mbs = [{"tokens": torch.randint(0, VOCAB, (1, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (1, SEQ), generator=g), "loss_mask": torch.ones(1, SEQ)}
           for _ in range(M)]
    try:
        run_microbatches(chunks, mbs, pg, schedule=schedule)
    finally:
        WeightGradStore.defer = defer
    assert held[0] == 0, "every queued output-layer weight gradient ran within the pass"
    return peak[0], any(c.post_process for c in chunks)


@pytest.mark.parametrize("schedule,fused", [("zb-h1", False), ("zb-h1", True), ("zbv", False)])
def test_loss_rank_holds_one_output_layer_w_at_a_time(schedule, fused):
    """ZB-H1's last rank defers its W's p - 1 micro-batches (ZB-V's rank 0 up to 2 of its loss chunk): the
    output layer's must not wait with them, or the rank holds that many logits gradients."""
    for peak, loss in run_ranks(_held_output_ws, 2, schedule, fused):
        assert peak == (1 if loss else 0), (schedule, fused, peak)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_tables_hold_one_loss_buffer_with_the_prompt_output_w(p, m):
    """The tables' count of loss-chunk micro-batches holding logits or their gradient: 1 as in 1F1B once
    the output layer's W runs right after its B; deferred with the table's W it would be p (ZB-H1)."""
    h1 = build_tables(ScheduleSpec(p, 1, m, "zb-h1"))[p - 1]
    one = build_tables(ScheduleSpec(p, 1, m, "1f1b"))[p - 1]
    v = build_tables(ScheduleSpec(p, 2, m, "zbv"))[0]
    assert peak_loss_buffers(one, 0) == peak_loss_buffers(h1, 0) == peak_loss_buffers(v, 1) == 1
    assert peak_loss_buffers(h1, 0, prompt=False) == p


def _plan(flags: list[str]):
    from megalite.config.arguments import parse_args
    from megalite.config.validate import fill_derived_defaults
    from megalite.planning.cli import vocab_of
    from megalite.planning.estimate import estimate
    from tests.test_planning_pipeline import SMALL, _cluster

    cfg = parse_args([*SMALL, *flags])
    fill_derived_defaults(cfg, 4)
    return estimate(cfg, _cluster(4), vocab_of(cfg))


@pytest.mark.parametrize("schedule,split", [
    ("zbv", []), ("zbv", ["--decoder-first-pipeline-num-layers", "0", "--decoder-last-pipeline-num-layers", "2"]),
    ("zb-h1", []), ("zb-h1", ["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"])])
def test_planner_w_bytes_follow_each_chunks_layers(schedule, split):
    """The planner's deferred-W term on every rank is its table played with each chunk's own layer count
    (uneven ZB-V: rank 0's chunks hold F = 0 and L = 2 layers, not one each) and the output layer's bytes
    once, at the loss chunk's B, never times the pending count."""
    from megalite.planning.memory import deferred_w_term
    from megalite.planning.zero_bubble import deferred_w_bytes, output_bytes

    plan = _plan(["--pipeline-schedule", schedule, *split])
    sh = plan.shape
    model = sh.cfg.model
    spec = ScheduleSpec(4, 2 if schedule == "zbv" else 1, sh.m, schedule)
    tables = build_tables(spec)
    for r in range(4):
        layers = [len(sh.split.layers(r, c)) for c in range(spec.vp)] if schedule == "zbv" else [sh.layers_in(r)]

        def w(c, layers=layers):
            return deferred_w_bytes(model, layers[c], sh.local_tokens, sh.padded_vocab, sh.tp, sh.sp, False,
                                    sh.act_bytes)

        def out(c, r=r):
            last = spec.stages.stage(r, c) == spec.stages.last
            return output_bytes(model, sh.local_tokens, sh.padded_vocab, sh.tp, sh.sp, sh.act_bytes) if last else 0

        pending = peak = 0  # the table played: a B adds its chunk's W bytes (and, for that moment, the output's)
        for a in tables[r]:
            if a.kind in "BW":
                pending += w(a.chunk) if a.kind == "B" else -w(a.chunk)
            peak = max(peak, pending + (out(a.chunk) if a.kind == "B" else 0))
        assert deferred_w_term(sh, r) == peak > 0, (schedule, split, r)
