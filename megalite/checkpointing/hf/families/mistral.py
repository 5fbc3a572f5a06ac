"""``MistralForCausalLM`` (model_type mistral): a Llama without biases and with one sliding window for all
layers (--window-size).

transformers' ``sliding_window`` W lets a query at i see the keys i - W < j <= i (masking_utils'
sliding-window overlay); megalite's --window-size LEFT 0 sees i - LEFT <= j <= i, so W = LEFT + 1 both ways.
``sliding_window`` None imports as plain causal attention (such a model exports as a Llama). A per-layer
pattern (--window-attn-skip-freq) is not Mistral's: transformers' Mistral applies its window to every layer.
"""

from __future__ import annotations

from typing import Any

from megalite.checkpointing.hf.common import HFConversionError
from megalite.checkpointing.hf.families.llama import NO_WINDOW, Llama
from megalite.config.model import ModelConfig


class Mistral(Llama):
    model_type = "mistral"
    architecture = "MistralForCausalLM"
    config_class_name = "MistralConfig"

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        window = bool(cfg.window_size) and cfg.window_size[0] >= 0
        llama = {k: ok for k, ok in self.llama_requirements(cfg).items() if k != NO_WINDOW}
        return {**llama, "no --num-experts (a dense MLP)": not cfg.is_moe,
                "--disable-bias-linear": not cfg.add_bias_linear, "no --add-qkv-bias": not cfg.add_qkv_bias,
                "--window-size": window, "no --window-attn-skip-freq": cfg.window_attn_skip_freq is None}

    def attention_kind_fields(self, c, where: str) -> dict[str, Any]:
        w = getattr(c, "sliding_window", None)
        if w is None:
            return {}
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise HFConversionError(f"{where}: sliding_window must be a positive integer or null, got {w!r}")
        return {"window_size": [w - 1, 0]}

    def bias_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        return {"disable_bias_linear": True, "add_qkv_bias": False}

    def hf_bias_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {}

    def hf_extra_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"sliding_window": cfg.window_size[0] + 1}


ADAPTER = Mistral()
