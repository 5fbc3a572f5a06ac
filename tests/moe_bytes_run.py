"""The MoE dispatch-bytes run that tests/test_moe_comm_bytes.py and bench/bench_moe.py both make: its
config, and what the formula of docs/moe.md (``tests/moe_formulas.py``) says its counters hold.

A run is keyed (name, world, tp, ep, etp, dispatcher, pad); fp32, ``ITERS`` steps of ``M`` micro-batches per
DP rank, every layer MoE. The counters to compare are ``pg.comm_bytes`` entries whose label is in
``MOE_LABELS``, divided by ``ITERS``.
"""

from __future__ import annotations

from collections import Counter

from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.moe.router import capacity
from tests.moe_formulas import allgather_bytes, alltoall_bytes, step_bytes

VOCAB = 512
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, swiglu=True, normalization="RMSNorm",
             position_embedding_type="rope", untie_embeddings_and_output_weights=True, disable_bias_linear=True,
             hidden_dropout=0.0, attention_dropout=0.0)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01)
SEQ, MBS, M, ITERS = 32, 2, 2, 2  # micro-batch size, micro-batches per DP rank and step, steps
MOE_LABELS = ("moe_counts", "moe_all_to_all", "moe_routing_all_gather", "moe_all_gather", "moe_reduce_scatter")


def bytes_cfg(world: int, tp: int, ep: int, etp: int, dispatcher: str, pad: bool) -> MegaliteConfig:
    dp = world // tp
    extra = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True) if pad else {}
    cfg = MegaliteConfig.from_flat(dict(
        MODEL, **MOE, **extra, seq_length=SEQ, max_position_embeddings=SEQ, micro_batch_size=MBS,
        global_batch_size=dp * MBS * M, train_iters=ITERS, lr=1e-4, log_interval=1, eval_iters=0,
        eval_interval=10_000, mock_data=True, vocab_size=VOCAB, seed=1234, tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        moe_token_dispatcher_type=dispatcher))
    validate(cfg, world)
    return cfg


def formula(key: tuple) -> tuple[Counter, bool]:
    """Step bytes summed over the world, and whether every rank's share is the same (the world / ranks)."""
    name, world, tp, ep, etp, disp, pad = key
    T, h, k, E = SEQ * MBS // tp, MODEL["hidden_size"], MOE["moe_router_topk"], MOE["num_experts"]
    layers = MODEL["num_layers"]
    if disp == "allgather":
        per = allgather_bytes(T, h, k, ep, etp, 4)
        return step_bytes(Counter({key: v * world for key, v in per.items()}), layers, M), True
    padded = E * capacity(T, k, E, 1.0) if pad else None
    return step_bytes(alltoall_bytes(T, h, k, E, ep, etp, world, 4, padded), layers, M), pad
