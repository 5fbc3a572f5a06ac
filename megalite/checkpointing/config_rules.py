"""The rules a model config must pass before any format is converted into it: the ones its training flags
would meet in pretrain_gpt.py (config/validate.py: every value in its domain, the model's shape;
config/validate_moe.py: the MoE flags). Every importer (Hugging Face, Megatron-LM) asks this one function,
so that a model is refused at conversion, not in training or generation."""

from __future__ import annotations

from megalite.config.arguments import MegaliteConfig
from megalite.config.model import ModelConfig
from megalite.config.validate import domain_check, model_errors
from megalite.config.validate_moe import moe_errors


def model_rule_errors(cfg: ModelConfig) -> list[str]:
    """What the training flags' validation would refuse in this model config; [] when it passes."""
    full = MegaliteConfig(model=cfg)
    return domain_check(full) or model_errors(cfg) + moe_errors(full)
