"""What every export to Megatron-LM shares, whichever format writes it (torch_dist/writer.py: whole
tensors, loadable at any layout; legacy/writer.py: one file per TP x PP rank): megatron-core's names for
megalite's tensors, the ``args`` Namespace Megatron-LM saves, the vocabulary padding, and the modules
that save an ``_extra_state``.

The names are the ones megatron-core 0.16's ``GPTModel.sharded_state_dict()`` gives the local layer spec
(checked by tests/test_megatron_export.py against that call):

- the norms under Transformer Engine's fused names (``self_attention.linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``), which the local spec saves its norms under too;
- SwiGLU's fc1 whole as [gate; up] (megatron-core's factory reads its TP pieces out of that order);
- a tied model has no ``output_layer.weight`` key; the vocabulary padded to Megatron's padded size;
- routed experts as the local spec's SequentialMLP saves them: stacked [E, ...] per layer under
  ``mlp.experts.experts.linear_fc1.weight`` (fc2 alike).
"""

from __future__ import annotations

import os
from argparse import Namespace
from collections.abc import Callable
from typing import Any

import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.megatron.args import MCORE_ROPE_SCALING
from megalite.checkpointing.megatron.names import LAYER, MLA_LAYER, TOP
from megalite.checkpointing.metadata import model_config
from megalite.checkpointing.stored import all_specs
from megalite.config.domain import MAX_SIZE
from megalite.config.yarn import YARN_DEFAULTS
from megalite.tensor_parallel.layers import padded_vocab_size

# megalite layer suffix -> megatron-core's sharded key suffix (local spec; norms under the fused names; a
# routed expert's fc1/fc2 stacked [E, ...] under SequentialMLP's sharded key)
FUSED_NORMS = {"input_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "input_norm.bias": "self_attention.linear_qkv.layer_norm_bias",
               "pre_mlp_norm.weight": "mlp.linear_fc1.layer_norm_weight",
               "pre_mlp_norm.bias": "mlp.linear_fc1.layer_norm_bias"}
EXPERTS = {"mlp.experts.fc1_weight": "mlp.experts.experts.linear_fc1.weight",
           "mlp.experts.fc2_weight": "mlp.experts.experts.linear_fc2.weight"}
EXPORT_LAYER = {**{v: k for k, v in LAYER.items() if v not in FUSED_NORMS}, **FUSED_NORMS, **EXPERTS}
EXPORT_TOP = {"embedding.word.weight": "embedding.word_embeddings.weight",
              "embedding.position.weight": "embedding.position_embeddings.weight",
              "final_norm.weight": "decoder.final_layernorm.weight",
              "final_norm.bias": "decoder.final_layernorm.bias",
              "output_layer.weight": "output_layer.weight"}
assert all(TOP[v] == k for k, v in EXPORT_TOP.items())
ATTENTION_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj")
# multi-latent attention as the local spec's MLA layer saves it: no key map, so the layer norms unfused
# (input_layernorm, pre_mlp_layernorm) and the latent norms as self_attention.q_layernorm / kv_layernorm
MLA_EXPORT_LAYER = {**{v: k for k, v in LAYER.items() if v not in FUSED_NORMS}, **EXPERTS,
                    **{v: k for k, v in MLA_LAYER.items() if ".linear_" not in k or "layer_norm" not in k},
                    "input_norm.weight": "input_layernorm.weight", "input_norm.bias": "input_layernorm.bias",
                    "pre_mlp_norm.weight": "pre_mlp_layernorm.weight", "pre_mlp_norm.bias": "pre_mlp_layernorm.bias"}
MLA_LINEARS = tuple(f"self_attention.linear_{n}" for n in ("q_proj", "q_down_proj", "q_up_proj", "kv_down_proj",
                                                           "kv_up_proj", "proj"))
CHECKPOINT_VERSION = 3.0

# Megatron-LM argument names copied from megalite's config unchanged
ARG_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "seq_length",
              "max_position_embeddings", "position_embedding_type", "rotary_base", "rotary_percent",
              "normalization", "norm_epsilon", "apply_layernorm_1p", "swiglu", "untie_embeddings_and_output_weights",
              "add_qkv_bias", "qk_layernorm", "hidden_dropout", "attention_dropout", "init_method_std",
              "make_vocab_size_divisible_by", "softmax_scale")
MOE_ARG_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size",
                  "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
                  "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                  "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_expert_capacity_factor",
                  "moe_token_drop_policy", "moe_pad_expert_input_to_capacity", "moe_token_dispatcher_type",
                  "moe_router_num_groups", "moe_router_group_topk")
MTP_EXPORT_OWN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_norm": "final_layernorm"}
MLA_ARG_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                  "v_head_dim")


def megatron_args(config: dict[str, Any], padded_vocab: int) -> Namespace:
    """The ``args`` Namespace Megatron-LM would have saved for this model (its own argument names; the
    inverse of args.config_from_args), so the folder describes its model without megalite. An MoE
    model's experts are written as SequentialMLP's (per-expert keys), so ``moe_grouped_gemm`` is False;
    ``moe_layer_freq`` is 1 when every layer is MoE (stacked keys) and the 0/1 list only for a mixed model,
    since megatron-core keys the layers one by one whenever it is a list."""
    cfg, _ = model_config(config)
    fields = {k: config[k] for k in ARG_FIELDS if config.get(k) is not None}
    heads = int(config["num_attention_heads"])
    groups = config.get("num_query_groups") if config.get("group_query_attention") else None
    fields.update(group_query_attention=bool(groups), num_query_groups=groups or heads,
                  add_bias_linear=not config.get("disable_bias_linear", False),
                  vocab_size=int(config["vocab_size"]), padded_vocab_size=padded_vocab,
                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ckpt_format="torch_dist")
    if cfg.window_size and cfg.window_size[0] >= 0:  # Megatron's (LEFT, RIGHT) tuple; the skip freq int or 0/1 list
        fields["window_size"] = tuple(cfg.window_size)
        freq = cfg.window_attn_skip_freq
        if freq is not None:
            text = str(freq).strip()
            fields["window_attn_skip_freq"] = int(text) if text.isdigit() else [
                int(w > 0) for w in cfg.attention_windows()]
    if cfg.rotary_seq_len_interpolation_factor is not None:  # Megatron's flag is an integer (checked on export)
        fields["rotary_seq_len_interpolation_factor"] = int(cfg.rotary_seq_len_interpolation_factor)
    if cfg.position_embedding_type == "yarn":  # Megatron-LM's argument names are megalite's
        fields.update({k: getattr(cfg, k) for k in YARN_DEFAULTS})
    if cfg.use_rope_scaling:  # megatron-core fixes the other factors (MCORE_ROPE_SCALING, checked on export)
        fields.update(use_rope_scaling=True, rope_scaling_factor=cfg.rope_scaling_factor)
    if cfg.multi_latent_attention:  # megatron-core's q_lora_rank None: no query compression
        fields.update({k: getattr(cfg, k) for k in MLA_ARG_FIELDS}, q_lora_rank=cfg.q_lora_rank or None,
                      rope_type="yarn" if cfg.position_embedding_type == "yarn" else "rope")
    if cfg.mtp_num_layers:
        fields.update(mtp_num_layers=cfg.mtp_num_layers, mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor)
    if cfg.num_experts:
        fields.update({k: config[k] for k in MOE_ARG_FIELDS if config.get(k) is not None})
        moe = [int(m) for m in cfg.moe_layers()]  # a list makes megatron-core key the layers one by one
        fields.update(moe_layer_freq=1 if all(moe) else moe, moe_grouped_gemm=False, expert_model_parallel_size=1)
    return Namespace(**fields)


def _refuse_unexported(config: dict[str, Any]) -> None:
    """What a Megatron-LM model would compute differently: a gated shared expert (Megatron's gate differs
    from megalite's, as the import refuses it too); q/k norms over the whole projection and norms after the
    sublayers (megatron-core's layer has neither: its --qk-layernorm is per head, its norms pre-sublayer);
    attention-logit soft-capping (megatron-core has no such option)."""
    if config.get("qk_layernorm") and config.get("qk_layernorm_scope", "head") != "head":
        raise CheckpointError(f"to-megatron: --qk-layernorm-scope {config['qk_layernorm_scope']} is not exported "
                              "(megatron-core's --qk-layernorm normalizes each head; it has no norm over the whole "
                              "projection)")
    if config.get("sublayer_norms", "pre") != "pre":
        raise CheckpointError(f"to-megatron: --sublayer-norms {config['sublayer_norms']} is not exported "
                              "(megatron-core's transformer layer normalizes each sublayer's input only)")
    if config.get("attn_logit_softcapping") is not None:
        raise CheckpointError(f"to-megatron: --attn-logit-softcapping {config['attn_logit_softcapping']:g} is not "
                              "exported (megatron-core's attention has no logit soft-capping)")
    _refuse_gemma_options(config)
    if config.get("use_rope_scaling"):
        differ = [f"--{k.replace('_', '-')} {config.get(k)} (megatron-core: {v:g})"
                  for k, v in MCORE_ROPE_SCALING.items() if config.get(k) != v]
        if differ:
            raise CheckpointError(f"to-megatron: --use-rope-scaling with {', '.join(differ)} is not exported "
                                  "(megatron-core's RoPE scaling takes only --rope-scaling-factor; it fixes the rest)")
    if config.get("moe_shared_expert_gate"):
        raise CheckpointError("to-megatron: --moe-shared-expert-gate is not exported (Megatron-LM's shared-expert "
                              "gate computes another function than megalite's)")


def _refuse_gemma_options(config: dict[str, Any]) -> None:
    """Options Megatron-LM's arguments cannot express (--softmax-scale travels as megatron-core's
    softmax_scale, an integral --rotary-seq-len-interpolation-factor as Megatron's flag)."""
    unexported = {"geglu": (bool(config.get("geglu")), "Megatron-LM's gated MLP activations are --swiglu and "
                            "--quick-geglu"),
                  "embedding-multiplier": (config.get("embedding_multiplier", 1.0) != 1.0,
                                           "megatron-core's embedding is not scaled"),
                  "final-logit-softcapping": (config.get("final_logit_softcapping") is not None,
                                              "megatron-core's output layer has no soft-capping"),
                  "rotary-base-local": (config.get("rotary_base_local") is not None,
                                        "megatron-core's RoPE has one base for every layer")}
    for flag, (used, why) in unexported.items():
        if used:
            raise CheckpointError(f"to-megatron: --{flag} is not exported ({why})")
    factor = config.get("rotary_seq_len_interpolation_factor")
    if factor is not None and not float(factor).is_integer():
        raise CheckpointError(f"to-megatron: --rotary-seq-len-interpolation-factor {factor:g} is not exported "
                              "(Megatron-LM's flag is an integer)")


def megatron_layers(config: dict[str, Any], get: Callable[[str], torch.Tensor], padded_vocab: int,
                    dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """(top-level tensors, one dict per layer) under megatron-core's names, full tensors; ``get(key)`` the
    full tensor of a megalite key. A layer's dict holds its own suffixes (a dense layer of an MoE model
    its fc1/fc2, an MoE layer its router and experts)."""
    cfg, _ = model_config(config)
    _refuse_unexported(config)
    top: dict[str, torch.Tensor] = {}
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_layers)]
    names = MLA_EXPORT_LAYER if cfg.multi_latent_attention else EXPORT_LAYER
    for key in all_specs(config, 1):
        t = get(key)
        t = t.to(dtype) if dtype is not None else t
        if key in EXPORT_TOP:
            if key in ("embedding.word.weight", "output_layer.weight") and t.shape[0] < padded_vocab:
                t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
            top[EXPORT_TOP[key]] = t.contiguous()
            continue
        if key.startswith("mtp."):
            top[_mtp_name(key, names)] = t.contiguous()
            continue
        _, i, suffix = key.split(".", 2)
        if suffix not in names:
            raise CheckpointError(f"to-megatron: {key} has no megatron-core counterpart")
        layers[int(i)][names[suffix]] = t.contiguous()
    return top, layers


def _mtp_name(key: str, names: dict[str, str]) -> str:
    """megatron-core's key of a multi-token prediction tensor (the reverse of what from-megatron reads):
    ``mtp.layers.K.{enorm,hnorm,eh_proj,final_layernorm}.*`` and the depth's layer as ``transformer_layer``."""
    _, _, k, head, rest = key.split(".", 4)
    if head in MTP_EXPORT_OWN:
        return f"mtp.layers.{k}.{MTP_EXPORT_OWN[head]}.{rest}"
    if head == "layer" and rest in names:
        return f"mtp.layers.{k}.transformer_layer.{names[rest]}"
    raise CheckpointError(f"to-megatron: {key} has no megatron-core counterpart")


def mtp_linears(top: dict[str, torch.Tensor]) -> list[str]:
    """The multi-token prediction depths' linear modules (eh_proj and the layer's), each of which saves an
    ``_extra_state`` (megatron-core keys each depth on its own, not stacked)."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in top.items():
        if key.startswith("mtp.layers.") and ".transformer_layer." in key:
            prefix, _, suffix = key.partition(".transformer_layer.")
            layers.setdefault(prefix, {})[suffix] = t
    return [m for prefix in sorted(layers) for m in
            [f"{prefix}.eh_proj", *(f"{prefix}.transformer_layer.{x}" for x in layer_linears(layers[prefix]))]]


def mtp_experts(top: dict[str, torch.Tensor]) -> dict[str, int]:
    """The routed experts of each multi-token prediction depth whose layer is MoE, by the depth's layer
    prefix (``mtp.layers.K.transformer_layer``): its experts are stacked [E, ...] under SequentialMLP's
    sharded key, as a main-model layer's, and each expert's fc1/fc2 saves its own ``_extra_state``."""
    fc1 = EXPERTS["mlp.experts.fc1_weight"]
    return {key.removesuffix(f".{fc1}"): t.shape[0] for key, t in top.items()
            if key.startswith("mtp.layers.") and key.endswith(f".transformer_layer.{fc1}")}


def layer_linears(layer: dict[str, torch.Tensor]) -> list[str]:
    """The linear modules of one layer (megatron-core's local-spec names), each of which saves an
    ``_extra_state``: attention's two (MLA's projections), the dense MLP's or the shared expert's fc1/fc2
    (routed experts apart: one pair per expert)."""
    mlp = [m for m in ("mlp.linear_fc1", "mlp.linear_fc2", "mlp.shared_experts.linear_fc1",
                       "mlp.shared_experts.linear_fc2") if f"{m}.weight" in layer]
    mla = "self_attention.linear_kv_down_proj.weight" in layer
    attention = [m for m in MLA_LINEARS if f"{m}.weight" in layer] if mla else list(ATTENTION_LINEARS)
    return [*attention, *mlp]


def export_vocab(config: dict[str, Any], padded_vocab: int | None, tp: int) -> int:
    """The embedding rows an export writes: ``padded_vocab`` if given (never below the vocabulary), else
    Megatron-LM's padding of the vocabulary for ``tp``."""
    cfg, vocab = model_config(config)
    padded = padded_vocab or padded_vocab_size(vocab, cfg.make_vocab_size_divisible_by, tp)
    if padded < vocab:
        raise CheckpointError(f"to-megatron: --padded-vocab-size {padded} is below the vocabulary ({vocab})")
    need = padded * cfg.hidden_size * 2  # bytes of the padded embedding at 2 bytes an element, at least
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if padded > MAX_SIZE or need > memory:  # checked before the padded embedding is allocated
        how = "--padded-vocab-size" if padded_vocab else (f"the vocabulary ({vocab}) padded to a multiple of "
                                                         f"{cfg.make_vocab_size_divisible_by} x TP {tp}")
        raise CheckpointError(f"to-megatron: {how} gives {padded} embedding rows: x hidden {cfg.hidden_size} "
                              f"that is {need / 2**30:.1f} GiB or more, past this machine's {memory / 2**30:.1f} "
                              f"GiB (or past {MAX_SIZE} rows)")
    return padded
