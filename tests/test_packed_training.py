"""Promise (docs/parallelism.md, "Packed documents"): with Megatron's --reset-position-ids,
--reset-attention-mask and --eod-mask-loss, 5 iterations in every layout give the single-process loss curve
and grad norms (fp32, relative 1e-5): TP2 + SP, PP2 interleaved, CP2 and CP4 with each comm type (p2p,
a2a, allgather, a2a+p2p), DP2 with the distributed optimizer; GPT-2 and Llama GQA with 2 KV groups (which
trains at CP4 only through a2a+p2p, 2 x 2). Every layout runs under NCCL's point-to-point rules, one also
on plain gloo. With the flags the mock data yields EOD-terminated documents of 2 to seq/2 tokens
(docs/data.md), so every sequence holds several. The serial run itself equals per-document runs:
tests/test_packed_attention.py."""

from __future__ import annotations

import pytest

from tests.layouts import LayoutMatrix, serial_curve
from tests.tp_utils import GPT2, LLAMA_GQA, layout_flat

VOCAB = 64
ITERS = 5
PACKED = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}
MODELS = {"gpt2": {**GPT2, "seq_length": 32}, "llama": {**LLAMA_GQA, "seq_length": 32, "num_layers": 4}}
# name -> (tp, pp, cp, extra flags); all on 4 ranks, data parallelism fills the rest
LAYOUTS = {
    "tp2_sp": (2, 1, 1, {"sequence_parallel": True}),
    "tp2_dp2_distopt": (2, 1, 1, {"use_distributed_optimizer": True}),
    "pp2_interleaved": (1, 2, 1, {"num_layers_per_virtual_pipeline_stage": 1}),
    "cp2_dp2_p2p": (1, 1, 2, {}),
    "cp2_dp2_a2a": (1, 1, 2, {"cp_comm_type": "a2a"}),
    "cp2_dp2_a2a+p2p": (1, 1, 2, {"cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [2, 1]}),
    "cp2_dp2_allgather_recompute": (1, 1, 2, {"cp_comm_type": "allgather", "recompute_granularity": "full",
                                               "recompute_method": "uniform", "recompute_num_layers": 1}),
    "cp2_tp2_sp": (2, 1, 2, {"sequence_parallel": True}),
    "cp4_p2p": (1, 1, 4, {}),
    "cp4_a2a": (1, 1, 4, {"cp_comm_type": "a2a"}),  # GPT-2 only: Llama's 2 query groups do not split 4 ways
    "cp4_allgather": (1, 1, 4, {"cp_comm_type": "allgather"}),
    "cp4_a2a+p2p": (1, 1, 4, {"cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [2, 2]}),
}
CASES = [("gpt2", "tp2_sp"), ("gpt2", "tp2_dp2_distopt"), ("gpt2", "cp4_p2p"), ("gpt2", "cp4_a2a"),
         ("gpt2", "cp2_dp2_allgather_recompute"), ("gpt2", "cp2_dp2_a2a"), ("llama", "cp2_dp2_a2a+p2p"),
         ("llama", "pp2_interleaved"), ("llama", "cp2_dp2_p2p"), ("llama", "cp2_tp2_sp"), ("llama", "cp4_allgather"),
         ("llama", "cp4_a2a+p2p")]
GLOO_CASES = [("llama", "cp4_a2a+p2p")]


def flat(model: str, tp: int = 1, pp: int = 1, cp: int = 1, **extra) -> dict:
    return layout_flat(MODELS[model], vocab=VOCAB, iters=ITERS, tp=tp, pp=pp, context_parallel_size=cp,
                       **PACKED, **extra)


MATRIX = LayoutMatrix(4, flat, LAYOUTS, CASES, GLOO_CASES)


@pytest.mark.parametrize("mode,model,layout", MATRIX.params())
def test_packed_loss_curve_matches_serial(mode, model, layout):
    MATRIX.check(mode, model, layout, ITERS)


def test_each_flag_changes_the_curve():
    """The documents are real and reach the model: dropping any one of the three flags changes the serial
    curve (the attention's boundaries, the positions, the loss mask). GPT-2, whose learned positions see
    the reset (RoPE's relative angles inside a document do not change when its positions shift)."""
    packed = serial_curve(flat("gpt2")).losses
    for name in PACKED:
        fewer = {k: v for k, v in PACKED.items() if k != name}
        other = serial_curve(layout_flat(MODELS["gpt2"], vocab=VOCAB, iters=ITERS, **fewer)).losses
        assert max(abs(a - b) for a, b in zip(packed, other)) > 1e-4, f"{name} changed nothing"
