"""``Gemma3ForCausalLM`` (model_type gemma3_text: Gemma 3's text-only causal LM): Gemma 2's block
(families/gemma2.py) with per-head q/k norms and a RoPE base per layer kind.

- ``self_attn.q_norm`` / ``k_norm``: RMSNorms over the head dim scaling by (1 + w), before RoPE
  (--qk-layernorm, zero-centred like every norm with --apply-layernorm-1p);
- ``rope_parameters`` keyed by layer kind (transformers 5.x; 4.x's ``rope_theta``, ``rope_local_base_freq``
  and ``rope_scaling`` come in through the config class the same way): the sliding layers' plain RoPE base
  is --rotary-base-local, the full-attention layers' base --rotary-base with a linear factor
  (``rope_type`` 'linear') as --rotary-seq-len-interpolation-factor;
- soft-capping off by default (both caps are read as Gemma 2's when a config sets them).
"""

from __future__ import annotations

from typing import Any

from megalite.checkpointing.hf.common import HFConversionError, TensorRule, rope_parameters, rope_theta
from megalite.checkpointing.hf.families.gemma2 import FULL, SLIDING, Gemma2
from megalite.checkpointing.hf.families.qwen3 import qk_norm_rules
from megalite.config.model import ModelConfig


class Gemma3(Gemma2):
    model_type = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    config_class_name = "Gemma3TextConfig"

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        return {**self.gemma_requirements(cfg), "--qk-layernorm": cfg.qk_layernorm,
                "--qk-layernorm-scope head": cfg.qk_layernorm_scope == "head",
                "no --use-rope-scaling": not cfg.use_rope_scaling}

    # ---- HF config -> megalite ----------------------------------------------------------------------------

    def rope_fields(self, c, where: str) -> dict[str, Any]:
        full, local = rope_parameters(c, FULL), rope_parameters(c, SLIDING)
        if local["rope_type"] != "default":
            raise HFConversionError(f"{where}: rope_parameters[{SLIDING!r}] rope_type {local['rope_type']!r} is not "
                                    "supported (megalite's --rotary-base-local is plain RoPE)")
        fields = {"position_embedding_type": "rope", "rotary_base": rope_theta(full["rope_theta"])}
        if full["rope_type"] == "linear":
            fields["rotary_seq_len_interpolation_factor"] = float(full["factor"])
        elif full["rope_type"] != "default":
            raise HFConversionError(f"{where}: rope_parameters[{FULL!r}] rope_type {full['rope_type']!r} is not "
                                    "supported (megalite reads 'default' and 'linear' for Gemma 3)")
        if SLIDING in (getattr(c, "layer_types", None) or []):
            fields["rotary_base_local"] = rope_theta(local["rope_theta"])
        return fields

    def extra_fields(self, c, where: str) -> dict[str, Any]:
        return {"qk_layernorm": True}

    # ---- megalite -> HF config ----------------------------------------------------------------------------

    def hf_rope_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
        if cfg.rotary_seq_len_interpolation_factor is not None:
            full.update(rope_type="linear", factor=float(cfg.rotary_seq_len_interpolation_factor))
        local = full if cfg.rotary_base_local is None else {"rope_type": "default",
                                                             "rope_theta": float(cfg.rotary_base_local)}
        return {"rope_parameters": {SLIDING: dict(local), FULL: full}}

    def to_hf(self, cfg: ModelConfig, vocab: int, eod: int | None):
        """The per-kind ``rope_parameters`` only (no flat ``rope_theta`` beside them)."""
        return self.config_class()(**self.hf_config_fields(cfg, vocab, eod), architectures=[self.architecture])

    # ---- tensors ------------------------------------------------------------------------------------------

    def qk_norm_rules(self, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
        return qk_norm_rules(self, cfg, m, h)


ADAPTER = Gemma3()
