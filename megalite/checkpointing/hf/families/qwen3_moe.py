"""``Qwen3MoeForCausalLM`` (model_type qwen3_moe): Qwen3's attention (per-head q/k norms) with MoE layers.

No shared expert. The router is softmax over all experts then top-k; ``norm_topk_prob`` true renormalises
the k weights, which is megalite's default router (top-k of the logits, then softmax over the k: the same
function), false keeps them as they are (--moe-router-pre-softmax), as Qwen2-MoE. Dense layers where
``mlp_only_layers`` / ``decoder_sparse_step`` say (--moe-layer-freq as a 0/1 list), their MLP of
``intermediate_size``; experts of ``moe_intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from megalite.checkpointing.hf.common import HFConversionError, TensorRule
from megalite.checkpointing.hf.families.llama import Llama
from megalite.checkpointing.hf.families.qwen3 import Qwen3, attention_bias_fields, qk_norm_rules
from megalite.checkpointing.hf.moe import (
    PER_EXPERT_MLP,
    aux_coeff_from_hf,
    aux_coeff_to_hf,
    layer_freq,
    softmax_router_requirements,
    sparse_layers,
)
from megalite.config.model import ModelConfig


class Qwen3Moe(Llama):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    config_class_name = "Qwen3MoeConfig"
    hf_keys = {**Llama.hf_keys, "--num-experts": "num_experts", "--moe-ffn-hidden-size": "moe_intermediate_size",
               "--moe-layer-freq": "mlp_only_layers"}
    expert_files = (PER_EXPERT_MLP,)

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        return {**self.llama_requirements(cfg), **softmax_router_requirements(cfg),
                "--num-experts (MoE layers)": cfg.is_moe,
                "no --moe-shared-expert-intermediate-size": not cfg.moe_shared_expert_intermediate_size,
                "--disable-bias-linear": not cfg.add_bias_linear}

    norm_requirements = Qwen3.norm_requirements

    def refuse(self, c, where: str) -> None:
        super().refuse(c, where)
        if c.num_experts <= 0:
            raise HFConversionError(f"{where}: num_experts {c.num_experts}: a Qwen3-MoE without experts is not an "
                                    "MoE model (its dense form is Qwen3)")

    def bias_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        return attention_bias_fields(c, where, qkv_bias_only)

    def mlp_fields(self, c, where: str) -> dict[str, Any]:
        layers = sparse_layers(c.decoder_sparse_step, c.mlp_only_layers, c.num_hidden_layers, where)
        if not any(layers):
            raise HFConversionError(f"{where}: mlp_only_layers / decoder_sparse_step leave no MoE layer")
        k = c.num_experts_per_tok
        return {"ffn_hidden_size": c.intermediate_size, "num_experts": c.num_experts,
                "moe_ffn_hidden_size": c.moe_intermediate_size, "moe_layer_freq": layer_freq(layers),
                "moe_router_pre_softmax": not c.norm_topk_prob, "moe_router_topk": k,
                "moe_aux_loss_coeff": aux_coeff_from_hf(c.router_aux_loss_coef, k, sum(layers))}

    def extra_fields(self, c, where: str) -> dict[str, Any]:
        return {"qk_layernorm": True}

    def hf_bias_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.add_qkv_bias}

    def hf_mlp_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        layers = cfg.moe_layers()
        return {"intermediate_size": cfg.ffn_hidden_size, "moe_intermediate_size": cfg.expert_ffn_hidden_size,
                "num_experts": cfg.num_experts, "norm_topk_prob": not cfg.moe_router_pre_softmax,
                "decoder_sparse_step": 1, "mlp_only_layers": [i for i, moe in enumerate(layers) if not moe],
                "num_experts_per_tok": cfg.moe_router_topk, "router_aux_loss_coef": aux_coeff_to_hf(cfg)}

    def qk_norm_rules(self, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
        return qk_norm_rules(self, cfg, m, h)


ADAPTER = Qwen3Moe()
