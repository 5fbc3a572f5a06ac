"""``MixtralForCausalLM`` (model_type mixtral): a Llama whose every MLP is an MoE layer.

Top-k over the logits then softmax over the k (HF's softmax, top-k and renormalisation is the same
function: megalite's default router), no shared expert, no biases. Its files store experts one by one
as ``block_sparse_moe.experts.{j}.w1/w3/w2`` (gate/up/down) and the router as ``block_sparse_moe.gate``.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from megalite.checkpointing.hf.common import HFConversionError
from megalite.checkpointing.hf.families.llama import Llama
from megalite.checkpointing.hf.files import ExpertFiles
from megalite.checkpointing.hf.moe import aux_coeff_from_hf, aux_coeff_to_hf, softmax_router_requirements
from megalite.config.model import ModelConfig


class Mixtral(Llama):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    config_class_name = "MixtralConfig"
    hf_keys = {**Llama.hf_keys, "--num-experts": "num_local_experts", "--moe-ffn-hidden-size": "intermediate_size"}
    qkv_bias_covers_o_proj = False
    expert_files = (ExpertFiles(
        re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$"),
        {"w1": "gate", "w3": "up", "w2": "down"}),)
    stored_renames = ((".block_sparse_moe.gate.", ".mlp.gate."),)

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        return {**self.llama_requirements(cfg), **softmax_router_requirements(cfg),
                "--num-experts (MoE layers)": cfg.is_moe,
                "every layer MoE (--moe-layer-freq 1)": not cfg.is_moe or all(cfg.moe_layers()),
                "no --moe-shared-expert-intermediate-size": not cfg.moe_shared_expert_intermediate_size,
                "no --add-qkv-bias": not cfg.add_qkv_bias,
                "no --moe-router-pre-softmax": not cfg.moe_router_pre_softmax,
                "--disable-bias-linear": not cfg.add_bias_linear}

    def refuse(self, c, where: str) -> None:
        super().refuse(c, where)
        window = c.sliding_window
        if window is not None and window < c.max_position_embeddings:
            raise HFConversionError(f"{where}: sliding_window {window} is not supported (megalite attends to the "
                                    "whole causal context); only null or >= max_position_embeddings converts")
        if c.router_jitter_noise:
            warnings.warn(f"{where}: router_jitter_noise {c.router_jitter_noise} is not carried over: megalite "
                          "has no router jitter; it only matters for training (the converted model computes the "
                          "same function)", stacklevel=4)

    def bias_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        return {"disable_bias_linear": True}

    def mlp_fields(self, c, where: str) -> dict[str, Any]:
        k = c.num_experts_per_tok
        return {"ffn_hidden_size": c.intermediate_size, "num_experts": c.num_local_experts,
                "moe_ffn_hidden_size": c.intermediate_size, "moe_router_topk": k,
                "moe_aux_loss_coeff": aux_coeff_from_hf(c.router_aux_loss_coef, k, c.num_hidden_layers)}

    def hf_bias_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {}

    def hf_mlp_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"intermediate_size": cfg.expert_ffn_hidden_size, "num_local_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.moe_router_topk, "router_aux_loss_coef": aux_coeff_to_hf(cfg),
                "router_jitter_noise": 0.0, "sliding_window": None}


ADAPTER = Mixtral()
