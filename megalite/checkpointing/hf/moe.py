"""Hugging Face conversion of mixture-of-experts models: ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``.

Both are Llama-style models (RoPE, RMSNorm, SwiGLU, GQA) whose MLPs are MoE layers; hf.py handles the
shared parts and asks this module for the configs and the MoE layers' tensors.

- Mixtral: every layer MoE, top-k over the logits then softmax over the k (HF's softmax, top-k and
  renormalisation is the same function: megalite's default router), no shared expert, no biases.
- Qwen2-MoE: q/k/v biases (--add-qkv-bias), a shared expert scaled by sigmoid(x . w)
  (--moe-shared-expert-intermediate-size, --moe-shared-expert-gate), dense layers where
  ``mlp_only_layers`` / ``decoder_sparse_step`` say (--moe-layer-freq as a 0/1 list). ``norm_topk_prob``
  false is softmax over all experts then top-k (--moe-router-pre-softmax); true is megalite's default.

transformers 5.x holds the routed experts stacked exactly as megalite does: ``mlp.experts.gate_up_proj``
[E, 2F, h] ([gate; up]) is ``mlp.experts.fc1_weight`` and ``mlp.experts.down_proj`` [E, h, F] is
``mlp.experts.fc2_weight``; ``mlp.gate.weight`` [E, h] is the router. (save_pretrained writes Mixtral's
per-expert w1/w3/w2 files itself, so 4.x reads the folders too.)

The load-balancing loss: HF adds ``router_aux_loss_coef`` times one loss over all MoE layers' tokens
together, which is k (top-k) for a balanced router; megalite sums one loss per MoE layer, each
``--moe-aux-loss-coeff`` when balanced. ``--moe-aux-loss-coeff = router_aux_loss_coef * k / L`` (L MoE
layers) gives the same loss and the same router gradients when the layers are loaded alike.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from megalite.checkpointing.hf.common import HFConversionError, TensorRule, check_model_rules, rope_theta
from megalite.checkpointing.metadata import config_dict
from megalite.config.model import ModelConfig

MOE_TYPES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def _llama_like(cfg: ModelConfig) -> dict[str, bool]:
    return {"--position-embedding-type rope": cfg.position_embedding_type == "rope",
            "--normalization RMSNorm": cfg.normalization == "RMSNorm", "--swiglu": cfg.swiglu,
            "--rotary-percent 1.0": cfg.rotary_percent == 1.0,
            "--moe-router-score-function softmax": cfg.moe_router_score_function == "softmax",
            "no --moe-router-enable-expert-bias": not cfg.moe_router_enable_expert_bias,
            "no --moe-router-topk-scaling-factor": cfg.moe_router_topk_scaling_factor in (None, 1.0)}


def moe_architecture(cfg: ModelConfig) -> str:
    """'mixtral' or 'qwen2_moe' for an MoE model config (a shared expert makes it Qwen2-MoE), or an error
    listing what does not fit."""
    common = _llama_like(cfg)
    mixtral = {**common, "every layer MoE (--moe-layer-freq 1)": all(cfg.moe_layers()),
               "no --moe-shared-expert-intermediate-size": not cfg.moe_shared_expert_intermediate_size,
               "no --add-qkv-bias": not cfg.add_qkv_bias,
               "no --moe-router-pre-softmax": not cfg.moe_router_pre_softmax}
    qwen = {**common, "--moe-shared-expert-intermediate-size": bool(cfg.moe_shared_expert_intermediate_size),
            "--moe-shared-expert-gate": cfg.moe_shared_expert_gate}
    arch, rules = ("qwen2_moe", qwen) if cfg.moe_shared_expert_intermediate_size else ("mixtral", mixtral)
    if all(rules.values()):
        return arch
    raise HFConversionError(
        "this MoE model has no Hugging Face equivalent: MixtralForCausalLM needs " + ", ".join(mixtral)
        + f" (missing: {', '.join(k for k, ok in mixtral.items() if not ok)}); Qwen2MoeForCausalLM needs "
        + ", ".join(qwen) + f" (missing: {', '.join(k for k, ok in qwen.items() if not ok)})")


def _coeff(x: float) -> float:
    return float(f"{x:.12g}")  # so a coefficient survives the scaling both ways unchanged


def to_hf_moe_config(cfg: ModelConfig, vocab: int, eod: int | None):
    """MixtralConfig or Qwen2MoeConfig of a megalite MoE model config."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    arch = moe_architecture(cfg)
    layers = cfg.moe_layers()
    coef = _coeff(cfg.moe_aux_loss_coeff * sum(layers) / cfg.moe_router_topk) \
        if cfg.moe_router_load_balancing_type != "none" else 0.0
    common = dict(vocab_size=vocab, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_attention_heads,
                  num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads, head_dim=cfg.kv_channels,
                  hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings,
                  rms_norm_eps=cfg.norm_epsilon,
                  rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
                  attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_method_std,
                  tie_word_embeddings=cfg.tied_embeddings, bos_token_id=eod, eos_token_id=eod,
                  num_experts_per_tok=cfg.moe_router_topk, router_aux_loss_coef=coef,
                  architectures=[MOE_TYPES[arch]])
    if arch == "mixtral":
        hf = MixtralConfig(intermediate_size=cfg.expert_ffn_hidden_size, num_local_experts=cfg.num_experts,
                           router_jitter_noise=0.0, sliding_window=None, **common)
    else:
        hf = Qwen2MoeConfig(intermediate_size=cfg.ffn_hidden_size, moe_intermediate_size=cfg.expert_ffn_hidden_size,
                            shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
                            num_experts=cfg.num_experts, norm_topk_prob=not cfg.moe_router_pre_softmax,
                            decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(layers) if not moe],
                            qkv_bias=cfg.add_qkv_bias, use_sliding_window=False, **common)
    hf.rope_theta = float(cfg.rotary_base)  # transformers 4.x reads this key, not rope_parameters
    return hf


def hf_moe_layers(c, where: str) -> list[bool]:
    """Which layers of a Qwen2-MoE config are sparse (HF's rule: not in mlp_only_layers, and
    (i + 1) % decoder_sparse_step == 0)."""
    step, dense = c.decoder_sparse_step, set(c.mlp_only_layers or [])
    if not isinstance(step, int) or step <= 0:
        raise HFConversionError(f"{where}: decoder_sparse_step must be a positive integer, got {step!r}")
    return [i not in dense and (i + 1) % step == 0 for i in range(c.num_hidden_layers)]


def _refusals(c, where: str) -> None:
    """Features of a Mixtral / Qwen2-MoE config megalite cannot run; each error names its key."""
    if c.hidden_act != "silu":
        raise HFConversionError(f"{where}: hidden_act {c.hidden_act!r} is not supported (SwiGLU needs silu)")
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise HFConversionError(f"{where}: rope_type {rope.get('rope_type')!r} (RoPE scaling) is not supported; "
                                "megalite implements plain RoPE")
    if c.model_type == "mixtral":
        window = c.sliding_window
        if window is not None and window < c.max_position_embeddings:
            raise HFConversionError(f"{where}: sliding_window {window} is not supported (megalite attends to the "
                                    "whole causal context); only null or >= max_position_embeddings converts")
        if c.router_jitter_noise:
            warnings.warn(f"{where}: router_jitter_noise {c.router_jitter_noise} is not carried over: megalite "
                          "has no router jitter; it only matters for training (the converted model computes the "
                          "same function)", stacklevel=3)
        return
    if c.use_sliding_window or any(t != "full_attention" for t in (c.layer_types or [])):
        raise HFConversionError(f"{where}: use_sliding_window / layer_types with sliding_attention is not "
                                "supported (megalite attends to the whole causal context)")
    if c.num_experts <= 0:
        raise HFConversionError(f"{where}: num_experts {c.num_experts}: a Qwen2-MoE without experts is not an "
                                "MoE model; from-hf reads its dense form as Qwen2 is not supported")
    if c.shared_expert_intermediate_size <= 0:
        raise HFConversionError(f"{where}: shared_expert_intermediate_size {c.shared_expert_intermediate_size} "
                                "must be positive (megalite's shared expert has a hidden size)")


def from_hf_moe_config(c, where: str, apply_layernorm_1p: bool = False) -> dict[str, Any]:
    """megalite model config dict (incl. vocab_size) of a MixtralConfig or Qwen2MoeConfig."""
    _refusals(c, where)
    heads, groups = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    theta = dict(getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
    k = c.num_experts_per_tok
    common = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=heads,
                  group_query_attention=groups != heads, num_query_groups=groups,
                  kv_channels=getattr(c, "head_dim", None) or c.hidden_size // heads,
                  seq_length=c.max_position_embeddings, max_position_embeddings=c.max_position_embeddings,
                  position_embedding_type="rope", rotary_base=rope_theta(theta), normalization="RMSNorm",
                  norm_epsilon=c.rms_norm_eps, swiglu=True,
                  untie_embeddings_and_output_weights=not c.tie_word_embeddings,
                  disable_bias_linear=True, hidden_dropout=0.0, attention_dropout=c.attention_dropout,
                  init_method_std=c.initializer_range, apply_layernorm_1p=apply_layernorm_1p, moe_router_topk=k)
    if c.model_type == "mixtral":
        cfg = ModelConfig(ffn_hidden_size=c.intermediate_size, num_experts=c.num_local_experts,
                          moe_ffn_hidden_size=c.intermediate_size,
                          moe_aux_loss_coeff=_coeff(c.router_aux_loss_coef * k / max(c.num_hidden_layers, 1)),
                          **common)
        check_model_rules(cfg, c, where)
        return config_dict(cfg, c.vocab_size)
    layers = hf_moe_layers(c, where)
    if not any(layers):
        raise HFConversionError(f"{where}: mlp_only_layers / decoder_sparse_step leave no MoE layer")
    freq = "1" if all(layers) else "[" + ",".join(str(int(x)) for x in layers) + "]"
    cfg = ModelConfig(ffn_hidden_size=c.intermediate_size, num_experts=c.num_experts,
                      moe_ffn_hidden_size=c.moe_intermediate_size, moe_layer_freq=freq,
                      moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True, moe_router_pre_softmax=not c.norm_topk_prob,
                      add_qkv_bias=bool(getattr(c, "qkv_bias", True)),
                      moe_aux_loss_coeff=_coeff(c.router_aux_loss_coef * k / sum(layers)), **common)
    check_model_rules(cfg, c, where)
    return config_dict(cfg, c.vocab_size)


def _gate_up(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.contiguous() for x in t.chunk(2, dim=0))


def _cat(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up])


def moe_mlp_rules(cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
    """The tensors of one MoE layer's MLP (``m``: megalite's ``layers.{i}.``, ``h``: HF's
    ``model.layers.{i}.``). Routed experts are stacked the same way on both sides (module doc)."""
    rules = [TensorRule(m + "mlp.router.weight", (h + "mlp.gate.weight",)),
             TensorRule(m + "mlp.experts.fc1_weight", (h + "mlp.experts.gate_up_proj",)),
             TensorRule(m + "mlp.experts.fc2_weight", (h + "mlp.experts.down_proj",))]
    if cfg.moe_shared_expert_intermediate_size:
        s = h + "mlp.shared_expert."
        rules += [TensorRule(m + "mlp.shared_expert.fc1.weight", (s + "gate_proj.weight", s + "up_proj.weight"),
                             _gate_up, _cat),
                  TensorRule(m + "mlp.shared_expert.fc2.weight", (s + "down_proj.weight",)),
                  TensorRule(m + "mlp.shared_expert_gate", (h + "mlp.shared_expert_gate.weight",))]
    return rules


def moe_tp_errors(cfg: ModelConfig, tp: int) -> list[str]:
    """What writing an MoE model's checkpoint at TP size ``tp`` needs: its experts are cut over expert-TP,
    which is TP in the checkpoint's files, and so is the shared expert."""
    if not cfg.is_moe or tp <= 0:
        return []
    errors = []
    if cfg.expert_ffn_hidden_size % tp:
        errors.append(f"--tensor-model-parallel-size ({tp}) must divide the expert hidden size "
                      f"(--moe-ffn-hidden-size {cfg.expert_ffn_hidden_size})")
    shared = cfg.moe_shared_expert_intermediate_size
    if shared and shared % tp:
        errors.append(f"--tensor-model-parallel-size ({tp}) must divide --moe-shared-expert-intermediate-size "
                      f"({shared})")
    return errors
