"""The cpu preset's eager-kernel terms (planning/eager.py, docs/planning.md "On this machine"): operator
calls at a measured cost each, dropout's masks at bernoulli_'s measured pace, unfused attention's passes
over its scores; none of them on a GPU preset."""

from __future__ import annotations

import pytest

from megalite.planning.cli import plan_config
from megalite.planning.eager import mask_elements, operator_calls
from megalite.planning.hardware import CPU_ELEMENTWISE_GBPS, CPU_MASK_GELEMS, CPU_OP_US, GPUS

EAGER_TERMS = ("operator calls", "dropout masks", "attention score passes")


def _plan(gpu: str = "cpu", layers: int = 2, extra: tuple[str, ...] = ()):
    flags = ["--num-layers", str(layers), "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length",
             "128", "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--attention-backend", "unfused", *extra]
    plan, _ = plan_config(flags, ["--num-nodes", "1", "--gpus-per-node", "1", "--gpu", gpu])
    return plan


def test_more_operator_calls_cost_more_on_cpu():
    """Twice the layers: more calls, each at the measured cost, and the step takes longer by that."""
    two, four = _plan(layers=2), _plan(layers=4)
    calls2, calls4 = operator_calls(two.shape, 0), operator_calls(four.shape, 0)
    assert calls4 > calls2 > 0
    m = two.shape.m
    assert two.time.terms["operator calls"] == pytest.approx(m * calls2 * CPU_OP_US * 1e-6)
    assert four.time.terms["operator calls"] > two.time.terms["operator calls"]
    recomputed = _plan(extra=("--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "1"))
    assert recomputed.time.terms["operator calls"] > two.time.terms["operator calls"]  # the forward again


def test_dropout_masks_are_timed_only_with_dropout():
    on = _plan()
    off = _plan(extra=("--attention-dropout", "0", "--hidden-dropout", "0"))
    sh = on.shape
    scores = sh.local_tokens * sh.s * 4  # b·s queries x s keys x 4 heads
    per_layer = scores + 2 * sh.local_tokens * sh.h
    assert mask_elements(sh, 0) == pytest.approx(2 * per_layer + sh.local_tokens * sh.h)
    assert on.time.terms["dropout masks"] == pytest.approx(sh.m * mask_elements(sh, 0) / (CPU_MASK_GELEMS * 1e9))
    assert off.time.terms["dropout masks"] == 0.0
    assert on.time.step_s > off.time.step_s


def test_unfused_score_passes_only_unfused():
    unfused, flash = _plan(), _plan(extra=("--attention-backend", "flash"))
    assert unfused.time.terms["attention score passes"] > 0
    assert flash.time.terms["attention score passes"] == 0.0


@pytest.mark.parametrize("gpu", sorted(g for g in GPUS if g != "cpu"))
def test_gpu_presets_have_no_eager_terms(gpu: str):
    """The GPU presets give none of the figures: their step time has none of the terms."""
    spec = GPUS[gpu]
    assert spec.op_overhead_us is None and spec.mask_gelems_per_s is None and not spec.eager_score_passes
    assert spec.elementwise_gbps is None
    plan = _plan(gpu, extra=("--bf16",))
    assert not set(EAGER_TERMS) & set(plan.time.terms)


def test_memory_bound_work_at_the_elementwise_bandwidth_on_cpu(monkeypatch):
    """The cpu preset's GeLU bandwidth (below its copy's) paces the memory-bound work; without it, the copy's."""
    import dataclasses

    import megalite.planning.hardware as hw

    plan = _plan()
    assert plan.cluster.elementwise_bytes_per_s() == pytest.approx(CPU_ELEMENTWISE_GBPS * 1e9)
    monkeypatch.setitem(hw.GPUS, "cpu", dataclasses.replace(GPUS["cpu"], elementwise_gbps=None))
    copy_paced = _plan()
    assert plan.time.terms["memory-bound work"] == pytest.approx(
        copy_paced.time.terms["memory-bound work"] * hw.CPU_MEMORY_GBPS / CPU_ELEMENTWISE_GBPS)


def test_block_recomputation_reruns_only_its_layers_eager_costs():
    """Block recomputation of 1 of 4 layers reruns a quarter of uniform's extra calls, masks and score passes."""
    full = ("--recompute-granularity", "full", "--recompute-num-layers", "1")
    none, uniform = _plan(layers=4), _plan(layers=4, extra=(*full, "--recompute-method", "uniform"))
    block = _plan(layers=4, extra=(*full, "--recompute-method", "block"))
    for term in EAGER_TERMS:
        extra_uniform = uniform.time.terms[term] - none.time.terms[term]
        assert extra_uniform > 0, term
        assert block.time.terms[term] - none.time.terms[term] == pytest.approx(extra_uniform / 4), term
