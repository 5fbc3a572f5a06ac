"""The state-dict adapter: everything one Hugging Face architecture owns, behind one interface.

The converter core (convert.py) knows no architecture. It asks the registry (registry.py) for the adapter
of an HF config's ``model_type`` (import) or for the first adapter that ``matches`` a megalite config
(export), then asks that adapter for:

- **its names**: ``model_type`` (and ``aliases``), the transformers ``architecture`` class written to
  config.json, its ``config_class_name``, the HF name of the word embedding (a tied head is that tensor);
- **configs**: ``from_hf`` (refusals first, then the megalite ``ModelConfig``, then the training flags'
  rules named by ``hf_keys``) and ``to_hf`` (the transformers config of a megalite config);
- **export choice**: ``requirements`` (what a megalite config needs, each named by its flag; with the
  attention kind, ``latent_attention``, they are ``export_requirements``) and ``matches``; the registry names
  every adapter's missing requirements when none matches;
- **tensors**: ``name_table`` (one ``TensorRule`` per megalite tensor, both directions) built from the
  embedding, per-layer and final rules, each a method a family overrides;
- **files**: per-expert tensors some files store one by one (``expert_files``) and stored names to rename
  (``stored_renames``), consumed by files.py before any tensor is loaded, and ``stored_weights``, which puts
  the read tensors in the layout the name table reads (DeepSeek-V3's rotate-half RoPE rows reordered).

A family that refines another subclasses it and overrides only what differs: the Llama-style adapter
(families/llama.py) exposes hooks for RoPE scaling dicts, per-layer attention kinds (sliding windows),
biases on q/k/v only, q/k norms, extra per-layer norms, MoE layers and embedding scale.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from megalite.checkpointing.hf.common import HFConversionError, TensorRule, check_model_rules
from megalite.config.model import ModelConfig


class HFAdapter:
    """One Hugging Face architecture (module doc). Subclasses set the class attributes and the methods
    that raise NotImplementedError; everything else has a default that fits most decoder models."""

    model_type: ClassVar[str]  # HF config.model_type: the registry key on import
    aliases: ClassVar[tuple[str, ...]] = ()  # other model_types this adapter reads the same way
    architecture: ClassVar[str]  # the transformers model class (config.json "architectures")
    config_class_name: ClassVar[str]  # the transformers config class
    embedding_key: ClassVar[str]  # HF name of the word embedding (a tied lm_head is this tensor)
    hf_keys: ClassVar[Mapping[str, str]] = {}  # megalite flag -> HF config key, to name rule errors
    hf_norm_zero_centred: ClassVar[bool] = False  # HF norms scale by (1 + w) and store w (Gemma)
    expert_files: ClassVar[tuple] = ()  # files.ExpertFiles: per-expert tensors stored one by one
    stored_renames: ClassVar[tuple[tuple[str, str], ...]] = ()  # (stored infix, transformers infix)
    latent_attention: ClassVar[bool] = False  # its attention is multi-latent (--multi-latent-attention)
    mtp_layers: ClassVar[bool] = False  # it exports --mtp-num-layers' depths (others refuse them, never drop them)

    # ---- names and classes --------------------------------------------------------------------------

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.model_type, *self.aliases)

    def describe(self) -> str:
        """How the supported-architectures list names it."""
        return f"{self.architecture} (model_type {self.model_type})"

    def config_class(self) -> type:
        import transformers

        return getattr(transformers, self.config_class_name)

    def model_class(self) -> type:
        import transformers

        return getattr(transformers, self.architecture)

    # ---- which megalite configs it exports ------------------------------------------------------------

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        """Each thing a megalite config needs to be this architecture, named by its flag -> whether it has it.
        A requirement's name must not contain ';' (the registry joins adapters with it)."""
        raise NotImplementedError

    def export_requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        """``requirements`` and the attention kind every architecture has: multi-latent or per-head q/k/v
        (a family states ``latent_attention``; none needs to repeat the rule)."""
        kind = "--multi-latent-attention" if self.latent_attention else "no --multi-latent-attention"
        mtp = {} if self.mtp_layers else {"no --mtp-num-layers": not cfg.mtp_num_layers}
        return {**self.requirements(cfg), kind: cfg.multi_latent_attention == self.latent_attention, **mtp}

    def matches(self, cfg: ModelConfig) -> bool:
        return all(self.export_requirements(cfg).values())

    # ---- configs ---------------------------------------------------------------------------------------

    def refuse(self, hf_config, where: str) -> None:
        """Raise HFConversionError naming the first HF key whose value megalite cannot run (warn for what only
        training would notice). Runs before model_fields."""

    def model_fields(self, hf_config, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        """ModelConfig keyword arguments of the HF config (``qkv_bias_only``: a hint from the weights, see
        qkv_bias_only)."""
        raise NotImplementedError

    def from_hf(self, hf_config, where: str, qkv_bias_only: bool = False,
                apply_layernorm_1p: bool = False) -> ModelConfig:
        """The megalite model config of an HF config, refused with the HF keys named where megalite cannot run
        it or where it breaks a training flag's rule."""
        self.refuse(hf_config, where)
        cfg = ModelConfig(**self.model_fields(hf_config, where, qkv_bias_only), apply_layernorm_1p=apply_layernorm_1p)
        check_model_rules(cfg, hf_config, where, self.hf_keys)
        return cfg

    def hf_config_fields(self, cfg: ModelConfig, vocab: int, eod: int | None) -> dict[str, Any]:
        """Keyword arguments of the transformers config class for a megalite config this adapter matches."""
        raise NotImplementedError

    def to_hf(self, cfg: ModelConfig, vocab: int, eod: int | None):
        """The transformers config of a megalite config this adapter matches."""
        return self.config_class()(**self.hf_config_fields(cfg, vocab, eod), architectures=[self.architecture])

    def outside_model(self, hf_config, names, where: str) -> set[str]:
        """Of the tensor ``names`` (stored on import, converted on export), those the family maps although
        transformers' class has no place for them (DeepSeek-V3's multi-token prediction layers): read without
        its shape check, written beside its save_pretrained files. Raise HFConversionError naming any the
        family cannot map; everything else unplaced is refused by files.py."""
        return set()

    def qkv_bias_only(self, hf_config, sd: Mapping[str, torch.Tensor]) -> bool:
        """Whether the weights say more than the config: e.g. a Llama with attention_bias whose o_proj biases
        are all zero is megalite's --add-qkv-bias. Passed back to model_fields on the second reading."""
        return False

    def stored_weights(self, hf_config, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The read state dict in the form name_table reads: a family whose config names another stored layout
        of the same function (DeepSeek-V3's rope_interleave false) rearranges it here, exactly."""
        return sd

    # ---- tensors ---------------------------------------------------------------------------------------

    def norm_rule(self, cfg: ModelConfig, ours: str, theirs: str) -> TensorRule:
        """A norm's weight. megalite's zero-centred w (--apply-layernorm-1p) scales by 1 + w; an HF family that
        holds the scale itself gets 1 + w, one that is zero-centred too (hf_norm_zero_centred) gets w."""
        if cfg.apply_layernorm_1p == self.hf_norm_zero_centred:
            return TensorRule(ours, (theirs,))
        if cfg.apply_layernorm_1p:
            return TensorRule(ours, (theirs,), lambda t: (t + 1,), lambda t: t - 1)
        raise HFConversionError(f"{self.architecture} stores zero-centred norm weights: export needs "
                                "--apply-layernorm-1p")

    def embedding_rules(self, cfg: ModelConfig) -> list[TensorRule]:
        return [TensorRule("embedding.word.weight", (self.embedding_key,))]

    def layer_rules(self, cfg: ModelConfig, i: int) -> list[TensorRule]:
        raise NotImplementedError

    def final_rules(self, cfg: ModelConfig) -> list[TensorRule]:
        raise NotImplementedError

    def output_rules(self, cfg: ModelConfig) -> list[TensorRule]:
        """A tied model has no ``lm_head.weight`` entry (HF ties it to the embedding)."""
        return [] if cfg.tied_embeddings else [TensorRule("output_layer.weight", ("lm_head.weight",))]

    def name_table(self, cfg: ModelConfig) -> list[TensorRule]:
        """Every tensor of the model, megalite's name <-> HF's."""
        rules = self.embedding_rules(cfg)
        for i in range(cfg.num_layers):
            rules += self.layer_rules(cfg, i)
        return rules + self.final_rules(cfg) + self.output_rules(cfg)
