"""``Qwen3ForCausalLM`` (model_type qwen3): a Llama with per-head q/k norms (--qk-layernorm).

HF's ``attention_bias`` biases q/k/v and o_proj and the MLP has no bias: megalite's --add-qkv-bias exports
as attention_bias with zero o_proj biases, and only such a checkpoint imports (``attention_bias_fields``,
which OLMo 2 shares). The q/k norms are RMSNorms over head_dim, one weight shared by the heads
(``self_attn.q_norm`` / ``k_norm``), applied before RoPE.
"""

from __future__ import annotations

from typing import Any

from megalite.checkpointing.hf.common import HFConversionError, TensorRule
from megalite.checkpointing.hf.families.llama import Llama
from megalite.config.model import ModelConfig


def attention_bias_fields(c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
    """A family whose ``attention_bias`` biases q/k/v and o_proj and whose MLP has none: only zero o_proj
    biases have a megalite equivalent (--add-qkv-bias)."""
    if c.attention_bias and not qkv_bias_only:
        raise HFConversionError(f"{where}: attention_bias with non-zero o_proj biases has no megalite equivalent "
                                "(--add-qkv-bias biases q/k/v only; this architecture's MLP has no bias)")
    return {"disable_bias_linear": True, "add_qkv_bias": bool(c.attention_bias)}


def qk_norm_rules(adapter: Llama, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
    """megalite's attention.q_norm / k_norm <-> HF's self_attn.q_norm / k_norm."""
    return [adapter.norm_rule(cfg, f"{m}attention.{n}_norm.weight", f"{h}self_attn.{n}_norm.weight") for n in "qk"]


class Qwen3(Llama):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    config_class_name = "Qwen3Config"

    def norm_requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        return {"--qk-layernorm": cfg.qk_layernorm, "--qk-layernorm-scope head": cfg.qk_layernorm_scope == "head",
                "--sublayer-norms pre": cfg.sublayer_norms == "pre"}

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        return {**super().requirements(cfg), "--disable-bias-linear": not cfg.add_bias_linear}

    def bias_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        return attention_bias_fields(c, where, qkv_bias_only)

    def extra_fields(self, c, where: str) -> dict[str, Any]:
        return {"qk_layernorm": True}

    def hf_bias_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.add_qkv_bias}

    def qk_norm_rules(self, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
        return qk_norm_rules(self, cfg, m, h)


ADAPTER = Qwen3()
