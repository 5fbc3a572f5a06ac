"""Promise (docs/parallelism.md, "Zero-bubble schedules"): the split backward computes in B only input
gradients and the gradients of norms, biases, embeddings and the router, and queues the weight gradients
of the linear layers, the output layer (fused or not) and the experts for W; W adds them through
autograd, so after W every gradient equals the unsplit backward's and the accumulation hooks fire. In a
pipeline pass the W's pending match the table's count, and with --overlap-grad-reduce no bucket starts
reducing while a W that touches it is queued."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megalite.config.model import ModelConfig
from megalite.moe.experts import grouped_linear
from megalite.parallel.groups import ProcessGroups
from megalite.pipeline.timeline import peak_pending_w
from megalite.tensor_parallel.fused_cross_entropy import fused_linear_cross_entropy
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.weight_grad import WeightGradStore
from tests.harness import run_ranks
from tests.layouts import layout_curves
from tests.tp_utils import LLAMA_GQA, build, layout_flat

PG = ProcessGroups.single()


def _split(fn, inputs: list[torch.Tensor], params: list[torch.nn.Parameter]):
    """Run ``fn`` forward under a store, its backward as B, then W; the grads after B and after W."""
    store = WeightGradStore()
    with store.deferrable():
        out = fn()
    with store.collect((0, 0)):
        out.sum().backward()
    after_b = [None if p.grad is None else p.grad.clone() for p in params]
    pending, nbytes = store.pending(), store.pending_bytes()
    store.run((0, 0))
    return after_b, [p.grad for p in params], [x.grad for x in inputs], pending, nbytes


def _reference(fn, inputs, params):
    for t in inputs + params:
        t.grad = None
    fn().sum().backward()
    grads = [p.grad.clone() for p in params], [x.grad.clone() for x in inputs]
    for t in inputs + params:
        t.grad = None
    return grads


def _cases():
    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 12, PG, bias=True)
    row = RowParallelLinear(12, 8, PG, bias=True)
    for layer in (col, row):
        for p in layer.parameters():
            torch.nn.init.normal_(p)
    x8 = torch.randn(5, 2, 8, requires_grad=True)
    x12 = torch.randn(5, 2, 12, requires_grad=True)
    experts = torch.nn.Parameter(torch.randn(3, 6, 8))
    rows = torch.randn(7, 8, requires_grad=True)
    out_w = torch.nn.Parameter(torch.randn(16, 8))
    target = torch.randint(0, 12, (5, 2))
    weights = torch.rand(5, 2)  # per-token weights: the fused path's W recomputes those tokens' logits
    return {
        "column": (lambda: col(x8), [x8], [col.weight, col.bias], 1),
        "row": (lambda: row(x12), [x12], [row.weight, row.bias], 1),
        "experts": (lambda: grouped_linear(rows, experts, [3, 0, 4], True), [rows], [experts], 1),
        "fused_output": (lambda: fused_linear_cross_entropy(x8, out_w, target, PG, 12) * weights, [x8], [out_w], 1),
    }


@pytest.mark.parametrize("name", ["column", "row", "experts", "fused_output"])
def test_b_queues_weight_grads_and_w_adds_them(name):
    fn, inputs, params, deferred = _cases()[name]
    ref_params, ref_inputs = _reference(fn, inputs, params)
    fired = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.append(p)) for p in params]
    after_b, after_w, input_grads, pending, nbytes = _split(fn, inputs, params)
    for h in hooks:
        h.remove()
    assert after_b[0] is None, "the weight gradient was computed in B"
    assert all(g is not None for g in after_b[1:]), "the bias gradient belongs to B"
    assert pending == deferred and nbytes > 0
    for got, want in zip(after_w + input_grads, ref_params + ref_inputs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert params[0] in fired, "W's accumulation did not fire the gradient hook"


@pytest.mark.parametrize("extra", [{}, {"recompute_granularity": "full", "recompute_method": "uniform",
                                        "recompute_num_layers": 1},
                                   {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}],
                         ids=["dense", "recompute", "moe"])
def test_whole_model_split_equals_unsplit(extra):
    cfg = ModelConfig(**{k: v for k, v in {**LLAMA_GQA, "hidden_size": 32, **extra}.items()})
    model = build(cfg, PG, 64)
    tokens = torch.randint(0, 64, (2, 16))

    def loss():
        return model(tokens, labels=tokens).mean()

    params = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    ref, _ = _reference(loss, [], params)
    after_b, after_w, _, pending, _ = _split(loss, [], params)
    for got, want in zip(after_w, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    deferred = {names[id(p)] for p, g in zip(params, after_b, strict=True) if g is None}
    kept = {names[id(p)] for p, g in zip(params, after_b, strict=True) if g is not None}
    assert pending == 1
    assert all(n.endswith("weight") and ("norm" not in n) and ("embedding" not in n) for n in deferred), deferred
    assert any("qkv" in n for n in deferred) and any("output_layer" in n for n in deferred), deferred
    assert all("norm" in n or "embedding" in n or "router" in n for n in kept), kept
    if "num_experts" in extra:
        assert any("experts" in n for n in deferred), deferred


PASS_CFG = {**LLAMA_GQA, "hidden_size": 32, "num_layers": 4}


def _chunks(pg: ProcessGroups, cfg: ModelConfig, schedule: str) -> list[torch.nn.Module]:
    """This rank's model chunks of a 2-stage pipeline: one (1F1B, ZB-H1) or two in a V (ZB-V)."""
    from megalite.model.build import initialize_parameters
    from megalite.model.gpt import GPTModel
    from megalite.pipeline.partition import chunk_layers
    from megalite.pipeline.stages import StageMap
    from megalite.tensor_parallel.context import BuildContext
    from megalite.tensor_parallel.random import model_parallel_seed

    stages = StageMap(2, 2, v_shape=True) if schedule == "zbv" else StageMap(2)
    chunks = []
    for c in range(stages.vp):
        stage = stages.stage(pg.pp_rank, c)
        model = GPTModel(cfg, BuildContext(pg, model_parallel_seed(1234, 0, stage)), 64,
                         layer_numbers=chunk_layers(4, 2, stages.vp, pg.pp_rank, c, stages),
                         pre_process=stage == 0, post_process=stage == stages.last)
        initialize_parameters(model, pg, 1234, cfg.init_method_std, cfg.num_layers)
        chunks.append(model)
    return chunks


def _pass(rank: int, world: int) -> dict:
    """One pipeline pass of a tiny model on 2 stages, 1F1B, ZB-H1 and ZB-V: gradients, peaks, the bytes the
    pending W's kept against the formula's peak (``split_backward_memory.peak_table_bytes``)."""
    from bench.split_backward_memory import peak_table_bytes
    from megalite.parallel.layout import RankLayout
    from megalite.pipeline.executor import PipelineRecord
    from megalite.pipeline.schedule_table import ScheduleSpec, build_tables
    from megalite.training.train_step import run_microbatches

    pg = ProcessGroups.build(RankLayout(world, 1, 2), rank)
    cfg = ModelConfig(**PASS_CFG)
    one = _chunks(pg, cfg, "1f1b")
    g = torch.Generator().manual_seed(7)
    mbs = [{"tokens": torch.randint(0, 64, (1, 16), generator=g), "labels": torch.randint(0, 64, (1, 16), generator=g),
            "loss_mask": torch.ones(1, 16)} for _ in range(6)]
    out = {}
    for schedule in ("1f1b", "zb-h1", "zbv"):
        chunks = _chunks(pg, cfg, schedule) if schedule == "zbv" else one
        for model in chunks:
            model.zero_grad(set_to_none=True)
        record = PipelineRecord()
        losses = run_microbatches(chunks, mbs, pg, schedule=schedule, record=record)
        spec = ScheduleSpec(2, len(chunks), 6, schedule)
        formula = peak_table_bytes(cfg, spec, pg.pp_rank, 16, chunks[0].padded_vocab)
        out[schedule] = ({n: p.grad.clone() for n, p in one[0].named_parameters()}, [float(x) for x in losses],
                         record.peak_deferred, peak_pending_w(build_tables(spec)[pg.pp_rank]), record.peak_live,
                         record.peak_deferred_bytes, formula)
    return out


def test_pipeline_pass_zb_h1_equals_1f1b_and_defers_as_the_table_says():
    for rank, out in enumerate(run_ranks(_pass, 2)):
        grads, losses, _, _, live, _, _ = out["1f1b"]
        zgrads, zlosses, peak, table_peak, zlive, nbytes, formula = out["zb-h1"]
        assert zlosses == pytest.approx(losses, rel=1e-6)
        for n, g in grads.items():
            torch.testing.assert_close(zgrads[n], g, rtol=1e-5, atol=1e-7)
        assert peak == table_peak == rank + 1, (rank, peak, table_peak)  # rank r defers r W's past its B
        assert zlive == live, "ZB-H1 holds 1F1B's activations in flight"
        assert nbytes == formula > 0, (rank, nbytes, formula)  # the count times one W's bytes
        _, _, vpeak, vtable_peak, _, vbytes, vformula = out["zbv"]
        assert vpeak == vtable_peak > 0, (rank, vpeak, vtable_peak)
        # the V's pending W's mix chunks (the loss chunk on rank 0): the table played with each chunk's bytes
        assert vbytes == vformula > 0, (rank, vbytes, vformula)


# --overlap-grad-reduce: every bucket starts during the pass, and never while a W that touches it is queued
EVENTS: list[tuple[str, int, bool]] = []  # ("pass" | "end", 0, _) , ("start", bucket, touched), ("buckets", n, _)
STORE: list[WeightGradStore | None] = [None]


def _spy() -> None:
    from megalite.distributed import grad_buffer
    from megalite.pipeline import schedules
    from megalite.training import train_step

    start, finish = grad_buffer.GradBuffer._start, grad_buffer.GradBuffer.finish_grad_sync

    def spy_start(self, bucket):
        if bucket.work is None and STORE[0] is not None:
            EVENTS.append(("start", id(bucket), bool(STORE[0].queued() & set(bucket.params))))
        return start(self, bucket)

    def spy_finish(self):
        EVENTS.append(("buckets", len(self.buckets), False))
        return finish(self)

    def spy_forward_backward(job, schedule="1f1b"):
        STORE[0] = None if job.forward_only else WeightGradStore()
        EVENTS.append(("pass", 0, False))
        try:
            return schedules.forward_backward(dataclasses.replace(job, weight_grads=STORE[0]), schedule)
        finally:
            EVENTS.append(("end", 0, False))
            STORE[0] = None

    grad_buffer.GradBuffer._start, grad_buffer.GradBuffer.finish_grad_sync = spy_start, spy_finish
    train_step.forward_backward = spy_forward_backward


def _events(res, pg) -> list[tuple[str, int, bool]]:
    return list(EVENTS)


def test_overlapped_buckets_start_after_their_last_w():
    flat = layout_flat({**LLAMA_GQA, "hidden_size": 32, "num_layers": 4}, vocab=64, iters=2, tp=1, pp=2,
                       pipeline_schedule="zb-h1", use_distributed_optimizer=True, overlap_grad_reduce=True,
                       ddp_bucket_size=3000)
    for curve in layout_curves(4, {"run": flat}, extract={"run": _events}, prepare=_spy):
        events = curve["run"].extra
        assert not [e for e in events if e[0] == "start" and e[2]], "a bucket started while a W touching it was queued"
        passes = [i for i, e in enumerate(events) if e[0] == "pass"]
        for i in passes:
            end = next(j for j in range(i, len(events)) if events[j][0] == "end")
            during = {b for kind, b, _ in events[i:end] if kind == "start"}
            buckets = next(n for kind, n, _ in events[end:] if kind == "buckets")
            assert len(during) == buckets > 1, (len(during), buckets)  # all started inside the pass


def test_bf16_split_equals_unsplit():
    """In bf16, W's GEMM runs in the compute dtype as the unsplit backward's does."""
    model = build(ModelConfig(**{**LLAMA_GQA, "hidden_size": 32}), PG, 64).to(torch.bfloat16)
    tokens = torch.randint(0, 64, (2, 16))
    params = [p for p in model.parameters() if p.requires_grad]
    ref, _ = _reference(lambda: model(tokens, labels=tokens).float().mean(), [], params)
    _, after_w, _, _, _ = _split(lambda: model(tokens, labels=tokens).float().mean(), [], params)
    for got, want in zip(after_w, ref, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)


MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}


@pytest.mark.parametrize("extra", [{}, {"cross_entropy_loss_fusion": True}, MOE,
                                   {**MOE, "moe_shared_expert_intermediate_size": 48, "moe_layer_freq": "2"}],
                         ids=["unfused_output", "fused_output", "moe", "moe_shared_mixed"])
def test_deferred_bytes_equal_the_formula(extra):
    """docs/design.md's deferred-W bytes: what the store keeps after one B equals the formula exactly (with
    MoE layers, the routed experts' rows and the shared expert included)."""
    from bench.split_backward_memory import measure

    cfg = ModelConfig(**{**LLAMA_GQA, "hidden_size": 32, "num_layers": 2, **extra})
    got, want = measure(cfg, PG, 16, 2, 64)
    assert got == want > 0


def _tp_bytes(rank: int, world: int) -> tuple[int, int]:
    from bench.split_backward_memory import _rank

    return _rank(rank, world, {**LLAMA_GQA, "hidden_size": 32, "num_layers": 2}, 16, 2, 64)


def test_deferred_bytes_equal_the_formula_at_tp2_sp():
    for got, want in run_ranks(_tp_bytes, 2):
        assert got == want > 0
