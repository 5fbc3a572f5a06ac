"""Model FLOPs per iteration, for TFLOP/s and MFU on the log line.

Counted per token, forward: 2 FLOPs per multiply-add of every GEMM (QKV, attention output, MLP, logits)
plus the two attention matmuls (QK^T and PV, 2*2*s*h_attn, counted over the full causal square as
Megatron does). Training = 3x forward (backward costs two forwards); full recomputation adds one more.
"""

from __future__ import annotations

from megalite.config.model import ModelConfig


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_length: int) -> float:
    h, d = cfg.hidden_size, cfg.kv_channels
    nq, nkv = cfg.num_attention_heads, cfg.num_query_groups
    qkv = h * (nq + 2 * nkv) * d
    proj = nq * d * h
    mlp = h * cfg.ffn_hidden_size * (3 if cfg.swiglu else 2)
    attn = 2 * seq_length * nq * d
    per_layer = 2 * (qkv + proj + mlp + attn)
    return cfg.num_layers * per_layer + 2 * h * vocab_size


def training_flops(cfg: ModelConfig, vocab_size: int, seq_length: int, tokens: int, recompute: bool = False
                   ) -> float:
    return (4.0 if recompute else 3.0) * flops_per_token(cfg, vocab_size, seq_length) * tokens
