"""Multi-latent attention's terms (--multi-latent-attention, model/mla.py): what its layers hold, compute and keep
in place of the standard attention's fused QKV, and what decoding caches per token.

The memory, FLOP and time terms read these where a model's attention is MLA (a model-wide flag: every layer's
attention is of one kind; ``ModelShape`` carries the windows of the standard kind). Sizes: h hidden, H heads
(this TP rank's: H/t), r --kv-lora-rank, q --q-lora-rank (0: no query latent), p --qk-pos-emb-head-dim,
dq = --qk-head-dim + p, dv --v-head-dim; the core runs q, k and v at the common width D = max(dq, dv) (v or
q/k zero-padded, model/mla.py), which its time and saved bytes follow; its FLOPs for MFU count dq and dv as
Megatron-LM does.
"""

from __future__ import annotations

from megalite.config.model import ModelConfig


def norm_params(m: ModelConfig, width: int) -> int:
    """A latent norm's weights (--qk-layernorm gives MLA its two latent norms, megatron-core's rule)."""
    return width * (2 if m.normalization == "LayerNorm" else 1) if m.qk_layernorm else 0


def attention_params(m: ModelConfig, tp: int) -> int:
    """One layer's attention parameters on one TP rank: the replicated down-projections and their norms, this
    rank's heads of the up-projections (or of q_proj) and of the output projection (its bias replicated)."""
    h, heads, r, q = m.hidden_size, m.num_attention_heads // tp, m.kv_lora_rank, m.q_lora_rank or 0
    n = h * (r + m.qk_pos_emb_head_dim) + norm_params(m, r) + r * heads * (m.qk_head_dim + m.v_head_dim)
    n += h * q + norm_params(m, q) + q * heads * m.q_head_dim if q else h * heads * m.q_head_dim
    return n + heads * m.v_head_dim * h + (h if m.add_bias_linear else 0)


def gemm_macs(m: ModelConfig) -> int:
    """Multiply-adds per token of the attention's projections (the whole model's heads): queries (through the
    latent or not), the key/value down-projection with the RoPE key, the up-projection, the output."""
    h, heads, r, q = m.hidden_size, m.num_attention_heads, m.kv_lora_rank, m.q_lora_rank or 0
    queries = h * q + q * heads * m.q_head_dim if q else h * heads * m.q_head_dim
    return queries + h * (r + m.qk_pos_emb_head_dim) + r * heads * (m.qk_head_dim + m.v_head_dim) \
        + heads * m.v_head_dim * h


def rank_gemm_macs(m: ModelConfig, tp: int, sp: bool) -> float:
    """``gemm_macs`` one TP rank runs per token of the micro-batch: its heads' share of the up- and output
    projections, the whole down-projections (on its sequence shard with sequence parallelism)."""
    h, r, q = m.hidden_size, m.kv_lora_rank, m.q_lora_rank or 0
    down = h * (r + m.qk_pos_emb_head_dim + q)
    return (gemm_macs(m) - down) / tp + down / (tp if sp else 1)


def core_macs(m: ModelConfig, keys: int) -> int:
    """Multiply-adds per token of QK^T (dq wide) and PV (dv wide) over ``keys`` keys, all heads."""
    return keys * m.num_attention_heads * (m.q_head_dim + m.v_head_dim)


def core_width(m: ModelConfig) -> int:
    """D: the width q, k and v enter the core with (the kernels' time and saved bytes follow it)."""
    return max(m.q_head_dim, m.v_head_dim)


def saved_sharded(m: ModelConfig, tp: int) -> tuple[int, int]:
    """Elements per token one TP rank keeps of its heads: (q, k and v as the core takes them, D wide: what
    selective recomputation keeps; the output projection's input, H·dv)."""
    heads = m.num_attention_heads // tp
    return 3 * heads * core_width(m), heads * m.v_head_dim


def saved_latent_bytes(m: ModelConfig, e: int, extra_norm_bytes) -> float:
    """Bytes per token the replicated latent path keeps (split by TP only with sequence parallelism): each
    latent's norm (``extra_norm_bytes(kind, width, e)``: its input is no GEMM's) and its output, the
    up-projection's input. The down-projections read the layer's normed input, which the layer term counts."""
    widths = [m.kv_lora_rank] + ([m.q_lora_rank] if m.q_lora_rank else [])
    norms = m.qk_layernorm  # the latent norms (else the up-projections read the down-projections' outputs)
    return sum((extra_norm_bytes(m.normalization, w, e) if norms else 0) + w * e for w in widths)


def core_saved_bytes(m: ModelConfig, tokens: int, tp: int, seq: int, cp: int, e: int, unfused: bool) -> float:
    """Per micro-batch, the core's saved tensors beyond q, k, v (``saved_sharded``): flash, its output (D wide)
    and fp32 log-sum-exp; unfused, per score the softmax output (with dropout its mask and output, with
    soft-capping the tanh) and the causal mask; its K and V (one per head already) are repeated copies that
    replace the uncopied ones, which nothing else keeps."""
    heads = m.num_attention_heads // tp
    if unfused:
        per_score = ((3 if m.attention_dropout > 0 else 1) + (1 if m.attn_logit_softcapping else 0)) * e
        return per_score * tokens * seq * heads + seq * seq // cp
    return heads * core_width(m) * tokens * e + 4 * heads * tokens


def w_elements(m: ModelConfig, tp: int, sp: bool) -> float:
    """Per token, what the attention's GEMMs keep for a deferred weight gradient (planning/zero_bubble.py): each
    GEMM's input and output gradient; the down-projections share the layer's normed input (and run on the
    sequence shard with SP), the up-projections take a latent (its shard with SP, gathered again in W) and
    give this rank's heads, the output projection takes its heads and gives the whole hidden size."""
    h, heads, r, q = m.hidden_size, m.num_attention_heads / tp, m.kv_lora_rank, m.q_lora_rank or 0
    shard = tp if sp else 1
    down = (h + r + m.qk_pos_emb_head_dim + q) / shard
    up = (r + q) / shard + heads * (m.qk_head_dim + m.v_head_dim + m.q_head_dim)
    return down + up + heads * m.v_head_dim + h


def cp_kv_elements(m: ModelConfig, tp: int) -> int:
    """Per token, the K and V elements a context-parallel ring or gather moves: per head, D wide each."""
    return 2 * (m.num_attention_heads // tp) * core_width(m)


def kv_cache_bytes_per_token(m: ModelConfig, tp: int = 1, element_bytes: int = 2) -> int:
    """What decoding caches per token over all layers on one TP rank: standard attention its K and V per
    query group (2·groups/t·--kv-channels; a group shared by ranks is held by each), MLA the latent and the
    RoPE key on every rank (--kv-lora-rank + --qk-pos-emb-head-dim), whatever the heads."""
    if m.multi_latent_attention:
        per_layer = m.mla_cache_channels()
    else:
        per_layer = 2 * m.heads_per_tp_rank(tp)[1] * m.kv_channels
    return m.num_layers * per_layer * element_bytes
