"""The megalite model config of a Megatron-LM checkpoint, from the ``args`` Namespace it saved.

megalite's flags carry Megatron-LM's names, so most fields are copied; the exceptions are spelled out
(``add_bias_linear`` is stored inverted as ``disable_bias_linear``; GQA is on when the groups differ from
the heads). Features that change what the model computes and that megalite does not implement are
refused, each named with its value, instead of importing a model that computes something else.
"""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from typing import Any

from megalite.checkpointing.config_rules import model_rule_errors
from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.metadata import config_dict, model_config
from megalite.config.model import ModelConfig
from megalite.config.yarn import YARN_DEFAULTS

COPIED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "seq_length",
          "max_position_embeddings", "rotary_base", "rotary_percent", "norm_epsilon", "apply_layernorm_1p",
          "swiglu", "untie_embeddings_and_output_weights", "add_qkv_bias", "qk_layernorm", "hidden_dropout",
          "attention_dropout", "init_method_std", "make_vocab_size_divisible_by", "num_experts", "moe_ffn_hidden_size",
          "moe_router_topk", "moe_shared_expert_intermediate_size", "moe_router_score_function",
          "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_aux_loss_coeff",
          "moe_router_group_topk",
          "moe_router_enable_expert_bias", "moe_router_load_balancing_type", "moe_z_loss_coeff", "softmax_scale",
          "rotary_seq_len_interpolation_factor",
          "mtp_num_layers", "mtp_loss_scaling_factor",
          "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
          "rope_type")
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")
# What megatron-core's --use-rope-scaling fixes (its arguments name only the factor): Llama 3's frequency
# factors and original context, as megalite's --rope-scaling-* flags
MCORE_ROPE_SCALING = {"rope_scaling_low_freq_factor": 1.0, "rope_scaling_high_freq_factor": 4.0,
                      "rope_scaling_original_max_position_embeddings": 8192}

# arg -> (the value megalite can honour, what it would change)
REFUSED: dict[str, tuple[Any, str]] = {
    "rotary_interleaved": (False, "interleaved RoPE (megalite rotates halves)"),
    "squared_relu": (False, "a squared-ReLU MLP"),
    "openai_gelu": (False, "the tanh GELU (megalite computes exact GELU)"),
    "moe_shared_expert_gate": (False, "a gated shared expert (Megatron's gate differs from megalite's)"),
    "heterogeneous_layers_config_path": (None, "heterogeneous layers"),
    "moe_router_topk_limited_devices": (None, "device-limited routing, the deprecated form of "
                                        "--moe-router-num-groups / --moe-router-group-topk"),
}


def _refusals(args: Namespace, where: str) -> list[str]:
    out = []
    for name, (ok, what) in REFUSED.items():
        value = getattr(args, name, ok)
        if value not in (ok, None) and not (ok is None and value in (0, False)):
            out.append(f"{name}={value!r} ({what}) is not implemented in megalite")
    position = _position(args)
    if position not in ("learned_absolute", "rope", "yarn"):
        out.append(f"position_embedding_type={position!r} is not implemented (learned_absolute, rope or yarn)")
    norm = getattr(args, "normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        out.append(f"normalization={norm!r} is not implemented (LayerNorm or RMSNorm)")
    if getattr(args, "num_experts", None) and getattr(args, "add_bias_linear", True):
        out.append("num_experts with add_bias_linear=True: megalite's routed experts have no biases")
    return [f"{where}: {e}" for e in out]


def _position(args: Namespace) -> str:
    if getattr(args, "use_rotary_position_embeddings", False):  # the flag of older Megatron-LM releases
        return "rope"
    return getattr(args, "position_embedding_type", "learned_absolute")


def _layer_freq(value: Any) -> str:
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(str(int(v)) for v in value) + "]"
    return str(value)


def config_from_args(args: Any, vocab_size: int, where: str) -> dict[str, Any]:
    """megalite's checkpoint ``config`` (incl. ``vocab_size``) for a Megatron run's saved ``args``; every
    argument megalite cannot honour is named in one error."""
    if not isinstance(args, Namespace):
        raise CheckpointError(f"{where}: has no 'args' Namespace (got {type(args).__name__}); the model "
                              "config is read from it")
    missing = [n for n in REQUIRED if getattr(args, n, None) is None]
    if missing:
        raise CheckpointError(f"{where}: its args lack {', '.join(missing)}")
    errors = _refusals(args, where)
    if errors:
        raise CheckpointError("\n  ".join(["this Megatron model cannot be imported:"] + errors)
                              if len(errors) > 1 else errors[0])
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    fields = {n: getattr(args, n) for n in COPIED if n in names and getattr(args, n, None) is not None}
    heads = int(args.num_attention_heads)
    groups = getattr(args, "num_query_groups", None) or heads
    if not getattr(args, "group_query_attention", False):
        groups = heads  # Megatron ignores num_query_groups without --group-query-attention
    fields.update(position_embedding_type=_position(args), normalization=getattr(args, "normalization", "LayerNorm"),
                  disable_bias_linear=not getattr(args, "add_bias_linear", True),
                  group_query_attention=groups != heads, num_query_groups=groups if groups != heads else None)
    if fields.get("moe_router_group_topk"):  # Megatron ignores the groups without a group top-k; so does the import
        fields["moe_router_num_groups"] = getattr(args, "moe_router_num_groups", None)
    if getattr(args, "moe_layer_freq", None) is not None and fields.get("num_experts"):
        fields["moe_layer_freq"] = _layer_freq(args.moe_layer_freq)
    rope_type = fields.get("rope_type")
    yarn = rope_type == "yarn" or (rope_type is None and fields.get("multi_latent_attention"))
    if fields["position_embedding_type"] == "yarn" or (fields["position_embedding_type"] == "rope" and yarn):
        # Megatron-LM's defaults where its args hold None (--rope-type yarn, MLA's default, is YaRN too)
        fields.update({k: d if getattr(args, k, None) is None else getattr(args, k) for k, d in YARN_DEFAULTS.items()})
    if getattr(args, "use_rope_scaling", False):
        fields.update(use_rope_scaling=True, rope_scaling_factor=float(getattr(args, "rope_scaling_factor", 8.0)),
                      **MCORE_ROPE_SCALING)
    window = getattr(args, "window_size", None)  # (LEFT, RIGHT); the rules below refuse RIGHT != 0
    if window is not None and int(window[0]) >= 0:
        fields["window_size"] = [int(x) for x in window]
        if getattr(args, "window_attn_skip_freq", None) is not None:
            fields["window_attn_skip_freq"] = _layer_freq(args.window_attn_skip_freq)
    try:
        cfg = ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: its args describe no megalite model ({e})") from None
    rules = model_rule_errors(cfg)
    if rules:
        raise CheckpointError(f"{where}: its args break the rules of the training flags: " + "; ".join(rules))
    config = config_dict(cfg, vocab_size)
    model_config(config)  # every size in its domain
    return config
