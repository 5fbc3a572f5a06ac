"""``Qwen2ForCausalLM`` (model_type qwen2; Qwen2 and Qwen2.5): a Llama with biases on q/k/v only.

Its q/k/v projections always carry a bias and o_proj and the MLP never do (transformers' Qwen2Config has no
bias keys): megalite's ``--disable-bias-linear --add-qkv-bias`` (Megatron's semantics), nothing else. Listed
before Llama in the registry, so a Llama-style model with --add-qkv-bias exports here, where the biases mean
what they say (a LlamaConfig needs ``attention_bias`` and zero o_proj biases for the same function).
"""

from __future__ import annotations

from typing import Any

from megalite.checkpointing.hf.families.llama import Llama
from megalite.config.model import ModelConfig


class Qwen2(Llama):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    config_class_name = "Qwen2Config"
    qkv_bias_covers_o_proj = False

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        return {**super().requirements(cfg), "--disable-bias-linear": not cfg.add_bias_linear,
                "--add-qkv-bias": cfg.add_qkv_bias}

    def bias_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        return {"disable_bias_linear": True, "add_qkv_bias": True}

    def hf_bias_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {}

    def hf_extra_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"use_sliding_window": False}


ADAPTER = Qwen2()
