"""``Olmo2ForCausalLM`` (model_type olmo2): a Llama with reordered norms and q/k norms over the projection.

Each sublayer's output is normalized before the residual add and its input is not
(--sublayer-norms post: ``post_attention_layernorm``, ``post_feedforward_layernorm``); q and k are
RMSNorm-ed over the whole projection (--qk-layernorm --qk-layernorm-scope projection: ``self_attn.q_norm``
of width heads x head_dim, ``k_norm`` of groups x head_dim), before RoPE. Biases as Qwen3's
(``attention_bias`` covers o_proj; the MLP has none).
"""

from __future__ import annotations

from typing import Any

from megalite.checkpointing.hf.common import TensorRule
from megalite.checkpointing.hf.families.llama import Llama
from megalite.checkpointing.hf.families.qwen3 import attention_bias_fields, qk_norm_rules
from megalite.config.model import ModelConfig


class Olmo2(Llama):
    model_type = "olmo2"
    architecture = "Olmo2ForCausalLM"
    config_class_name = "Olmo2Config"
    layer_norms = (("post_attention_norm", "post_attention_layernorm"),
                   ("post_mlp_norm", "post_feedforward_layernorm"))

    def norm_requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        return {"--qk-layernorm": cfg.qk_layernorm,
                "--qk-layernorm-scope projection": cfg.qk_layernorm_scope == "projection",
                "--sublayer-norms post": cfg.sublayer_norms == "post"}

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        return {**super().requirements(cfg), "--disable-bias-linear": not cfg.add_bias_linear}

    def bias_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        return attention_bias_fields(c, where, qkv_bias_only)

    def extra_fields(self, c, where: str) -> dict[str, Any]:
        return {"qk_layernorm": True, "qk_layernorm_scope": "projection", "sublayer_norms": "post"}

    def hf_bias_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.add_qkv_bias}

    def qk_norm_rules(self, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
        return qk_norm_rules(self, cfg, m, h)


ADAPTER = Olmo2()
