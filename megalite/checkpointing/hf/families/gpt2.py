"""``GPT2LMHeadModel`` (model_type gpt2): learned positions, LayerNorm, exact GELU, no GQA.

HF's Conv1D stores weights [in, out] (transposed), and ``c_attn`` is all query heads, then all keys, then
all values (megalite's per-group interleave is split and stacked). GPT-2 always has biases: a megalite
model without them (--disable-bias-linear) exports zeros, the same function.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from megalite.checkpointing.hf.adapter import HFAdapter
from megalite.checkpointing.hf.common import HFConversionError, TensorRule, fuse_qkv, split_qkv, transposed
from megalite.config.model import ModelConfig

GELUS = {"gelu": 0.0, "gelu_new": 1e-3, "gelu_pytorch_tanh": 1e-3, "gelu_fast": 1e-3}  # -> logit error
KEYS = {"--num-layers": "n_layer", "--hidden-size": "n_embd", "--num-attention-heads": "n_head",
        "--ffn-hidden-size": "n_inner", "--seq-length": "n_positions", "--max-position-embeddings": "n_positions",
        "--hidden-dropout": "resid_pdrop", "--attention-dropout": "attn_pdrop",
        "--norm-epsilon": "layer_norm_epsilon", "--init-method-std": "initializer_range"}


class GPT2(HFAdapter):
    model_type = "gpt2"
    architecture = "GPT2LMHeadModel"
    config_class_name = "GPT2Config"
    embedding_key = "transformer.wte.weight"
    hf_keys = KEYS

    def requirements(self, cfg: ModelConfig) -> dict[str, bool]:
        groups = cfg.num_query_groups or cfg.num_attention_heads
        return {"--position-embedding-type learned_absolute": cfg.position_embedding_type == "learned_absolute",
                "--normalization LayerNorm": cfg.normalization == "LayerNorm",
                "no --swiglu (GELU MLP)": not cfg.swiglu,
                "no grouped-query attention": groups == cfg.num_attention_heads,
                "--kv-channels = hidden / heads": cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size,
                "no --num-experts (a dense MLP)": not cfg.is_moe,
                "no --qk-layernorm": not cfg.qk_layernorm, "--sublayer-norms pre": cfg.sublayer_norms == "pre"}

    # ---- configs ------------------------------------------------------------------------------------------

    def refuse(self, c, where: str) -> None:
        act = c.activation_function
        if act not in GELUS:
            raise HFConversionError(f"{where}: activation_function {act!r} is not supported (megalite uses exact "
                                    "GELU; gelu, gelu_new, gelu_pytorch_tanh are accepted)")
        if GELUS[act]:
            warnings.warn(f"{where}: activation_function {act!r} is the tanh approximation of GELU; megalite "
                          f"computes exact GELU, so logits will differ by about {GELUS[act]:g}", stacklevel=4)
        if not c.scale_attn_weights or c.scale_attn_by_inverse_layer_idx:
            raise HFConversionError(f"{where}: only attention scaled by 1/sqrt(head_dim) is supported "
                                    "(scale_attn_weights=true, scale_attn_by_inverse_layer_idx=false)")

    def model_fields(self, c, where: str, qkv_bias_only: bool) -> dict[str, Any]:
        return dict(num_layers=c.n_layer, hidden_size=c.n_embd, ffn_hidden_size=c.n_inner or 4 * c.n_embd,
                    num_attention_heads=c.n_head, seq_length=c.n_positions, max_position_embeddings=c.n_positions,
                    position_embedding_type="learned_absolute", normalization="LayerNorm",
                    norm_epsilon=c.layer_norm_epsilon, swiglu=False,
                    untie_embeddings_and_output_weights=not c.tie_word_embeddings, hidden_dropout=c.resid_pdrop,
                    attention_dropout=c.attn_pdrop, init_method_std=c.initializer_range)

    def hf_config_fields(self, cfg: ModelConfig, vocab: int, eod: int | None) -> dict[str, Any]:
        return dict(vocab_size=vocab, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
                    n_layer=cfg.num_layers, n_head=cfg.num_attention_heads,
                    n_inner=None if cfg.ffn_hidden_size == 4 * cfg.hidden_size else cfg.ffn_hidden_size,
                    activation_function="gelu", resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
                    attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.norm_epsilon,
                    initializer_range=cfg.init_method_std, tie_word_embeddings=cfg.tied_embeddings,
                    bos_token_id=eod, eos_token_id=eod)

    # ---- tensors ------------------------------------------------------------------------------------------

    def embedding_rules(self, cfg: ModelConfig) -> list[TensorRule]:
        return [*super().embedding_rules(cfg), TensorRule("embedding.position.weight", ("transformer.wpe.weight",))]

    def _qkv_rules(self, cfg: ModelConfig, m: str, h: str) -> list[TensorRule]:
        """c_attn: [q; k; v] stacked, Conv1D-transposed weight; a bias always."""
        heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, cfg.kv_channels
        split = lambda t: split_qkv(t, heads, groups, d)  # noqa: E731
        fuse = lambda q, k, v: fuse_qkv(q, k, v, heads, groups, d)  # noqa: E731
        w, b = m + "attention.qkv.weight", m + "attention.qkv.bias"
        has_bias = cfg.add_bias_linear or cfg.add_qkv_bias
        return [TensorRule(w, (h + "attn.c_attn.weight",), lambda t: (transposed(torch.cat(split(t))),),
                           lambda t: fuse(*t.t().chunk(3, dim=0))),
                TensorRule(b, (h + "attn.c_attn.bias",), lambda t: (torch.cat(split(t)),),
                           lambda t: fuse(*t.chunk(3)), None if has_bias else w)]

    def layer_rules(self, cfg: ModelConfig, i: int) -> list[TensorRule]:
        m, h = f"layers.{i}.", f"transformer.h.{i}."
        rules = [rule for ours, theirs in (("input_norm", "ln_1"), ("pre_mlp_norm", "ln_2"))
                 for rule in (self.norm_rule(cfg, m + ours + ".weight", h + theirs + ".weight"),
                              TensorRule(m + ours + ".bias", (h + theirs + ".bias",)))]
        rules += self._qkv_rules(cfg, m, h)
        for ours, theirs in (("attention.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            rules.append(TensorRule(m + ours + ".weight", (h + theirs + ".weight",),  # Conv1D: [in, out]
                                    lambda t: (transposed(t),), transposed))
            rules.append(TensorRule(m + ours + ".bias", (h + theirs + ".bias",),
                                    zeros_like_rows_of=None if cfg.add_bias_linear else m + ours + ".weight"))
        return rules

    def final_rules(self, cfg: ModelConfig) -> list[TensorRule]:
        return [self.norm_rule(cfg, "final_norm.weight", "transformer.ln_f.weight"),
                TensorRule("final_norm.bias", ("transformer.ln_f.bias",))]


ADAPTER = GPT2()
