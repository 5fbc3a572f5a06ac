"""Hugging Face conversion: megalite's full (layout-free) tensors <-> transformers models.

The converter core: it names no architecture. The adapter of each family (families/, listed once in
registry.py, interface in adapter.py) owns its HF config <-> megalite config mapping, its tensor names and
split/merge rules, and its refusals; this module finds the adapter (by the HF config's ``model_type`` on
import, by the megalite config on export) and runs its name table both ways.

megalite's fused QKV weight is Megatron's per-group interleave (docs/design.md §3.3): for each of the
``groups`` KV groups, its ``heads / groups`` query heads, then its key head, then its value head,
``head_dim`` rows each. ``split_qkv`` undoes it and ``fuse_qkv`` rebuilds it (common.py). Query head j of
HF uses KV head j // (heads / groups), which is the group whose block holds it here, so GQA maps head for
head.

HF's vocab is the true vocab (megalite's full tensors hold it; shards are padded). Biases HF needs and
megalite lacks are written as zeros (exactly the same function). A model with zero-centred norm weights
(--apply-layernorm-1p) stores w and scales by 1 + w; HF norms that hold the scale itself get 1 + w on
export, and an import with --apply-layernorm-1p stores HF's weight - 1.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch

from megalite.checkpointing.hf.common import HFConversionError, TensorRule, fuse_qkv, split_qkv
from megalite.checkpointing.hf.files import read_checked_weights, write_beside
from megalite.checkpointing.hf.registry import for_export, for_hf_config, for_model_type, supported
from megalite.checkpointing.metadata import config_dict, model_config
from megalite.config.model import ModelConfig
from megalite.config.strict_load import DuplicateKeyError, load_json

__all__ = ["HFConversionError", "TensorRule", "architecture", "copy_tokenizer_files", "from_hf_config",
           "from_hf_state_dict", "fuse_qkv", "model_class", "name_table", "qkv_bias_only", "read_hf_config",
           "read_hf_weights", "save_hf_model", "save_tokenizer", "split_qkv", "to_hf_config", "to_hf_state_dict"]


# ---- configs ------------------------------------------------------------------------------------


def architecture(cfg: ModelConfig, model_type: str | None = None) -> str:
    """The HF model_type a megalite model config exports to (``model_type``: the one asked for, checked), or
    an error listing what each architecture needs and this model lacks."""
    return for_export(cfg, model_type).model_type


def to_hf_config(config: dict[str, Any], eod: int | None = None, model_type: str | None = None):
    """The transformers config of a megalite model config dict, in the architecture it matches (or
    ``model_type``)."""
    cfg, vocab = model_config(config)
    return for_export(cfg, model_type).to_hf(cfg, vocab, eod)


def from_hf_config(hf_config, where: str = "config.json", qkv_bias_only: bool = False,
                   apply_layernorm_1p: bool = False) -> dict[str, Any]:
    """megalite model config dict (incl. vocab_size) of a transformers config of a registered architecture.

    ``qkv_bias_only``: what the weights say beyond the config (adapter.qkv_bias_only, e.g. a Llama with
    attention_bias whose o_proj biases are all zero).
    ``apply_layernorm_1p``: the checkpoint is to store zero-centred norm weights (HF's weight - 1)."""
    cfg = for_hf_config(hf_config, where).from_hf(hf_config, where, qkv_bias_only, apply_layernorm_1p)
    return config_dict(cfg, hf_config.vocab_size)


# ---- tensors: one name table for both directions ------------------------------------------------


def name_table(cfg: ModelConfig, model_type: str | None = None) -> list[TensorRule]:
    """Every tensor of the model, megalite's name <-> HF's, in the architecture it exports to (or
    ``model_type``). A tied model has no ``lm_head.weight`` entry (HF ties it to the embedding)."""
    return for_export(cfg, model_type).name_table(cfg)


def to_hf_state_dict(config: dict[str, Any], get: Callable[[str], torch.Tensor],
                     dtype: torch.dtype | None = None, model_type: str | None = None) -> dict[str, torch.Tensor]:
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

    for r in name_table(cfg, model_type):
        if r.zeros_like_rows_of is not None:
            like = read(r.zeros_like_rows_of)
            out[r.theirs[0]] = torch.zeros(like.shape[0], dtype=dtype or like.dtype)
        else:
            out.update((k, v if dtype is None else v.to(dtype)) for k, v in zip(r.theirs, r.split(read(r.ours))))
    return out


def from_hf_state_dict(config: dict[str, Any], sd: Mapping[str, torch.Tensor],
                       model_type: str | None = None) -> dict[str, torch.Tensor]:
    """megalite full tensors (layout-free keys) from an HF state dict, for the megalite ``config``
    that from_hf_config made (see name_table). A missing HF tensor raises naming it."""
    cfg, _ = model_config(config)

    def get(key: str) -> torch.Tensor:
        if key not in sd:
            raise HFConversionError(f"the Hugging Face weights have no tensor {key}")
        return sd[key]

    return {r.ours: r.join(*(get(k) for k in r.theirs)) for r in name_table(cfg, model_type)
            if r.zeros_like_rows_of is None}


# ---- folders ------------------------------------------------------------------------------------


def model_class(hf_config):
    """The transformers model class of an HF config (its adapter's)."""
    return for_hf_config(hf_config, "config.json").model_class()


def save_hf_model(out_dir: str, hf_config, state_dict: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` + safetensors with transformers' save_pretrained. The model is built on
    the meta device and takes the tensors as they are (no random init, no copy); a strict load checks
    that every name and shape is what transformers expects."""
    adapter = for_hf_config(hf_config, "config.json")
    cls = adapter.model_class()
    with torch.device("meta"):
        model = cls(hf_config)
    if hf_config.tie_word_embeddings:  # the tied head is the embedding
        state_dict = {**state_dict, "lm_head.weight": state_dict[adapter.embedding_key]}
    outside = adapter.outside_model(hf_config, list(state_dict), "the converted model")
    beside = {k: state_dict[k] for k in outside}
    state_dict = {k: v for k, v in state_dict.items() if k not in outside}
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
    if beside:
        write_beside(out_dir, beside)


def read_hf_config(folder: str):
    """The transformers config of a local folder of a registered architecture (nothing downloaded): its
    config.json's ``model_type`` picks the adapter, whose config class reads it."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise HFConversionError(f"--load {folder}: no config.json there; expected a local transformers model "
                                "folder (save_pretrained output)")
    try:
        raw = load_json(open(cfg_path).read(), cfg_path)
    except json.JSONDecodeError as e:
        raise HFConversionError(f"{cfg_path} is not valid JSON: {e}") from None
    except DuplicateKeyError as e:  # transformers would keep the last one without a word
        raise HFConversionError(str(e)) from None
    if not isinstance(raw, dict):
        raise HFConversionError(f"{cfg_path}: not a JSON object")
    adapter = for_model_type(raw.get("model_type"), cfg_path, raw.get("architectures"))
    try:
        return adapter.config_class().from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises several kinds on bad values
        raise HFConversionError(f"{cfg_path}: transformers cannot read it ({e}); from-hf reads {supported()}"
                                ) from None


def read_hf_weights(folder: str, hf_config) -> dict[str, torch.Tensor]:
    """State dict of a local folder (safetensors, or .bin read with weights_only) in transformers' names,
    every stored tensor matched with the config's model and its shape checked before any is loaded
    (files.py): nothing dropped, nothing left to random initialisation; then in the layout the name table
    reads (adapter.stored_weights)."""
    where = os.path.join(folder, "config.json")
    adapter = for_hf_config(hf_config, where)
    sd = read_checked_weights(folder, adapter.model_class(), hf_config, where, adapter.expert_files,
                              adapter.stored_renames, lambda names: adapter.outside_model(hf_config, names, where))
    return adapter.stored_weights(hf_config, sd)


def qkv_bias_only(hf_config, sd: Mapping[str, torch.Tensor]) -> bool:
    """What the weights say beyond the config, e.g. a Llama with attention_bias, no mlp_bias and all-zero
    o_proj biases is megalite's --add-qkv-bias (the adapter decides)."""
    return for_hf_config(hf_config, "config.json").qkv_bias_only(hf_config, sd)


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
