"""What the dense and the MoE Hugging Face mappings share: the conversion error, one tensor's rule, and
how a RoPE base is written to an HF config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class HFConversionError(ValueError):
    """A model or folder that cannot be converted; the message says which feature or file."""


def rope_theta(value: float) -> int | float:
    """HF writes an integral RoPE base as an int (10000, not 10000.0)."""
    return int(value) if float(value).is_integer() else float(value)


def _same(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (t,)


def transposed(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


@dataclass(frozen=True)
class TensorRule:
    """One megalite tensor and the HF tensor(s) it becomes. ``split`` maps ours to theirs (to HF),
    ``join`` theirs back to ours (from HF). ``zeros_like_rows_of``: megalite has no such tensor but HF
    needs one: it is exported as zeros with as many rows as that megalite tensor, and not imported."""

    ours: str
    theirs: tuple[str, ...]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = _same
    join: Callable[..., torch.Tensor] = lambda t: t
    zeros_like_rows_of: str | None = None


# megalite flag -> the HF config key it is read from, per family (named in rule errors)
_GPT2_KEYS = {"--num-layers": "n_layer", "--hidden-size": "n_embd", "--num-attention-heads": "n_head",
              "--ffn-hidden-size": "n_inner", "--seq-length": "n_positions", "--max-position-embeddings": "n_positions",
              "--hidden-dropout": "resid_pdrop", "--attention-dropout": "attn_pdrop",
              "--norm-epsilon": "layer_norm_epsilon", "--init-method-std": "initializer_range"}
_LLAMA_KEYS = {"--num-layers": "num_hidden_layers", "--hidden-size": "hidden_size",
               "--num-attention-heads": "num_attention_heads", "--num-query-groups": "num_key_value_heads",
               "--kv-channels": "head_dim", "--ffn-hidden-size": "intermediate_size",
               "--seq-length": "max_position_embeddings", "--max-position-embeddings": "max_position_embeddings",
               "--norm-epsilon": "rms_norm_eps", "--rotary-base": "rope_theta",
               "--attention-dropout": "attention_dropout",
               "--init-method-std": "initializer_range", "--moe-router-topk": "num_experts_per_tok",
               "--moe-aux-loss-coeff": "router_aux_loss_coef",
               "--moe-shared-expert-intermediate-size": "shared_expert_intermediate_size"}
_MOE_KEYS = {"mixtral": {"--num-experts": "num_local_experts", "--moe-ffn-hidden-size": "intermediate_size"},
             "qwen2_moe": {"--num-experts": "num_experts", "--moe-ffn-hidden-size": "moe_intermediate_size",
                           "--moe-layer-freq": "mlp_only_layers"}}


def _hf_keys(model_type: str) -> dict[str, str]:
    return _GPT2_KEYS if model_type == "gpt2" else {**_LLAMA_KEYS, **_MOE_KEYS.get(model_type, {})}


def check_model_rules(cfg, hf_config, where: str) -> None:
    """The model a Hugging Face config describes must pass the rules its training flags would
    (config/validate.py: every value in its domain, the model's shape; config/validate_moe.py: the MoE flags), so
    that it is refused at conversion, not in training or generation. Each error names the HF keys it
    comes from, with their values."""
    from megalite.config.arguments import MegaliteConfig
    from megalite.config.validate import domain_check, model_errors
    from megalite.config.validate_moe import moe_errors

    full = MegaliteConfig(model=cfg)
    errors = domain_check(full)
    errors = errors or model_errors(cfg) + moe_errors(full)
    if not errors:
        return
    keys = _hf_keys(getattr(hf_config, "model_type", ""))
    lines = []
    for e in errors:
        named = dict.fromkeys(keys[f] for f in keys if f in e)
        values = ", ".join(f"{k} {getattr(hf_config, k, None)!r}" for k in named)
        lines.append(f"{values}: {e}" if values else e)
    if len(lines) == 1:
        raise HFConversionError(f"{where}: {lines[0]} (the rule of the training flag it maps to)")
    raise HFConversionError(f"{where}: this model breaks the rules of the training flags it maps to:\n  "
                            + "\n  ".join(lines))
