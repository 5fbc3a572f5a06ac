"""Hugging Face conversion: megalite's full (layout-free) tensors <-> transformers models.

Two families, chosen from the model config:

- GPT-2 style (learned positions, LayerNorm, exact GELU, no GQA) <-> ``GPT2LMHeadModel``. HF's Conv1D
  stores weights [in, out] (transposed), and ``c_attn`` is all query heads, then all keys, then all
  values.
- Llama style (RoPE rotate-half, RMSNorm, SwiGLU, optional GQA) <-> ``LlamaForCausalLM`` with separate
  q/k/v projections and gate/up projections.
- Llama style with MoE layers <-> ``MixtralForCausalLM`` or ``Qwen2MoeForCausalLM``: hf_moe.py holds their
  configs and MoE tensors; everything else is the Llama mapping.

megalite's fused QKV weight is Megatron's per-group interleave (docs/design.md §3.3): for each of the
``groups`` KV groups, its ``heads / groups`` query heads, then its key head, then its value head,
``head_dim`` rows each. ``split_qkv`` undoes it and ``fuse_qkv`` rebuilds it. Query head j of HF uses
KV head j // (heads / groups), which is the group whose block holds it here, so GQA maps head for head.

HF's vocab is the true vocab (megalite's full tensors hold it; shards are padded). Biases HF needs and
megalite lacks are written as zeros (exactly the same function); on import, zero o_proj biases of a
Llama with only attention biases map back to megalite's ``--add-qkv-bias``. A model with zero-centred
norm weights (--apply-layernorm-1p) stores w and scales by 1 + w; HF norms hold the scale itself, so the
export writes 1 + w and an import with --apply-layernorm-1p stores HF's weight - 1.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from megalite.checkpointing.hf.common import (
    HFConversionError,
    TensorRule,
    check_model_rules,
    rope_theta,
    transposed,
)
from megalite.checkpointing.hf.files import read_checked_weights
from megalite.checkpointing.hf.moe import (
    MOE_TYPES,
    from_hf_moe_config,
    moe_architecture,
    moe_mlp_rules,
    to_hf_moe_config,
)
from megalite.checkpointing.metadata import config_dict, model_config
from megalite.config.model import ModelConfig
from megalite.config.strict_load import StrictReadError, load_json

GPT2_GELUS = {"gelu": 0.0, "gelu_new": 1e-3, "gelu_pytorch_tanh": 1e-3, "gelu_fast": 1e-3}
SUPPORTED = ("GPT2LMHeadModel (model_type gpt2), LlamaForCausalLM (llama), MixtralForCausalLM (mixtral) or "
             "Qwen2MoeForCausalLM (qwen2_moe)")


# ---- the QKV interleave -----------------------------------------------------------------------


def split_qkv(fused: torch.Tensor, heads: int, groups: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megalite's per-group [q_g..., k_g, v_g] rows -> (q [heads*d, ...], k [groups*d, ...], v)."""
    rest = fused.shape[1:]
    x = fused.reshape(groups, heads // groups + 2, head_dim, *rest)
    q = x[:, :-2].reshape(heads * head_dim, *rest)
    k = x[:, -2].reshape(groups * head_dim, *rest)
    v = x[:, -1].reshape(groups * head_dim, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, head_dim: int
             ) -> torch.Tensor:
    """Inverse of split_qkv: separate q/k/v rows -> megalite's per-group interleave."""
    rest = q.shape[1:]
    per = heads // groups
    blocks = [q.reshape(groups, per, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
              v.reshape(groups, 1, head_dim, *rest)]
    return torch.cat(blocks, dim=1).reshape((heads + 2 * groups) * head_dim, *rest).contiguous()


# ---- which HF architecture --------------------------------------------------------------------


def architecture(cfg: ModelConfig) -> str:
    """'gpt2' or 'llama' for a megalite model config ('mixtral' or 'qwen2_moe' for an MoE model, see
    hf_moe.py), or an error listing what does not fit."""
    if cfg.is_moe:

        return moe_architecture(cfg)
    groups = cfg.num_query_groups or cfg.num_attention_heads
    gpt2 = {"--position-embedding-type learned_absolute": cfg.position_embedding_type == "learned_absolute",
            "--normalization LayerNorm": cfg.normalization == "LayerNorm",
            "no --swiglu (GELU MLP)": not cfg.swiglu,
            "no grouped-query attention": groups == cfg.num_attention_heads,
            "--kv-channels = hidden / heads": cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size}
    llama = {"--position-embedding-type rope": cfg.position_embedding_type == "rope",
             "--normalization RMSNorm": cfg.normalization == "RMSNorm",
             "--swiglu": cfg.swiglu,
             "--rotary-percent 1.0": cfg.rotary_percent == 1.0}
    if all(gpt2.values()):
        return "gpt2"
    if all(llama.values()):
        return "llama"
    raise HFConversionError(
        "this model has no Hugging Face equivalent: GPT2LMHeadModel needs "
        + ", ".join(gpt2) + f" (missing: {', '.join(k for k, ok in gpt2.items() if not ok)}); LlamaForCausalLM "
        "needs " + ", ".join(llama) + f" (missing: {', '.join(k for k, ok in llama.items() if not ok)})")


# ---- configs ------------------------------------------------------------------------------------


def to_hf_config(config: dict[str, Any], eod: int | None = None):
    """transformers config (GPT2Config, LlamaConfig, MixtralConfig or Qwen2MoeConfig) of a megalite model
    config dict."""
    from transformers import GPT2Config, LlamaConfig


    cfg, vocab = model_config(config)
    arch = architecture(cfg)
    if arch in MOE_TYPES:
        return to_hf_moe_config(cfg, vocab, eod)
    tied = cfg.tied_embeddings
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
                          n_layer=cfg.num_layers, n_head=cfg.num_attention_heads,
                          n_inner=None if cfg.ffn_hidden_size == 4 * cfg.hidden_size else cfg.ffn_hidden_size,
                          activation_function="gelu", resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
                          attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.norm_epsilon,
                          initializer_range=cfg.init_method_std, tie_word_embeddings=tied,
                          bos_token_id=eod, eos_token_id=eod, architectures=["GPT2LMHeadModel"])
    groups = cfg.num_query_groups or cfg.num_attention_heads
    hf = LlamaConfig(vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=groups, head_dim=cfg.kv_channels, hidden_act="silu",
                       max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_epsilon,
                       rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
                       attention_bias=cfg.add_bias_linear or cfg.add_qkv_bias, mlp_bias=cfg.add_bias_linear,
                       attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_method_std,
                       tie_word_embeddings=tied, bos_token_id=eod, eos_token_id=eod,
                       architectures=["LlamaForCausalLM"])
    hf.rope_theta = float(cfg.rotary_base)  # transformers 4.x reads this key, not rope_parameters
    return hf


def hf_architecture(hf_config, where: str) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type in ("gpt2", "llama", "mixtral", "qwen2_moe"):
        return model_type
    archs = getattr(hf_config, "architectures", None)
    raise HFConversionError(f"{where}: unsupported architecture (model_type {model_type!r}, architectures "
                            f"{archs}); from-hf reads {SUPPORTED}")


def from_hf_config(hf_config, where: str = "config.json", qkv_bias_only: bool = False,
                   apply_layernorm_1p: bool = False) -> dict[str, Any]:
    """megalite model config dict (incl. vocab_size) of a GPT-2, Llama, Mixtral or Qwen2-MoE transformers config.

    ``qkv_bias_only``: a Llama with attention_bias whose o_proj biases are all zero (see module doc).
    ``apply_layernorm_1p``: the checkpoint is to store zero-centred norm weights (HF's weight - 1)."""
    c = hf_config
    arch = hf_architecture(c, where)
    if arch in ("mixtral", "qwen2_moe"):

        return from_hf_moe_config(c, where, apply_layernorm_1p)
    if arch == "gpt2":
        act = c.activation_function
        if act not in GPT2_GELUS:
            raise HFConversionError(f"{where}: activation_function {act!r} is not supported (megalite uses exact "
                                    "GELU; gelu, gelu_new, gelu_pytorch_tanh are accepted)")
        if GPT2_GELUS[act]:
            warnings.warn(f"{where}: activation_function {act!r} is the tanh approximation of GELU; megalite "
                          f"computes exact GELU, so logits will differ by about {GPT2_GELUS[act]:g}", stacklevel=2)
        if not c.scale_attn_weights or c.scale_attn_by_inverse_layer_idx:
            raise HFConversionError(f"{where}: only attention scaled by 1/sqrt(head_dim) is supported "
                                    "(scale_attn_weights=true, scale_attn_by_inverse_layer_idx=false)")
        cfg = ModelConfig(num_layers=c.n_layer, hidden_size=c.n_embd, ffn_hidden_size=c.n_inner or 4 * c.n_embd,
                          num_attention_heads=c.n_head, seq_length=c.n_positions,
                          max_position_embeddings=c.n_positions, position_embedding_type="learned_absolute",
                          normalization="LayerNorm", norm_epsilon=c.layer_norm_epsilon, swiglu=False,
                          untie_embeddings_and_output_weights=not c.tie_word_embeddings,
                          hidden_dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop,
                          init_method_std=c.initializer_range, apply_layernorm_1p=apply_layernorm_1p)
        check_model_rules(cfg, c, where)
        return config_dict(cfg, c.vocab_size)
    if c.hidden_act != "silu":
        raise HFConversionError(f"{where}: hidden_act {c.hidden_act!r} is not supported (SwiGLU needs silu)")
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HFConversionError(f"{where}: rope_type {rope_type!r} (RoPE scaling) is not supported; megalite "
                                "implements plain RoPE")
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    if c.attention_bias and not c.mlp_bias and not qkv_bias_only:
        raise HFConversionError(f"{where}: attention_bias without mlp_bias (and non-zero o_proj biases) has no "
                                "megalite equivalent (--add-qkv-bias biases q/k/v only; biases everywhere need "
                                "mlp_bias too)")
    if c.mlp_bias and not c.attention_bias:
        raise HFConversionError(f"{where}: mlp_bias without attention_bias has no megalite equivalent")
    heads, groups = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    cfg = ModelConfig(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                      ffn_hidden_size=c.intermediate_size, num_attention_heads=heads,
                      group_query_attention=groups != heads, num_query_groups=groups, kv_channels=head_dim,
                      seq_length=c.max_position_embeddings, max_position_embeddings=c.max_position_embeddings,
                      position_embedding_type="rope", rotary_base=rope_theta(theta), normalization="RMSNorm",
                      norm_epsilon=c.rms_norm_eps, swiglu=True,
                      untie_embeddings_and_output_weights=not c.tie_word_embeddings,
                      disable_bias_linear=not c.mlp_bias, add_qkv_bias=bool(c.attention_bias and not c.mlp_bias),
                      hidden_dropout=0.0, attention_dropout=c.attention_dropout, init_method_std=c.initializer_range,
                      apply_layernorm_1p=apply_layernorm_1p)
    check_model_rules(cfg, c, where)
    return config_dict(cfg, c.vocab_size)


# ---- tensors: one name table for both directions ------------------------------------------------


def _norm_weight(cfg: ModelConfig, ours: str, theirs: str) -> TensorRule:
    """A norm's weight: HF holds the scale itself, which is 1 + w for a zero-centred (--apply-layernorm-1p) w."""
    if not cfg.apply_layernorm_1p:
        return TensorRule(ours, (theirs,))
    return TensorRule(ours, (theirs,), lambda t: (t + 1,), lambda t: t - 1)


def _qkv_rules(cfg: ModelConfig, m: str, h: str, arch: str) -> list[TensorRule]:
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, cfg.kv_channels
    split = lambda t: split_qkv(t, heads, groups, d)  # noqa: E731
    fuse = lambda q, k, v: fuse_qkv(q, k, v, heads, groups, d)  # noqa: E731
    w, b = m + "attention.qkv.weight", m + "attention.qkv.bias"
    has_bias = cfg.add_bias_linear or cfg.add_qkv_bias
    if arch == "gpt2":  # c_attn: [q; k; v] stacked, Conv1D-transposed weight; a bias always
        return [TensorRule(w, (h + "attn.c_attn.weight",), lambda t: (transposed(torch.cat(split(t))),),
                           lambda t: fuse(*t.t().chunk(3, dim=0))),
                TensorRule(b, (h + "attn.c_attn.bias",), lambda t: (torch.cat(split(t)),),
                           lambda t: fuse(*t.chunk(3)), None if has_bias else w)]
    names = tuple(h + f"self_attn.{n}_proj." for n in "qkv")
    rules = [TensorRule(w, tuple(n + "weight" for n in names), split, fuse)]
    if has_bias:
        rules.append(TensorRule(b, tuple(n + "bias" for n in names), split, fuse))
    return rules


def _gpt2_layer(cfg: ModelConfig, i: int) -> list[TensorRule]:
    m, h = f"layers.{i}.", f"transformer.h.{i}."
    rules = [rule for ours, theirs in (("input_norm", "ln_1"), ("pre_mlp_norm", "ln_2"))
             for rule in (_norm_weight(cfg, m + ours + ".weight", h + theirs + ".weight"),
                          TensorRule(m + ours + ".bias", (h + theirs + ".bias",)))]
    rules += _qkv_rules(cfg, m, h, "gpt2")
    for ours, theirs in (("attention.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
        rules.append(TensorRule(m + ours + ".weight", (h + theirs + ".weight",),  # Conv1D: [in, out]
                                lambda t: (transposed(t),), transposed))
        rules.append(TensorRule(m + ours + ".bias", (h + theirs + ".bias",),
                                zeros_like_rows_of=None if cfg.add_bias_linear else m + ours + ".weight"))
    return rules


def _llama_layer(cfg: ModelConfig, i: int) -> list[TensorRule]:
    """A Llama layer; in an MoE model (Mixtral, Qwen2-MoE) its MoE layers' MLPs come from hf_moe.py."""
    m, h = f"layers.{i}.", f"model.layers.{i}."
    rules = [_norm_weight(cfg, m + "input_norm.weight", h + "input_layernorm.weight"),
             _norm_weight(cfg, m + "pre_mlp_norm.weight", h + "post_attention_layernorm.weight"),
             *_qkv_rules(cfg, m, h, "llama"),
             TensorRule(m + "attention.proj.weight", (h + "self_attn.o_proj.weight",))]
    if cfg.is_moe:  # Qwen2-MoE's qkv_bias has no o_proj bias; MoE models have no other biases

        if cfg.moe_layers()[i]:
            return rules + moe_mlp_rules(cfg, m, h)
    elif cfg.add_bias_linear or cfg.add_qkv_bias:  # HF's attention_bias covers o_proj too
        rules.append(TensorRule(m + "attention.proj.bias", (h + "self_attn.o_proj.bias",),
                                zeros_like_rows_of=None if cfg.add_bias_linear else m + "attention.proj.weight"))
    gate_up = lambda t: tuple(x.contiguous() for x in t.chunk(2, dim=0))  # noqa: E731
    cat = lambda gate, up: torch.cat([gate, up])  # noqa: E731
    rules += [TensorRule(m + "mlp.fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), gate_up, cat),
              TensorRule(m + "mlp.fc2.weight", (h + "mlp.down_proj.weight",))]
    if cfg.add_bias_linear:
        rules += [TensorRule(m + "mlp.fc1.bias", (h + "mlp.gate_proj.bias", h + "mlp.up_proj.bias"), gate_up, cat),
                  TensorRule(m + "mlp.fc2.bias", (h + "mlp.down_proj.bias",))]
    return rules


def name_table(cfg: ModelConfig) -> list[TensorRule]:
    """Every tensor of the model, megalite's name <-> HF's (GPT2LMHeadModel, or the Llama-style
    LlamaForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM). A tied model has no ``lm_head.weight`` entry
    (HF ties it to the embedding)."""
    if architecture(cfg) == "gpt2":
        rules = [TensorRule("embedding.word.weight", ("transformer.wte.weight",)),
                 TensorRule("embedding.position.weight", ("transformer.wpe.weight",))]
        for i in range(cfg.num_layers):
            rules += _gpt2_layer(cfg, i)
        rules += [_norm_weight(cfg, "final_norm.weight", "transformer.ln_f.weight"),
                  TensorRule("final_norm.bias", ("transformer.ln_f.bias",))]
    else:
        rules = [TensorRule("embedding.word.weight", ("model.embed_tokens.weight",))]
        for i in range(cfg.num_layers):
            rules += _llama_layer(cfg, i)
        rules.append(_norm_weight(cfg, "final_norm.weight", "model.norm.weight"))
    if not cfg.tied_embeddings:
        rules.append(TensorRule("output_layer.weight", ("lm_head.weight",)))
    return rules


def to_hf_state_dict(config: dict[str, Any], get: Callable[[str], torch.Tensor],
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF state dict from megalite full tensors ``get(key)`` (see name_table), cast to ``dtype`` if given
    after the conversion (a zero-centred norm's 1 + w is formed in the saved dtype, as training did)."""
    cfg, _ = model_config(config)
    out: dict[str, torch.Tensor] = {}
    last: dict[str, torch.Tensor] = {}  # the tensor read just before: a missing bias takes its rows

    def read(key: str) -> torch.Tensor:
        if key not in last:
            last.clear()
            last[key] = get(key)
        return last[key]

    for r in name_table(cfg):
        if r.zeros_like_rows_of is not None:
            like = read(r.zeros_like_rows_of)
            out[r.theirs[0]] = torch.zeros(like.shape[0], dtype=dtype or like.dtype)
        else:
            out.update((k, v if dtype is None else v.to(dtype)) for k, v in zip(r.theirs, r.split(read(r.ours))))
    return out


def from_hf_state_dict(config: dict[str, Any], sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megalite full tensors (layout-free keys) from an HF state dict, for the megalite ``config``
    that from_hf_config made (see name_table). A missing HF tensor raises naming it."""
    cfg, _ = model_config(config)

    def get(key: str) -> torch.Tensor:
        if key not in sd:
            raise HFConversionError(f"the Hugging Face weights have no tensor {key}")
        return sd[key]

    return {r.ours: r.join(*(get(k) for k in r.theirs)) for r in name_table(cfg) if r.zeros_like_rows_of is None}


# ---- folders ------------------------------------------------------------------------------------


def model_class(hf_config):
    import transformers

    names = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
             "qwen2_moe": "Qwen2MoeForCausalLM"}
    return getattr(transformers, names[hf_config.model_type])


def save_hf_model(out_dir: str, hf_config, state_dict: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` + safetensors with transformers' save_pretrained. The model is built on
    the meta device and takes the tensors as they are (no random init, no copy); a strict load checks
    that every name and shape is what transformers expects."""
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config)
    if hf_config.tie_word_embeddings:  # the tied head is the embedding
        embed = "transformer.wte.weight" if hf_config.model_type == "gpt2" else "model.embed_tokens.weight"
        state_dict = {**state_dict, "lm_head.weight": state_dict[embed]}
    dtypes = {t.dtype for t in state_dict.values()}
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as e:
        raise HFConversionError(f"the converted tensors do not fit {cls.__name__}: {e}") from None
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    if len(dtypes) == 1:
        model.config.dtype = next(iter(dtypes))
    model.save_pretrained(out_dir, safe_serialization=True)


def read_hf_config(folder: str):
    """The transformers config of a local GPT-2, Llama, Mixtral or Qwen2-MoE folder (nothing downloaded)."""
    from transformers import AutoConfig

    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise HFConversionError(f"--load {folder}: no config.json there; expected a local transformers model "
                                "folder (save_pretrained output)")
    try:
        load_json(open(cfg_path).read(), cfg_path)
    except json.JSONDecodeError as e:
        raise HFConversionError(f"{cfg_path} is not valid JSON: {e}") from None
    except StrictReadError as e:  # transformers would keep the last one without a word
        raise HFConversionError(str(e)) from None
    try:
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - unknown model types raise several kinds
        raise HFConversionError(f"{cfg_path}: transformers cannot read it ({e}); from-hf reads {SUPPORTED}"
                                ) from None
    hf_architecture(hf_config, cfg_path)
    return hf_config


def read_hf_weights(folder: str, hf_config) -> dict[str, torch.Tensor]:
    """State dict of a local folder (safetensors, or .bin read with weights_only) in transformers' names,
    every stored tensor matched with the config's model and its shape checked before any is loaded
    (hf_files.py): nothing dropped, nothing left to random initialisation."""
    return read_checked_weights(folder, model_class(hf_config), hf_config, os.path.join(folder, "config.json"))


def qkv_bias_only(hf_config, sd: Mapping[str, torch.Tensor]) -> bool:
    """A Llama with attention_bias, no mlp_bias and all-zero o_proj biases is megalite's --add-qkv-bias."""
    if hf_config.model_type != "llama" or not hf_config.attention_bias or hf_config.mlp_bias:
        return False
    return all(not sd[k].any() for k in sd if k.endswith("self_attn.o_proj.bias"))


# ---- tokenizers (best effort: the model is what matters) ------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy the tokenizer files of a transformers folder; returns the names copied."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src_dir, n))]
    if names:
        os.makedirs(dst_dir, exist_ok=True)
        for n in names:
            shutil.copyfile(os.path.join(src_dir, n), os.path.join(dst_dir, n))
    return names


def portable_tokenizer_config(out_dir: str, max_length: int | None) -> None:
    """Make ``tokenizer_config.json`` loadable by transformers 4.x as well as 5.x: a tokenizer.json-backed
    tokenizer is named ``PreTrainedTokenizerFast`` (5.x writes its own ``TokenizersBackend``, unknown to
    4.x), and ``model_max_length`` is the model's positions instead of transformers' "unbounded" value."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    conf = json.load(open(path)) if os.path.isfile(path) else {}
    if os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        conf["tokenizer_class"] = "PreTrainedTokenizerFast"
        conf.pop("backend", None)
    if max_length is not None:
        conf["model_max_length"] = max_length
    with open(path, "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)


def save_tokenizer(out_dir: str, tokenizer_type: str, vocab_file: str | None = None, merge_file: str | None = None,
                   tokenizer_model: str | None = None, max_length: int | None = None) -> int | None:
    """Write a transformers tokenizer for megalite's ``--tokenizer-type`` files into ``out_dir``; returns
    its end-of-document id (HF's bos and eos). The tokenizers-based types are saved from the very
    ``tokenizers.Tokenizer`` megalite encodes with, so both sides split text the same way.
    ``max_length`` (the model's positions) becomes ``model_max_length``."""
    eod = _save_tokenizer_files(out_dir, tokenizer_type, vocab_file, merge_file, tokenizer_model)
    if tokenizer_type != "NullTokenizer":
        portable_tokenizer_config(out_dir, max_length)
    return eod


def _save_tokenizer_files(out_dir: str, tokenizer_type: str, vocab_file: str | None, merge_file: str | None,
                          tokenizer_model: str | None) -> int | None:
    from types import SimpleNamespace

    from megalite.data.tokenizer import build_tokenizer

    if tokenizer_type == "NullTokenizer":
        return None
    if tokenizer_type == "HuggingFaceTokenizer" and tokenizer_model and os.path.isdir(tokenizer_model):
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=True)
        hf_tok.save_pretrained(out_dir)
        return hf_tok.eos_token_id
    tok = build_tokenizer(SimpleNamespace(tokenizer_type=tokenizer_type, vocab_file=vocab_file,
                                          merge_file=merge_file, tokenizer_model=tokenizer_model, vocab_size=None))
    if tokenizer_type == "SentencePieceTokenizer":  # transformers converts the .model when it loads
        shutil.copyfile(tokenizer_model, os.path.join(out_dir, "tokenizer.model"))
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False}, f)
        return tok.eod
    from transformers import PreTrainedTokenizerFast

    eod_text = tok._tok.id_to_token(tok.eod)
    PreTrainedTokenizerFast(tokenizer_object=tok._tok, eos_token=eod_text, bos_token=eod_text,
                            unk_token=eod_text).save_pretrained(out_dir)
    return tok.eod
