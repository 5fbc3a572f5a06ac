"""Model FLOPs per iteration, for TFLOP/s and MFU on the log line.

Counted per token, forward: 2 FLOPs per multiply-add of every GEMM (QKV, attention output, MLP, logits)
plus the two attention matmuls (QK^T and PV, 2*2*s*h_attn, counted over the full causal square as
Megatron does; a sliding-window layer counts its window instead of the sequence); with
--attn-logit-softcapping each of those scores also costs a divide, a tanh and a multiply (C·tanh(s/C)),
counted as 3 FLOPs per score, 3·keys·a per token. Training = 3x forward
(backward costs two forwards); full recomputation adds the layers' forward again.
Multi-latent attention counts its own projections and QK^T at --qk-head-dim + --qk-pos-emb-head-dim,
PV at --v-head-dim (planning/mla.py), as Megatron-LM does (the core's padding is the kernels' time only).
Multi-token prediction adds per depth its layer, its projection and the output head again (planning/mtp.py).
Mixture of experts counts the active parameters: an MoE layer's MLP is its router (h x E), the k routed
experts a token goes through (expert hidden size) and the shared expert and its gate if any.
"""

from __future__ import annotations

from megalite.config.model import ModelConfig
from megalite.planning import mla, mtp
from megalite.planning.model_shape import DENSE_LAYER, LayerShape, ModelShape


def mlp_macs(cfg: ModelConfig, ffn: int) -> int:
    """Multiply-adds per token of one MLP of hidden size ``ffn`` (SwiGLU: gate, up and down)."""
    return cfg.hidden_size * ffn * (3 if cfg.gated_linear_unit else 2)


def moe_mlp_macs(cfg: ModelConfig) -> int:
    """Multiply-adds per token of an MoE layer's MLP: router, k routed experts, shared expert and gate."""
    h = cfg.hidden_size
    n = h * cfg.num_experts + cfg.moe_router_topk * mlp_macs(cfg, cfg.expert_ffn_hidden_size)
    shared = cfg.moe_shared_expert_intermediate_size
    if shared:
        n += mlp_macs(cfg, shared) + (h if cfg.moe_shared_expert_gate else 0)
    return n


def layer_flops_per_token(cfg: ModelConfig, seq_length: int, layer: LayerShape = DENSE_LAYER) -> float:
    """Forward FLOPs per token of one transformer layer of kind ``layer`` (an MoE one: its active experts)."""
    h, d = cfg.hidden_size, cfg.kv_channels
    nq, nkv = cfg.num_attention_heads, cfg.num_query_groups
    qkv = h * (nq + 2 * nkv) * d
    proj = nq * d * h
    keys = layer.keys_per_query(seq_length)
    attn = 2 * keys * nq * d
    if cfg.multi_latent_attention:  # its latent projections and head widths (planning/mla.py)
        qkv, proj, attn = mla.gemm_macs(cfg), 0, mla.core_macs(cfg, keys)
    cap = 3 * keys * nq if cfg.attn_logit_softcapping else 0  # C·tanh(s/C): 3 FLOPs per score, not multiply-adds
    return 2 * (qkv + proj + (moe_mlp_macs(cfg) if layer.moe else mlp_macs(cfg, cfg.ffn_hidden_size)) + attn) + cap


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_length: int) -> float:
    """Forward FLOPs per token: each layer's, by its kind (model_shape.py), and the output layer's (with
    --final-logit-softcapping its C·tanh(z/C), 3 FLOPs per logit)."""
    model = ModelShape.of(cfg)
    per_kind = {kind: layer_flops_per_token(cfg, seq_length, kind) for kind in model.kinds}
    output = output_flops_per_token(cfg, vocab_size)
    depths = mtp.flops_per_token(cfg, lambda kind: layer_flops_per_token(cfg, seq_length, kind), output)  # MTP's
    return sum(per_kind[layer] for layer in model.layers) + output + depths


def output_flops_per_token(cfg: ModelConfig, vocab_size: int) -> float:
    return 2 * cfg.hidden_size * vocab_size + (3 * vocab_size if cfg.final_logit_softcapping else 0)


def training_flops(cfg: ModelConfig, vocab_size: int, seq_length: int, tokens: int, recompute: bool = False
                   ) -> float:
    """3x the forward; full recomputation runs the layers' forward again (never the output layer's)."""
    forward = flops_per_token(cfg, vocab_size, seq_length)
    again = forward - output_flops_per_token(cfg, vocab_size) if recompute else 0.0
    return (3.0 * forward + again) * tokens
