"""Model shape flags (Megatron-LM names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megalite.config.domain import MAX_COUNT, MAX_HIDDEN, at_least, fraction, positive, size
from megalite.config.flags import option
from megalite.config.mla import MLAFields
from megalite.config.moe import MAX_LAYERS, MoEFields
from megalite.config.mtp import MTPFields
from megalite.config.yarn import YarnFields


@dataclass(kw_only=True)
class ModelConfig(MoEFields, YarnFields, MLAFields, MTPFields):
    """Model: the GPT's shape. GPT-2 style by default; Llama style with rope/RMSNorm/swiglu/GQA; MoE layers
    with --num-experts (config/moe.py)."""

    num_layers: int = option(2, help="Number of transformer layers.", domain=size(MAX_LAYERS))
    hidden_size: int = option(64, help="Transformer hidden size h.", domain=size(MAX_HIDDEN))
    ffn_hidden_size: int | None = option(
        None, help="MLP hidden size; default 4h (8h/3 rounded to 64 with --swiglu or --geglu).", domain=size())
    num_attention_heads: int = option(4, help="Number of attention heads.", domain=size(MAX_HIDDEN))
    group_query_attention: bool = option(False, help="Use grouped-query attention (needs --num-query-groups).")
    num_query_groups: int | None = option(None, help="Number of key/value groups with --group-query-attention.",
                                           domain=size(MAX_HIDDEN))
    kv_channels: int | None = option(None, help="Per-head dimension; default hidden_size / num_attention_heads.",
                                      domain=size(MAX_HIDDEN))
    seq_length: int = option(128, help="Training sequence length.", domain=size())
    max_position_embeddings: int | None = option(None, help="Learned position table size; default --seq-length.",
                                                  domain=size())
    position_embedding_type: str = option(
        "learned_absolute", help="Position encoding: a learned table, RoPE, or RoPE with YaRN scaling (its options: "
        "--rotary-scaling-factor, --yarn-*, --mscale, --mscale-all-dim).", choices=["learned_absolute", "rope", "yarn"])
    rope_type: str | None = option(
        None, help="Megatron-LM's --rope-type, with --position-embedding-type rope: 'yarn' applies YaRN (its options "
        "as above), 'rope' plain RoPE; unset, multi-latent attention takes YaRN and standard attention RoPE "
        "(Megatron's defaults; YaRN at --rotary-scaling-factor 1 is plain RoPE). Resolved into "
        "--position-embedding-type yarn when the model is configured.", choices=["rope", "yarn"])
    rotary_base: int = option(10000, help="RoPE base (theta).", domain=size(MAX_COUNT))
    rotary_percent: float = option(1.0, help="Fraction of each head's channels RoPE rotates.",
                                   domain=fraction(lo_open=True))
    use_rope_scaling: bool = option(
        False, help="Llama 3's frequency-dependent RoPE scaling (Megatron's flag): inverse frequencies whose "
        "wavelength exceeds --rope-scaling-original-max-position-embeddings / --rope-scaling-low-freq-factor are "
        "divided by --rope-scaling-factor, those below the original context / --rope-scaling-high-freq-factor "
        "kept, the ones between interpolated smoothly.")
    rope_scaling_factor: float = option(8.0, help="With --use-rope-scaling: how much the low frequencies are "
                                        "divided by (Llama 3.1: 8, Llama 3.2: 32).", domain=at_least(1.0))
    rope_scaling_low_freq_factor: float = option(
        1.0, help="With --use-rope-scaling: wavelengths above original context / this are fully scaled.",
        domain=positive())
    rope_scaling_high_freq_factor: float = option(
        4.0, help="With --use-rope-scaling: wavelengths below original context / this are kept (must exceed "
        "--rope-scaling-low-freq-factor).", domain=positive())
    rope_scaling_original_max_position_embeddings: int = option(
        8192, help="With --use-rope-scaling: the context the model was first trained at (Llama 3: 8192).",
        domain=size())
    normalization: str = option("LayerNorm", help="Norm layer.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = option(1e-5, help="Epsilon of the norm layers.", domain=positive(hi=1))
    apply_layernorm_1p: bool = option(
        False, help="Zero-centred norm weights (LayerNorm and RMSNorm): the stored weight w, initialized to 0, "
        "is applied as 1 + w (checkpoints store w; Hugging Face exports hold 1 + w).")
    qk_layernorm: bool = option(
        False, help="Normalize queries and keys (--normalization, --norm-epsilon) after the QKV projection, before "
        "RoPE: per head (over --kv-channels, Megatron's semantics) or, with --qk-layernorm-scope projection, over "
        "the whole projection.")
    qk_layernorm_scope: str = option(
        "head", help="What --qk-layernorm normalizes over: 'head' (each head's channels: Qwen3, Gemma 3) or "
        "'projection' (all heads of the q projection, and of the k projection, at once: OLMo 2; RMSNorm only; "
        "under TP its sum of squares is all-reduced over the ranks and its weight is cut like the projection).",
        choices=["head", "projection"])
    sublayer_norms: str = option(
        "pre", help="Where each layer's norms sit: 'pre' normalizes each sublayer's input (x + attn(norm(x))), "
        "'post' its output before the residual add (x + norm(attn(x)), OLMo 2), 'pre-post' both (four norms "
        "per layer).", choices=["pre", "post", "pre-post"])
    window_size: list[int] | None = option(
        None, help="Sliding-window attention (Megatron's flag): 'LEFT RIGHT', a query at i sees the keys i - LEFT "
        "..i + RIGHT; causal, so RIGHT must be 0 (Hugging Face's sliding_window W is --window-size W-1 0); LEFT "
        "-1: no window. Every attention path keeps to it, and its cost follows the window (attention/window.py).",
        domain=at_least(-1))
    window_attn_skip_freq: str | None = option(
        None, help="With --window-size, which layers keep full attention (Megatron's flag): an integer N makes "
        "every N-th layer (counting from 1) full and the others windowed (Gemma 2: 2, Gemma 3: 6); a list of "
        "0/1 per layer, 1 windowed (e.g. '[1,1,1,1,1,0]*2'). Default: every layer windowed.")
    attn_logit_softcapping: float | None = option(
        None, help="Attention-logit soft-capping C (Gemma 2: 50): each scaled score s becomes C * tanh(s / C) "
        "before the masks and the softmax, in every layer. SDPA and the flash kernels cannot cap, so the other "
        "backends than 'unfused'/'local' run the blockwise path then; every context-parallel comm type and "
        "KV-cache decoding apply it too. Default: no cap.", domain=positive())
    swiglu: bool = option(False, help="SwiGLU MLP (gated SiLU) instead of GeLU.")
    geglu: bool = option(
        False, help="GeGLU MLP: the gated MLP of --swiglu (fc1 holds [gate; up], cut alike over TP) with the tanh "
        "approximation of GELU on the gate (megatron-core's geglu; Gemma's gelu_pytorch_tanh).")
    embedding_multiplier: float = option(
        1.0, help="Multiply the word embeddings by this on the first pipeline stage, rounded to the run's dtype "
        "as transformers rounds it (Gemma: sqrt(--hidden-size)); a tied output layer uses the unscaled weight.",
        domain=positive())
    softmax_scale: float | None = option(
        None, help="Scale of the attention scores q.k before the softmax (megatron-core's softmax_scale; Gemma's "
        "query_pre_attn_scalar Q is Q**-0.5); default 1 / sqrt(--kv-channels). Every attention path, context "
        "parallelism and decoding included.", domain=positive())
    final_logit_softcapping: float | None = option(
        None, help="Soft-cap the output logits to C * tanh(logits / C) (Gemma 2: 30): in the loss (the "
        "vocab-parallel and the fused cross-entropy) and in the logits of generation and evaluation.",
        domain=positive())
    rotary_base_local: int | None = option(
        None, help="With --window-size: the RoPE base of the windowed layers, which use it unscaled; the "
        "full-attention layers keep --rotary-base and its scaling (Gemma 3: 10000 local, 1000000 global). "
        "Default: every layer uses --rotary-base.", domain=size(MAX_COUNT))
    rotary_seq_len_interpolation_factor: float | None = option(
        None, help="Linear RoPE scaling (Megatron's flag): the rotary angles divided by this factor "
        "(transformers' rope_type 'linear'); with --rotary-base-local only the full-attention layers are "
        "scaled.", domain=at_least(1.0))
    untie_embeddings_and_output_weights: bool = option(
        False, help="Give the output layer its own weight instead of sharing the input embedding.")
    disable_bias_linear: bool = option(False, help="No bias in the linear layers (Llama style).")
    add_qkv_bias: bool = option(False, help="Keep a bias on the QKV projection even with --disable-bias-linear.")
    hidden_dropout: float = option(0.1, help="Dropout on the residual branches.", domain=fraction(hi_open=True))
    attention_dropout: float = option(0.1, help="Dropout on the attention probabilities.",
                                      domain=fraction(hi_open=True))
    init_method_std: float = option(0.02, help="Std of the normal weight init; output projections use "
                                    "std / sqrt(2 * num_layers).", domain=positive())
    make_vocab_size_divisible_by: int = option(
        128, help="Pad the vocabulary to a multiple of this times the tensor-parallel size.",
        domain=size(MAX_HIDDEN))
    recompute_granularity: str | None = option(
        None, help="Recompute activations in backward: 'full' layers, or 'selective' (core attention only).",
        choices=["full", "selective"])
    recompute_method: str | None = option(
        None, help="With --recompute-granularity full: 'uniform' (the default then) recomputes groups of "
        "--recompute-num-layers layers, 'block' the first --recompute-num-layers layers of each pipeline stage.",
        choices=["uniform", "block"])
    recompute_num_layers: int = option(1, help="Layers per recomputed group (uniform) or per stage (block).",
                                       domain=size(MAX_LAYERS))
    attention_backend: str = option(
        "auto", help="Core attention kernel. 'auto': torch SDPA, which picks its fastest kernel; 'flash' and "
        "'fused': SDPA restricted to its flash / memory-efficient kernel on CUDA ('flash' needs fp16/bf16 "
        "there; on CPU both run SDPA's CPU kernel); 'unfused' and 'local': the explicit softmax(QK^T)V "
        "reference. 'sdpa': the same as 'auto' (older checkpoints name it).",
        choices=["auto", "flash", "fused", "unfused", "local", "sdpa"])
    cross_entropy_loss_fusion: bool = option(
        False, help="Fuse the output layer with the vocab-parallel cross-entropy, in chunks of tokens, so the "
        "full [s, b, vocab/tp] fp32 logits never exist (the logit gradient is formed chunk by chunk in forward).")

    # Defaults filled in from other fields: {field: (its sources, how)}; the domain check names them.
    DERIVED: ClassVar[dict[str, tuple[tuple[str, ...], str]]] = {
        "ffn_hidden_size": (("hidden_size",), "4 x --hidden-size, 8/3 with --swiglu or --geglu"),
        "kv_channels": (("hidden_size", "num_attention_heads"), "--hidden-size / --num-attention-heads"),
        "max_position_embeddings": (("seq_length",), "--seq-length"),
        "num_query_groups": (("num_attention_heads",), "--num-attention-heads"),
    }

    def __post_init__(self) -> None:
        # which of DERIVED this instance filled in (messages name a derived value by its sources)
        self.derived_fields = {name for name in self.DERIVED if getattr(self, name) is None}
        if self.position_embedding_type == "rope" and (
                self.rope_type == "yarn" or (self.rope_type is None and self.multi_latent_attention)):
            self.position_embedding_type = "yarn"  # Megatron's --rope-type, and MLA's default
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.kv_channels is None and self.num_attention_heads > 0:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.gated_linear_unit:
                self.ffn_hidden_size = ((8 * self.hidden_size // 3 + 63) // 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if not self.group_query_attention and self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads  # any other value is refused by validation

    def attention_windows(self) -> list[int]:
        """Per layer, the keys a query sees with --window-size (LEFT + 1, itself included), 0 for a layer of
        full causal attention (--window-attn-skip-freq picks them; raises ValueError on a bad one). The model
        builds its layers' attention from this, and the planner reads it."""
        n = self.num_layers
        if not self.window_size or self.window_size[0] < 0:
            return [0] * n
        from megalite.config.moe import moe_layer_pattern

        freq = self.window_attn_skip_freq
        if freq is None:
            windowed = [True] * n
        elif str(freq).strip().lstrip("-").isdigit():
            every = int(str(freq).strip())
            if every <= 0:
                raise ValueError(f"--window-attn-skip-freq must be a positive integer or a list, got {freq}")
            windowed = [(i + 1) % every != 0 for i in range(n)]
        else:
            windowed = moe_layer_pattern(freq, n, flag="--window-attn-skip-freq")
        return [self.window_size[0] + 1 if w else 0 for w in windowed]

    def heads_per_tp_rank(self, tp: int) -> tuple[int, int]:
        """(query heads, query groups) one tensor-parallel rank holds: the groups split over the ranks or,
        with fewer groups than ranks, one group's K/V replicated on each of the ranks sharing it. The model's
        Attention is built from these, and validation and the planner read the same counts, so a rule on
        them cannot disagree with the model."""
        groups = self.num_query_groups or self.num_attention_heads
        return self.num_attention_heads // tp, max(groups // tp, 1)

    @property
    def gated_linear_unit(self) -> bool:
        """fc1 holds [gate; up] (--swiglu or --geglu: megatron-core's gated_linear_unit)."""
        return self.swiglu or self.geglu

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def add_bias_linear(self) -> bool:
        return not self.disable_bias_linear
