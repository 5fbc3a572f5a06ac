"""Bytes per rank, one function per term (docs/design.md §3.4-3.6, docs/planning.md).

Activation bytes are what megalite's eager layer keeps, tensor by tensor (tests/test_planning.py holds
them to the bytes autograd saves on CPU within 5%): Korthikanti et al.'s per-layer terms plus what the
eager code keeps besides (2 more bytes per token and channel outside the GEMMs, the repeated K/V and the
causal mask of the unfused attention, RoPE's rotated copies); MoE layers their router, dispatch and
experts' rows in place of the MLP (``planning/moe.py``). ZeRO-2/3 (--data-parallel-sharding-strategy) divide
gradients / weights by the DP x CP ranks and add what a step holds in full meanwhile (bench/README.md,
"Sharding strategies").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megalite.config.arguments import MegaliteConfig
from megalite.pipeline.schedule_table import ScheduleSpec
from megalite.pipeline.timeline import ChunkBytes, spec_for
from megalite.planning import mla, mtp
from megalite.planning.model_shape import DENSE_LAYER, EXPERT_FAMILY, LayerShape
from megalite.planning.moe import (
    active_mlp_params,
    dispatch_buffer_bytes,
    expert_params,
    frozen_params,
    moe_dense_params,
    moe_mlp_activation_bytes,
)
from megalite.planning.shape import RunShape
from megalite.planning.zero_bubble import ZERO_BUBBLE, chunk_w_bytes, output_bytes
from megalite.planning.zero_bubble_memory import choose_holds, one_f_one_b, played

UNFUSED_BACKENDS = ("unfused", "local")  # the explicit softmax(QK^T)V; others are flash attention on a GPU


# ---- parameters ------------------------------------------------------------------------------------
def layer_params(sh: RunShape, layer: LayerShape = DENSE_LAYER) -> int:
    """One transformer layer's parameters on one TP rank (norms and row-parallel biases replicated) that
    the dense gradient buffer holds; an MoE layer's router, shared expert and gate in place of the MLP
    (its routed experts, the expert family: ``planning/moe.py:expert_params``)."""
    m, t, h = sh.cfg.model, sh.tp, sh.h
    a, g, d, f = m.num_attention_heads, m.num_query_groups, m.kv_channels, m.ffn_hidden_size
    bias = m.add_bias_linear
    qkv_rows = (a // t + 2 * max(g // t, 1)) * d
    n = qkv_rows * h + (qkv_rows if bias or m.add_qkv_bias else 0)
    n += (a * d // t) * h + (h if bias else 0)
    if m.multi_latent_attention:  # its latent projections in place of the fused QKV (planning/mla.py)
        n = mla.attention_params(m, t)
    if layer.moe:
        n += moe_dense_params(sh)
    else:
        fc1_rows = (2 * f if m.gated_linear_unit else f) // t
        n += fc1_rows * h + (fc1_rows if bias else 0)
        n += (f // t) * h + (h if bias else 0)
    return n + layer_norms(sh) * norm_params(sh) + qk_norm_params(sh)


def layer_norms(sh: RunShape) -> int:
    """Norms over the hidden size in one layer: two with --sublayer-norms pre or post, four with pre-post."""
    return 4 if sh.cfg.model.sublayer_norms == "pre-post" else 2


def qk_norm_params(sh: RunShape) -> int:
    """--qk-layernorm's weights on one TP rank: per head, one norm of the head dim for q and one for k
    (replicated); over the projection, a weight per channel of this rank's q and k rows (model/qk_norm.py)."""
    m, t = sh.cfg.model, sh.tp
    if not m.qk_layernorm or m.multi_latent_attention:  # MLA's latent norms: planning/mla.py
        return 0
    d = m.kv_channels
    if m.qk_layernorm_scope == "head":
        return 2 * d * (2 if m.normalization == "LayerNorm" else 1)
    return (m.num_attention_heads // t + max(m.num_query_groups // t, 1)) * d


def norm_params(sh: RunShape) -> int:
    return sh.h * (2 if sh.cfg.model.normalization == "LayerNorm" else 1)


def embedding_params(sh: RunShape) -> int:
    """First stage: the vocab-parallel word embedding and the learned positions."""
    m = sh.cfg.model
    pos = m.max_position_embeddings * sh.h if m.position_embedding_type == "learned_absolute" else 0
    return sh.padded_vocab // sh.tp * sh.h + pos


def output_params(sh: RunShape) -> int:
    """Last stage: the final norm and the output layer (its own weight unless tied on one stage)."""
    own = not sh.cfg.model.tied_embeddings or sh.pp > 1
    return norm_params(sh) + (sh.padded_vocab // sh.tp * sh.h if own else 0)


def _stage_layer_params(sh: RunShape, stage: int) -> int:
    """The dense-buffer parameters of the stage's transformer layers."""
    return sum(n * layer_params(sh, kind) for kind, n in sh.kinds_in(stage).items())


def stage_dense_params(sh: RunShape, stage: int) -> int:
    """Trainable parameters of pipeline rank ``stage`` (its v chunks) outside the routed experts: what the
    dense gradient buffers hold, reduced and sharded over DP x CP."""
    n = _stage_layer_params(sh, stage)
    if stage == 0:
        n += embedding_params(sh)
    if stage == sh.loss_rank:  # ZB-V: rank 0, beside the embedding
        # --mtp-num-layers: its depths sit with the loss (planning/mtp.py)
        n += output_params(sh) + mtp.dense_params(sh, layer_params, norm_params)
    return n


def stage_expert_params(sh: RunShape, stage: int) -> int:
    """Routed-expert parameters of pipeline rank ``stage`` (the expert family): reduced and sharded over
    expert-DP."""
    return (sum(n * expert_params(sh) for kind, n in sh.kinds_in(stage).items() if kind.moe)
            + (mtp.expert_params(sh) if stage == sh.loss_rank else 0))


def stage_frozen_params(sh: RunShape, stage: int) -> int:
    """fp32 parameters without gradient (the MoE layers' expert bias)."""
    return (sum(n * frozen_params(sh) for kind, n in sh.kinds_in(stage).items() if kind.moe)
            + (mtp.frozen_params(sh) if stage == sh.loss_rank else 0))


def stage_params(sh: RunShape, stage: int) -> int:
    """All parameters on pipeline rank ``stage`` (its v chunks)."""
    return stage_dense_params(sh, stage) + stage_expert_params(sh, stage) + stage_frozen_params(sh, stage)


def active_params(sh: RunShape) -> int:
    """The whole model's parameters one token goes through (unsplit): all of them but, in each MoE layer,
    the routed experts (and bias) a token is not routed to (a dense model: all of them); MTP's apart."""
    one = dataclasses.replace(sh, tp=1, pp=1, v=1, ep=1, etp=1)
    inactive = sum(_inactive_params(one) for layer in sh.model_shape.layers if layer.moe)
    return stage_params(one, 0) - mtp.all_params(one, layer_params, norm_params) - inactive


def _inactive_params(one: RunShape) -> int:
    """Of one MoE layer (unsplit), the parameters a token does not go through."""
    return expert_params(one) + frozen_params(one) + moe_dense_params(one) - active_mlp_params(one)


def total_params(sh: RunShape) -> int:
    """The main model's parameters (--mtp-num-layers' depths counted apart: planning/mtp.py:all_params)."""
    one = dataclasses.replace(sh, tp=1, pp=1, v=1, ep=1, etp=1)
    return stage_params(one, 0) - mtp.all_params(one, layer_params, norm_params)


# ---- weights, gradients, optimizer state (docs/design.md §3.6) ---------------------------------------
def _shards(sh: RunShape) -> int:
    return sh.dp * sh.cp


def _bucket_numel(sh: RunShape, n: int, dp: int | None = None) -> int:
    dd = sh.cfg.ddp
    return min(n, dd.ddp_bucket_size or max(40_000_000, 1_000_000 * (sh.dp if dp is None else dp)))


def _largest_layer(sh: RunShape) -> int:
    return max(layer_params(sh, kind) for kind in sh.model_shape.kinds)


def weight_bytes(sh: RunShape, n: int, stage: int = 0) -> float:
    """The weights; with optim_grads_params their shard, plus the full weights gathered at once: the
    chunk's own unit (embedding, final norm, output layer) and two layers (the one computing, the one
    prefetched), or all of them with --fsdp-keep-params-across-microbatches."""
    dd = sh.cfg.ddp
    if not dd.shards_params or _shards(sh) == 1:
        return n * sh.param_bytes
    layers = _stage_layer_params(sh, stage)
    gathered = n if dd.fsdp_keep_params_across_microbatches else min(n, n - layers + 2 * _largest_layer(sh))
    return (n / _shards(sh) + gathered) * sh.param_bytes


def grad_bytes(sh: RunShape, n: int) -> float:
    """The contiguous gradient buffer (reduce-scattered in place, so not sharded by the distributed
    optimizer); with optim_grads / optim_grads_params the gradient shard, plus one bucket's gradients in
    full while it waits for its reduce-scatter (the flat buffer and the low-precision .grad)."""
    dd = sh.cfg.ddp
    if not dd.shards_grads or _shards(sh) == 1:
        return n * sh.grad_bytes
    bucket = _largest_layer(sh) if dd.shards_params else _bucket_numel(sh, n)
    return n * sh.grad_bytes / _shards(sh) + bucket * (sh.grad_bytes + sh.param_bytes)


def optimizer_bytes(sh: RunShape, n: int, shards: int | None = None) -> float:
    """fp32 main params (aliased to the weight in fp32 runs) and two Adam moments, sharded over the
    DP x CP ranks (``shards``: expert-DP for routed experts) by every sharding strategy, on the host with
    --optimizer-cpu-offload."""
    if sh.cfg.ddp.optimizer_cpu_offload:
        return 0.0
    per = (4 if sh.param_bytes == 2 else 0) + 8
    shards = (_shards(sh) if shards is None else shards) if sh.cfg.ddp.shards_optimizer else 1
    return n * per / shards


def _expert_layer(sh: RunShape, n: int, stage: int) -> int:
    """One MoE layer's routed-expert parameters on this rank (ZeRO-3's expert unit)."""
    layers = sh.moe_layers_in(stage)
    return n // layers if layers else 0


def expert_weight_bytes(sh: RunShape, n: int, stage: int = 0) -> float:
    """The E/ep experts' weights; with optim_grads_params their shard over expert-DP, plus two layers'
    experts gathered at once (the one computing, the one prefetched), or all of them with
    --fsdp-keep-params-across-microbatches."""
    dd = sh.cfg.ddp
    if not dd.shards_params or sh.edp == 1:
        return n * sh.param_bytes
    gathered = n if dd.fsdp_keep_params_across_microbatches else min(n, 2 * _expert_layer(sh, n, stage))
    return (n / sh.edp + gathered) * sh.param_bytes


def expert_grad_bytes(sh: RunShape, n: int, stage: int = 0) -> float:
    """The routed experts' gradient buffer, over expert-DP: whole, or with optim_grads / optim_grads_params
    its shard plus one bucket in full (ZeRO-3: one layer's experts)."""
    if not sh.cfg.ddp.shards_grads or sh.edp == 1:
        return n * sh.grad_bytes
    bucket = _expert_layer(sh, n, stage) if sh.cfg.ddp.shards_params else _bucket_numel(sh, n, sh.edp)
    return n * sh.grad_bytes / sh.edp + bucket * (sh.grad_bytes + sh.param_bytes)


def expert_state_terms(sh: RunShape, stage: int) -> dict[str, float]:
    """The report's expert lines: the E/ep experts' weights (each cut over expert-TP; sharded over
    expert-DP by ZeRO-3), gradients and optimizer state (sharded over expert-DP by the distributed
    optimizer and ZeRO)."""
    n = stage_expert_params(sh, stage)
    return {"expert weights": expert_weight_bytes(sh, n, stage), "expert gradients": expert_grad_bytes(sh, n, stage),
            "expert optimizer state": optimizer_bytes(sh, n, sh.edp)}


# ---- activations (docs/design.md §3.5) ----------------------------------------------------------------
def layer_outside_core_bytes(sh: RunShape, layer: LayerShape = DENSE_LAYER) -> float:
    """Per micro-batch: what one layer keeps outside the core attention (selective recomputation's
    total), in elements of the activation dtype per token unless said otherwise.

    Replicated over TP (split by TP with sequence parallelism): the two norms' inputs and outputs (4h),
    the residual dropouts' outputs (2h, with --hidden-dropout > 0), the norm statistics (4 bytes per
    element size), and with RMSNorm the eager decomposition's 6 bytes per channel per norm. Split by
    TP: the fused QKV output ((a + 2g)d), a new copy of q when heads share a K/V group or RoPE rotates
    it, the rotated k with RoPE, the projection's input (ad), the MLP's fc1 output and activation (2f;
    SwiGLU 4f). RoPE's cos/sin tables (4 of s x rotated channels) do not depend on the batch. An MoE
    layer has its router, dispatch and experts' bytes in place of the MLP's (planning/moe.py)."""
    m, h, t, e = sh.cfg.model, sh.h, sh.tp, sh.act_bytes
    a, g, d, f = m.num_attention_heads, m.num_query_groups, m.kv_channels, m.ffn_hidden_size
    rope = m.rotary  # RoPE or YaRN
    qkv = (a + 2 * g) * d + (a * d if rope or a != g else 0) + (g * d if rope else 0)
    # Transformer Engine (--model-te-layers): the projection reads flash attention's saved output, the
    # fused SwiGLU keeps fc1's output and its own (3f), the fused RMSNorm no decomposition
    te = sh.te_layers
    proj = 0 if te and m.attention_backend not in UNFUSED_BACKENDS else a * d
    latent = 0.0
    if m.multi_latent_attention:  # q, k, v at the core's width, and the latent path (planning/mla.py)
        (qkv, proj), latent = mla.saved_sharded(m, 1), mla.saved_latent_bytes(m, e, extra_norm_bytes)
    sharded = (qkv + proj + (0 if layer.moe else (3 if te else 4) * f if m.gated_linear_unit else 2 * f)) * e
    replicated = (4 + (2 if m.hidden_dropout > 0 else 0)) * h * e + 4 * e
    if m.normalization == "RMSNorm" and not te:
        replicated += 12 * h
    replicated += (layer_norms(sh) - 2) * extra_norm_bytes(m.normalization, h, e) + latent
    per_token = (replicated + sharded) / t if sh.sp else replicated + sharded / t
    per_token += qk_norm_bytes(sh)  # this rank's heads (K/V groups copied where ranks share one)
    tables = 4 * (sh.s // sh.cp) * m.rotary_dim * e if rope else 0
    return per_token * sh.local_tokens + tables + (moe_mlp_activation_bytes(sh) if layer.moe else 0.0)


def extra_norm_bytes(kind: str, width: int, e: int) -> float:
    """Per token, what one more norm over ``width`` channels keeps (--sublayer-norms pre-post's third and
    fourth, whose inputs no GEMM keeps): the eager RMSNorm its fp32 input and normalized copy (8 bytes per
    channel) and its fp32 statistic; LayerNorm its input and two statistics (measured, tests/test_planning.py)."""
    return 8 * width + 4 if kind == "RMSNorm" else (width + 2) * e


def qk_norm_bytes(sh: RunShape) -> float:
    """Per token, on one TP rank: what --qk-layernorm keeps for this rank's q and k channels (c) and rows
    (one per head, or one per projection): RMSNorm its fp32 input, its output and the rotated copy RoPE
    then makes of a new tensor ((4 + 2e) bytes per channel) and a fp32 statistic per row; LayerNorm 2e per
    channel and per row (measured, tests/test_planning.py)."""
    m, t, e = sh.cfg.model, sh.tp, sh.act_bytes
    if not m.qk_layernorm or m.multi_latent_attention:  # MLA's latent norms: planning/mla.py
        return 0.0
    a, g = m.heads_per_tp_rank(t)
    channels = (a + g) * m.kv_channels
    rows = a + g if m.qk_layernorm_scope == "head" else 2
    if m.normalization == "RMSNorm":
        return (4 + 2 * e) * channels + 4 * rows
    return 2 * e * (channels + rows)


def core_attention_bytes(sh: RunShape) -> float:
    """Per micro-batch: the core attention's saved tensors. Unfused: per score the softmax output, and
    with --attention-dropout > 0 the dropout mask and output (Korthikanti's 5 bytes, 6 here), with
    --attn-logit-softcapping the tanh of the capped scores (its backward's input), K and V repeated to every
    head, and the causal mask (s x s bytes); flash attention, and the blockwise path a capped layer runs on
    the other backends: its output and fp32 log-sum-exp (its q, k, v are the tensors selective recomputation
    keeps)."""
    m, t, e = sh.cfg.model, sh.tp, sh.act_bytes
    a, d = m.num_attention_heads, m.kv_channels
    tokens = sh.local_tokens
    if m.multi_latent_attention:
        return mla.core_saved_bytes(m, tokens, t, sh.s, sh.cp, e, m.attention_backend in UNFUSED_BACKENDS)
    if m.attention_backend in UNFUSED_BACKENDS:
        scores = tokens * sh.s * a / t  # each local query sees the whole sequence
        per_score = ((3 if m.attention_dropout > 0 else 1) + (1 if m.attn_logit_softcapping else 0)) * e
        # QK^T and PV keep the repeated K and V, not the fused QKV output (unless q is a view of it)
        # nor RoPE's rotated k, which layer_outside_core_bytes counts for the recomputed case
        g, rope = m.num_query_groups, m.rotary
        unkept = ((a + 2 * g) * d if rope or a != g else 0) + (g * d if rope else 0)
        return (per_score * scores + (2 * a * d - unkept) * tokens / t * e + sh.s * sh.s // sh.cp)
    return a * d * tokens / t * e + 4 * a * tokens / t


def full_layer_bytes(sh: RunShape, layer: LayerShape = DENSE_LAYER) -> float:
    return layer_outside_core_bytes(sh, layer) + core_attention_bytes(sh)


def stage_layer_bytes(sh: RunShape, stage: int) -> float:
    """All of a pipeline rank's layers, one micro-batch each, without recomputation."""
    return sum(n * full_layer_bytes(sh, kind) for kind, n in sh.kinds_in(stage).items())


def layer_input_bytes(sh: RunShape) -> float:
    """What full recomputation keeps per recomputed group: its input (split by TP with SP)."""
    return sh.local_tokens * sh.h * sh.act_bytes / (sh.tp if sh.sp else 1)


def _kept_layers(sh: RunShape, stage: int, chunk: int | None) -> dict[LayerShape, float]:
    """Layers of each kind in a chunk whose activations are kept (not recomputed); chunk None: the mean
    over the rank's chunks."""
    counts = {kind: n / (sh.v if chunk is None else 1) for kind, n in sh.kinds_in(stage, chunk).items()}
    if sh.recompute != "full":
        return counts
    n = sh.chunk_size(stage, chunk)
    k = min(sh.cfg.model.recompute_num_layers, n)
    block = sh.cfg.model.recompute_method == "block" and n
    return {kind: c * (n - k) / n if block else 0.0 for kind, c in counts.items()}


def chunk_activation_bytes(sh: RunShape, stage: int = 0, chunk: int | None = None) -> float:
    """One model chunk of one micro-batch, as kept between its forward and backward, by recomputation
    granularity (chunk None: the mean over the rank's chunks, which differ in how many layers of each kind
    they hold and, under an uneven layout string, in their layers)."""
    m, n = sh.cfg.model, sh.chunk_size(stage, chunk)
    # each kept layer keeps what a dense one does, plus what its kind keeps besides (an MoE layer: its MLP's
    # bytes replaced by the MoE layer's)
    other = sum(c * (full_layer_bytes(sh, kind) - full_layer_bytes(sh)) for kind, c in
                _kept_layers(sh, stage, chunk).items() if kind != DENSE_LAYER)
    if sh.recompute == "selective":
        return n * layer_outside_core_bytes(sh) + other
    if sh.recompute != "full":
        return n * full_layer_bytes(sh) + other
    k = min(m.recompute_num_layers, n)
    if m.recompute_method == "block":  # the first k layers recomputed, the rest kept
        return k * layer_input_bytes(sh) + (n - k) * full_layer_bytes(sh) + other
    return -(-n // k) * layer_input_bytes(sh) if k else 0.0  # uniform: one input per group of k layers


def moe_activation_bytes(sh: RunShape, stage: int) -> float:
    """The MoE layers' part of the stage's peak activations (router, dispatch, experts' rows): the
    report's "MoE activations" line (included in activation_bytes)."""
    kept = sum(c for kind, c in _kept_layers(sh, stage, None).items() if kind.moe)
    return in_flight_chunks(sh, stage) * kept * moe_mlp_activation_bytes(sh) if kept else 0.0


def recompute_working_bytes(sh: RunShape) -> float:
    """Full recomputation rebuilds one group's activations at a time during backward: a group of
    --recompute-num-layers layers (uniform), one layer (block: each of its layers is checkpointed alone)."""
    if sh.recompute != "full":
        return 0.0
    layer = max(full_layer_bytes(sh, kind) for kind in sh.model_shape.kinds)
    group = 1 if sh.cfg.model.recompute_method == "block" else sh.cfg.model.recompute_num_layers
    return min(group, sh.layers_per_chunk) * layer


def in_flight_chunks(sh: RunShape, stage: int) -> float:
    """Micro-batch chunks whose activations a pipeline rank holds at its peak (docs/design.md §3.4):
    1F1B p - r, the interleaved warm-up (p - r - 1)·2 + (v - 1)·p + 1 chunks, GPipe all m."""
    p, v, m = sh.pp, sh.v, sh.m
    if p == 1:
        return 1.0
    if sh.cfg.parallel.pipeline_schedule == "gpipe":
        return float(m * v)
    if v == 1:
        return float(min(p - stage, m))
    return float(min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v))


def embedding_activation_bytes(sh: RunShape, stage: int) -> float:
    """First stage, per micro-batch in flight: the embedding dropout's output (with --hidden-dropout)."""
    if stage != 0 or sh.cfg.model.hidden_dropout == 0:
        return 0.0
    return sh.local_tokens * sh.h * sh.act_bytes / (sh.tp if sh.sp else 1)


def logits_bytes(sh: RunShape, stage: int) -> float:
    """Last stage, per micro-batch whose loss is computed: the fp32 logits the vocab-parallel
    cross-entropy keeps for backward, and the inputs of the final norm and the output layer. With
    --cross-entropy-loss-fusion: one chunk of at least 512 tokens, the fp32 weight-gradient accumulator
    and the input gradient (not measured here)."""
    if stage != sh.loss_rank:
        return 0.0
    vocab, tokens = sh.padded_vocab // sh.tp, sh.local_tokens
    inputs = 2 * tokens * sh.h * sh.act_bytes / (sh.tp if sh.sp else 1)
    if sh.cfg.model.cross_entropy_loss_fusion:
        chunk = min(tokens, max(512, 2**24 // vocab))
        return chunk * vocab * 4 + vocab * sh.h * 4 + tokens * sh.h * 4 + inputs
    return tokens * vocab * 4 + inputs


def losses_in_flight(sh: RunShape) -> int:
    """Micro-batches whose loss inputs the last stage holds at once: all of them under GPipe, else one
    (its backward starts right after its forward)."""
    return sh.m if sh.cfg.parallel.pipeline_schedule == "gpipe" and sh.pp > 1 else 1


def activation_bytes(sh: RunShape, stage: int) -> float:
    """The stage's peak: its chunks in flight, the embedding outputs of the micro-batches in flight on
    the first chunk, and the larger of the losses' inputs and full recomputation's working set (the
    loss's backward frees its logits before any layer is recomputed)."""
    chunks = in_flight_chunks(sh, stage)
    first_chunk = -(-chunks // sh.v)
    logits = logits_bytes(sh, stage)
    loss = logits + mtp.activation_bytes(sh, stage, full_layer_bytes, logits)  # --mtp-num-layers' depths
    return (chunks * chunk_activation_bytes(sh, stage) + first_chunk * embedding_activation_bytes(sh, stage)
            + max(losses_in_flight(sh) * loss, recompute_working_bytes(sh)))


# ---- communication buffers ---------------------------------------------------------------------------
def comm_buffer_bytes(sh: RunShape) -> float:
    """Receive buffers of the pipeline (an activation and a gradient per chunk), the gathered input of a
    column-parallel GEMM with SP, and the K/V chunks a context-parallel ring has in flight."""
    msg = sh.local_tokens * sh.h * sh.act_bytes / (sh.tp if sh.sp else 1)
    pp = 2 * sh.v * msg if sh.pp > 1 else 0.0
    sp = sh.local_tokens * sh.h * sh.act_bytes if sh.sp else 0.0
    m = sh.cfg.model
    kv = 2 * sh.local_tokens * m.heads_per_tp_rank(sh.tp)[1] * m.kv_channels * sh.act_bytes
    if m.multi_latent_attention:  # K and V per head, at the core's width (planning/mla.py)
        kv = sh.local_tokens * mla.cp_kv_elements(m, sh.tp) * sh.act_bytes
    cp = 2 * kv if sh.cp > 1 else 0.0
    return pp + sp + cp


# ---- zero bubble: each rank's table played with its chunks' bytes (docs/design.md §3.4) -------------------
def rank_chunks(sh: RunShape, stage: int, split_backward: bool) -> tuple[ChunkBytes, ...]:
    """Each of pipeline rank ``stage``'s chunks' bytes per micro-batch (``ChunkBytes``), from its own layer
    count; ``split_backward``: whether W's keep theirs (zero bubble) or the backward is whole (1F1B)."""
    split = sh.split
    stages, total = split.stages, sh.layers_in(stage)
    per_rank = chunk_activation_bytes(sh, stage) * (1 if split.v_shape else sh.v)
    out = []
    for c in range(split.vp):
        layers, vstage = len(split.layers(stage, c)), stages.stage(stage, c)
        act = per_rank * layers / total if total else 0.0
        w = chunk_w_bytes(sh.cfg.model, stages, stage, c, sh.local_tokens, sh.padded_vocab, sh.tp, sh.sp,
                          sh.act_bytes, layers) if split_backward else 0
        logits, prompt = _loss_bytes(sh, stage) if vstage == stages.last else (0.0, 0.0)
        first = vstage == 0
        out.append(ChunkBytes(act + (embedding_activation_bytes(sh, 0) if first else 0.0), float(w), logits, prompt,
                              float(sh.padded_vocab // sh.tp * sh.h * sh.act_bytes) if first else 0.0))
    return tuple(out)


def _loss_bytes(sh: RunShape, stage: int) -> tuple[float, float]:
    """(what the loss keeps from F to just after B, what is made on top at B's end). Unfused: the fp32 logits
    (their gradient in place) and the inputs; then the output layer's weight gradient and input. Fused with
    the cross-entropy: the fp32 weight-gradient accumulator, the input gradient and the inputs; the chunk of
    logits lives only inside F and the accumulator is scaled in place, so a chunk's worth on top."""
    kept = logits_bytes(sh, stage)
    if not sh.cfg.model.cross_entropy_loss_fusion:
        return kept, float(output_bytes(sh.cfg.model, sh.local_tokens, sh.padded_vocab, sh.tp, sh.sp, sh.act_bytes))
    vocab = sh.padded_vocab // sh.tp
    chunk = min(sh.local_tokens, max(512, 2**24 // vocab)) * vocab * 4  # logits_bytes's chunk
    return kept - chunk, float(chunk)


def live_bytes(sh: RunShape, stage: int, holds: tuple[int, ...] | None = None) -> tuple[float, float]:
    """(pipeline rank ``stage``'s most bytes above its state at once, the pending W's part then) under its
    schedule's table (``holds``: ScheduleSpec.holds), plus what full recomputation rebuilds at a time where
    that exceeds the loss's logits (the two are not live together)."""
    name = sh.cfg.parallel.pipeline_schedule
    zero_bubble = name in ZERO_BUBBLE and sh.pp > 1
    spec = spec_for(name, sh.pp, sh.m, holds) if zero_bubble else ScheduleSpec(
        sh.pp, sh.v, sh.m, "gpipe" if name == "gpipe" else "1f1b")
    chunks = rank_chunks(sh, stage, zero_bubble)
    peak, w = played(spec, stage, chunks)
    logits = max(c.logits for c in chunks)
    return peak + max(recompute_working_bytes(sh) - logits, 0.0), w


def state_bytes(sh: RunShape, stage: int) -> float:
    """Rank ``stage``'s bytes no schedule changes (``state_terms``)."""
    return sum(state_terms(sh, stage).values())


def zero_bubble_holds(sh: RunShape) -> tuple[int, ...] | None:
    """The holds a zero-bubble run uses (``planning/zero_bubble_memory.py:choose_holds``): each rank's room is
    1F1B's highest rank's planned bytes (same model, even split) less its own state. None: the schedule's own
    (or not zero bubble, or no even 1F1B split to compare with)."""
    name, base = sh.cfg.parallel.pipeline_schedule, one_f_one_b(sh)
    if name not in ZERO_BUBBLE or sh.pp < 2 or base is None:
        return None
    total = max(state_bytes(base, r) + live_bytes(base, r)[0] for r in range(sh.pp))
    room = tuple(total - state_bytes(sh, r) for r in range(sh.pp))
    return choose_holds(name, sh.pp, sh.m, tuple(rank_chunks(sh, r, True) for r in range(sh.pp)), room)


_RUN_HOLDS: dict[tuple[str, int, int], tuple[int, ...] | None] = {}


def run_holds(cfg: MegaliteConfig, world: int, vocab: int) -> tuple[int, ...] | None:
    """``zero_bubble_holds`` of a training run (every rank computes the same), once per configuration."""
    if cfg.parallel.pipeline_schedule not in ZERO_BUBBLE or cfg.parallel.pipeline_model_parallel_size < 2:
        return None
    key = (repr(cfg), world, vocab)
    if key not in _RUN_HOLDS:
        _RUN_HOLDS[key] = zero_bubble_holds(RunShape.of(cfg, world, vocab))
    return _RUN_HOLDS[key]


def zero_bubble_live(sh: RunShape, stage: int) -> tuple[float, float]:
    """zb-h1 / zbv: ``live_bytes`` under the holds training runs."""
    return live_bytes(sh, stage, zero_bubble_holds(sh))


def deferred_w_term(sh: RunShape, stage: int) -> float:
    """zb-h1 / zbv: the pending W's bytes at the rank's peak (``zero_bubble_live``)."""
    return zero_bubble_live(sh, stage)[1]


# ---- the total -----------------------------------------------------------------------------------------
@dataclass
class MemoryReport:
    stage: int  # the pipeline rank shown (the one with the most bytes)
    params: int
    terms: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def state_terms(sh: RunShape, stage: int) -> dict[str, float]:
    """The rank's bytes that no schedule changes: weights, gradients, optimizer (and expert) state, buffers."""
    n = stage_dense_params(sh, stage)
    terms = {"weights": weight_bytes(sh, n, stage) + 4 * stage_frozen_params(sh, stage),
             "gradients": grad_bytes(sh, n), "optimizer state": optimizer_bytes(sh, n)}
    if EXPERT_FAMILY in sh.families:
        terms.update(expert_state_terms(sh, stage))
    terms["communication buffers"] = comm_buffer_bytes(sh)
    return terms


def stage_memory(sh: RunShape, stage: int) -> MemoryReport:
    terms = state_terms(sh, stage)
    act, moe_act = activation_bytes(sh, stage), moe_activation_bytes(sh, stage)
    terms["activations"] = act - moe_act
    if sh.cfg.parallel.pipeline_schedule in ZERO_BUBBLE and sh.pp > 1:
        live, w = zero_bubble_live(sh, stage)
        terms["activations"] = max(live - w - moe_act, 0.0)
        terms["deferred W (zero bubble)"] = w
    if EXPERT_FAMILY in sh.families:
        terms.update({"MoE activations": moe_act, "MoE dispatch buffers": dispatch_buffer_bytes(sh)})
    return MemoryReport(stage, stage_params(sh, stage), terms)


def peak_memory(sh: RunShape) -> MemoryReport:
    """The pipeline rank with the most bytes (the first holds the most activations, the last the
    output layer and the logits; under an uneven split the rank with the most layers may)."""
    stages = {0, sh.pp - 1, sh.busiest_stage}
    return max((stage_memory(sh, r) for r in sorted(stages)), key=lambda r: r.total)
