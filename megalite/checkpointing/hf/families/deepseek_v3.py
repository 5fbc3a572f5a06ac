"""``DeepseekV3ForCausalLM`` (model_type deepseek_v3): multi-latent attention, YaRN, and MoE layers after the
first dense ones, routed by sigmoid scores with an expert bias, group-limited top-k and a scaling factor, beside
a shared expert.

Attention (--multi-latent-attention, model/mla.py): ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or one
``q_proj`` when ``q_lora_rank`` is null) are q_down_proj / q_layernorm / q_up_proj, ``kv_a_proj_with_mqa`` /
``kv_a_layernorm`` / ``kv_b_proj`` are kv_down_proj / kv_layernorm / kv_up_proj, ``o_proj`` is proj; their rows
lie alike (per head [nope; rope], the latent then the RoPE key, per head [k; v]); the latent norms are megalite's
with --qk-layernorm (megatron-core's rule). transformers' rope_interleave true rotation is megalite's (channels
(2i, 2i+1) pair up); with rope_interleave false it rotates halves (channel i pairs with i + d/2, rotate_half),
which from-hf maps exactly by reordering the RoPE rows of q_b_proj / q_proj (per head) and kv_a_proj_with_mqa
(``halves_to_pairs``): the rotated q_pe and k_pe are then the very vectors transformers forms. to-hf writes the
form megalite holds, rope_interleave true. The latent norms hold a fixed epsilon of 1e-6 where megalite's norms
take --norm-epsilon, so only rms_norm_eps 1e-6 converts.

MoE: ``first_k_dense_replace`` dense layers (``intermediate_size``) then MoE layers (--moe-layer-freq as a 0/1
list); ``n_shared_experts`` x ``moe_intermediate_size`` is the shared expert's size; the router's
``e_score_correction_bias`` is megalite's expert bias (added to the sigmoid scores for the choice only, the same
sign); ``routed_scaling_factor`` is --moe-router-topk-scaling-factor. transformers scores a group by the sum of
its top 2 experts, megalite (Megatron-LM) by its top k / group-topk: group-limited routing converts where these
agree. transformers renormalises the top-k weights when ``norm_topk_prob``; megalite's sigmoid router does when
k > 1. transformers trains neither the bias nor a load-balancing loss: imports have none
(--moe-router-load-balancing-type none); to match its fine-tuning also pass --moe-router-bias-update-rate 0.

Multi-token prediction (--mtp-num-layers D): DeepSeek-V3's checkpoints keep depth k as one more layer index,
``num_hidden_layers + k`` (``num_nextn_predict_layers`` of them), which transformers' class does not build or
run: ``enorm`` / ``hnorm`` / ``eh_proj`` (its input [embedding; hidden], megatron-core's order too), a decoder
layer of the last layer's kind with its experts stored one by one, ``shared_head.norm`` (megalite's depth
final_norm), and copies of the word embedding (``embed_tokens``) and output head (``shared_head.head``), which
must equal the main model's (megalite shares them). from-hf imports the depths present in the weights (a config
saying more or fewer is not trusted: transformers' default is 1 with none stored); to-hf writes them in a
safetensors file of their own, named in the weight index (files.write_beside), and sets num_mtp_layers.
Anything else past num_hidden_layers is refused by name.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from megalite.checkpointing.hf.common import (
    HFConversionError,
    TensorRule,
    cat_rows,
    halves,
    rope_parameters,
    rope_theta,
)
from megalite.checkpointing.hf.families.llama import LLAMA_KEYS, NO_WINDOW, Llama
from megalite.checkpointing.hf.moe import PER_EXPERT_MLP, expert_rules, layer_freq
from megalite.config.model import ModelConfig

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which q_a_layernorm / kv_a_layernorm keep
HF_GROUP_SCORE_TOPK = 2  # transformers scores a group by the sum of its top 2 expert scores

KEYS = {**{k: v for k, v in LLAMA_KEYS.items() if k not in ("--num-query-groups", "--kv-channels")},
        "--num-experts": "n_routed_experts", "--moe-ffn-hidden-size": "moe_intermediate_size",
        "--moe-layer-freq": "first_k_dense_replace", "--moe-router-num-groups": "n_group",
        "--moe-router-group-topk": "topk_group", "--moe-router-topk-scaling-factor": "routed_scaling_factor",
        "--moe-shared-expert-intermediate-size": "n_shared_experts", "--q-lora-rank": "q_lora_rank",
        "--kv-lora-rank": "kv_lora_rank", "--qk-head-dim": "qk_nope_head_dim",
        "--qk-pos-emb-head-dim": "qk_rope_head_dim", "--v-head-dim": "v_head_dim",
        "--rotary-scaling-factor": "rope_parameters", "--yarn-beta-fast": "rope_parameters",
        "--yarn-beta-slow": "rope_parameters", "--mscale": "rope_parameters"}

# megalite's YaRN field -> transformers' rope_parameters key
YARN_KEYS = {"rotary_scaling_factor": "factor", "yarn_original_max_position_embeddings":
             "original_max_position_embeddings", "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
             "yarn_correction_range_round_to_int": "truncate", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}


def _yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_fields(rope: dict[str, Any], c, where: str) -> dict[str, Any]:
    """megalite's YaRN fields of transformers' rope_type 'yarn' parameters, as transformers reads them: a null
    factor is max_position_embeddings / original; cos/sin are scaled by mscale(s, mscale) / mscale(s,
    mscale_all_dim) only when both are set (else by mscale(s, 1)); MLA's softmax scale by mscale(s,
    mscale_all_dim)^2 when that is set. An explicit attention_factor must be the one these give."""
    original = rope.get("original_max_position_embeddings")
    if original is None or not float(original).is_integer():
        raise HFConversionError(f"{where}: rope_type 'yarn' needs an integer original_max_position_embeddings, "
                                f"got {original!r}")
    factor = rope.get("factor") or c.max_position_embeddings / original
    mscale, all_dim = rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
    if mscale and all_dim:
        ms = {"mscale": float(mscale), "mscale_all_dim": float(all_dim)}
    elif all_dim:  # cos/sin by mscale(s, 1) but the softmax by mscale(s, all_dim)^2: no megalite pair gives both
        if _yarn_mscale(factor, all_dim) != _yarn_mscale(factor, 1.0):
            raise HFConversionError(f"{where}: rope_parameters mscale_all_dim {all_dim!r} without mscale has no "
                                    "megalite equivalent (--mscale / --mscale-all-dim set both factors together)")
        ms = {"mscale": 1.0, "mscale_all_dim": float(all_dim)}
    else:
        ms = {"mscale": 1.0, "mscale_all_dim": 0.0}
    given = rope.get("attention_factor")
    implied = _yarn_mscale(factor, ms["mscale"]) / _yarn_mscale(factor, ms["mscale_all_dim"])
    if given is not None and not math.isclose(given, implied, rel_tol=1e-12):
        raise HFConversionError(f"{where}: rope_parameters attention_factor {given!r} differs from the "
                                f"concentration factor its factor / mscale / mscale_all_dim give ({implied!r}), "
                                "which megalite computes")
    return {"position_embedding_type": "yarn", "rotary_scaling_factor": float(factor),
            "yarn_original_max_position_embeddings": int(original),
            "yarn_beta_fast": float(rope.get("beta_fast") or 32), "yarn_beta_slow": float(rope.get("beta_slow") or 1),
            "yarn_correction_range_round_to_int": bool(rope.get("truncate", True)), **ms}


def hf_yarn_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' rope_parameters of a megalite model (rope_type 'yarn' with --position-embedding-type yarn;
    the concentration factor written out, as megalite computes it)."""
    if cfg.position_embedding_type != "yarn" or (cfg.rotary_scaling_factor == 1.0 and cfg.rope_attention_factor == 1.0
                                                 and cfg.yarn_softmax_scale_multiplier == 1.0):  # YaRN at 1: RoPE
        return {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    return {"rope_type": "yarn", "rope_theta": float(cfg.rotary_base),
            **{theirs: getattr(cfg, ours) for ours, theirs in YARN_KEYS.items()},
            "attention_factor": cfg.rope_attention_factor}


def dense_first(layers: list[bool]) -> int | None:
    """How many dense layers lead a dense-then-MoE pattern (transformers' first_k_dense_replace), else None."""
    k = layers.index(True) if any(layers) else len(layers)
    return k if all(layers[k:]) else None


class DeepseekV3(Llama):
    """DeepSeek-V3 (module doc)."""

    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    config_class_name = "DeepseekV3Config"
    hf_keys = KEYS
    latent_attention = True
    mtp_layers = True
    expert_files = (PER_EXPERT_MLP,)
    shared_expert = "shared_experts"

    # ---- export choice ----------------------------------------------------------------------------------

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        layers = cfg.moe_layers()
        k, g = cfg.moe_router_topk, cfg.moe_router_group_topk
        shared, ffn = cfg.moe_shared_expert_intermediate_size, cfg.expert_ffn_hidden_size
        return {"--position-embedding-type rope or yarn": cfg.position_embedding_type in ("rope", "yarn"),
                "--normalization RMSNorm": cfg.normalization == "RMSNorm", "--swiglu": cfg.swiglu,
                f"--norm-epsilon {LATENT_NORM_EPS:g} (transformers' latent norms)": cfg.norm_epsilon == LATENT_NORM_EPS,
                **self.norm_requirements(cfg), NO_WINDOW: not cfg.window_size or cfg.window_size[0] < 0,
                "--disable-bias-linear": not cfg.add_bias_linear,
                "--num-experts (MoE layers)": cfg.is_moe,
                "dense layers only first (--moe-layer-freq [0]*k+[1]*n)": dense_first(layers) is not None,
                "--moe-router-score-function sigmoid": cfg.moe_router_score_function == "sigmoid",
                "a shared expert of n x --moe-ffn-hidden-size (--moe-shared-expert-intermediate-size)":
                    bool(shared) and shared % ffn == 0,
                "no --moe-shared-expert-gate": not cfg.moe_shared_expert_gate,
                f"--moe-router-topk / --moe-router-group-topk = {HF_GROUP_SCORE_TOPK} (transformers' group score)":
                    not g or k // g == HF_GROUP_SCORE_TOPK}

    def norm_requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        """transformers' q_a_layernorm / kv_a_layernorm: megalite's MLA has them with --qk-layernorm (megatron-core's
        rule)."""
        return {"--qk-layernorm (the latent norms)": cfg.qk_layernorm,
                "--sublayer-norms pre": cfg.sublayer_norms == "pre"}

    # ---- HF config -> megalite ----------------------------------------------------------------------------

    def refuse(self, c, where: str) -> None:
        super().refuse(c, where)
        k = c.num_experts_per_tok
        rules = [
            (c.attention_bias, f"attention_bias {c.attention_bias!r}: megalite's multi-latent attention has no "
             "biases on q_a_proj / kv_a_proj_with_mqa"),
            (c.rms_norm_eps != LATENT_NORM_EPS, f"rms_norm_eps {c.rms_norm_eps!r}: transformers' q_a_layernorm / "
             f"kv_a_layernorm keep eps {LATENT_NORM_EPS:g} while megalite's norms share one --norm-epsilon"),
            ((c.num_key_value_heads or c.num_attention_heads) != c.num_attention_heads,
             f"num_key_value_heads {c.num_key_value_heads} differs from num_attention_heads "
             f"{c.num_attention_heads}: multi-latent attention has a key and value per head"),
            (not c.n_routed_experts or c.n_routed_experts <= 0, f"n_routed_experts {c.n_routed_experts!r}: "
             "a DeepSeek-V3 without routed experts is not supported"),
            (not c.n_shared_experts or c.n_shared_experts <= 0, f"n_shared_experts {c.n_shared_experts!r}: "
             "transformers always builds the shared expert; it needs a positive count"),
            ((c.first_k_dense_replace or 0) >= c.num_hidden_layers, f"first_k_dense_replace "
             f"{c.first_k_dense_replace} leaves no MoE layer of the {c.num_hidden_layers}"),
            (bool(c.norm_topk_prob) != (k > 1), f"norm_topk_prob {c.norm_topk_prob!r} with num_experts_per_tok "
             f"{k}: megalite's sigmoid router renormalises the top-k weights exactly when k > 1 (Megatron-LM's rule)"),
        ]
        for bad, why in rules:
            if bad:
                raise HFConversionError(f"{where}: {why}")
        if self._grouped(c) and k // c.topk_group != HF_GROUP_SCORE_TOPK:
            raise HFConversionError(
                f"{where}: n_group {c.n_group}, topk_group {c.topk_group}, num_experts_per_tok {k}: transformers "
                f"scores a group by its top {HF_GROUP_SCORE_TOPK} experts, megalite (Megatron-LM) by its top "
                f"num_experts_per_tok // topk_group ({k // c.topk_group}); only configs where they agree convert")

    @staticmethod
    def _grouped(c) -> bool:
        """Whether the groups limit the choice (more than one, not all of them kept)."""
        return bool(c.n_group) and c.n_group > 1 and bool(c.topk_group) and c.topk_group < c.n_group

    def rope_fields(self, c, where: str) -> dict[str, Any]:
        rope = rope_parameters(c)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise HFConversionError(f"{where}: rope_parameters partial_rotary_factor "
                                    f"{rope['partial_rotary_factor']!r}: MLA rotates the whole qk_rope_head_dim")
        # --rope-type rope: plain RoPE stays plain (unset, megalite's MLA takes YaRN, Megatron-LM's default)
        fields = {"position_embedding_type": "rope", "rope_type": "rope", "rotary_base": rope_theta(rope["rope_theta"])}
        if rope["rope_type"] == "yarn":
            return {**fields, "rope_type": None, **yarn_fields(rope, c, where)}
        if rope["rope_type"] != "default":
            raise HFConversionError(f"{where}: rope_type {rope['rope_type']!r} is not supported for DeepSeek-V3; "
                                    "megalite converts plain RoPE and 'yarn'")
        return fields

    def model_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        dense = c.first_k_dense_replace or 0
        layers = [i >= dense for i in range(c.num_hidden_layers)]
        scaling = float(c.routed_scaling_factor)
        groups = {"moe_router_num_groups": c.n_group, "moe_router_group_topk": c.topk_group} if self._grouped(c) \
            else {}
        return dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                    num_attention_heads=c.num_attention_heads,
                    seq_length=c.max_position_embeddings, max_position_embeddings=c.max_position_embeddings,
                    normalization="RMSNorm", norm_epsilon=c.rms_norm_eps, swiglu=True,
                    untie_embeddings_and_output_weights=not c.tie_word_embeddings, hidden_dropout=0.0,
                    attention_dropout=c.attention_dropout, init_method_std=c.initializer_range,
                    disable_bias_linear=True, multi_latent_attention=True, qk_layernorm=True,
                    q_lora_rank=c.q_lora_rank or None,
                    kv_lora_rank=c.kv_lora_rank, qk_head_dim=c.qk_nope_head_dim,
                    qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                    **self.rope_fields(c, where),
                    ffn_hidden_size=c.intermediate_size, num_experts=c.n_routed_experts,
                    moe_ffn_hidden_size=c.moe_intermediate_size, moe_layer_freq=layer_freq(layers),
                    moe_router_topk=c.num_experts_per_tok,
                    moe_shared_expert_intermediate_size=c.n_shared_experts * c.moe_intermediate_size,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
                    moe_router_load_balancing_type="none", mtp_num_layers=getattr(c, MTP_FOUND, 0) or None,
                    **groups)

    # ---- megalite -> HF config ----------------------------------------------------------------------------

    def hf_config_fields(self, cfg: ModelConfig, vocab: int, eod: int | None) -> dict[str, Any]:
        heads, k = cfg.num_attention_heads, cfg.moe_router_topk
        return dict(vocab_size=vocab, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                    num_attention_heads=heads, num_key_value_heads=heads, hidden_act="silu",
                    max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_epsilon,
                    rope_parameters=hf_yarn_parameters(cfg), rope_interleave=True, attention_bias=False,
                    attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_method_std,
                    tie_word_embeddings=cfg.tied_embeddings, bos_token_id=eod, eos_token_id=eod,
                    q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                    qk_nope_head_dim=cfg.qk_head_dim, qk_rope_head_dim=cfg.qk_pos_emb_head_dim,
                    v_head_dim=cfg.v_head_dim, intermediate_size=cfg.ffn_hidden_size,
                    moe_intermediate_size=cfg.expert_ffn_hidden_size, n_routed_experts=cfg.num_experts,
                    n_shared_experts=cfg.moe_shared_expert_intermediate_size // cfg.expert_ffn_hidden_size,
                    num_experts_per_tok=k, norm_topk_prob=k > 1,
                    routed_scaling_factor=float(cfg.moe_router_topk_scaling_factor or 1.0),
                    n_group=cfg.moe_router_num_groups or 1, topk_group=cfg.moe_router_group_topk or 1,
                    first_k_dense_replace=dense_first(cfg.moe_layers()), num_mtp_layers=cfg.mtp_depths)

    # ---- tensors ------------------------------------------------------------------------------------------

    def attention_rules(self, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
        a, s = m + "attention.", h + "self_attn."
        if cfg.q_lora:
            q = [TensorRule(a + "q_down_proj.weight", (s + "q_a_proj.weight",)),
                 self.norm_rule(cfg, a + "q_layernorm.weight", s + "q_a_layernorm.weight"),
                 TensorRule(a + "q_up_proj.weight", (s + "q_b_proj.weight",))]
        else:
            q = [TensorRule(a + "q_proj.weight", (s + "q_proj.weight",))]
        return q + [TensorRule(a + "kv_down_proj.weight", (s + "kv_a_proj_with_mqa.weight",)),
                    self.norm_rule(cfg, a + "kv_layernorm.weight", s + "kv_a_layernorm.weight"),
                    TensorRule(a + "kv_up_proj.weight", (s + "kv_b_proj.weight",)),
                    TensorRule(a + "proj.weight", (s + "o_proj.weight",))]

    def moe_rules(self, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
        bias = h + "mlp.gate.e_score_correction_bias"
        rule = TensorRule(m + "mlp.router.expert_bias", (bias,)) if cfg.moe_router_enable_expert_bias else \
            TensorRule(m + "mlp.router.expert_bias", (bias,), zeros_like_rows_of=m + "mlp.router.weight")
        return [*expert_rules(cfg, m, h, self.shared_expert, None), rule]

    def stored_weights(self, hf_config, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """rope_interleave false: every layer's (MTP depths' too) RoPE rows reordered to the pairs megalite's MLA
        rotates (module doc); rope_interleave true is already its layout."""
        if getattr(hf_config, "rope_interleave", True):
            return sd
        nope, rope = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
        widths = {"q_b_proj": nope + rope, "q_proj": nope + rope, "kv_a_proj_with_mqa": hf_config.kv_lora_rank + rope}
        out = dict(sd)
        for name, t in sd.items():
            x = ROPE_ROWS.match(name)
            if x:
                out[name] = halves_to_pairs(t, widths[x.group(1)], rope)
        return out

    # ---- multi-token prediction (module doc) ------------------------------------------------------------

    def embedding_rules(self, cfg: ModelConfig) -> list[TensorRule]:
        copies = [f"model.layers.{cfg.num_layers + k}.embed_tokens.weight" for k in range(cfg.mtp_depths)]
        if cfg.tied_embeddings:
            copies += [f"model.layers.{cfg.num_layers + k}.shared_head.head.weight" for k in range(cfg.mtp_depths)]
        return [copied_rule("embedding.word.weight", self.embedding_key, copies)]

    def output_rules(self, cfg: ModelConfig) -> list[TensorRule]:
        if cfg.tied_embeddings:
            return []
        copies = [f"model.layers.{cfg.num_layers + k}.shared_head.head.weight" for k in range(cfg.mtp_depths)]
        return [copied_rule("output_layer.weight", "lm_head.weight", copies)]

    def mtp_rules(self, cfg: ModelConfig, k: int) -> list[TensorRule]:
        """Depth k's tensors (its copies of the embedding and head: embedding_rules / output_rules)."""
        m, h, last = f"mtp.layers.{k}.", f"model.layers.{cfg.num_layers + k}.", cfg.num_layers - 1
        layer = m + "layer."
        norms = [self.norm_rule(cfg, f"{layer}{ours}.weight", f"{h}{theirs}.weight")
                 for ours, theirs in self.layer_norms]
        mlp = self.mlp_rules(cfg, last, layer, h)
        if cfg.is_moe and cfg.moe_layers()[last]:  # experts one by one, as DeepSeek-V3's checkpoints store them
            mlp = [r for r in mlp if not r.ours.startswith(layer + "mlp.experts.")] + per_expert_rules(cfg, layer, h)
        return [self.norm_rule(cfg, m + "enorm.weight", h + "enorm.weight"),
                self.norm_rule(cfg, m + "hnorm.weight", h + "hnorm.weight"),
                TensorRule(m + "eh_proj.weight", (h + "eh_proj.weight",)),
                *norms, *self.attention_rules(cfg, layer, h), *mlp,
                self.norm_rule(cfg, m + "final_norm.weight", h + "shared_head.norm.weight")]

    def name_table(self, cfg: ModelConfig) -> list[TensorRule]:
        rules = super().name_table(cfg)
        for k in range(cfg.mtp_depths):
            rules += self.mtp_rules(cfg, k)
        return rules

    def outside_model(self, c, names, where: str) -> set[str]:
        """The MTP depths' tensors (layer indices from num_hidden_layers on): on import, the depths present set
        --mtp-num-layers and every tensor of theirs must be one the depth has (else refused by name)."""
        layer = re.compile(r"^model\.layers\.(\d+)\.")
        extra = {n: int(x.group(1)) for n in names if (x := layer.match(n)) and int(x.group(1)) >= c.num_hidden_layers}
        if not extra:
            return set()
        indices = sorted(set(extra.values()))
        if indices != list(range(c.num_hidden_layers, c.num_hidden_layers + len(indices))):
            raise HFConversionError(f"{where}: layers {indices} past num_hidden_layers {c.num_hidden_layers} are not "
                                    "consecutive multi-token prediction depths")
        setattr(c, MTP_FOUND, len(indices))
        wanted = {t for r in self.name_table(self.from_hf(c, where)) for t in r.theirs}
        unknown = sorted(set(extra) - wanted)
        if unknown:
            raise HFConversionError(f"{where}: tensor {unknown[0]} of a multi-token prediction depth (layer index "
                                    f"{extra[unknown[0]]}) has no place in megalite's MTP depth; nothing is dropped")
        return set(extra)


ROPE_ROWS = re.compile(r"^model\.layers\.\d+\.self_attn\.(q_b_proj|q_proj|kv_a_proj_with_mqa)\.weight$")


def halves_to_pairs(w: torch.Tensor, width: int, rope: int) -> torch.Tensor:
    """w's rows in blocks of ``width`` (one per head, or kv_a_proj_with_mqa's one) ending in ``rope`` RoPE rows
    laid out for rotate_half (channel i pairs with i + rope/2) -> those rows interleaved as (i, i + rope/2),
    the pairs (2i, 2i+1) megalite rotates with the same frequency i. The rotation of each pair is the same
    2x2 one, and megalite's output keeps the halves layout (model/mla.py, mla_rope), so q_pe and k_pe come
    out equal to transformers' rope_interleave false ones, not merely with equal dot products."""
    order = torch.arange(rope).view(2, rope // 2).t().reshape(-1)  # [0, h, 1, h+1, ...]
    blocks = w.reshape(-1, width, *w.shape[1:]).clone()
    blocks[:, width - rope:] = blocks[:, width - rope:][:, order]
    return blocks.reshape(w.shape)


MTP_FOUND = "_megalite_mtp_depths"  # set on the HF config by outside_model: the depths its weights hold


def copied_rule(ours: str, main: str, copies: list[str]) -> TensorRule:
    """A tensor stored again by each MTP depth: written to every copy; read from the main one once every copy
    equals it (megalite keeps one)."""
    def join(first: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        for name, t in zip(copies, rest):
            if not torch.equal(t, first):
                raise HFConversionError(f"{name} differs from {main}: megalite's multi-token prediction shares "
                                        "the main model's embedding and output head")
        return first

    return TensorRule(ours, (main, *copies), lambda t: (t,) * (1 + len(copies)), join)


def per_expert_rules(cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
    """Stacked experts <-> ``mlp.experts.{j}.gate_proj / up_proj / down_proj`` one by one."""
    E = cfg.num_experts
    up = tuple(f"{h}mlp.experts.{j}.{p}_proj.weight" for j in range(E) for p in ("gate", "up"))
    down = tuple(f"{h}mlp.experts.{j}.down_proj.weight" for j in range(E))

    def split_fc1(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x for e in t for x in halves(e))

    def join_fc1(*parts: torch.Tensor) -> torch.Tensor:
        return torch.stack([cat_rows(parts[2 * j], parts[2 * j + 1]) for j in range(E)])

    return [TensorRule(m + "mlp.experts.fc1_weight", up, split_fc1, join_fc1),
            TensorRule(m + "mlp.experts.fc2_weight", down, lambda t: tuple(e.contiguous() for e in t),
                       lambda *parts: torch.stack(parts))]

ADAPTER = DeepseekV3()
