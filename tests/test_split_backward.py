"""Promise (docs/parallelism.md, "Zero-bubble schedules"): the split backward computes in B only input
gradients and the gradients of norms, biases, embeddings and the router, and queues the weight gradients
of the linear layers, the output layer (fused or not) and the experts for W; W adds them through
autograd, so after W every gradient equals the unsplit backward's and the accumulation hooks fire. In a
pipeline pass the W's pending match the table's count, and with --overlap-grad-reduce no bucket starts
reducing while a W that touches it is queued: under ZB-H1 and ZB-V each starts strictly after the last W
that adds into one of its parameters."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megalite.config.model import ModelConfig
from megalite.moe.experts import grouped_linear
from megalite.parallel.groups import ProcessGroups
from megalite.pipeline.timeline import peak_pending_w
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.fused_cross_entropy import fused_linear_cross_entropy
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.random import RNGTracker
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
    ctx = BuildContext(PG, RNGTracker())
    col = ColumnParallelLinear(8, 12, ctx, bias=True)
    row = RowParallelLinear(12, 8, ctx, bias=True)
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


CALLS: list[bool] = []  # one per grouped GEMM: whether it ran with autograd recording (an unsplit F)


def _loop_grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A reference grouped GEMM for builds without one (the CPU's): each group's rows times its weight_t."""
    CALLS.append(torch.is_grad_enabled())
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    return torch.cat([x[a:b] @ weight_t[e] for e, (a, b) in enumerate(zip(starts, ends, strict=True))])


@pytest.fixture
def grouped_mm(monkeypatch):
    """The grouped GEMM this build has, else the reference one in its place (the code path is the same)."""
    from megalite import compat

    CALLS.clear()
    if not compat.grouped_mm_supported("cpu", torch.float32):
        monkeypatch.setattr(compat, "grouped_mm_supported", lambda device, dtype: True)
        monkeypatch.setattr(compat, "grouped_mm", _loop_grouped_mm)
    yield
    CALLS.clear()


def test_moe_grouped_keeps_the_grouped_gemm_in_f_and_b_and_defers_w(grouped_mm):
    """--moe-grouped-gemm under the split: F and B's input gradient are grouped GEMMs, the weight gradient
    waits for W, and after W every gradient is the unsplit one."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 8, 12))  # 16-byte row strides: the grouped GEMM takes them
    rows = torch.randn(7, 12, requires_grad=True)

    def fn():
        return grouped_linear(rows, weight, [3, 0, 4], True) * torch.arange(8.0)

    ref_params, ref_inputs = _reference(fn, [rows], [weight])
    patched = bool(CALLS)
    CALLS.clear()
    after_b, after_w, input_grads, pending, nbytes = _split(fn, [rows], [weight])
    assert after_b[0] is None and pending == 1 and nbytes > 0, "the experts' weight gradient was not deferred"
    assert after_w[0] is not None
    if patched:  # the reference GEMM counts its calls: one in F, one for B's input gradient, none in W
        assert CALLS == [False, False], CALLS
    torch.testing.assert_close(after_w[0], ref_params[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(input_grads[0], ref_inputs[0], rtol=1e-5, atol=1e-6)


def test_moe_grouped_whole_model_split_equals_unsplit(grouped_mm):
    cfg = ModelConfig(**{**LLAMA_GQA, "hidden_size": 32, "num_experts": 4, "moe_router_topk": 2,
                         "moe_ffn_hidden_size": 32, "moe_grouped_gemm": True})
    model = build(cfg, PG, 64)
    tokens = torch.randint(0, 64, (2, 16))
    params = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    ref, _ = _reference(lambda: model(tokens, labels=tokens).mean(), [], params)
    CALLS.clear()
    after_b, after_w, _, _, _ = _split(lambda: model(tokens, labels=tokens).mean(), [], params)
    for got, want in zip(after_w, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    experts = [n for p, g in zip(params, after_b, strict=True) if "experts" in (n := names[id(p)])]
    assert experts and all(g is None for p, g in zip(params, after_b, strict=True) if names[id(p)] in experts)
    assert not CALLS or (len(CALLS) == 2 * 2 * cfg.num_layers and not any(CALLS)), CALLS  # fc1, fc2: F, B


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
    assert all(n.endswith("weight") and ("norm" not in n) and ("position" not in n) for n in deferred), deferred
    assert {"embedding.word.weight"} <= deferred and any("qkv" in n for n in deferred), deferred
    assert any("output_layer" in n for n in deferred), deferred  # the word embedding's too: its W runs last
    assert all("norm" in n or "position" in n or "router" in n for n in kept), kept
    if "num_experts" in extra:
        assert any("experts" in n for n in deferred), deferred


PASS_CFG = {**LLAMA_GQA, "hidden_size": 32, "num_layers": 4}


def _chunks(pg: ProcessGroups, cfg: ModelConfig, schedule: str) -> list[torch.nn.Module]:
    """This rank's model chunks of a 2-stage pipeline: one (1F1B, ZB-H1) or two in a V (ZB-V)."""
    from megalite.model.build import initialize_parameters
    from megalite.model.gpt import GPTModel
    from megalite.pipeline.partition import chunk_layers
    from megalite.pipeline.stages import StageMap
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
    pending W's kept against the formula's peak (``megalite.planning.zero_bubble.peak_table_bytes``)."""
    from megalite.parallel.layout import RankLayout
    from megalite.pipeline.executor import PipelineRecord
    from megalite.pipeline.schedule_table import ScheduleSpec, build_tables
    from megalite.planning.zero_bubble import peak_table_bytes
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


# --overlap-grad-reduce: every bucket starts during the pass, and only after the last W that adds into it
# Events in order (the index is the sequence number): ("pass" | "end", None, _), ("w", id(param), _) just
# before a W adds that parameter's gradient, ("start", id(bucket), (queued-W-touches-it, its param ids)),
# ("buckets", n, _) per buffer at the step's finish.
EVENTS: list[tuple[str, int | None, object]] = []
STORE: list[WeightGradStore | None] = [None]


def _spy() -> None:
    from megalite.distributed import grad_buffer
    from megalite.pipeline import schedules
    from megalite.training import train_step

    start, finish, defer = grad_buffer.GradBuffer._start, grad_buffer.GradBuffer.finish_grad_sync, WeightGradStore.defer

    def spy_start(self, bucket):
        if bucket.work is None and STORE[0] is not None:
            touched = bool(STORE[0].queued() & set(bucket.params))
            EVENTS.append(("start", id(bucket), (touched, frozenset(id(p) for p in bucket.params))))
        return start(self, bucket)

    def spy_finish(self):
        EVENTS.append(("buckets", len(self.buckets), None))
        return finish(self)

    def spy_defer(self, key, param, fn, kept, prompt=None):
        def recorded():
            EVENTS.append(("w", id(param), None))
            return fn()
        return defer(self, key, param, recorded, kept, prompt)

    def spy_forward_backward(job, schedule="1f1b"):
        STORE[0] = None if job.forward_only else WeightGradStore()
        EVENTS.append(("pass", None, None))
        try:
            return schedules.forward_backward(dataclasses.replace(job, weight_grads=STORE[0]), schedule)
        finally:
            EVENTS.append(("end", None, None))
            STORE[0] = None

    grad_buffer.GradBuffer._start, grad_buffer.GradBuffer.finish_grad_sync = spy_start, spy_finish
    WeightGradStore.defer = spy_defer
    train_step.forward_backward = spy_forward_backward


def _events(res, pg) -> list[tuple[str, int | None, object]]:
    return list(EVENTS)


def _check_pass(events: list, i: int) -> int:
    """One pass from ``events[i]``: every bucket starts inside it, strictly after the last W adding into any
    of its parameters; returns how many buckets had such a W."""
    end = next(j for j in range(i, len(events)) if events[j][0] == "end")
    last_w: dict[int, int] = {}  # param id -> sequence number of its last W in the pass
    starts: dict[int, tuple[int, frozenset]] = {}
    for k in range(i, end):
        kind, key, info = events[k]
        if kind == "w":
            last_w[key] = k
        elif kind == "start":
            starts[key] = (k, info[1])
    touched = 0
    for at, params in starts.values():
        last = max((last_w[p] for p in params if p in last_w), default=None)
        if last is not None:
            touched += 1
            assert at > last, f"bucket started at event {at}, before its last W at {last}"
    nxt = next((j for j in range(end, len(events)) if events[j][0] == "pass"), len(events))
    buckets = sum(n for kind, n, _ in events[end:nxt] if kind == "buckets")
    assert len(starts) == buckets > 1, (len(starts), buckets)  # all started inside the pass
    return touched


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_overlapped_buckets_start_after_their_last_w(schedule):
    flat = layout_flat({**LLAMA_GQA, "hidden_size": 32, "num_layers": 4}, vocab=64, iters=2, tp=1, pp=2,
                       pipeline_schedule=schedule, use_distributed_optimizer=True, overlap_grad_reduce=True,
                       ddp_bucket_size=3000)
    for curve in layout_curves(4, {"run": flat}, extract={"run": _events}, prepare=_spy):
        events = curve["run"].extra
        early = [e for e in events if e[0] == "start" and e[2][0]]
        assert not early, "a bucket started while a W touching it was queued"
        passes = [i for i, e in enumerate(events) if e[0] == "pass"]
        assert len(passes) == 2
        for i in passes:
            assert _check_pass(events, i) > 1, "some buckets must take gradients from W's"


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
    from tests.split_backward_counts import measure

    cfg = ModelConfig(**{**LLAMA_GQA, "hidden_size": 32, "num_layers": 2, **extra})
    got, want = measure(cfg, PG, 16, 2, 64)
    assert got == want > 0


def _tp_bytes(rank: int, world: int) -> tuple[int, int]:
    from tests.split_backward_counts import measure_on_rank

    return measure_on_rank(rank, world, {**LLAMA_GQA, "hidden_size": 32, "num_layers": 2}, 16, 2, 64)


def test_deferred_bytes_equal_the_formula_at_tp2_sp():
    for got, want in run_ranks(_tp_bytes, 2):
        assert got == want > 0
