"""``Qwen2MoeForCausalLM`` (model_type qwen2_moe): a Llama with MoE layers and a gated shared expert.

q/k/v biases (--add-qkv-bias; HF's ``qkv_bias`` has no o_proj bias), a shared expert scaled by
sigmoid(x . w) (--moe-shared-expert-intermediate-size, --moe-shared-expert-gate), dense layers where
``mlp_only_layers`` / ``decoder_sparse_step`` say (--moe-layer-freq as a 0/1 list). ``norm_topk_prob``
false is softmax over all experts then top-k (--moe-router-pre-softmax); true is megalite's default.
"""

from __future__ import annotations

from typing import Any

from megalite.checkpointing.hf.common import HFConversionError
from megalite.checkpointing.hf.families.llama import Llama
from megalite.checkpointing.hf.moe import (
    PER_EXPERT_MLP,
    aux_coeff_from_hf,
    aux_coeff_to_hf,
    layer_freq,
    softmax_router_requirements,
    sparse_layers,
)
from megalite.config.model import ModelConfig


class Qwen2Moe(Llama):
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    config_class_name = "Qwen2MoeConfig"
    hf_keys = {**Llama.hf_keys, "--num-experts": "num_experts", "--moe-ffn-hidden-size": "moe_intermediate_size",
               "--moe-layer-freq": "mlp_only_layers"}
    qkv_bias_covers_o_proj = False
    shared_expert = "shared_expert"
    shared_expert_gate = "shared_expert_gate.weight"
    expert_files = (PER_EXPERT_MLP,)

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        return {**self.llama_requirements(cfg), **softmax_router_requirements(cfg),
                "--num-experts (MoE layers)": cfg.is_moe,
                "--moe-shared-expert-intermediate-size": bool(cfg.moe_shared_expert_intermediate_size),
                "--moe-shared-expert-gate": cfg.moe_shared_expert_gate,
                "--disable-bias-linear": not cfg.add_bias_linear}

    def refuse(self, c, where: str) -> None:
        super().refuse(c, where)
        if c.use_sliding_window or any(t != "full_attention" for t in (c.layer_types or [])):
            raise HFConversionError(f"{where}: use_sliding_window / layer_types with sliding_attention is not "
                                    "supported (megalite attends to the whole causal context)")
        if c.num_experts <= 0:
            raise HFConversionError(f"{where}: num_experts {c.num_experts}: a Qwen2-MoE without experts is not an "
                                    "MoE model; from-hf reads its dense form as Qwen2 is not supported")
        if c.shared_expert_intermediate_size <= 0:
            raise HFConversionError(f"{where}: shared_expert_intermediate_size {c.shared_expert_intermediate_size} "
                                    "must be positive (megalite's shared expert has a hidden size)")

    def bias_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        return {"disable_bias_linear": True, "add_qkv_bias": bool(getattr(c, "qkv_bias", True))}

    def mlp_fields(self, c, where: str) -> dict[str, Any]:
        layers = sparse_layers(c.decoder_sparse_step, c.mlp_only_layers, c.num_hidden_layers, where)
        if not any(layers):
            raise HFConversionError(f"{where}: mlp_only_layers / decoder_sparse_step leave no MoE layer")
        k = c.num_experts_per_tok
        return {"ffn_hidden_size": c.intermediate_size, "num_experts": c.num_experts,
                "moe_ffn_hidden_size": c.moe_intermediate_size, "moe_layer_freq": layer_freq(layers),
                "moe_shared_expert_intermediate_size": c.shared_expert_intermediate_size,
                "moe_shared_expert_gate": True, "moe_router_pre_softmax": not c.norm_topk_prob,
                "moe_router_topk": k, "moe_aux_loss_coeff": aux_coeff_from_hf(c.router_aux_loss_coef, k, sum(layers))}

    def hf_bias_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"qkv_bias": cfg.add_qkv_bias}

    def hf_mlp_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        layers = cfg.moe_layers()
        return {"intermediate_size": cfg.ffn_hidden_size, "moe_intermediate_size": cfg.expert_ffn_hidden_size,
                "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
                "num_experts": cfg.num_experts, "norm_topk_prob": not cfg.moe_router_pre_softmax,
                "decoder_sparse_step": 1, "mlp_only_layers": [i for i, moe in enumerate(layers) if not moe],
                "num_experts_per_tok": cfg.moe_router_topk, "router_aux_loss_coef": aux_coeff_to_hf(cfg),
                "use_sliding_window": False}


ADAPTER = Qwen2Moe()
