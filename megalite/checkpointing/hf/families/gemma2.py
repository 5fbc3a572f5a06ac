"""``Gemma2ForCausalLM`` (model_type gemma2): a Llama-style decoder with Gemma's block, each part a general
megalite option:

- four norms per layer (--sublayer-norms pre-post: ``input_layernorm``, ``post_attention_layernorm``,
  ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``), every RMSNorm scaling by (1 + w) with w
  stored (--apply-layernorm-1p; megalite stores the same w, so the weights travel unchanged);
- GeGLU with tanh GELU (``hidden_activation`` gelu_pytorch_tanh: --geglu);
- embeddings multiplied by sqrt(hidden_size) (--embedding-multiplier, rounded to the run's dtype as
  transformers rounds it);
- the query scale ``query_pre_attn_scalar`` Q: scores scaled by Q**-0.5 (--softmax-scale; none when Q is the
  head dim);
- local and global layers (``layer_types``, ``sliding_window`` W: --window-size W-1 0 and
  --window-attn-skip-freq, an integer N where every N-th layer is global, else a 0/1 list);
- attention-logit and final-logit soft-capping (--attn-logit-softcapping, --final-logit-softcapping);
- tied output by default (``tie_word_embeddings``).

Gemma 3 (families/gemma3.py) refines it with q/k norms and a RoPE base per layer kind.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from megalite.checkpointing.hf.common import HFConversionError, rope_parameters, rope_theta
from megalite.checkpointing.hf.families.llama import Llama
from megalite.checkpointing.hf.families.qwen3 import attention_bias_fields
from megalite.config.model import ModelConfig

GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)  # transformers' tanh-approximated GELU (megalite's --geglu)
SLIDING, FULL = "sliding_attention", "full_attention"


def window_fields(c, where: str) -> dict[str, Any]:
    """--window-size and --window-attn-skip-freq of ``layer_types`` and ``sliding_window``."""
    kinds = list(getattr(c, "layer_types", None) or [FULL] * c.num_hidden_layers)
    unknown = sorted(set(kinds) - {SLIDING, FULL})
    if unknown or len(kinds) != c.num_hidden_layers:
        raise HFConversionError(f"{where}: layer_types must name {SLIDING} or {FULL} for each of the "
                                f"{c.num_hidden_layers} layers, got {kinds}")
    windowed = [k == SLIDING for k in kinds]
    if not any(windowed):
        return {}
    w = getattr(c, "sliding_window", None)
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise HFConversionError(f"{where}: sliding_window must be a positive integer with sliding layers, got {w!r}")
    fields: dict[str, Any] = {"window_size": [w - 1, 0]}
    if all(windowed):
        return fields
    every = windowed.index(False) + 1  # the first global layer: every N-th layer global?
    if windowed == [(i + 1) % every != 0 for i in range(len(windowed))]:
        fields["window_attn_skip_freq"] = str(every)
    else:
        fields["window_attn_skip_freq"] = "[" + ",".join(str(int(x)) for x in windowed) + "]"
    return fields


def hf_window_fields(cfg: ModelConfig) -> dict[str, Any]:
    """``layer_types`` and ``sliding_window`` of megalite's windows."""
    windows = cfg.attention_windows()
    used = [w for w in windows if w]
    return {"layer_types": [SLIDING if w else FULL for w in windows],
            "sliding_window": used[0] if used else cfg.max_position_embeddings}


def is_sqrt_hidden(cfg: ModelConfig) -> bool:
    return math.isclose(cfg.embedding_multiplier, math.sqrt(cfg.hidden_size), rel_tol=1e-12)


class Gemma2(Llama):
    model_type = "gemma2"
    architecture = "Gemma2ForCausalLM"
    config_class_name = "Gemma2Config"
    hf_norm_zero_centred = True
    layer_norms: ClassVar[tuple[tuple[str, str], ...]] = (
        ("input_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
        ("pre_mlp_norm", "pre_feedforward_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm"))

    # ---- export choice ----------------------------------------------------------------------------------

    def gemma_requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        """What Gemma's block needs (module doc)."""
        return {"--position-embedding-type rope": cfg.position_embedding_type == "rope",
                "--normalization RMSNorm": cfg.normalization == "RMSNorm",
                "--apply-layernorm-1p": cfg.apply_layernorm_1p, "--geglu": cfg.geglu,
                "--sublayer-norms pre-post": cfg.sublayer_norms == "pre-post",
                "--embedding-multiplier sqrt(--hidden-size)": is_sqrt_hidden(cfg),
                "--rotary-percent 1.0": cfg.rotary_percent == 1.0, "--disable-bias-linear": not cfg.add_bias_linear,
                "no --num-experts (a dense MLP)": not cfg.is_moe}

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        return {**self.gemma_requirements(cfg), "no --qk-layernorm": not cfg.qk_layernorm,
                "no --rotary-base-local": cfg.rotary_base_local is None,
                "no --rotary-seq-len-interpolation-factor": cfg.rotary_seq_len_interpolation_factor is None,
                "no --use-rope-scaling": not cfg.use_rope_scaling}

    # ---- HF config -> megalite ----------------------------------------------------------------------------

    def refuse(self, c, where: str) -> None:
        act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
        if act not in GEMMA_ACTIVATIONS:
            raise HFConversionError(f"{where}: hidden_activation {act!r} is not supported (megalite's --geglu is "
                                    "gelu_pytorch_tanh)")
        if getattr(c, "use_bidirectional_attention", False):
            raise HFConversionError(f"{where}: use_bidirectional_attention is not supported (megalite's attention "
                                    "is causal)")

    def from_hf(self, hf_config, where: str, qkv_bias_only: bool = False, apply_layernorm_1p: bool = False):
        """Gemma's norms store w of (1 + w): megalite keeps them so (--apply-layernorm-1p), whatever was asked."""
        return super().from_hf(hf_config, where, qkv_bias_only, apply_layernorm_1p=True)

    def rope_fields(self, c, where: str) -> dict[str, Any]:
        rope = rope_parameters(c)
        if rope["rope_type"] != "default":
            raise HFConversionError(f"{where}: rope_type {rope['rope_type']!r} is not supported for "
                                    f"{self.architecture} (plain RoPE)")
        return {"position_embedding_type": "rope", "rotary_base": rope_theta(rope["rope_theta"])}

    def attention_kind_fields(self, c, where: str) -> dict[str, Any]:
        return window_fields(c, where)

    def bias_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        return attention_bias_fields(c, where, qkv_bias_only)

    def model_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        """The Llama-style fields with Gemma's block in place of SwiGLU and pre-norms (module doc)."""
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        q = getattr(c, "query_pre_attn_scalar", None) or head_dim
        return {**super().model_fields(c, where, qkv_bias_only), "swiglu": False, "geglu": True,
                "sublayer_norms": "pre-post", "embedding_multiplier": c.hidden_size ** 0.5,
                "softmax_scale": None if q == head_dim else float(q) ** -0.5,
                "attn_logit_softcapping": getattr(c, "attn_logit_softcapping", None),
                "final_logit_softcapping": getattr(c, "final_logit_softcapping", None)}

    # ---- megalite -> HF config ----------------------------------------------------------------------------

    def hf_bias_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.add_qkv_bias}

    def hf_rope_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}}

    def hf_extra_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        scale = cfg.softmax_scale
        q = cfg.kv_channels if scale is None else scale ** -2
        return {"hidden_activation": GEMMA_ACTIVATIONS[0], **hf_window_fields(cfg),
                "query_pre_attn_scalar": round(q) if math.isclose(q, round(q), rel_tol=1e-9) else q,
                "attn_logit_softcapping": cfg.attn_logit_softcapping,
                "final_logit_softcapping": cfg.final_logit_softcapping}

    def hf_config_fields(self, cfg: ModelConfig, vocab: int, eod: int | None) -> dict[str, Any]:
        fields = super().hf_config_fields(cfg, vocab, eod)
        del fields["hidden_act"]  # Gemma's key is hidden_activation
        return {**fields, **self.hf_rope_fields(cfg), "pad_token_id": None}


ADAPTER = Gemma2()
