"""``LlamaForCausalLM`` (model_type llama), and the base of every Llama-style family.

Llama style: RoPE (rotate-half), RMSNorm, SwiGLU, optional GQA, separate q/k/v projections (megalite's
fused QKV interleave is split per KV group, common.split_qkv) and separate gate/up projections.

Biases: HF's ``attention_bias`` covers q/k/v and o_proj, ``mlp_bias`` the MLP. Biases everywhere are
megalite's default (no --disable-bias-linear). megalite's ``--add-qkv-bias`` exports as attention_bias with
zero o_proj biases (exactly the same function); on import, zero o_proj biases of a Llama with only
attention biases map back to --add-qkv-bias (``qkv_bias_only``).

Families built on it (Mistral, Qwen2/3, Qwen3-MoE, Gemma, OLMo 2, Llama 3.x, the MoE families here)
subclass ``Llama`` and override the hooks that differ:

- configs: ``rope_fields`` (RoPE type and scaling dict; ``common.rope_parameters(c, kind)`` reads per-layer-
  kind dicts), ``attention_kind_fields`` (sliding windows, ``layer_types``), ``bias_fields`` /
  ``hf_bias_fields`` (e.g. biases on q/k/v only), ``mlp_fields`` / ``hf_mlp_fields`` (MoE),
  ``extra_fields`` / ``hf_extra_fields`` (q/k norms, embedding scale, soft-capping, query scale);
- tensors: ``layer_norms`` (extra per-layer norms, e.g. Gemma's four, OLMo 2's post-norms),
  ``qk_norm_rules``, ``attention_rules`` (whole attention, e.g. multi-latent), ``mlp_rules`` /
  ``moe_rules`` (router, stacked experts, shared expert names), ``qkv_bias_covers_o_proj``;
- ``hf_norm_zero_centred`` for norms that scale by (1 + w).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from megalite.checkpointing.hf.adapter import HFAdapter
from megalite.checkpointing.hf.common import (
    HFConversionError,
    TensorRule,
    cat_rows,
    fuse_qkv,
    halves,
    rope_parameters,
    rope_theta,
    split_qkv,
)
from megalite.checkpointing.hf.moe import expert_rules
from megalite.config.model import ModelConfig

LLAMA_KEYS = {"--num-layers": "num_hidden_layers", "--hidden-size": "hidden_size",
              "--num-attention-heads": "num_attention_heads", "--num-query-groups": "num_key_value_heads",
              "--kv-channels": "head_dim", "--ffn-hidden-size": "intermediate_size",
              "--seq-length": "max_position_embeddings", "--max-position-embeddings": "max_position_embeddings",
              "--norm-epsilon": "rms_norm_eps", "--rotary-base": "rope_theta",
              "--attention-dropout": "attention_dropout",
              "--init-method-std": "initializer_range", "--moe-router-topk": "num_experts_per_tok",
              "--moe-aux-loss-coeff": "router_aux_loss_coef",
              "--moe-shared-expert-intermediate-size": "shared_expert_intermediate_size"}


NO_WINDOW = "no --window-size"  # a requirement the sliding-window families (Mistral) drop

LLAMA3_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_low_freq_factor",
               "high_freq_factor": "rope_scaling_high_freq_factor",
               "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings"}


def llama3_scaling_fields(rope: Mapping[str, Any], where: str) -> dict[str, Any]:
    """megalite's --use-rope-scaling fields of an HF rope_type 'llama3' dict (every key required: transformers
    requires them too, so a missing one is a broken config, not a default to guess)."""
    missing = [k for k in LLAMA3_KEYS if rope.get(k) is None]
    if missing:
        raise HFConversionError(f"{where}: rope_type 'llama3' without {', '.join(missing)}")
    fields = {ours: rope[k] for k, ours in LLAMA3_KEYS.items()}
    if not float(fields["rope_scaling_original_max_position_embeddings"]).is_integer():
        raise HFConversionError(f"{where}: rope original_max_position_embeddings must be an integer, got "
                                f"{fields['rope_scaling_original_max_position_embeddings']!r}")
    fields["rope_scaling_original_max_position_embeddings"] = int(
        fields["rope_scaling_original_max_position_embeddings"])
    return {"use_rope_scaling": True, **{k: v if k.endswith("embeddings") else float(v) for k, v in fields.items()}}


def hf_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' rope_parameters of a megalite model (rope_type 'llama3' with --use-rope-scaling)."""
    if not cfg.use_rope_scaling:
        return {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    return {"rope_type": "llama3", "rope_theta": float(cfg.rotary_base),
            **{k: getattr(cfg, ours) for k, ours in LLAMA3_KEYS.items()}}


class Llama(HFAdapter):
    """The Llama-style decoder (module doc)."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"
    config_class_name = "LlamaConfig"
    embedding_key = "model.embed_tokens.weight"
    hf_keys = LLAMA_KEYS
    layer_prefix: ClassVar[str] = "model.layers."
    # (megalite norm, HF norm) of each layer, in the layer's order
    layer_norms: ClassVar[tuple[tuple[str, str], ...]] = (("input_norm", "input_layernorm"),
                                                          ("pre_mlp_norm", "post_attention_layernorm"))
    qkv_bias_covers_o_proj: ClassVar[bool] = True  # HF's attention_bias also biases o_proj
    shared_expert: ClassVar[str | None] = None  # HF module of an MoE layer's shared expert
    shared_expert_gate: ClassVar[str | None] = None  # HF name of its sigmoid gate's weight

    # ---- export choice ----------------------------------------------------------------------------------

    def llama_requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        """What every Llama-style family needs."""
        return {"--position-embedding-type rope": cfg.position_embedding_type == "rope",
                "--normalization RMSNorm": cfg.normalization == "RMSNorm",
                "--swiglu": cfg.swiglu,
                "--rotary-percent 1.0": cfg.rotary_percent == 1.0, **self.norm_requirements(cfg),
                NO_WINDOW: not cfg.window_size or cfg.window_size[0] < 0}

    def norm_requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        """Where the family's norms sit (override for q/k norms or reordered norms)."""
        return {"no --qk-layernorm": not cfg.qk_layernorm, "--sublayer-norms pre": cfg.sublayer_norms == "pre"}

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        return {**self.llama_requirements(cfg), "no --num-experts (a dense MLP)": not cfg.is_moe}

    # ---- HF config -> megalite ----------------------------------------------------------------------------

    def refuse(self, c, where: str) -> None:
        if c.hidden_act != "silu":
            raise HFConversionError(f"{where}: hidden_act {c.hidden_act!r} is not supported (SwiGLU needs silu)")

    def rope_fields(self, c, where: str) -> dict[str, Any]:
        """RoPE type, base and scaling (override for rope_type llama3, yarn, a base per layer kind...)."""
        rope = rope_parameters(c)
        fields = {"position_embedding_type": "rope", "rotary_base": rope_theta(rope["rope_theta"])}
        if rope["rope_type"] == "llama3":
            return {**fields, **llama3_scaling_fields(rope, where)}
        if rope["rope_type"] != "default":
            raise HFConversionError(f"{where}: rope_type {rope['rope_type']!r} (RoPE scaling) is not supported; "
                                    "megalite implements plain RoPE and Llama 3's scaling (rope_type 'llama3')")
        return fields

    def attention_kind_fields(self, c, where: str) -> dict[str, Any]:
        """Per-layer attention kinds (sliding windows): megalite attends to the whole causal context."""
        kinds = getattr(c, "layer_types", None) or []
        if any(t != "full_attention" for t in kinds):
            raise HFConversionError(f"{where}: layer_types with sliding_attention is not supported (megalite "
                                    "attends to the whole causal context)")
        return {}

    def bias_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        if c.attention_bias and not c.mlp_bias and not qkv_bias_only:
            raise HFConversionError(f"{where}: attention_bias without mlp_bias (and non-zero o_proj biases) has no "
                                    "megalite equivalent (--add-qkv-bias biases q/k/v only; biases everywhere need "
                                    "mlp_bias too)")
        if c.mlp_bias and not c.attention_bias:
            raise HFConversionError(f"{where}: mlp_bias without attention_bias has no megalite equivalent")
        return {"disable_bias_linear": not c.mlp_bias, "add_qkv_bias": bool(c.attention_bias and not c.mlp_bias)}

    def mlp_fields(self, c, where: str) -> dict[str, Any]:
        """The MLP's sizes (MoE families add their experts and router here)."""
        return {"ffn_hidden_size": c.intermediate_size}

    def extra_fields(self, c, where: str) -> dict[str, Any]:
        """Whatever else a family sets (q/k norms, embedding scale, soft-capping, query scale)."""
        return {}

    def model_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        heads, groups = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
        return dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=heads,
                    group_query_attention=groups != heads, num_query_groups=groups,
                    kv_channels=getattr(c, "head_dim", None) or c.hidden_size // heads,
                    seq_length=c.max_position_embeddings, max_position_embeddings=c.max_position_embeddings,
                    normalization="RMSNorm", norm_epsilon=c.rms_norm_eps, swiglu=True,
                    untie_embeddings_and_output_weights=not c.tie_word_embeddings, hidden_dropout=0.0,
                    attention_dropout=c.attention_dropout, init_method_std=c.initializer_range,
                    **self.rope_fields(c, where), **self.attention_kind_fields(c, where),
                    **self.bias_fields(c, where, qkv_bias_only), **self.mlp_fields(c, where),
                    **self.extra_fields(c, where))

    def qkv_bias_only(self, c, sd: Mapping[str, torch.Tensor]) -> bool:
        if not getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
            return False
        return all(not sd[k].any() for k in sd if k.endswith("self_attn.o_proj.bias"))

    # ---- megalite -> HF config ----------------------------------------------------------------------------

    def hf_bias_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.add_bias_linear or cfg.add_qkv_bias, "mlp_bias": cfg.add_bias_linear}

    def hf_mlp_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"intermediate_size": cfg.ffn_hidden_size}

    def hf_extra_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {}

    def hf_config_fields(self, cfg: ModelConfig, vocab: int, eod: int | None) -> dict[str, Any]:
        return dict(vocab_size=vocab, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                    num_attention_heads=cfg.num_attention_heads,
                    num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads, head_dim=cfg.kv_channels,
                    hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings,
                    rms_norm_eps=cfg.norm_epsilon,
                    rope_parameters=hf_rope_parameters(cfg),
                    attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_method_std,
                    tie_word_embeddings=cfg.tied_embeddings, bos_token_id=eod, eos_token_id=eod,
                    **self.hf_mlp_fields(cfg), **self.hf_bias_fields(cfg), **self.hf_extra_fields(cfg))

    def to_hf(self, cfg: ModelConfig, vocab: int, eod: int | None):
        hf = super().to_hf(cfg, vocab, eod)
        hf.rope_theta = float(cfg.rotary_base)  # transformers 4.x reads this key, not rope_parameters
        return hf

    # ---- tensors ------------------------------------------------------------------------------------------

    def qkv_rules(self, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
        heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, cfg.kv_channels
        split = lambda t: split_qkv(t, heads, groups, d)  # noqa: E731
        fuse = lambda q, k, v: fuse_qkv(q, k, v, heads, groups, d)  # noqa: E731
        names = tuple(h + f"self_attn.{n}_proj." for n in "qkv")
        rules = [TensorRule(m + "attention.qkv.weight", tuple(n + "weight" for n in names), split, fuse)]
        if cfg.add_bias_linear or cfg.add_qkv_bias:
            rules.append(TensorRule(m + "attention.qkv.bias", tuple(n + "bias" for n in names), split, fuse))
        return rules

    def qk_norm_rules(self, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
        """Norms on queries and keys (Qwen3, Gemma 3, OLMo 2): none here."""
        return []

    def attention_rules(self, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
        rules = [*self.qkv_rules(cfg, m, h), TensorRule(m + "attention.proj.weight", (h + "self_attn.o_proj.weight",)),
                 *self.qk_norm_rules(cfg, m, h)]
        if cfg.add_bias_linear or (cfg.add_qkv_bias and self.qkv_bias_covers_o_proj):
            rules.append(TensorRule(m + "attention.proj.bias", (h + "self_attn.o_proj.bias",),
                                    zeros_like_rows_of=None if cfg.add_bias_linear else m + "attention.proj.weight"))
        return rules

    def moe_rules(self, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
        """An MoE layer's MLP: router, stacked experts, the shared expert if any (moe.py)."""
        return expert_rules(cfg, m, h, self.shared_expert, self.shared_expert_gate)

    def mlp_rules(self, cfg: ModelConfig, i: int, m: str, h: str) -> list[TensorRule]:
        if cfg.is_moe and cfg.moe_layers()[i]:
            return self.moe_rules(cfg, m, h)
        rules = [TensorRule(m + "mlp.fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), halves,
                            cat_rows),
                 TensorRule(m + "mlp.fc2.weight", (h + "mlp.down_proj.weight",))]
        if cfg.add_bias_linear:
            rules += [TensorRule(m + "mlp.fc1.bias", (h + "mlp.gate_proj.bias", h + "mlp.up_proj.bias"), halves,
                                 cat_rows),
                      TensorRule(m + "mlp.fc2.bias", (h + "mlp.down_proj.bias",))]
        return rules

    def layer_rules(self, cfg: ModelConfig, i: int) -> list[TensorRule]:
        m, h = f"layers.{i}.", f"{self.layer_prefix}{i}."
        norms = [self.norm_rule(cfg, f"{m}{ours}.weight", f"{h}{theirs}.weight") for ours, theirs in self.layer_norms]
        return norms + self.attention_rules(cfg, m, h) + self.mlp_rules(cfg, i, m, h)

    def final_rules(self, cfg: ModelConfig) -> list[TensorRule]:
        return [self.norm_rule(cfg, "final_norm.weight", "model.norm.weight")]


ADAPTER = Llama()
